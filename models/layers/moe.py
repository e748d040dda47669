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

Expert offload (`WeightLoader.moe_offload`: "auto" | "cpu" | "none"): `HostOffloadedExperts` keeps the
routed experts where the source has them (a GGUF memory map: host RAM, quantized, never copied to the
device) and computes them with kernels.moe_cpu; router, shared expert and the mixers stay on the
device. Per MoE layer only the hidden states and the routing (top-k ids and weights) go to the host,
and only the routed output comes back; on CUDA the shared expert runs on the GPU meanwhile.
"cpu" forces it; "auto" uses it on CUDA when the experts would not fit in free GPU memory, and on a
CPU device whenever the experts are quantized (and not dequantized by the loader); "none" never.

Tensor parallel: the routed experts are split by expert (expert parallel), each rank holding whole
experts [start, start + count); the router and the shared expert's split are as in a dense MLP, and
one all-reduce sums the routed and shared partial outputs. Whole experts rather than slices of each:
a GGUF's expert stacks stay views of the memory map, and a slice of Qwen3-30B-A3B's 768 columns over
two ranks (384) would not fall on the K-quants' 256-element blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.cpu_decoder import activation
from nanochat.kernels.moe_cpu import HostExperts, StackedWeight, clamped_swiglu
from nanochat.kernels.qweight import QuantWeight
from nanochat.models.config import ModelConfig
from nanochat.models.layers.common import GatedMLP, Linear, WeightLoader
from nanochat.models.parallel.sharding import split

OFFLOAD_MODES = ("auto", "cpu", "none")
_GPU_HEADROOM = 1 << 30   # KV cache and activations need room beside the weights


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          mode: str = "softmax_topk") -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]). "topk_softmax" (gpt-oss): the top k
    logits, then a softmax over them (weights sum to 1 by construction)."""
    if mode == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class ExpertMLP:
    """What an expert computes besides its three matmuls: its activation of (gate, up), and per-expert biases
    on gate, up and down (gpt-oss; None elsewhere), fp32 [E, I], [E, I], [E, H] for the experts held."""

    act: str = "silu"                  # "silu" | "swiglu_oai" (ModelConfig.expert_act)
    alpha: float = 1.702
    limit: float = 7.0
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @classmethod
    def load(cls, cfg: ModelConfig, w: WeightLoader, prefix: str, first: int, count: int) -> "ExpertMLP":
        """`prefix`: the layer's "....mlp.experts"; the biases of experts [first, first + count) when the
        checkpoint has them."""
        biases = []
        for p in ("gate", "up", "down"):
            name = f"{prefix}.{p}_proj.bias"
            biases.append(w.dense(name, torch.float32, rows=[(first, count)]).contiguous() if name in w.names else None)
        return cls(cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit, *biases)

    def hidden(self, gate: torch.Tensor, up: torch.Tensor, e: int | torch.Tensor) -> torch.Tensor:
        """The down projection's input from gate and up rows of expert(s) e (an index, or one per row)."""
        if self.gate_bias is not None:
            gate, up = gate + self.gate_bias[e].to(gate.dtype), up + self.up_bias[e].to(up.dtype)
        if self.act == "swiglu_oai":
            return clamped_swiglu(gate, up, self.alpha, self.limit)
        return activation("silu", gate, up)

    def out(self, y: torch.Tensor, e: int | torch.Tensor) -> torch.Tensor:
        return y if self.down_bias is None else y + self.down_bias[e].to(y.dtype)


