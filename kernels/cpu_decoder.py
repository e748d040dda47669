"""A whole model step of a dense decoder stack in one compiled call (csrc/decoder.cpp).

Decode on the CPU is one row per sequence: beside the int8 matmuls, the ~25 small torch ops per layer
around them took as long again. `FusedDecoder.forward` runs every layer
(RMSNorm, fused qkv matmul + bias, q/k head norms, RoPE, paged KV store, causal softmax attention,
o_proj, residuals (with Gemma 3's output norms), SwiGLU or GeGLU MLP, or a sparse MoE MLP: router, top-k and the
routed experts where they lie, Qwen3-MoE and gpt-oss) and the final norm inside the library
of cpu_qgemv, on its thread pool, for any ragged batch: decode rows and prefill chunks (rows after cached keys
included).

The model describes itself once as plain buffers (`DecoderDims`, `DecoderLayer`): torch tensors (the engine)
or numpy arrays (the lean one-shot, engine/lean.py), never both in one plan; the plan keeps references to them
(the C side holds raw pointers), so a plan is valid as long as those buffers are the ones the model uses:
rebuild it when the KV cache is reallocated. The qkv and gate_up projections
may come as row segments of their own weight types (GGUF files quantize q, k, v and gate, up
separately); the KV cache may be float16 (K/V rounded to nearest even when stored, all arithmetic
in fp32) or float32.

A row's result depends only on that row, never on the rest of the batch (csrc/decoder.cpp, "Batch
invariance"). The module path on the CPU takes the step's attention (`paged_attention`) and
elementwise activations (`activation`) from here for that reason.
"""

from __future__ import annotations

import ctypes
import math
import struct
from array import array
from dataclasses import dataclass

from typing import TYPE_CHECKING

from nanochat.kernels import cpu_qgemv

if TYPE_CHECKING:
    import torch

_ERRORS = {3: "a quantized matmul failed", 4: "a position is outside the RoPE table",
           5: "the rows of a sequence do not end at its context length",
           6: "the routed experts failed (an unsupported weight type or shape, or a bad top-k)"}
# A sparse MoE layer's routing (csrc/decoder.cpp ROUTE_*) by models/layers/moe.py's route's (mode, renormalize):
# a softmax over all experts renormalized over the top k is the softmax over the top k.
_ROUTING = {("softmax_topk", False): 0, ("softmax_topk", True): 1, ("topk_softmax", False): 1,
            ("topk_softmax", True): 1}
# Row segments per layer in the plan (csrc/decoder.cpp: QKV_SEGS, GU_SEGS).
_QKV_SEGMENTS, _GATE_UP_SEGMENTS = 3, 2
_KV_DTYPES = ("float16", "float32")
_MLP_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}   # csrc/decoder.cpp ACT_*


@dataclass(frozen=True)
class DecoderDims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rotary_dim: int
    block_size: int
    eps: float
    activation: str = "silu"        # the gated MLP's: "silu" or "gelu_tanh"
    attention_scale: float = 0.0    # 0: head_dim ** -0.5


@dataclass
class MoeMlp:
    """A sparse MoE MLP in place of a layer's gated MLP: router [experts, hidden] (packed, any type the matmul takes)
    and its bias (fp32 [experts] or None); routing as models/layers/moe.py's route (mode, renormalize); the routed
    experts on kernels/moe_cpu's kernel (`HostExperts` with backend "kernel": its weights stay where they lie)."""

    router: cpu_qgemv.PackedWeight
    experts: object                   # kernels.moe_cpu.HostExperts
    top_k: int
    routing: str = "softmax_topk"
    renormalize: bool = False
    router_bias: torch.Tensor | None = None


