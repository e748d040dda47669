"""Building blocks shared by the model families: norms, rotary embedding, linear layers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanochat.kernels.qweight import QuantWeight
from nanochat.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(config: ModelConfig, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "llama3":
        # Llama 3.x frequency-dependent scaling (long wavelengths stretched, short kept).
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "freq_factors":   # GGUF llama3 files store the per-frequency divisors as a tensor
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float64)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """NeoX-style (rotate-half) RoPE over the first `rotary_dim` dims, from a cos/sin table.

    All layers of a forward share one positions tensor, so the table lookup is done once per forward
    (cached on the identity of `positions`) instead of once per layer."""

    def __init__(self, config: ModelConfig, rotary_dim: int, max_positions: int, device):
        super().__init__()
        inv_freq = rope_inv_freq(config, rotary_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)   # [max_pos, rotary_dim/2]
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)
        self.rotary_dim = rotary_dim
        self._cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._cached
        if cached is None or cached[0] is not positions:
            cached = self._cached = (positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return cached[1], cached[2]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, head_dim] -> rotated copy."""
        cos, sin = self.cos_sin(positions)
        return _apply_rope(x, cos, sin, self.rotary_dim)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [N, h, d], k [N, kvh, d] -> rotated copies."""
        return self.rotate(positions, q), self.rotate(positions, k)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    full = rotary_dim == x.shape[-1]
    rot = x if full else x[..., :rotary_dim]
    if rot.dtype != torch.float32:
        rot = rot.float()
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if full else torch.cat([out, x[..., rotary_dim:]], dim=-1)


class Linear(nn.Module):
    """y = x W^T (+ b) with W dense or GGML-quantized (consumed by the quant kernels)."""

    def __init__(self, weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.quant = None
        if isinstance(weight, torch.Tensor):
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.out_features = weight.shape[0]
        else:  # a PreparedQuantWeight from kernels.quant_matmul
            self.weight = None
            self.quant = weight
            self.out_features = weight.shape[0] if hasattr(weight, "shape") else weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.linear(x, self.weight, self.bias)
        from nanochat.kernels.quant_matmul import quant_linear
        return quant_linear(x, self.quant, self.bias)


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x) with gate/up fused into one matmul."""

    def __init__(self, w: WeightLoader, prefix: str):
        super().__init__()
        self.gate_up_proj = Linear(w.linear_weight([f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]))
        self.down_proj = Linear(w.linear_weight([f"{prefix}.down_proj.weight"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@dataclass
class WeightLoader:
    """Turns source tensors into device tensors or prepared quantized weights."""

    source: object
    device: torch.device
    dtype: torch.dtype
    dequantize: bool = False
    moe_offload: str = "auto"      # routed MoE experts: "auto" | "cpu" (host kernels) | "none" (see models/moe.py)
    quantize: str | None = None    # "q8_0": dense linears (not GGUF blocks) are quantized to Q8_0 here

    def dense(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        w = self.source.get(name)
        if isinstance(w, QuantWeight):
            from nanochat.kernels.gguf_quants import dequantize
            w = dequantize(w, torch.float32)
        return w.to(device=self.device, dtype=dtype or self.dtype)

    def linear_weight(self, names: list[str]):
        """One fused weight from the row-concatenation of `names` (e.g. q,k,v)."""
        parts = [self.source.get(n) for n in names]
        if all(isinstance(p, QuantWeight) for p in parts) and not self.dequantize \
                and len({p.ggml_type for p in parts}) == 1:
            # Rows of GGML blocks are independent, so fusing is a row concatenation of raw bytes.
            data = torch.cat([p.data for p in parts]) if len(parts) > 1 else parts[0].data
            rows = sum(p.shape[0] for p in parts)
            qw = QuantWeight(parts[0].ggml_type, (rows, parts[0].shape[1]), data)
            from nanochat.kernels.quant_matmul import prepare_quant_weight
            return prepare_quant_weight(qw, self.device, self.dtype)
        dense = torch.cat([self.dense(n) for n in names]) if len(names) > 1 else self.dense(names[0])
        if self.quantize == "q8_0" and dense.shape[-1] % 32 == 0:
            # Like a Q8_0 GGUF (the same blocks gguf would write): quantized kernels, the CPU fused path.
            from nanochat.kernels.gguf_quants import Q8_0, quantize_q8_0
            from nanochat.kernels.quant_matmul import prepare_quant_weight
            qw = QuantWeight(Q8_0, tuple(dense.shape), quantize_q8_0(dense).to(self.device))
            return prepare_quant_weight(qw, self.device, self.dtype)
        return dense

    def optional(self, name: str) -> torch.Tensor | None:
        return self.dense(name) if name in self.names else None

    @property
    def names(self) -> set[str]:
        if not hasattr(self, "_names"):
            self._names = set(self.source.tensor_names())
        return self._names