class Experts(nn.Module):
    """Experts [first, first + num_experts) of the layer (all of them without tensor parallelism)."""

    def __init__(self, w: WeightLoader, prefix: str, num_experts: int, first: int = 0,
                 mlp: ExpertMLP = ExpertMLP()):
        super().__init__()
        self.num_experts = num_experts
        self.mlp = mlp
        self.w13 = self.w2 = None          # dense: [E, 2I, H], [E, H, I]
        self.quant = None                  # on the kernels: per expert, its Linears (`_pair`)
        fused = f"{prefix}.gate_up_proj"
        if fused in w.names:
            mine = [(first, num_experts)]
            self.w13 = nn.Parameter(w.dense(fused, rows=mine), requires_grad=False)
            self.w2 = nn.Parameter(w.dense(f"{prefix}.down_proj", rows=mine), requires_grad=False)
        else:
            names = [[f"{prefix}.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
                     for e in range(first, first + num_experts)]
            if w.kernel_type(names[0][0]) is not None:   # GGML blocks, or a folder's bf16 / fp16 on the CPU
                self.quant = nn.ModuleList(_pair(Linear(w.linear_weight(n[:2])), Linear(w.linear_weight(n[2:])))
                                           for n in names)
            else:
                self.w13 = nn.Parameter(torch.stack([torch.cat([w.dense(n[0]), w.dense(n[1])]) for n in names]),
                                        requires_grad=False)
                self.w2 = nn.Parameter(torch.stack([w.dense(n[2]) for n in names]), requires_grad=False)
        if self.w13 is not None and (self.w13.shape[0] != num_experts or self.w2.shape[0] != num_experts):
            raise ValueError(f"{prefix}: expected {num_experts} experts, got weights {tuple(self.w13.shape)} "
                             f"and {tuple(self.w2.shape)}")
        self.use_grouped_mm = False

    @property
    def invariant(self) -> bool:
        return self.w13 is None   # (quantized experts are Linears, which say for themselves)

    def to_batch_invariant(self) -> None:
        """Dense experts on the CPU: a Linear pair per expert on the q8 kernels' dense tiles (Linear's
        to_batch_invariant), so a token's sums do not depend on which tokens share its expert."""
        if self.w13 is None or not self.w13.is_cpu:
            return
        pairs = []
        for e in range(self.num_experts):
            pair = _pair(Linear(self.w13[e]), Linear(self.w2[e]))
            for linear in pair.values():
                linear.to_batch_invariant()
            pairs.append(pair)
        self.quant = nn.ModuleList(pairs)
        self.w13 = self.w2 = None

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            gate_up, down = self.quant[e].values()
            gate, up = gate_up(x).chunk(2, dim=-1)
            return self.mlp.out(down(self.mlp.hidden(gate, up, e)), e)
        gate, up = F.linear(x, self.w13[e]).chunk(2, dim=-1)
        return self.mlp.out(F.linear(self.mlp.hidden(gate, up, e), self.w2[e]), e)

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate, up = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        rows = torch.repeat_interleave(torch.arange(self.num_experts, device=xs.device), counts,
                                       output_size=xs.shape[0])   # each row's expert
        return self.mlp.out(torch._grouped_mm(self.mlp.hidden(gate, up, rows), self.w2.transpose(1, 2), offs=offs),
                            rows)

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


def _pair(gate_up: Linear, down: Linear) -> nn.ModuleDict:
    """An expert's two Linears, named as a dense MLP's (what `nanochat info` lists them by)."""
    return nn.ModuleDict({"gate_up_proj": gate_up, "down_proj": down})


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


# ---------------------------------------------------------------- expert offload


def _expert_names(prefix: str, e: int) -> list[str]:
    return [f"{prefix}.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]


def host_expert_stacks(w: WeightLoader, prefix: str, num_experts: int) -> tuple[StackedWeight, ...]:
    """(gate, up, down) of every expert under `prefix` as [E, out, in] host tensors: the source's own
    3-D tensors when it has them (GGUF: views of the memory map), else the experts stacked."""
    stacks = tuple(w.source.expert_stack(prefix, p) for p in ("gate", "up", "down"))
    if all(s is not None for s in stacks):
        return stacks
    if f"{prefix}.gate_up_proj" in w.names:          # HF Qwen3.5: fused dense [E, 2I, H]
        gu, down = w.source.get(f"{prefix}.gate_up_proj"), w.source.get(f"{prefix}.down_proj")
        half = gu.shape[1] // 2
        return tuple(_dense_stack(t) for t in (gu[:, :half], gu[:, half:], down))
    per_expert = [[w.source.get(n) for n in _expert_names(prefix, e)] for e in range(num_experts)]
    stacks = []
    for j in range(3):
        parts = [p[j] for p in per_expert]
        if isinstance(parts[0], QuantWeight):
            stacks.append(StackedWeight(parts[0].ggml_type, (num_experts, *parts[0].shape),
                                        torch.stack([p.data for p in parts])))
        else:
            stacks.append(_dense_stack(torch.stack(parts)))
    return tuple(stacks)


def _dense_stack(t: torch.Tensor) -> StackedWeight:
    if t.dtype not in gq.DENSE_TYPE_OF:
        t = t.float()
    return StackedWeight(gq.DENSE_TYPE_OF[t.dtype], tuple(t.shape), t)


def _experts_quantized(w: WeightLoader, cfg: ModelConfig) -> bool:
    layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)), 0)
    name = _expert_names(f"model.layers.{layer}.mlp.experts", 0)[0]
    return name in w.names and isinstance(w.source.peek(name)[0], int)   # GGML blocks (a header's answer)


