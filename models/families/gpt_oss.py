"""gpt-oss (20b, 120b): the MoE decoder of models/families/qwen3_moe.py with biases on q/k/v/o and the router,
learned attention sinks, 128-token windows on every other layer, YaRN RoPE, a router that takes the top 4 logits
before its softmax, and experts with biases and a clamped SwiGLU (ModelConfig's attention_sinks, moe_router,
expert_act).

The checkpoint stores the experts in its own layout: gate|up interleaved (gate rows even, up rows odd) and,
in bf16 checkpoints, transposed ([E, in, out]); as published, in MXFP4 (`*_blocks` [E, out, in / 32, 16]
nibbles, two values a byte, low first; `*_scales` [E, out, in / 32] E8M0 exponents). `hf_views` serves them as
the per-expert [out, in] weights every MoE family reads, MXFP4 repacked into GGUF's block_mxfp4 rows (the same
values and size: one scale byte, then value j in the low and j + 16 in the high nibble of byte j), never
widened to floats.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import torch

from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.qweight import QuantWeight
from nanochat.models.errors import ModelLoadError
from nanochat.models.families.qwen3_moe import MoeForCausalLM
from nanochat.models.families.spec import DENSE_BLOCK_TENSORS, FamilySpec

# llama.cpp's names. Its post_attention_norm is HF's post_attention_layernorm (the norm before the MLP); the
# expert biases ffn_{gate,up,down}_exps.bias are served as mlp.experts.{gate,up,down}_proj.bias [E, out].
GPT_OSS_BLOCK_TENSORS = {
    **DENSE_BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}

_LAYER = re.compile(r"(model\.layers\.\d+)\.(.+)")


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Checkpoint MXFP4 ([rows, n, 16] nibbles, [rows, n] exponents) -> GGUF block_mxfp4 rows [rows, n * 17]."""
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).reshape(blocks.shape[0], -1)


def _expert_views(layer: str, names: Collection[str], e: int, experts: int) -> dict:
    """Expert e's gate, up and down weights of one layer, from bf16 or MXFP4 tensors."""
    x = f"{layer}.mlp.experts"
    out = {}
    if f"{x}.gate_up_proj_blocks" in names:
        def mx(stored: str, rows: slice):
            def view(blocks: torch.Tensor, scales: torch.Tensor) -> QuantWeight:
                if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 or \
                        tuple(scales.shape) != tuple(blocks.shape[:3]) or blocks.shape[0] != experts:
                    raise ModelLoadError(f"{stored}_blocks / _scales: shapes {list(blocks.shape)} and "
                                         f"{list(scales.shape)} are not MXFP4 blocks of {experts} experts")
                b, s = blocks[e, rows], scales[e, rows]
                return QuantWeight(gq.MXFP4, (b.shape[0], b.shape[1] * 32), mxfp4_rows(b, s))
            return (f"{stored}_blocks", f"{stored}_scales"), view
        gate_up = f"{x}.gate_up_proj"
        out[f"{x}.{e}.gate_proj.weight"] = mx(gate_up, slice(0, None, 2))
        out[f"{x}.{e}.up_proj.weight"] = mx(gate_up, slice(1, None, 2))
        out[f"{x}.{e}.down_proj.weight"] = mx(f"{x}.down_proj", slice(None))
    elif f"{x}.gate_up_proj" in names:
        def dense(stored: str, cols: slice):
            def view(t: torch.Tensor) -> torch.Tensor:
                if t.dim() != 3 or t.shape[0] != experts:
                    raise ModelLoadError(f"{stored}: shape {list(t.shape)} is not [experts {experts}, in, out]")
                return t[e, :, cols].t().contiguous()
            return (stored,), view
        out[f"{x}.{e}.gate_proj.weight"] = dense(f"{x}.gate_up_proj", slice(0, None, 2))
        out[f"{x}.{e}.up_proj.weight"] = dense(f"{x}.gate_up_proj", slice(1, None, 2))
        out[f"{x}.{e}.down_proj.weight"] = dense(f"{x}.down_proj", slice(None))
    return out


def hf_views(names: Collection[str], cfg) -> dict:
    """Our names for gpt-oss's checkpoint tensors (see the module's doc): {name: (stored names, function)}."""
    views: dict = {}
    layers = sorted({m.group(1) for n in names if (m := _LAYER.fullmatch(n))})
    for layer in layers:
        for p in ("weight", "bias"):
            if f"{layer}.mlp.router.{p}" in names:
                views[f"{layer}.mlp.gate.{p}"] = ((f"{layer}.mlp.router.{p}",), lambda t: t)
        if f"{layer}.self_attn.sinks" in names:
            views[f"{layer}.self_attn.sinks.weight"] = ((f"{layer}.self_attn.sinks",), lambda t: t)
        x = f"{layer}.mlp.experts"
        if f"{x}.gate_up_proj_bias" in names:
            views[f"{x}.gate_proj.bias"] = ((f"{x}.gate_up_proj_bias",), lambda t: t[:, 0::2].contiguous())
            views[f"{x}.up_proj.bias"] = ((f"{x}.gate_up_proj_bias",), lambda t: t[:, 1::2].contiguous())
        if f"{x}.down_proj_bias" in names:
            views[f"{x}.down_proj.bias"] = ((f"{x}.down_proj_bias",), lambda t: t)
        for e in range(cfg.num_experts):
            views.update(_expert_views(layer, names, e, cfg.num_experts))
    return views


# config.json: attention_bias (true) covers q/k/v/o; layer_types (or transformers' default, every other layer
# windowed) says which layers the window applies to. GGUF: llama.cpp's rule, every second layer global.
GPT_OSS = FamilySpec(
    "gpt_oss", MoeForCausalLM, gguf_arch="gpt-oss", moe=True, attention_bias=True, attention_sinks=True,
    moe_router="topk_softmax", expert_act="swiglu_oai", rope_theta=150_000.0,
    defaults={"sliding_window": 128, "sliding_window_pattern": 2, "rms_norm_eps": 1e-5, "head_dim": 64},
    hf_views=hf_views, block_tensors=GPT_OSS_BLOCK_TENSORS, swa_pattern=2)
