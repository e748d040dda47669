"""The CPU fast path of dense models: each engine step's whole layer stack in one compiled call.

`FusedForward.run` replaces DenseForCausalLM's module-by-module forward for every step (decode rows,
prefill chunks, mixes of both) when the model can run on kernels/cpu_decoder.py: on the CPU in
float32, every linear on the q8 backend (each projection in the file's own type: q/k/v or gate/up of
different types run as separate kernel calls inside the one compiled step). Anything else (dense or
int4 weights, other dtypes, GPUs) runs the module forward, which also stays the reference the fused path is tested against.
The engine's fused_forward=False (env NANOCHAT_FUSED_FORWARD=0, KernelOptions.fused_forward) turns it off.
"""

from __future__ import annotations

import weakref

import torch

from nanochat.kernels.options import DEFAULT, KernelOptions
from nanochat.models.layers.attention import AttnMetadata

OFF_REASON = "turned off (fused_forward=False, NANOCHAT_FUSED_FORWARD=0)"


def _packed(linear) -> list | None:
    """The q8-packed weights of a Linear, in output order (one, or one per differently typed segment)."""
    from nanochat.kernels.cpu_qgemv import PackedWeight

    parts = linear.quant_parts()
    if not parts or any(p.backend != "q8" for p in parts):
        return None
    return [PackedWeight(p.ggml_type, p.shape, p.weight) for p in parts]


def _why_not_q8(name: str, linear) -> str:
    from nanochat.kernels import gguf_quants as gq

    parts = linear.quant_parts()
    if not parts:
        return f"{name} is a dense {tuple(linear.weight.shape)} {linear.weight.dtype} matrix (not GGUF blocks)"
    off = next(p for p in parts if p.backend != "q8")
    return f"{name} ({gq.type_name(off.ggml_type)}) is on the {off.backend} backend, not the q8 kernels"


class FusedForward:
    """Builds the fused decoder for a model on first use (after the KV cache exists) and rebuilds it if
    the cache is reallocated. `why_not` says why a model cannot use it (None when it can)."""

    def __init__(self, model, options: KernelOptions = DEFAULT):
        # A weak reference: the model owns this object, and a cycle would keep a replaced model's memory
        # until a full garbage collection.
        self._model = weakref.ref(model)
        self.options = options
        self.why_not = self._check(model)
        self._decoder = None

    def _check(self, model) -> str | None:
        if not self.options.fused_forward:
            return OFF_REASON
        if model.tp.on:
            return "tensor parallel (the compiled step has no all-reduce between its layers)"
        if model.backend.kind != "torch" or model.norm.weight.device.type != "cpu":
            return "not on the CPU"
        if model.norm.weight.dtype != torch.float32:
            return f"dtype {model.norm.weight.dtype} (needs float32)"
        from nanochat.kernels import cpu_qgemv
        if not cpu_qgemv.available():
            return "the CPU kernels are not available"
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            for name, lin in (("qkv_proj", a.qkv_proj), ("o_proj", a.o_proj), ("gate_up_proj", m.gate_up_proj),
                              ("down_proj", m.down_proj)):
                if _packed(lin) is None:
                    return f"layer {i} {name}: " + _why_not_q8(name, lin)
        return None

    def usable(self) -> bool:
        return self.why_not is None

    def recheck(self) -> None:
        """Decide again after the model's linears changed (models.layers.use_batch_invariant_kernels)."""
        self.why_not = self._check(self._model())
        self._decoder = None

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        model = self._model()
        first = model.layers[0].self_attn
        if self._decoder is None or not self._decoder.uses(first.k_cache):
            self._decoder = self._build()
        x = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
        return self._decoder.forward(x, positions, meta.slot_mapping, meta.cu_seqlens_q, meta.block_tables,
                                     meta.context_lens, self.options.act_levels, self.options.threads,
                                     meta.window_slot_mapping, meta.window_block_tables)

    def _build(self):
        from nanochat.kernels.cpu_decoder import DecoderDims, DecoderLayer, FusedDecoder

        model = self._model()
        cfg = model.config
        attn0 = model.layers[0].self_attn
        dims = DecoderDims(layers=len(model.layers), hidden=cfg.hidden_size, heads=attn0.num_heads,
                           kv_heads=attn0.num_kv_heads, head_dim=attn0.head_dim,
                           intermediate=_packed(model.layers[0].mlp.down_proj)[0].in_features,
                           rotary_dim=model.rotary.rotary_dim, block_size=attn0.k_cache.shape[1],
                           eps=model.norm.eps, activation=model.layers[0].mlp.act, attention_scale=attn0.scale)
        layers = []
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            layers.append(DecoderLayer(
                input_norm=layer.input_layernorm.weight.data, post_norm=layer.mlp_norm.weight.data,
                qkv=_packed(a.qkv_proj), o=_packed(a.o_proj)[0], gate_up=_packed(m.gate_up_proj),
                down=_packed(m.down_proj)[0], k_cache=a.k_cache, v_cache=a.v_cache,
                qkv_bias=None if a.qkv_proj.bias is None else a.qkv_proj.bias.data.float().contiguous(),
                q_norm=None if a.q_norm is None else a.q_norm.weight.data,
                k_norm=None if a.k_norm is None else a.k_norm.weight.data, rope=a.rotary is not None,
                cos=None if a.rotary in (None, model.rotary) else a.rotary.cos,
                sin=None if a.rotary in (None, model.rotary) else a.rotary.sin, window=a.window,
                attn_out_norm=None if layer.attn_out_norm is None else layer.attn_out_norm.weight.data,
                mlp_out_norm=None if layer.mlp_out_norm is None else layer.mlp_out_norm.weight.data,
                sinks=None if a.sinks is None else a.sinks.detach().float().contiguous()))
        return FusedDecoder(dims, layers, model.rotary.cos, model.rotary.sin, model.norm.weight.data)
