"""Sparse mixture-of-experts MLP (Qwen3-MoE, Qwen3-Next, Qwen3.5/3.6-MoE).

    p = softmax(x Wr^T) (fp32); top-k; renormalise when norm_topk_prob
    y = sum_k p_k * down_e(silu(gate_e x) * up_e x)  [+ sigmoid(x Ws^T) * shared(x)]

Dispatch is grouped by expert: the (token, expert) pairs are sorted by expert id so each active expert
runs one matmul pair over a contiguous slice of gathered rows (torch._grouped_mm does all of them in
one call where it is usable: CUDA, half precision). The k partial outputs of a token are summed in a
fixed order (no atomics), so results are deterministic.

Expert weights come as HF names, either per expert (`experts.{e}.{gate,up,down}_proj.weight`, Qwen3-MoE
and Qwen3-Next checkpoints; also what a GGUF source exposes) or fused (`experts.gate_up_proj [E, 2I, H]`
with gate = first I rows, `experts.down_proj [E, H, I]`, Qwen3.5/3.6 checkpoints). Dense experts are
stacked into two 3-D tensors; quantized ones stay one quantized Linear pair per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanochat.kernels.qweight import QuantWeight
from nanochat.models.config import ModelConfig
from nanochat.models.layers import Linear, WeightLoader


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x) with gate/up fused into one matmul."""

    def __init__(self, w: WeightLoader, prefix: str):
        super().__init__()
        self.gate_up_proj = Linear(w.linear_weight([f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]))
        self.down_proj = Linear(w.linear_weight([f"{prefix}.down_proj.weight"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    def __init__(self, w: WeightLoader, prefix: str, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w13 = self.w2 = None          # dense: [E, 2I, H], [E, H, I]
        self.quant = None                  # quantized: nn.ModuleList of (gate_up, down) per expert
        fused = f"{prefix}.gate_up_proj"
        if fused in w.names:
            self.w13 = nn.Parameter(w.dense(fused), requires_grad=False)
            self.w2 = nn.Parameter(w.dense(f"{prefix}.down_proj"), requires_grad=False)
        else:
            names = [[f"{prefix}.{e}.{p}_proj.weight" for p in ("gate", "up", "down")] for e in range(num_experts)]
            if isinstance(w.source.get(names[0][0]), QuantWeight) and not w.dequantize:
                self.quant = nn.ModuleList(
                    nn.ModuleList([Linear(w.linear_weight(n[:2])), Linear(w.linear_weight(n[2:]))]) for n in names)
            else:
                self.w13 = nn.Parameter(torch.stack([torch.cat([w.dense(n[0]), w.dense(n[1])]) for n in names]),
                                        requires_grad=False)
                self.w2 = nn.Parameter(torch.stack([w.dense(n[2]) for n in names]), requires_grad=False)
        if self.w13 is not None and (self.w13.shape[0] != num_experts or self.w2.shape[0] != num_experts):
            raise ValueError(f"{prefix}: expected {num_experts} experts, got weights {tuple(self.w13.shape)} "
                             f"and {tuple(self.w2.shape)}")
        self.use_grouped_mm = False

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            gate_up, down = self.quant[e]
            gate, up = gate_up(x).chunk(2, dim=-1)
            return down(F.silu(gate) * up)
        gate, up = F.linear(x, self.w13[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2[e])

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate, up = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offs)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> [T, H]."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        xs = x.index_select(0, order // k)                     # rows grouped by expert
        # (index_add_ rather than bincount: no device->host sync, so the grouped path can be graph-captured)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))
        if self.use_grouped_mm and self.w13 is not None:
            ys = self._grouped(xs, counts)
        else:
            ys = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    ys[start:start + n] = self._expert(e, xs[start:start + n])
                    start += n
        out = torch.empty_like(ys)
        out[order] = ys                                        # back to (token, slot) order
        return (out.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def grouped_mm_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm pays off on CUDA (sm90+ kernels) in half precision; on CPU a loop is faster."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        a = torch.zeros(16, 16, device=device, dtype=dtype)
        b = torch.zeros(2, 16, 16, device=device, dtype=dtype)
        torch._grouped_mm(a, b, offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
    except Exception:
        return False
    return True


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, prefix: str):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        # Router logits in the model dtype (as the reference), softmax in fp32.
        self.gate = Linear(w.dense(f"{prefix}.gate.weight"))
        self.experts = Experts(w, f"{prefix}.experts", cfg.num_experts)
        self.experts.use_grouped_mm = grouped_mm_usable(w.device, w.dtype)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(w, f"{prefix}.shared_expert")
            self.shared_expert_gate = Linear(w.dense(f"{prefix}.shared_expert_gate.weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        y = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
