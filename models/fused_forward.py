"""The CPU fast path of dense models: each engine step's whole layer stack in one compiled call.

`FusedForward.run` replaces DenseForCausalLM's module-by-module forward for every step (decode rows,
prefill chunks, mixes of both) when the model can run on kernels/cpu_decoder.py: on the CPU in
float32, every linear on the q8 backend. Anything else (dense or int4 weights, other dtypes, GPUs)
runs the module forward, which also stays the reference the fused path is tested against.
NANOCHAT_FUSED_FORWARD=0 turns it off.
"""

from __future__ import annotations

import os

import torch

from nanochat.models.attention import AttnMetadata


def fused_forward_enabled() -> bool:
    return os.environ.get("NANOCHAT_FUSED_FORWARD", "1").strip() not in ("0", "false", "no", "off")


def _q8(linear) -> tuple[int, torch.Tensor] | None:
    pw = linear.quant
    if pw is None or pw.backend != "q8":
        return None
    return pw.ggml_type, pw.weight


class FusedForward:
    """Builds the fused decoder for a model on first use (after the KV cache exists) and rebuilds it if
    the cache is reallocated. `why_not` says why a model cannot use it (None when it can)."""

    def __init__(self, model):
        self.model = model
        self.why_not = self._check(model)
        self._decoder = None

    @staticmethod
    def _check(model) -> str | None:
        if not fused_forward_enabled():
            return "NANOCHAT_FUSED_FORWARD=0"
        if model.backend.kind != "torch" or model.norm.weight.device.type != "cpu":
            return "not on the CPU"
        if model.norm.weight.dtype != torch.float32:
            return f"dtype {model.norm.weight.dtype} (needs float32)"
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            if any(_q8(lin) is None for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)):
                return "some linears are not on the q8 backend"
        from nanochat.kernels import cpu_qgemv
        if not cpu_qgemv.available():
            return "the CPU kernels are not available"
        return None

    def usable(self) -> bool:
        return self.why_not is None

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        model = self.model
        first = model.layers[0].self_attn
        if self._decoder is None or not self._decoder.uses(first.k_cache):
            self._decoder = self._build()
        x = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
        return self._decoder.forward(x, positions, meta.slot_mapping, meta.cu_seqlens_q, meta.block_tables,
                                     meta.context_lens)

    def _build(self):
        from nanochat.kernels.cpu_decoder import DecoderDims, DecoderLayer, FusedDecoder

        model, cfg = self.model, self.model.config
        attn0 = model.layers[0].self_attn
        dims = DecoderDims(layers=len(model.layers), hidden=cfg.hidden_size, heads=attn0.num_heads,
                           kv_heads=attn0.num_kv_heads, head_dim=attn0.head_dim,
                           intermediate=model.layers[0].mlp.down_proj.quant.in_features,
                           rotary_dim=model.rotary.rotary_dim, block_size=attn0.k_cache.shape[1],
                           eps=model.norm.eps)
        layers = []
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            layers.append(DecoderLayer(
                input_norm=layer.input_layernorm.weight.data, post_norm=layer.post_attention_layernorm.weight.data,
                qkv=_q8(a.qkv_proj), o=_q8(a.o_proj), gate_up=_q8(m.gate_up_proj), down=_q8(m.down_proj),
                k_cache=a.k_cache, v_cache=a.v_cache,
                qkv_bias=None if a.qkv_proj.bias is None else a.qkv_proj.bias.data.float().contiguous(),
                q_norm=None if a.q_norm is None else a.q_norm.weight.data,
                k_norm=None if a.k_norm is None else a.k_norm.weight.data))
        return FusedDecoder(dims, layers, model.rotary.cos, model.rotary.sin, model.norm.weight.data)
