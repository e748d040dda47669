"""Building blocks shared by the model families: norms, rotary embedding, linear layers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanochat.kernels import cpu_qgemv
from nanochat.kernels.cpu_decoder import activation
from nanochat.kernels.options import DEFAULT, KernelOptions
from nanochat.kernels.qweight import QuantWeight
from nanochat.models.config import ModelConfig
from nanochat.models.parallel.sharding import SINGLE, TensorParallel, column_units, split

Ranges = list[tuple[int, int]]   # (start, count) slices of a weight's rows, concatenated in order
SMALL_COPY_BYTES = 1 << 20       # dense tensors up to this size are copied out of a memory-mapped file


def norm_weight(cfg: ModelConfig, w: "WeightLoader", name: str) -> torch.Tensor:
    """An RMSNorm scale: 1 + w for zero-centred checkpoints (HF hybrids, Gemma 3), added in fp32 as transformers
    does, so the kernels see a plain weight."""
    weight = w.dense(name, torch.float32)
    return (weight + 1.0 if cfg.norm_zero_centred else weight).to(w.dtype)


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
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(config, rotary_dim, scaling)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv_freq.float()


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's factor on cos and sin: the stated one, else 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    stated = scaling.get("attention_factor")
    if stated is not None:
        return float(stated)
    factor = scaling["factor"]
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _yarn_inv_freq(config: ModelConfig, rotary_dim: int, scaling: dict) -> torch.Tensor:
    """YaRN (gpt-oss): interpolated (divided by factor) below the correction range's low end, extrapolated
    (kept) above its high end, a linear ramp between, as transformers' _compute_yarn_parameters and ggml's
    rope_yarn. `truncate` (transformers' default, and llama.cpp's only rule) rounds the range out to whole
    dimensions; gpt-oss's config.json turns it off."""
    base, factor = config.rope_theta, scaling["factor"]
    orig = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001   # as transformers: no division by zero
    # In float32, as both references compute it.
    extrapolation = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (extrapolation / factor * (1 - keep) + extrapolation * keep).double()


def rope_tables(config: ModelConfig, rotary_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, rotary_dim / 2] (float32). LongRoPE (Phi-3): the short factors below the
    pretraining context (original_max_position_embeddings), the long ones from there on, both tables times the
    attention factor. transformers picks one set per forward by its last position, so this is its forward for
    every prompt that does not cross that length and for every decode step on a cache; its generate() also
    recomputes the whole cache with the long factors once a sequence passes it, which a paged cache shared
    by prefixes cannot do in place (a token's rotation here depends on its position alone)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind != "longrope":
        freqs = torch.outer(positions, rope_inv_freq(config, rotary_dim))
        if kind == "yarn":
            attention = yarn_attention_factor(scaling)
            return freqs.cos() * attention, freqs.sin() * attention
        return freqs.cos(), freqs.sin()
    # As transformers computes them, in float32.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    short, long = (1.0 / (torch.tensor(scaling[k], dtype=torch.float32) * config.rope_theta ** exponents)
                   for k in ("short_factor", "long_factor"))
    past = (positions >= scaling["original_max_position_embeddings"]).unsqueeze(1)
    freqs = positions.unsqueeze(1) * torch.where(past, long, short)
    attention = scaling["attention_factor"]
    return freqs.cos() * attention, freqs.sin() * attention