def _device_expert_bytes(w: WeightLoader, cfg: ModelConfig) -> tuple[int, int]:
    """(bytes the routed experts would take on the device, bytes they take in the source)."""
    elem = torch.empty((), dtype=w.dtype).element_size()
    dense = cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * elem
    on_device = stored = 0
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        stacks = [w.source.expert_stack(f"model.layers.{i}.mlp.experts", p) for p in ("gate", "up", "down")]
        if all(s is not None for s in stacks):
            size = sum(s.nbytes() for s in stacks)
            stored += size
            on_device += size if all(s.quantized for s in stacks) and not w.dequantize else dense
        else:
            stored += dense
            on_device += dense
    return on_device, stored


def use_host_experts(w: WeightLoader, cfg: ModelConfig) -> bool:
    """Whether this model's routed experts run on the host (decided once per loader, see the module doc)."""
    decided = getattr(w, "_host_experts", None)
    if decided is not None:
        return decided
    mode = getattr(w, "moe_offload", "auto")
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"moe_offload must be one of {', '.join(OFFLOAD_MODES)}, got {mode!r}")
    if mode != "auto":
        decided = mode == "cpu"
    elif w.device.type == "cpu":
        decided = not w.dequantize and _experts_quantized(w, cfg)
    elif w.device.type == "cuda":
        experts, stored = _device_expert_bytes(w, cfg)
        rest = max(0, w.source.file_size - stored)   # attention, embeddings, ...
        free, _ = torch.cuda.mem_get_info(w.device)
        decided = experts + rest + _GPU_HEADROOM > free
    else:
        decided = False
    w._host_experts = decided
    return decided