@dataclass
class DecoderLayer:
    """One layer's buffers (torch tensors or numpy arrays; "fp32" below: float32). qkv: row segments in output order whose rows add up to
    (heads + 2 kv_heads) * head_dim (one fused q|k|v weight, or q, k, v, or any other split in 2-3);
    gate_up: gate|up fused or (gate, up); each segment of its own ggml type. KV caches
    [num_blocks, block_size, kv_heads, head_dim], float16 or float32 (every layer the same);
    norms and the qkv bias (all segments') fp32. rope: False leaves the layer without RoPE (SmolLM3's
    NoPE layers); cos / sin: the layer's own RoPE table (else the decoder's). window: 0 = full attention,
    else W (a query at position p sees keys p - W + 1 .. p). attn_out_norm / mlp_out_norm: RMSNorm weights
    (fp32) on the attention and MLP outputs before their residual adds (Gemma 3), or None. sinks: the attention
    sinks (fp32 [heads]: one logit per query head that joins the softmax's denominator and has no value, gpt-oss),
    or None. o_bias: the output projection's bias (fp32 [hidden]) or None. moe: a sparse MoE MLP in place of
    gate_up and down (then None)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: list[cpu_qgemv.PackedWeight]
    o: cpu_qgemv.PackedWeight
    gate_up: list[cpu_qgemv.PackedWeight] | None
    down: cpu_qgemv.PackedWeight | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    rope: bool = True
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    window: int = 0
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    moe: MoeMlp | None = None


def _bits(v: float) -> int:
    """A double's bits as an int64 plan field."""
    return struct.unpack("<q", struct.pack("<d", v))[0]


def _ptr(t) -> int:
    return 0 if t is None else cpu_qgemv.data_address(t)


def _dtype(t) -> str:
    """A buffer's dtype name ("float32", "int64", ...): torch's without its "torch." prefix, or numpy's."""
    return str(t.dtype).removeprefix("torch.")


def _contiguous_cpu(t) -> bool:
    if hasattr(t, "is_contiguous"):
        return t.is_contiguous() and t.is_cpu
    return t.flags.c_contiguous


def _contiguous(t):
    """t, or a contiguous copy of it."""
    if hasattr(t, "is_contiguous"):
        return t.contiguous()
    import numpy as np
    return np.ascontiguousarray(t)


def _fp32(t, what: str):
    if t is not None and (_dtype(t) != "float32" or not _contiguous_cpu(t)):
        raise ValueError(f"fused decoder: {what} must be a contiguous float32 CPU tensor")
    return t


def _row_stride(t) -> int:
    """The element stride between the rows of a 2-D buffer."""
    return t.stride(0) if hasattr(t, "is_contiguous") else t.strides[0] // t.itemsize