class RotaryEmbedding(nn.Module):
    """NeoX-style (rotate-half) RoPE over the first `rotary_dim` dims, from a cos/sin table.

    All layers of a forward share one positions tensor, so the table lookup is done once per forward
    (cached on the identity of `positions`) instead of once per layer."""

    def __init__(self, config: ModelConfig, rotary_dim: int, max_positions: int, device):
        super().__init__()
        cos, sin = rope_tables(config, rotary_dim, max_positions)
        self.register_buffer("cos", cos.to(device), persistent=False)   # [max_pos, rotary_dim/2]
        self.register_buffer("sin", sin.to(device), persistent=False)
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
    """y = x W^T (+ b) with W dense, GGML-quantized, or row segments of different GGML types.

    Segments: a fused q|k|v or gate|up whose parts the file stores in different types (llama.cpp's
    quantizer mixes them, e.g. Q5_0 q/k with a Q8_0 v) keeps each part in its own type, one kernel call
    per part, rather than a dense copy of the whole.

    Tensor parallel: a row-parallel Linear (`reduce`) sums the ranks' partial outputs; a column-parallel
    one that must end whole on rank 0 (the lm_head, `gather`) gathers the ranks' columns there (the
    other ranks' forward returns None)."""

    def __init__(self, weight, bias: torch.Tensor | None = None, reduce: TensorParallel | None = None,
                 gather: tuple[TensorParallel, list[int]] | None = None):
        super().__init__()
        self.reduce, self.gather = reduce, gather
        self.quant = None
        self.segments: list | None = None
        if isinstance(weight, torch.Tensor):
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.out_features = weight.shape[0]
        elif isinstance(weight, list):  # PreparedQuantWeights stacked along the output
            self.weight = None
            self.segments = weight
            self.out_features = sum(seg.out_features for seg in weight)
        else:  # a PreparedQuantWeight from kernels.quant_matmul
            self.weight = None
            self.quant = weight
            self.out_features = weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def to_batch_invariant(self) -> None:
        """A dense W on the CPU moves to the q8 kernels' dense tiles (F32 / F16 / BF16 as W is; exact): their
        sum for a row of x runs in one order whatever else the call holds, where torch's GEMM picks its
        blocking by the number of rows (a row's result changed with the batch: 1, 2, 3 or 4+ rows, and with
        its place among them)."""
        if self.weight is None or not self.weight.is_cpu or self.weight.dim() != 2 or not cpu_qgemv.available():
            return
        from nanochat.kernels.quant_matmul import PreparedQuantWeight
        packed = cpu_qgemv.pack_dense(self.weight.data)
        self.quant = PreparedQuantWeight(packed.ggml_type, packed.shape, "q8", self.weight.dtype, packed.data)
        self.weight = None

    @property
    def invariant(self) -> bool:
        """Whether a row's result is the same bits whatever rows share the call: W on the q8 kernels."""
        parts = self.quant_parts()
        return bool(parts) and all(p.backend == "q8" for p in parts)

    def quant_parts(self) -> list | None:
        """The PreparedQuantWeights that make up W, in output order (None for a dense W)."""
        if self.segments is not None:
            return self.segments
        return None if self.quant is None else [self.quant]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._local(x)
        if self.reduce is not None:
            return self.reduce.all_reduce(y)
        if self.gather is not None:
            return self.gather[0].gather_columns(y, self.gather[1])
        return y

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None and self.segments is None:
            return F.linear(x, self.weight, self.bias)
        from nanochat.kernels.quant_matmul import quant_linear
        if self.quant is not None:
            return quant_linear(x, self.quant, self.bias)
        y = torch.cat([quant_linear(x, seg) for seg in self.segments], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Embedding(nn.Module):
    """Token embedding from a dense table (fp32, or 16-bit rows widened on lookup), from raw GGML
    blocks, or from the packed weight of a tied lm_head (one copy for both), rows dequantized on lookup.
    Tensor parallel: the table holds the vocabulary rows [vocab_start, vocab_start + rows) of this rank."""

    def __init__(self, weight, dtype: torch.dtype, tp: TensorParallel = SINGLE, vocab_start: int = 0):
        super().__init__()
        self.dtype = dtype
        self.tp, self.vocab_start = tp, vocab_start
        self.quant = weight if isinstance(weight, QuantWeight) else None
        self.packed = None
        if not isinstance(weight, (torch.Tensor, QuantWeight)):  # a q8 PreparedQuantWeight
            from nanochat.kernels.cpu_qgemv import PackedWeight
            self.packed = PackedWeight(weight.ggml_type, weight.shape, weight.weight)
        table = weight if isinstance(weight, torch.Tensor) else None
        self.weight = None if table is None else nn.Parameter(table, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.on:
            return self._lookup(ids)
        rows = self.weight.shape[0] if self.weight is not None else (
            self.packed.shape[0] if self.packed is not None else self.quant.out_features)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < rows)
        x = self._lookup(torch.where(mine, local, torch.zeros_like(local)))
        x = x.masked_fill(~mine.unsqueeze(-1), 0).contiguous()
        return self.tp.all_reduce(x)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight).to(self.dtype)
        if self.packed is not None:
            from nanochat.kernels.cpu_qgemv import dequantize_rows
            return dequantize_rows(self.packed, ids.reshape(-1)).view(*ids.shape, -1).to(self.dtype)
        from nanochat.kernels.gguf_quants import dequantize_rows
        return dequantize_rows(self.quant, ids).to(self.dtype)


