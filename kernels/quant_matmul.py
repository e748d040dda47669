"""Linear layers on GGML-quantized weights: y = x @ W^T with W kept quantized.

`prepare_quant_weight` runs once at load and picks a backend:

- "q8"     (CPU, the default where the extension builds): the compiled kernels of cpu_qgemv.py for Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, MXFP4, and F16 / BF16 / F32 matrices (read exactly, with fp32
  activations, not the int8 scheme below). The raw blocks are repacked once into tiles of 16 rows
  (same bytes; the last tile is padded to 16 rows); each call quantizes the rows of x per block of 32
  to int8 codes plus int8 codes of the residual (two levels; one level, as llama.cpp, with
  KernelOptions.act_levels=1), runs integer dot products (AVX-512 VNNI / AVX2 / scalar) and
  scales them per block in fp32. Any number of rows, one copy of the weight for decode and prefill,
  a row's output independent of the batch. Error vs x @ W^T: the activation grid, at most
  amax(block of x) / 32512 per element (two levels; / 254 with one), plus fp32 rounding.
- "int4"   (CPU, the fallback when the extension cannot be built, or when asked for): torch's
  int4 group-32 kernel `aten._weight_int4pack_mm_for_cpu`, which computes
  W[o, k] = S[g, o] * (q[o, k] - 8) + Z[g, o] per group g of 32 inputs, reading bf16 activations.
  Every GGML type whose values are affine in small unsigned integers per group maps onto it as a
  sum of int4 "parts" over a repeated input: W = sum_p W_p, y = [x, x, ...] @ [W_0 | W_1 | ...]^T.
    Q4_0, Q4_1, Q4_K   1 part                           5 bits/weight (file: 4.5 / 5.0 / 4.5)
    Q5_0, Q5_1, Q5_K   2 parts: low nibble, high bit    10 bits/weight
    Q8_0, Q8_1         2 parts: nibbles of q + 128      10 bits/weight
    Q2_K, Q3_K         1 part on a zero-spread input    10 bits/weight: their scales cover 16
                       inputs, the kernel's groups 32, so each 16-group is padded to 32 with
                       inputs that are zero.
  (4 bits per quant nibble plus 1 bit per element for the bf16 scale and zero of each group.)
  The maths is exact up to bf16: S and Z are rounded to bf16 (relative 2^-9), x is cast to bf16 and
  the output is rounded to bf16; accumulation is fp32 inside the kernel.
- "dense": dequantized once to `compute_dtype`, then F.linear (fp32-exact results when compute_dtype
  is float32). Used for F32/F16/BF16, whenever `backend="dense"` is asked (the engine's
  dequantize=True), and on CPU without the extension for Q6_K (six bits with 16-wide scales would
  need 4 int4 nibbles per weight: no smaller than bf16, and slower than MKL) and MXFP4 (its values come
  from a table, not affine in the codes).
- "triton" (CUDA): fused dequant + matmul straight from the raw GGML blocks, see triton_gguf.py.

The fp32 variant of the int4 kernel is scalar code (far slower than bf16), so the int4 backend
always computes in bf16 and casts the result back to x's dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.gguf_quants import _bits32, _f16, _k_scale_min, _nibbles, _split_bits
from nanochat.kernels.options import DEFAULT, KernelOptions
from nanochat.kernels.qweight import QuantWeight, Shaped

GROUP = 32
# torch >= 2.6 has the CPU int4 kernel; without it the CPU falls back to dense weights.
_INT4MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)
_ROW_CHUNK = 1024  # rows packed per step (a multiple of 64: chunks pack like the whole matrix)
CPU_INT4_TYPES = frozenset({gq.Q4_0, gq.Q4_1, gq.Q5_0, gq.Q5_1, gq.Q8_0, gq.Q8_1,
                            gq.Q2_K, gq.Q3_K, gq.Q4_K, gq.Q5_K})
_SPREAD16_TYPES = frozenset({gq.Q2_K, gq.Q3_K})


@dataclass
class PreparedQuantWeight(Shaped):
    """A weight ready for `quant_linear` on its device. Fields by backend:
    q8:     weight = uint8 tiles [ceil(out / 16), tile row bytes] (cpu_qgemv.pack);
    int4:   weight = packed uint8 [out_pad, k_eff // 2], scale_zeros = [k_eff // 32, out_pad, 2] bf16,
            where k_eff = parts * in (* 2 when spread16);
    dense:  weight = [out, in] in compute_dtype;
    triton: weight = raw GGML blocks uint8 [out, bytes_per_row] on the GPU."""

    ggml_type: int
    shape: tuple[int, int]
    backend: str
    compute_dtype: torch.dtype
    weight: torch.Tensor
    scale_zeros: torch.Tensor | None = None
    parts: int = 1
    spread16: bool = False
    prefill_weight: torch.Tensor | None = None  # opt-in bf16 copy for big batches (see prepare)
    prefill_min_rows: int = 0
    levels: int = cpu_qgemv.DEFAULT_LEVELS      # q8: activation levels and threads (KernelOptions)
    threads: int | None = None

    def nbytes(self) -> int:
        tensors = (self.weight, self.scale_zeros, self.prefill_weight)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---------------------------------------------------------------- int4 decomposition
# A part is (q, S, C, qmax): q uint8 [rows, K] in [0, qmax], S and C float32 [rows, K / group],
# meaning W += S * q + C over each group (group = 32, or 16 for the spread types).

def _blocks(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return data.reshape(-1, gq.BLOCK_SIZES[ggml_type][1])


def _parts_32(t: int, data: torch.Tensor, rows: int, k: int):
    b = _blocks(data, t)
    shape_q, shape_s = (rows, k), (rows, k // 32)
    if t in (gq.Q4_0, gq.Q4_1):
        d = _f16(b, 0)
        c = -8 * d if t == gq.Q4_0 else _f16(b, 2)
        qs = b[:, 2:18] if t == gq.Q4_0 else b[:, 4:20]
        return [(_nibbles(qs).view(shape_q), d.view(shape_s), c.view(shape_s), 15)]
    if t in (gq.Q5_0, gq.Q5_1):
        d = _f16(b, 0)
        if t == gq.Q5_0:
            c, qh, qs = -16 * d, b[:, 2:6], b[:, 6:22]
        else:
            c, qh, qs = _f16(b, 2), b[:, 4:8], b[:, 8:24]
        zero = torch.zeros_like(d)
        return [(_nibbles(qs).view(shape_q), d.view(shape_s), c.view(shape_s), 15),
                (_bits32(qh).view(shape_q), (16 * d).view(shape_s), zero.view(shape_s), 1)]
    if t in (gq.Q8_0, gq.Q8_1):
        off = 2 if t == gq.Q8_0 else 4
        d = _f16(b, 0)
        u = (b[:, off:off + 32].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        zero = torch.zeros_like(d)
        return [((u & 15).view(shape_q), d.view(shape_s), (-128 * d).view(shape_s), 15),
                ((u >> 4).view(shape_q), (16 * d).view(shape_s), zero.view(shape_s), 15)]
    raise AssertionError(t)


def _parts_k(t: int, data: torch.Tensor, rows: int, k: int):
    b = _blocks(data, t)
    n = b.shape[0]
    if t in (gq.Q4_K, gq.Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        scale, mins = _k_scale_min(b[:, 4:16])
        s, c = (d * scale).view(rows, k // 32), (-(dmin * mins)).view(rows, k // 32)
        if t == gq.Q4_K:
            q = _split_bits(b[:, 16:144].reshape(n, 4, 32), 4).reshape(rows, k)
            return [(q, s, c, 15)]
        ql = _split_bits(b[:, 48:176].reshape(n, 4, 32), 4).reshape(rows, k)
        qh = _split_bits(b[:, 16:48], 1).reshape(rows, k)
        return [(ql, s, c, 15), (qh, 16 * s, torch.zeros_like(s), 1)]
    if t == gq.Q2_K:
        sc = b[:, 0:16]
        d, dmin = _f16(b, 80), _f16(b, 82)
        s = (d * (sc & 15).float()).view(rows, k // 16)
        c = (-(dmin * (sc >> 4).float())).view(rows, k // 16)
        q = _split_bits(b[:, 16:80].reshape(n, 2, 32), 2).reshape(rows, k)
        return [(q, s, c, 3)]
    if t == gq.Q3_K:
        sc = b[:, 96:108]
        low = _split_bits(sc[:, 0:8], 4).reshape(n, 16)
        high = _split_bits(sc[:, 8:12], 2).reshape(n, 16)
        s = (_f16(b, 108) * ((low | (high << 4)).to(torch.int8) - 32).float()).view(rows, k // 16)
        ql = _split_bits(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, gq.QK_K)
        hbit = _split_bits(b[:, 0:32], 1).reshape(n, gq.QK_K)
        q = (ql | (hbit << 2)).view(rows, k)  # = q3 + 4, in [0, 7]
        return [(q, s, -4 * s, 7)]
    raise AssertionError(t)


def _int4_parts(t: int, data: torch.Tensor, rows: int, k: int):
    return _parts_32(t, data, rows, k) if gq.BLOCK_SIZES[t][0] == 32 else _parts_k(t, data, rows, k)


def _fold_offsets(parts):
    """Turn parts (q, S, C) into kernel terms (q + c, S, Z) with W = sum S*(q + c - 8) + Z.

    Each part picks an integer shift c (keeping q + c within 0..15) that absorbs as much of the
    remaining constant as possible, so the bf16-rounded Z left at the end stays small (|Z| <= 8|S|)."""
    carry = sum(c for _, _, c, _ in parts)
    terms = []
    for q, s, _, qmax in parts:
        safe = torch.where(s == 0, torch.ones_like(s), s)
        shift = torch.round(8 + carry / safe).clamp_(0, 15 - qmax)
        shift = torch.where(s == 0, torch.zeros_like(shift), shift)
        carry = carry + s * (8 - shift)
        if qmax < 15:  # a 4-bit part has no room to shift (c = 0)
            q = (q.view(*s.shape, -1) + shift.to(torch.uint8).unsqueeze(-1)).view(q.shape)  # uint8, 0..15
        terms.append((q, s))
    zeros = [torch.zeros_like(carry)] * (len(terms) - 1) + [carry]
    return [(q, s, z) for (q, s), z in zip(terms, zeros)]


def _spread_q(q: torch.Tensor) -> torch.Tensor:
    """[rows, K] in 16-groups -> [rows, 2K]: each 16-group followed by 16 neutral quants (8)."""
    rows = q.shape[0]
    pad = torch.full_like(q.view(rows, -1, 16), 8)
    return torch.cat([q.view(rows, -1, 16), pad], dim=2).view(rows, -1)


def _torch_pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)


def _fast_pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 quants [n, k] (n % 64 == 0) -> the layout of _convert_weight_to_int4pack_for_cpu:
    per 64 rows, k-major bytes whose low nibble is row r and high nibble row r + 32. Doing it with
    byte ops skips the int32 copy and torch's converter (a faster load)."""
    n, k = q.shape
    b = q.view(n // 64, 2, 32, k)
    return (b[:, 0] | (b[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


@functools.cache
def _packer():
    """_fast_pack relies on an internal layout: use it only while it matches torch's own packer."""
    q = torch.randint(0, 16, (128, 96), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return _fast_pack if torch.equal(_fast_pack(q), _torch_pack(q)) else _torch_pack


def _pack_int4(qw: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    t = qw.ggml_type
    out_f, in_f = qw.shape
    spread = t in _SPREAD16_TYPES
    out_pad = -(-out_f // 64) * 64  # whole 64-row tiles of the packed layout; extra rows are sliced off
    data = qw.data.cpu()
    pack = _packer()
    packed, scales, zeros = [], [], []
    parts_n = 1
    for r0 in range(0, out_pad, _ROW_CHUNK):
        r1 = min(r0 + _ROW_CHUNK, out_pad)
        rows = data[r0:min(r1, out_f)]
        if rows.shape[0] < r1 - r0:  # padding rows: all-zero bytes decode to 0 in every block type
            rows = torch.cat([rows, rows.new_zeros(r1 - r0 - rows.shape[0], rows.shape[1])])
        terms = _fold_offsets(_int4_parts(t, rows, r1 - r0, in_f))
        parts_n = len(terms)
        qs = [(_spread_q(q) if spread else q) for q, _, _ in terms]
        packed.append(pack(torch.cat(qs, 1) if len(qs) > 1 else qs[0]))
        scales.append(torch.cat([s for _, s, _ in terms], 1))
        zeros.append(torch.cat([z for _, _, z in terms], 1))
    s = torch.cat(scales, 0).t()
    z = torch.cat(zeros, 0).t()
    sz = torch.stack([s, z], dim=-1).to(torch.bfloat16).contiguous()
    return torch.cat(packed, 0), sz, parts_n, spread


# ---------------------------------------------------------------- public API

def concat_out_features(qws: list[QuantWeight], tensor_name: str = "<fused>") -> QuantWeight:
    """Stack weights along the output dim (q|k|v, gate|up): GGML blocks never cross rows, so this is
    a byte concatenation. One fused call saves the dispatch of each extra matmul on CPU decode."""
    t, in_f = qws[0].ggml_type, qws[0].in_features
    for qw in qws:
        if qw.ggml_type != t or qw.in_features != in_f:
            raise ValueError(f"{tensor_name}: cannot fuse {[(q.type_name, list(q.shape)) for q in qws]}: "
                             "types and input sizes must match")
    data = torch.cat([qw.data for qw in qws], dim=0)
    return QuantWeight(t, (data.shape[0], in_f), data)


BACKENDS = ("auto", "q8", "int4", "dense", "triton")


def _check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown quant backend {name!r} ({', '.join(BACKENDS)})")


def _pick_backend(t: int, device: torch.device, compute_dtype: torch.dtype, backend: str) -> str:
    if backend != "auto":
        _check_backend(backend)
        return backend
    if device.type == "cuda":
        from nanochat.kernels import triton_gguf

        return "triton" if t in triton_gguf.FUSED_TYPES and triton_gguf.available() else "dense"
    # Weights stay quantized whatever the activation dtype: fp32 activations are rounded to bf16 for
    # the int4 kernel (errors at bf16 level); `dequantize=True` / backend "dense" give fp32-exact maths.
    # q8 where its library has a SIMD build. A scalar build (no AVX2, no NEON) is slower than torch: SmolLM2-135M
    # Q4_1 on 2 AVX2 EPYC cores, scalar q8 prefills 11 tok/s and decodes 3.5, int4 113 and 9.6, dense 31 and 10.2.
    if t in cpu_qgemv.KERNEL_TYPES and cpu_qgemv.available() and cpu_qgemv.simd_compiled() != "scalar":
        return "q8"
    fast = _INT4MM is not None and t in CPU_INT4_TYPES
    return "int4" if fast else "dense"


def prepare_quant_weight(qw: QuantWeight, device, compute_dtype=torch.bfloat16, backend: str | None = None,
                         tensor_name: str = "<tensor>", prefill_min_rows: int | None = None,
                         options: KernelOptions = DEFAULT) -> PreparedQuantWeight:
    """Make `qw` ready for `quant_linear` on `device`. Runs once at load time.

    `backend` "auto" picks, on CPU: q8 for its types when the extension builds with SIMD, else int4 where the type
    maps (errors at bf16 level), dense otherwise (whatever compute_dtype is: weights stay quantized);
    on CUDA: triton for the fused types, else dense. "q8" / "int4" / "dense" / "triton" force a backend.
    None: options.quant_backend (the engine's quant_backend, env NANOCHAT_QUANT_BACKEND). The q8 weight
    runs with options' activation levels and threads.

    `prefill_min_rows` (q8 / int4, opt-in): also keep a dense bf16 copy and use it for calls with at
    least that many rows, trading 16 extra bits per weight for prefill speed (int4: from a few rows on a
    dense bf16 GEMM is faster). Decode (few rows) keeps reading the quantized
    weight. Off by default: q8 needs no second copy."""
    device = torch.device(device)
    gq.check_supported(qw.ggml_type, tensor_name)
    out_f, in_f = qw.shape
    expected = (out_f, gq.row_bytes(qw.ggml_type, in_f))
    if tuple(qw.data.shape) != expected or qw.data.dtype != torch.uint8:
        raise ValueError(f"tensor {tensor_name!r}: {qw.type_name} {list(qw.shape)} needs uint8 data of shape "
                         f"{list(expected)}, got {qw.data.dtype} {list(qw.data.shape)}")
    kind = _pick_backend(qw.ggml_type, device, compute_dtype, backend or options.quant_backend)
    base = dict(ggml_type=qw.ggml_type, shape=(out_f, in_f), compute_dtype=compute_dtype)
    if kind == "q8":
        if device.type != "cpu" or qw.ggml_type not in cpu_qgemv.KERNEL_TYPES or not cpu_qgemv.available():
            raise ValueError(f"tensor {tensor_name!r}: q8 backend needs the compiled CPU kernels (g++, ninja), a CPU "
                             f"device and one of {sorted(gq.type_name(t) for t in cpu_qgemv.KERNEL_TYPES)}, "
                             f"got {qw.type_name} on {device}")
        pw = PreparedQuantWeight(backend="q8", weight=cpu_qgemv.pack(qw, tensor_name).data, levels=options.act_levels,
                                 threads=options.threads, **base)
        _add_prefill_copy(pw, qw, prefill_min_rows, tensor_name)
        return pw
    if kind == "int4":
        if device.type != "cpu" or qw.ggml_type not in CPU_INT4_TYPES or _INT4MM is None:
            raise ValueError(f"tensor {tensor_name!r}: int4 backend needs torch >= 2.6, a CPU device and one of "
                             f"{sorted(gq.type_name(t) for t in CPU_INT4_TYPES)}, got {qw.type_name} on {device}")
        packed, sz, parts, spread = _pack_int4(qw)
        pw = PreparedQuantWeight(backend="int4", weight=packed, scale_zeros=sz, parts=parts, spread16=spread, **base)
        _add_prefill_copy(pw, qw, prefill_min_rows, tensor_name)
        return pw
    if kind == "triton":
        from nanochat.kernels import triton_gguf

        if qw.ggml_type not in triton_gguf.FUSED_TYPES:
            raise ValueError(f"tensor {tensor_name!r}: no fused Triton kernel for {qw.type_name}")
        return PreparedQuantWeight(backend="triton", weight=qw.data.to(device).contiguous(), **base)
    dense = gq.dequantize_raw(qw.ggml_type, qw.data.to(device), qw.shape, compute_dtype, tensor_name)
    return PreparedQuantWeight(backend="dense", weight=dense, **base)


def _add_prefill_copy(pw: PreparedQuantWeight, qw: QuantWeight, min_rows: int | None, tensor_name: str) -> None:
    if min_rows is not None:
        pw.prefill_weight = gq.dequantize_raw(qw.ggml_type, qw.data, qw.shape, torch.bfloat16, tensor_name)
        pw.prefill_min_rows = min_rows


def _expand_input(x: torch.Tensor, pw: PreparedQuantWeight) -> torch.Tensor:
    if pw.spread16:  # inputs of each 16-group, then 16 zeros that meet the neutral padding quants
        n = x.shape[0]
        x = F.pad(x.view(n, -1, 16), (0, 16)).view(n, -1)
    if pw.parts > 1:
        x = torch.cat([x] * pw.parts, dim=1)
    return x


def quant_linear(x: torch.Tensor, pw: PreparedQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [..., in]; y has x's dtype and shape [..., out]."""
    if x.shape[-1] != pw.in_features:
        raise ValueError(f"quant_linear: input has {x.shape[-1]} features, weight expects {pw.in_features}")
    x2 = x if x.dim() == 2 else x.reshape(-1, pw.in_features)
    if pw.backend == "q8":
        y = _q8_linear(x2, pw, bias)
    elif pw.backend == "int4":
        y = _int4_linear(x2, pw)
        if bias is not None:
            y = y + bias.to(y.dtype)
    elif pw.backend == "dense":
        w = pw.weight
        y = F.linear(x2.to(w.dtype), w, None if bias is None else bias.to(w.dtype)).to(x.dtype)
    else:
        from nanochat.kernels import triton_gguf

        y = triton_gguf.gguf_linear(x2, pw.weight, pw.ggml_type, pw.out_features, pw.in_features, pw.compute_dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], pw.out_features)




def _q8_linear(x: torch.Tensor, pw: PreparedQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if pw.prefill_weight is not None and x.shape[0] >= pw.prefill_min_rows:
        w = pw.prefill_weight
        return F.linear(x.to(w.dtype), w, None if bias is None else bias.to(w.dtype)).to(x.dtype)
    # fp32 / bf16 in and out directly (the kernel converts); bias is added in the kernel.
    y = cpu_qgemv.linear(x, pw.ggml_type, pw.weight, pw.out_features, bias, levels=pw.levels, threads=pw.threads)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _int4_linear(x: torch.Tensor, pw: PreparedQuantWeight) -> torch.Tensor:
    # Decode calls this ~200 times per token: keep the common case (bf16, one part) to one op.
    xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    if pw.prefill_weight is not None and x.shape[0] >= pw.prefill_min_rows:
        y = F.linear(xb, pw.prefill_weight)
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)
    if not xb.is_contiguous():
        xb = xb.contiguous()
    if pw.parts > 1 or pw.spread16:
        xb = _expand_input(xb, pw)
    y = _INT4MM(xb, pw.weight, GROUP, pw.scale_zeros)
    if y.shape[1] != pw.out_features:
        y = y[:, :pw.out_features]
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)