class HostOffloadedExperts(nn.Module):
    """Routed experts computed on the host by kernels.moe_cpu; same call as `Experts`. Holds experts
    [first, first + count) of the layer's num_experts (count None: all)."""

    def __init__(self, w: WeightLoader, prefix: str, num_experts: int, first: int = 0, count: int | None = None,
                 mlp: ExpertMLP = ExpertMLP()):
        super().__init__()
        gate, up, down = host_expert_stacks(w, prefix, num_experts)
        if gate.num_experts != num_experts:
            raise ValueError(f"{prefix}: expected {num_experts} experts, got {gate.num_experts}")
        if count is not None:   # a view of this rank's experts (the memory map is not copied)
            gate, up, down = (StackedWeight(s.ggml_type, (count, *s.shape[1:]), s.data[first:first + count])
                              for s in (gate, up, down))
            num_experts = count
        self.host = HostExperts(gate, up, down, w.kernels, name=prefix, activation=mlp.act, alpha=mlp.alpha,
                                limit=mlp.limit, gate_bias=mlp.gate_bias, up_bias=mlp.up_bias,
                                down_bias=mlp.down_bias)
        self.num_experts = num_experts

    @property
    def invariant(self) -> bool:
        return self.host.backend == "kernel" or self.host.batch_invariant

    def to_batch_invariant(self) -> None:
        self.host.batch_invariant = True

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """Begin the call; returns a function that finishes it and gives the routed output [T, H]
        in x's dtype and device. On CUDA the inputs go to pinned host buffers behind the router
        on the stream, so work queued before finish() (the shared expert) overlaps the host part."""
        if x.device.type == "cpu":
            y = self.host(x, ids, weights)
            return lambda: y.to(x.dtype)
        xh = torch.empty(x.shape, dtype=torch.float32, pin_memory=True)
        idh = torch.empty(ids.shape, dtype=torch.int64, pin_memory=True)
        wh = torch.empty(weights.shape, dtype=torch.float32, pin_memory=True)
        xh.copy_(x.float(), non_blocking=True)
        idh.copy_(ids, non_blocking=True)
        wh.copy_(weights.float(), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def finish() -> torch.Tensor:
            copied.synchronize()
            out = torch.empty(x.shape, dtype=torch.float32, pin_memory=True)
            self.host(xh, idh, wh, out=out)
            return out.to(x.device, non_blocking=True).to(x.dtype)

        return finish

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.start(x, ids, weights)()


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, prefix: str):
        super().__init__()
        self.top_k, self.renormalize, self.router = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.moe_router
        self.tp = w.tp
        # Router logits in the model dtype (as the reference), softmax in fp32. On the CPU the router and the
        # shared expert's gate run on the q8 kernels' dense tiles (exact; cheap at their size): a token's
        # experts and weights must not depend on the tokens beside it (see Linear.to_batch_invariant).
        bias = f"{prefix}.gate.bias"
        self.gate = Linear(w.dense(f"{prefix}.gate.weight"), w.dense(bias) if bias in w.names else None)
        self.gate.to_batch_invariant()
        self.offloaded = use_host_experts(w, cfg)
        self.first, count = split(cfg.num_experts, w.tp.size, w.tp.rank)
        if w.tp.on and count == 0:
            raise ValueError(f"{prefix}: {cfg.num_experts} experts cannot be split over {w.tp.size} ranks")
        mlp = ExpertMLP.load(cfg, w, f"{prefix}.experts", self.first, count)
        if self.offloaded:
            self.experts = HostOffloadedExperts(w, f"{prefix}.experts", cfg.num_experts, self.first,
                                                count if w.tp.on else None, mlp)
        else:
            self.experts = Experts(w, f"{prefix}.experts", count, self.first, mlp)
            self.experts.use_grouped_mm = grouped_mm_usable(w.device, w.dtype)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(w, f"{prefix}.shared_expert", reduce=False)
            self.shared_expert_gate = Linear(w.dense(f"{prefix}.shared_expert_gate.weight"))
            self.shared_expert_gate.to_batch_invariant()

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is None:
            return None
        return activation("sigmoid", self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.router)
        if self.tp.on:
            y = self._local_experts(x, ids, weights)
            shared = self._shared(x)
            return self.tp.all_reduce(y if shared is None else y + shared)
        if self.offloaded:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("MoE experts offloaded to the CPU cannot run inside a CUDA graph: run this "
                                   "model eagerly (enforce_eager, or skip capture when has_host_experts(model))")
            finish = self.experts.start(x, ids, weights)
            shared = self._shared(x)          # on the device while the host computes the experts
            y = finish()
        else:
            y = self.experts(x, ids, weights)
            shared = self._shared(x)
        return y if shared is None else y + shared


    def _local_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's share of the routed output: the (token, expert) pairs whose expert it holds, run
        as one pair per row, summed back per token (zeros where it holds none of a token's experts)."""
        local = ids - self.first
        mine = (local >= 0) & (local < self.experts.num_experts)
        tokens, slots = mine.nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if tokens.numel():
            y = self.experts(x.index_select(0, tokens), local[tokens, slots].unsqueeze(1),
                             weights[tokens, slots].unsqueeze(1))
            out.index_add_(0, tokens, y.to(x.dtype))
        return out


def has_host_experts(model: nn.Module) -> bool:
    """Whether any MoE layer of `model` computes its experts on the host (such a model cannot be
    captured in CUDA graphs: the host part needs a synchronisation per layer)."""
    return any(isinstance(m, SparseMoeBlock) and m.offloaded for m in model.modules())