def use_batch_invariant_kernels(model: nn.Module) -> None:
    """Config.batch_invariant: the matmuls still on torch's GEMM, whose sums it orders by the batch (a Hugging
    Face MoE's dense experts, quant_backend "dense"), move onto the q8 kernels' dense tiles, which sum each row
    in one order. Everything else is invariant anyway (the q8 matmuls, attention, activations, the fused
    step, the Gated DeltaNet recurrence). Each module with dense weights says how in its
    `to_batch_invariant()`; a dense model whose every linear is then on the q8 kernels takes the fused step."""
    for module in list(model.modules()):
        if hasattr(module, "to_batch_invariant"):
            module.to_batch_invariant()
    fused = getattr(model, "fused", None)
    if fused is not None:
        fused.recheck()


def batch_invariant(model: nn.Module) -> bool:
    """Whether each of the model's matmuls gives a row the same bits whatever rows share its step (the q8
    kernels; torch's GEMM blocks by the rows), so speculative proposals cannot change a greedy token."""
    return all(m.invariant for m in model.modules() if hasattr(m, "invariant"))


def embedding_and_head(cfg: ModelConfig, w: "WeightLoader") -> tuple[Embedding, Linear]:
    """The token embedding and the lm_head, quantized as the file has them. A tied head on the q8
    kernels serves the embedding too (one copy of a 151k x 896 table instead of two). Tensor parallel:
    both are split by vocabulary rows, the same rows for both, so a tied head still shares its table."""
    embed = "model.embed_tokens.weight"
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in w.names
    tp = w.tp
    vocab = [split(cfg.vocab_size, tp.size, r) for r in range(tp.size)]
    start, count = vocab[tp.rank]
    mine = [(start, count)] if tp.on else None     # this rank's vocabulary rows
    gather = (tp, [n for _, n in vocab]) if tp.on else None
    head = Linear(w.linear_weight([embed if tied else "lm_head.weight"], mine and [mine]), gather=gather)
    if tied and head.quant is not None and head.quant.backend == "q8":
        return Embedding(head.quant, w.dtype, tp, start), head
    return token_embedding(w, embed, mine, start), head


def token_embedding(w: "WeightLoader", name: str, rows: Ranges | None = None, start: int = 0) -> Embedding:
    """A token table as the file has it: GGML blocks, or 16-bit rows on the CPU, read where they lie (dequantized or
    widened on lookup); else dense. rows / start: this rank's vocabulary rows (tensor parallel)."""
    table = w.get(name)
    if isinstance(table, QuantWeight) and not w.dequantize:
        return Embedding(_slice(table, rows, None).to(w.device), w.dtype, w.tp, start)
    if isinstance(table, torch.Tensor) and table.dtype in (torch.float16, torch.bfloat16) and not w.dequantize \
            and w.device.type == "cpu":
        return Embedding(_slice(table, rows, None), w.dtype, w.tp, start)   # 16-bit rows straight from the file
    return Embedding(w.dense(name, rows=rows), w.dtype, w.tp, start)


def head_logits(lm_head: Linear, hidden: torch.Tensor) -> torch.Tensor | None:
    """fp32 logits [n, vocab] (None on a tensor-parallel rank other than 0)."""
    logits = lm_head(hidden)
    return None if logits is None else logits.float()