class FusedDecoder:
    """The plan for one model; `forward` runs one engine step. cos / sin [max_pos, rotary_dim / 2]: the RoPE
    table of the layers that do not bring their own."""

    def __init__(self, dims: DecoderDims, layers: list[DecoderLayer], cos, sin, final_norm, lib=None):
        lib = lib or cpu_qgemv.extension()
        if lib is None:
            raise RuntimeError("the CPU kernels are not available")
        if len(layers) != dims.layers:
            raise ValueError(f"fused decoder: {len(layers)} layers given, dims say {dims.layers}")
        if dims.heads % dims.kv_heads or dims.rotary_dim % 2 or dims.rotary_dim > dims.head_dim \
                or dims.head_dim > 256:
            raise ValueError("fused decoder: unsupported head layout")
        self.lib, self.dims = lib, dims
        self._keep = [_fp32(final_norm, "final norm")]
        self._cos_sin = cos, sin
        self.kv_dtype = _dtype(layers[0].k_cache)
        self._kv_dtype_shown = str(layers[0].k_cache.dtype)   # as the caller's library names it
        if self.kv_dtype not in _KV_DTYPES:
            raise ValueError(f"fused decoder: KV cache dtype {self._kv_dtype_shown} is not float16 or float32")
        if dims.activation not in _MLP_ACTIVATIONS:
            raise ValueError(f"fused decoder: activation {dims.activation!r} is not one of "
                             f"{', '.join(_MLP_ACTIVATIONS)}")
        scale = dims.attention_scale or dims.head_dim ** -0.5
        plan = [dims.layers, dims.hidden, dims.heads, dims.kv_heads, dims.head_dim, dims.intermediate,
                dims.rotary_dim, dims.block_size, cos.shape[0], _ptr(final_norm), _bits(dims.eps),
                int(self.kv_dtype == "float16"), _MLP_ACTIVATIONS[dims.activation], _bits(scale)]
        if len(plan) != lib.nc_dec_header_fields():
            raise RuntimeError("fused decoder: plan header does not match the library")
        for i, layer in enumerate(layers):
            fields = self._layer_fields(i, layer)
            if len(fields) != lib.nc_dec_layer_fields():
                raise RuntimeError("fused decoder: plan layout does not match the library")
            plan += fields
        self._first_k_cache = _ptr(layers[0].k_cache)
        self.plan = array("q", plan)
        self._plan_ptr = ctypes.c_void_p(self.plan.buffer_info()[0])

    def _layer_fields(self, i: int, layer: DecoderLayer) -> list[int]:
        d = self.dims
        for name in ("input_norm", "post_norm", "qkv_bias", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm",
                     "sinks", "o_bias"):
            self._keep.append(_fp32(getattr(layer, name), f"layer {i} {name}"))
        for name in ("attn_out_norm", "mlp_out_norm", "o_bias"):
            if getattr(layer, name) is not None and getattr(layer, name).shape != (d.hidden,):
                raise ValueError(f"fused decoder: layer {i} {name} must have {d.hidden} values")
        if layer.sinks is not None and layer.sinks.shape != (d.heads,):
            raise ValueError(f"fused decoder: layer {i} sinks must have {d.heads} values (one per query head)")
        cache_shape = (d.block_size, d.kv_heads, d.head_dim)
        for name in ("k_cache", "v_cache"):
            cache = getattr(layer, name)
            if _dtype(cache) != self.kv_dtype or not _contiguous_cpu(cache):
                raise ValueError(f"fused decoder: layer {i} {name} must be a contiguous {self._kv_dtype_shown} CPU tensor "
                                 "(every layer's K and V caches of one dtype)")
            if len(cache.shape) != 4 or tuple(cache.shape[1:]) != cache_shape \
                    or tuple(cache.shape) != tuple(layer.k_cache.shape):
                raise ValueError(f"fused decoder: layer {i} {name} shape {list(cache.shape)} does not fit")
            self._keep.append(cache)
        qkv_rows = (d.heads + 2 * d.kv_heads) * d.head_dim
        if layer.qkv_bias is not None and layer.qkv_bias.shape != (qkv_rows,):
            raise ValueError(f"fused decoder: layer {i} qkv_bias must have {qkv_rows} values")
        qkv = self._segments(i, "qkv", layer.qkv, _QKV_SEGMENTS, qkv_rows, d.hidden)
        o = self._weight(i, "o", layer.o, d.hidden, d.heads * d.head_dim)
        if layer.moe is None:
            gate_up = self._segments(i, "gate_up", layer.gate_up, _GATE_UP_SEGMENTS, 2 * d.intermediate, d.hidden)
            down = self._weight(i, "down", layer.down, d.hidden, d.intermediate)
            moe = 0
        else:
            gate_up, down = [0] * (_GATE_UP_SEGMENTS * 3), [0, 0]
            moe = self._moe(i, layer.moe)
        cos, sin = (layer.cos, layer.sin) if layer.cos is not None else self._cos_sin
        table = (self._cos_sin[0].shape[0], d.rotary_dim // 2)
        for name, t in (("cos", cos), ("sin", sin)):
            if layer.rope and (_fp32(t, f"layer {i} {name}") is None or tuple(t.shape) != table):
                raise ValueError(f"fused decoder: layer {i} {name} must be a [{table[0]}, {table[1]}] table")
            self._keep.append(t)
        if isinstance(layer.window, bool) or not isinstance(layer.window, int) or layer.window < 0:
            raise ValueError(f"fused decoder: layer {i} window must be 0 (full attention) or a positive integer")
        rope = (_ptr(cos), _ptr(sin)) if layer.rope else (0, 0)
        return [_ptr(layer.input_norm), _ptr(layer.post_norm), *qkv, _ptr(layer.qkv_bias), _ptr(layer.q_norm),
                _ptr(layer.k_norm), *o, *gate_up, *down, _ptr(layer.k_cache), _ptr(layer.v_cache), *rope,
                layer.window, _ptr(layer.attn_out_norm), _ptr(layer.mlp_out_norm), _ptr(layer.sinks),
                _ptr(layer.o_bias), moe]

    def _moe(self, i: int, moe: MoeMlp) -> int:
        """The address of layer i's MoE description (csrc/decoder.cpp M_FIELDS), kept alive by the plan."""
        x = moe.experts
        if getattr(x, "backend", None) != "kernel" or x.hidden_size != self.dims.hidden:
            raise ValueError(f"fused decoder: layer {i} experts must be HostExperts on the kernel backend "
                             f"with hidden size {self.dims.hidden}")
        if not 1 <= moe.top_k <= x.num_experts or (moe.routing, moe.renormalize) not in _ROUTING:
            raise ValueError(f"fused decoder: layer {i} routing {moe.routing!r} top-{moe.top_k} of {x.num_experts}")
        if moe.router_bias is not None and tuple(moe.router_bias.shape) != (x.num_experts,):
            raise ValueError(f"fused decoder: layer {i} router bias must have {x.num_experts} values")
        self._keep += [x, _fp32(moe.router_bias, f"layer {i} router bias")]
        router = self._weight(i, "router", moe.router, x.num_experts, self.dims.hidden)
        fields = array("q", [x.num_experts, moe.top_k, _ROUTING[moe.routing, moe.renormalize], *router,
                             _ptr(moe.router_bias), *(ctypes.addressof(m) for m in x.mats), x.act_id,
                             _bits(x.alpha), _bits(x.limit), _ptr(x.gate_bias), _ptr(x.up_bias), _ptr(x.down_bias)])
        if len(fields) != self.lib.nc_dec_moe_fields():
            raise RuntimeError("fused decoder: MoE plan layout does not match the library")
        self._keep.append(fields)
        return fields.buffer_info()[0]

    def _weight(self, i: int, name: str, w: cpu_qgemv.PackedWeight, rows: int, cols: int) -> list[int]:
        """(type, tiles) of a packed [rows, cols] weight, kept alive by the plan."""
        if not isinstance(w, cpu_qgemv.PackedWeight) or tuple(w.shape) != (rows, cols) \
                or _dtype(w.data) != "uint8" or not _contiguous_cpu(w.data) \
                or math.prod(w.data.shape) != cpu_qgemv.packed_bytes(w.ggml_type, rows, cols):
            raise ValueError(f"fused decoder: layer {i} {name} is not a packed [{rows}, {cols}] weight")
        self._keep.append(w.data)
        return [w.ggml_type, _ptr(w.data)]

    def _segments(self, i: int, name: str, segs: list[cpu_qgemv.PackedWeight], most: int, rows: int,
                  cols: int) -> list[int]:
        """(type, tiles, rows) per row segment, padded to `most` segments with rows = 0."""
        seg_rows = [getattr(w, "out_features", 0) for w in segs] if isinstance(segs, (list, tuple)) else []
        if not 1 <= len(seg_rows) <= most or min(seg_rows) < 1 or sum(seg_rows) != rows:
            raise ValueError(f"fused decoder: layer {i} {name} must be 1 to {most} packed weights whose rows add "
                             f"up to {rows}")
        fields = []
        for j, w in enumerate(segs):
            fields += self._weight(i, f"{name}[{j}]", w, w.out_features, cols) + [w.out_features]
        return fields + [0, 0, 0] * (most - len(segs))

    def uses(self, k_cache) -> bool:
        """Whether the plan was built over this (first layer's) K cache."""
        return self._first_k_cache == _ptr(k_cache)

    def forward(self, x, positions, slots, cu_seqlens_q, block_tables, context_lens, levels: int | None = None,
                threads: int | None = None, window_slots=None, window_block_tables=None):
        """One step over a ragged batch: x [n, hidden] float32 (embedded tokens, updated in place and
        returned as the final-normed hidden states); positions/slots int64 [n]; sequence b owns rows
        cu_seqlens_q[b]:cu_seqlens_q[b + 1] (int32 [B + 1], consecutive positions ending at
        context_lens[b] - 1); block_tables int32 [B, max_blocks]; context_lens int32 [B]. window_slots (int64 [n])
        and window_block_tables (int32 [B, max_window_blocks]), or None: the slots and tables of the windowed layers
        (window > 0) of a model that keeps their KV in a group of its own. Every argument is a torch tensor or
        a numpy array, as the plan's buffers are."""
        n = x.shape[0]
        if _dtype(x) != "float32" or not _contiguous_cpu(x) or x.shape[1] != self.dims.hidden:
            raise ValueError(f"fused decoder: x must be contiguous float32 [n, {self.dims.hidden}]")
        positions, slots, cu_seqlens_q = _contiguous(positions), _contiguous(slots), _contiguous(cu_seqlens_q)
        block_tables, context_lens = _contiguous(block_tables), _contiguous(context_lens)
        seqs = context_lens.shape[0]
        if _dtype(positions) != "int64" or _dtype(slots) != "int64" or _dtype(block_tables) != "int32" \
                or _dtype(context_lens) != "int32" or _dtype(cu_seqlens_q) != "int32" \
                or positions.shape[0] != n or slots.shape[0] != n or block_tables.shape[0] != seqs \
                or cu_seqlens_q.shape[0] != seqs + 1:
            raise ValueError("fused decoder: batch tensors have the wrong dtypes or shapes")
        if (window_slots is None) != (window_block_tables is None):
            raise ValueError("fused decoder: window_slots and window_block_tables come together")
        win_ptrs = (0, 0, 0)
        if window_slots is not None:
            window_slots, window_block_tables = _contiguous(window_slots), _contiguous(window_block_tables)
            if _dtype(window_slots) != "int64" or tuple(window_slots.shape) != (n,) \
                    or _dtype(window_block_tables) != "int32" or len(window_block_tables.shape) != 2 \
                    or window_block_tables.shape[0] != seqs:
                raise ValueError("fused decoder: window batch tensors have the wrong dtypes or shapes")
            win_ptrs = (_ptr(window_slots), _ptr(window_block_tables), _row_stride(window_block_tables))
        rc = self.lib.nc_dec_forward(self._plan_ptr, _ptr(x), n, _ptr(positions), _ptr(slots), seqs,
                                     _ptr(cu_seqlens_q), _ptr(block_tables), _row_stride(block_tables),
                                     _ptr(context_lens), *win_ptrs, (levels or cpu_qgemv.DEFAULT_LEVELS) == 2,
                                     threads or cpu_qgemv.num_threads())
        if rc:
            raise RuntimeError(f"fused decoder: {_ERRORS.get(rc, f'error {rc}')}")
        return x


# name -> (csrc/decoder.cpp op, the torch reference's name in torch / torch.nn.functional)
_ACTIVATIONS = {"silu": (0, "silu"), "sigmoid": (1, "sigmoid"), "softplus": (2, "softplus"), "exp": (3, "exp"),
                "gelu_tanh": (4, "gelu"), "tanh": (5, "tanh")}


def _torch_activation(name: str):
    import torch
    import torch.nn.functional as F

    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    ref = _ACTIVATIONS[name][1]
    return getattr(F, ref) if ref in ("silu", "softplus") else getattr(torch, ref)


def activation(name: str, x: torch.Tensor, mul: torch.Tensor | None = None) -> torch.Tensor:
    """silu, sigmoid, softplus, exp, gelu_tanh (GELU, tanh approximation) or tanh of x (times `mul`, of x's
    shape). On the CPU in float32 through the fused step's library, where each element's result is a function
    of its value only: torch's kernels compute the last elements of each range they split a tensor into in
    scalar code, which rounds differently, so a row's values would depend on how many rows share the call.
    Elsewhere torch's own."""
    import torch

    ref = _torch_activation(name)
    lib = cpu_qgemv.extension() if x.is_cpu and x.dtype == torch.float32 and x.dim() >= 1 else None
    if lib is None or x.shape[-1] == 0 or x.stride(-1) != 1 or (mul is not None and (
            mul.shape != x.shape or mul.dtype != torch.float32 or mul.stride(-1) != 1)):
        return ref(x) if mul is None else ref(x) * mul
    rows = x.reshape(-1, x.shape[-1])      # a view for the layouts the callers have (rows of a wider tensor)
    u = None if mul is None else mul.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=torch.float32)
    activation_raw(name, rows, out, mul=u)
    return out.view(x.shape)


def activation_raw(name: str, x, out, threads: int | None = None, mul=None) -> None:
    """`activation` into `out` on 2-D float32 buffers (torch tensors or numpy arrays) whose rows are contiguous:
    out = f(x) (* mul). The CPU library must be available."""
    lib = cpu_qgemv.extension()
    lib.nc_dec_activation(_ACTIVATIONS[name][0], _ptr(x), _row_stride(x), _ptr(mul), 0 if mul is None else
                          _row_stride(mul), x.shape[0], x.shape[1], _ptr(out), _row_stride(out),
                          cpu_qgemv.num_threads(threads))


def attention_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_attention` takes these: CPU tensors, an fp16 or fp32 cache, the library built."""
    return q.is_cpu and k_cache.is_cpu and _dtype(k_cache) in _KV_DTYPES and cpu_qgemv.available()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The fused step's attention on its own (the module path on the CPU): q [n, heads, head_dim] of the
    rows of each sequence (cu_seqlens_q, the last at context_lens - 1), whose K/V are in the paged caches
    [num_blocks, block_size, kv_heads, head_dim] already; returns float32 [n, heads, head_dim]. The same
    arithmetic as the fused step (a query's output depends only on it, its position and the cache). window: 0 =
    full attention, else W (a query at position p sees keys p - W + 1 .. p). sinks: float32 [heads], a logit per
    query head in the softmax's denominator only, or None."""
    import torch

    lib = cpu_qgemv.extension()
    n, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape \
            or v_cache.dtype != k_cache.dtype:
        raise ValueError("paged attention: q and the caches do not fit together")
    if sinks is not None:
        if sinks.shape != (heads,):
            raise ValueError(f"paged attention: sinks must have {heads} values (one per query head)")
        sinks = sinks.to(torch.float32).contiguous()
    q2 = q.reshape(n, heads * head_dim)
    if q2.dtype != torch.float32 or q2.stride(-1) != 1:
        q2 = q2.float().contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty(n, heads, head_dim, dtype=torch.float32)
    rc = lib.nc_dec_attention(q2.data_ptr(), q2.stride(0), n, lens.shape[0], cu.data_ptr(), tables.data_ptr(),
                              tables.stride(0), lens.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                              int(k_cache.dtype == torch.float16), heads, kv_heads, head_dim, k_cache.shape[1], scale,
                              window, _ptr(sinks), out.data_ptr(), cpu_qgemv.num_threads())
    if rc:
        raise RuntimeError(f"paged attention: {_ERRORS.get(rc, f'error {rc}')}")
    return out