class GatedMLP(nn.Module):
    """down(act(gate x) * up x) with gate/up fused into one matmul; act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU,
    Gemma). Tensor parallel: each rank holds a slice of the intermediate columns; reduce=False leaves the
    partial sum to the caller (a MoE block sums it with its routed experts' in one all-reduce)."""

    def __init__(self, w: WeightLoader, prefix: str, reduce: bool = True, act: str = "silu"):
        super().__init__()
        self.act = act
        names = [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
        down = f"{prefix}.down_proj.weight"
        rows = cols = None
        if w.tp.on:
            cols = column_units(w.tp, w.shape(down)[1], w.align([down]), down)
            rows = [[cols], [cols]]
        self.gate_up_proj = Linear(w.linear_weight(names, rows))
        self.down_proj = Linear(w.linear_weight([down], cols=cols), reduce=w.tp if w.tp.on and reduce else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(activation(self.act, gate, up))


@dataclass
class WeightLoader:
    """Turns source tensors into device tensors or prepared quantized weights."""

    source: object                 # a models.formats.weights.WeightSource
    device: torch.device
    dtype: torch.dtype
    dequantize: bool = False
    moe_offload: str = "auto"      # routed MoE experts: "auto" | "cpu" (host kernels) | "none" (see models/layers/moe.py)
    quantize: str | None = None    # "q8_0": dense linears (not GGUF blocks) are quantized to Q8_0 here
    progress: Callable[[int, int], None] | None = None   # (tensors loaded, of total): a load bar
    pack_cache: object | None = None   # models.pack_cache.PackCache: packed tiles kept across loads
    tp: TensorParallel = SINGLE        # this rank's slice of every split weight (models/parallel/sharding.py)
    kernels: KernelOptions = DEFAULT   # the engine's kernel options, handed to every weight and kernel built

    def get(self, name: str):
        """The source tensor `name`, counted for `progress`."""
        w = self.source.get(name)
        self._count(name)
        return w

    def _count(self, name: str) -> None:
        """Tensor `name` is loaded: tell `progress` (routed experts are left out of the count: the MoE code reads
        them as whole stacks)."""
        if self.progress is not None and ".mlp.experts." not in name:
            if not self._seen:
                self._total = sum(1 for n in self.names if ".mlp.experts." not in n)
            self._seen.add(name)
            self.progress(min(len(self._seen), self._total), self._total)

    def __post_init__(self) -> None:
        self._seen: set[str] = set()
        self._total = 0

    def dense(self, name: str, dtype: torch.dtype | None = None, rows: Ranges | None = None,
              cols: tuple[int, int] | None = None) -> torch.Tensor:
        """`name` as a dense tensor on the device; rows / cols: only that slice (sliced before it is
        dequantized or copied)."""
        w = _slice(self.get(name), rows, cols)
        if isinstance(w, QuantWeight):
            from nanochat.kernels.gguf_quants import dequantize
            w = dequantize(w, torch.float32)
        out = w.to(device=self.device, dtype=dtype or self.dtype)
        if out.data_ptr() == w.data_ptr() and out.nbytes <= SMALL_COPY_BYTES:
            # A small tensor (a norm, a bias) still a view of the file's memory map: each step would read it
            # there, and a read of a mapped file page maps the page cache's whole folio around it (up to
            # 2 MiB), so the norms scattered between a GGUF's layers kept ~70 MB of its weights resident
            # beside their packed copies (SmolLM2 Q4_K_M: 441 -> 371 MB peak).
            out = out.clone()
        return out

    def linear_weight(self, names: list[str], rows: list[Ranges | None] | None = None,
                      cols: tuple[int, int] | None = None):
        """One weight for the row-concatenation of `names` (e.g. q,k,v): a PreparedQuantWeight when the
        parts go to the kernels in one type (GGML blocks, or a matrix of a float type they read), a list of
        them (segments) when their types differ, else a dense tensor. rows (per name) / cols: this rank's slice
        of each (tensor parallel)."""
        from nanochat.kernels.quant_matmul import prepare_quant_weight

        rows = rows or [None] * len(names)
        types = [self.kernel_type(n) for n in names]
        if None not in types:
            shapes = [self._sliced_shape(n, r, cols) for n, r in zip(names, rows)]
            if len(set(types)) == 1:
                shape = (sum(s[0] for s in shapes), shapes[0][1])
                return self._prepared(names, types[0], shape, rows, cols)
            return [self._prepared([n], t, s, [r], cols) for n, t, s, r in zip(names, types, shapes, rows)]
        dense = [self.dense(n, rows=r, cols=cols) for n, r in zip(names, rows)]
        dense = torch.cat(dense) if len(dense) > 1 else dense[0]
        if self.quantize == "q8_0" and dense.shape[-1] % 32 == 0:
            # Like a Q8_0 GGUF (the same blocks gguf would write): quantized kernels, the CPU fused path.
            from nanochat.kernels.gguf_quants import Q8_0, quantize_q8_0
            qw = QuantWeight(Q8_0, tuple(dense.shape), quantize_q8_0(dense).to(self.device))
            return prepare_quant_weight(qw, self.device, self.dtype, options=self.kernels)
        return dense

    def kernel_type(self, name: str) -> int | None:
        """The GGML type `name` goes to the kernels as: its blocks' type, or on the CPU F16/BF16/F32 for a matrix
        of those (as raw bytes, for the kernels that read those types), unless dequantize was asked. None: a
        torch tensor. A Hugging Face folder's matrices go to the kernels unless they are to be quantized at load
        or another backend was asked: in the checkpoint's own type they are half the bytes of the fp32 copy
        torch's GEMM needs, and their rows exact (benchmarks/README.md, "Hugging Face folders on the CPU
        kernels"). From the source's header where it has one: nothing is read."""
        if self.dequantize:
            return None
        stored, shape = self.source.peek(name)
        if isinstance(stored, int):
            return stored
        kernels = self.source.kind == "gguf" or (not self.quantize and self.kernels.quant_backend in ("auto", "q8"))
        if self.device.type == "cpu" and len(shape) == 2 and kernels:
            from nanochat.kernels import cpu_qgemv
            from nanochat.kernels import gguf_quants as gq
            t = gq.DENSE_TYPE_OF.get(stored)
            if t in cpu_qgemv.KERNEL_TYPES and cpu_qgemv.available():
                return t
        return None

    def _sliced_shape(self, name: str, rows: Ranges | None, cols: tuple[int, int] | None) -> tuple[int, int]:
        """The shape of `name`'s slice `_slice` cuts (rows: ranges, concatenated; cols: a range)."""
        out_f, in_f = self.source.peek(name)[1]
        return (sum(n for _, n in rows) if rows is not None else out_f), (cols[1] if cols is not None else in_f)

    def _file_weight(self, name: str, t: int) -> QuantWeight:
        """`name` as the kernels take it (of GGML type t, `kernel_type`): its blocks, or its matrix as raw bytes."""
        w = self.get(name)
        if isinstance(w, QuantWeight):
            return w
        return QuantWeight(t, tuple(w.shape), w.contiguous().view(torch.uint8))

    def _prepared(self, names: list[str], t: int, shape: tuple[int, int], rows: list[Ranges | None],
                  cols: tuple[int, int] | None):
        """`names` (GGML type t; `shape` once sliced by rows / cols) stacked along the output and prepared for the
        kernels. The packed tiles come from the pack cache when an earlier load left them there: then nothing is
        read."""
        from nanochat.kernels.quant_matmul import PreparedQuantWeight, prepare_quant_weight

        name = "+".join(names)   # a tensor-parallel rank's slice: in the rank's own cache file (build_model)
        tiles = None if self.pack_cache is None else self.pack_cache.lookup(name, t, shape)
        if tiles is not None:
            for n in names:
                self._count(n)
            pw = PreparedQuantWeight(t, shape, "q8", self.dtype, tiles, levels=self.kernels.act_levels,
                                     threads=self.kernels.threads)
        else:
            parts = [_slice(self._file_weight(n, t), r, cols) for n, r in zip(names, rows)]
            # Rows of GGML blocks are independent, so fusing is a row concatenation of raw bytes.
            data = torch.cat([p.data for p in parts]) if len(parts) > 1 else parts[0].data
            pw = prepare_quant_weight(QuantWeight(t, shape, data), self.device, self.dtype, tensor_name=name,
                                      options=self.kernels)
            if self.pack_cache is not None and pw.backend == "q8":
                self.pack_cache.add(name, t, shape, pw.weight)
        for n in names:   # the source's copy of a packed tensor is not read again: let it go
            self.source.release(n)
        return pw

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.peek(name)[1]

    def align(self, names: list[str]) -> int:
        """The column boundaries a row-parallel split of `names` must keep: their GGML blocks (32 more
        when dense weights are quantized to Q8_0 at load), 1 for dense weights."""
        from nanochat.kernels.gguf_quants import BLOCK_SIZES
        sizes = [BLOCK_SIZES[t][0] if (t := self.kernel_type(n)) is not None
                 else (32 if self.quantize == "q8_0" else 1) for n in names]
        return math.lcm(*sizes)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.dense(name) if name in self.names else None

    @property
    def names(self) -> set[str]:
        if not hasattr(self, "_names"):
            self._names = set(self.source.tensor_names())
        return self._names


def _slice(w, rows: Ranges | None, cols: tuple[int, int] | None):
    """Rows (ranges, concatenated) and a column range of a dense tensor or GGML blocks; GGML columns are
    cut on block boundaries (models/parallel/sharding.py makes sure they fall there)."""
    if rows is not None:
        def take(t):   # one range stays a view
            return torch.cat([t[s:s + n] for s, n in rows]) if len(rows) > 1 else t[rows[0][0]:sum(rows[0])]
        w = QuantWeight(w.ggml_type, (sum(n for _, n in rows), *w.shape[1:]), take(w.data)) \
            if isinstance(w, QuantWeight) else take(w)
    if cols is not None:
        start, count = cols
        if isinstance(w, QuantWeight):
            from nanochat.kernels.gguf_quants import BLOCK_SIZES
            elems, nbytes = BLOCK_SIZES[w.ggml_type]
            if start % elems or count % elems:
                raise ValueError(f"columns {start}:{start + count} do not fall on {elems}-element blocks")
            data = w.data[:, start // elems * nbytes:(start + count) // elems * nbytes].contiguous()
            w = QuantWeight(w.ggml_type, (w.shape[0], count), data)
        else:
            w = w[:, start:start + count].contiguous()
    return w
