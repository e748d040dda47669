"""Triton fused dequant + matmul on raw GGML blocks: y = x @ W^T, W never materialised.

One kernel, specialised per GGML type at compile time (QTYPE constexpr). Each program owns a
[BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps: it loads the x tile, decodes the
[BLOCK_K, BLOCK_N] tile of W^T straight from the block bytes (every element finds its block, its
scale bytes and its quant bits by address arithmetic; neighbouring elements share bytes, which the
cache serves), and accumulates tl.dot in fp32. When the output tiles are too few to fill the GPU
(decode on narrow layers), K is split over extra programs whose fp32 partial sums torch reduces.

Fused types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4. The per-element
formulas are the ones in gguf_quants.py (same operation order; on GPUs the compiler may fuse a
multiply-add, which changes the last bit only). Other types fall back to a dense weight at load.

The triton import is guarded: importing this module without triton works, calling raises.
"""

from __future__ import annotations

import functools
import os

import torch

from nanochat.kernels import gguf_quants as gq

try:  # GPU-only dependency: keep `import nanochat.kernels.triton_gguf` working without it.
    import triton
    import triton.language as tl
    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # ImportError, or a broken install raising something else
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = exc

FUSED_TYPES = frozenset({gq.Q4_0, gq.Q4_1, gq.Q5_0, gq.Q5_1, gq.Q8_0, gq.Q8_1,
                         gq.Q2_K, gq.Q3_K, gq.Q4_K, gq.Q5_K, gq.Q6_K, gq.MXFP4})


def available() -> bool:
    return triton is not None


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _byte(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _f16(ptr, mask):
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _i8(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)

    @triton.jit
    def _k_scale_min(blk, s, mask):
        """Q4_K/Q5_K: six-bit scale and min of sub-block s (0..7) from the 12 bytes at blk + 4."""
        lo = s % 4
        a = _byte(blk + 4 + lo, mask)
        b = _byte(blk + 8 + lo, mask)
        c = _byte(blk + 12 + lo, mask)
        sc = tl.where(s < 4, a & 63, (c & 15) | ((a >> 6) << 4))
        mn = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _dequant(w_ptr, rows, ks, row_bytes, mask, QTYPE: tl.constexpr):
        """W[rows, ks] as float32; rows and ks broadcast against each other (any 2-D tile shape)."""
        row = w_ptr + rows.to(tl.int64) * row_bytes
        if QTYPE == 2:  # Q4_0: d, 16 B nibbles
            blk = row + (ks // 32) * 18
            j = ks % 32
            q = (_byte(blk + 2 + j % 16, mask) >> ((j // 16) * 4)) & 15
            w = _f16(blk, mask) * (q.to(tl.float32) - 8.0)
        elif QTYPE == 3:  # Q4_1: d, m, nibbles
            blk = row + (ks // 32) * 20
            j = ks % 32
            q = (_byte(blk + 4 + j % 16, mask) >> ((j // 16) * 4)) & 15
            w = _f16(blk, mask) * q.to(tl.float32) + _f16(blk + 2, mask)
        elif QTYPE == 6:  # Q5_0: d, u32 high bits, nibbles
            blk = row + (ks // 32) * 22
            j = ks % 32
            lo = (_byte(blk + 6 + j % 16, mask) >> ((j // 16) * 4)) & 15
            hi = (_byte(blk + 2 + j // 8, mask) >> (j % 8)) & 1
            w = _f16(blk, mask) * ((lo | (hi << 4)).to(tl.float32) - 16.0)
        elif QTYPE == 7:  # Q5_1: d, m, u32 high bits, nibbles
            blk = row + (ks // 32) * 24
            j = ks % 32
            lo = (_byte(blk + 8 + j % 16, mask) >> ((j // 16) * 4)) & 15
            hi = (_byte(blk + 4 + j // 8, mask) >> (j % 8)) & 1
            w = _f16(blk, mask) * (lo | (hi << 4)).to(tl.float32) + _f16(blk + 2, mask)
        elif QTYPE == 8:  # Q8_0: d, 32 x i8
            blk = row + (ks // 32) * 34
            w = _i8(blk + 2 + ks % 32, mask) * _f16(blk, mask)
        elif QTYPE == 9:  # Q8_1: d, s, 32 x i8
            blk = row + (ks // 32) * 36
            w = _i8(blk + 4 + ks % 32, mask) * _f16(blk, mask)
        elif QTYPE == 10:  # Q2_K: 16 scale/min bytes, 64 B of 2-bit quants, d, dmin
            blk = row + (ks // 256) * 84
            j = ks % 256
            sc = _byte(blk + j // 16, mask)
            q = (_byte(blk + 16 + (j // 128) * 32 + j % 32, mask) >> (((j % 128) // 32) * 2)) & 3
            dl = _f16(blk + 80, mask) * (sc & 15).to(tl.float32)
            ml = _f16(blk + 82, mask) * (sc >> 4).to(tl.float32)
            w = dl * q.to(tl.float32) - ml
        elif QTYPE == 11:  # Q3_K: 32 B high-bit mask, 64 B 2-bit quants, 12 B 6-bit scales, d
            blk = row + (ks // 256) * 110
            j = ks % 256
            g = j // 16
            low = (_byte(blk + 96 + g % 8, mask) >> ((g // 8) * 4)) & 15
            high = (_byte(blk + 104 + g % 4, mask) >> ((g // 4) * 2)) & 3
            scale = ((low | (high << 4)) - 32).to(tl.float32)
            ql = (_byte(blk + 32 + (j // 128) * 32 + j % 32, mask) >> (((j % 128) // 32) * 2)) & 3
            hbit = (_byte(blk + j % 32, mask) >> (j // 32)) & 1
            q = ql - ((hbit ^ 1) << 2)
            w = (_f16(blk + 108, mask) * scale) * q.to(tl.float32)
        elif QTYPE == 12:  # Q4_K: d, dmin, 12 B scales/mins, 128 B nibbles
            blk = row + (ks // 256) * 144
            j = ks % 256
            sc, mn = _k_scale_min(blk, j // 32, mask)
            q = (_byte(blk + 16 + (j // 64) * 32 + j % 32, mask) >> (((j // 32) % 2) * 4)) & 15
            w = (_f16(blk, mask) * sc) * q.to(tl.float32) - _f16(blk + 2, mask) * mn
        elif QTYPE == 13:  # Q5_K: d, dmin, 12 B scales/mins, 32 B high bits, 128 B nibbles
            blk = row + (ks // 256) * 176
            j = ks % 256
            sc, mn = _k_scale_min(blk, j // 32, mask)
            lo = (_byte(blk + 48 + (j // 64) * 32 + j % 32, mask) >> (((j // 32) % 2) * 4)) & 15
            hi = (_byte(blk + 16 + j % 32, mask) >> (j // 32)) & 1
            q = lo | (hi << 4)
            w = (_f16(blk, mask) * sc) * q.to(tl.float32) - _f16(blk + 2, mask) * mn
        elif QTYPE == 39:  # MXFP4: E8M0 e, 16 B nibbles of E2M1 indices
            blk = row + (ks // 32) * 17
            j = ks % 32
            q = (_byte(blk + 1 + j % 16, mask) >> ((j // 16) * 4)) & 15
            # gq.MXFP4_VALUES by arithmetic: magnitude m = q & 7 is m (m < 4), else (2 or 3) << (m // 2 - 1)
            m = q & 7
            mag = tl.where(m < 4, m, (2 + (m & 1)) << (m // 2 - 1))
            v = tl.where(q >= 8, -mag, mag).to(tl.float32)
            e = _byte(blk, mask)
            d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)  # gq.e8m0_half
            w = d * v
        else:  # QTYPE == 14, Q6_K: 128 B low nibbles, 64 B high 2 bits, 16 x i8 scales, d
            blk = row + (ks // 256) * 210
            j = ks % 256
            lo = (_byte(blk + (j // 128) * 64 + j % 64, mask) >> (((j % 128) // 64) * 4)) & 15
            hi = (_byte(blk + 128 + (j // 128) * 32 + j % 32, mask) >> (((j % 128) // 32) * 2)) & 3
            q = (lo | (hi << 4)) - 32
            w = (_f16(blk + 208, mask) * _i8(blk + 192 + j // 16, mask)) * q.to(tl.float32)
        return w

    @triton.jit
    def _gguf_mm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym, stride_ys, k_per_split,
                        QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        """Program (m, n, s) computes y tile (m, n) over K range [s*k_per_split, (s+1)*k_per_split);
        with split-K (grid dim 2 > 1) y is an fp32 [splits, M, N] buffer of partial sums."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_lo = pid_s * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x_mask = (rm[:, None] < M) & (rk[None, :] < k_hi)
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=x_mask, other=0.0)
            w_mask = (rk[:, None] < k_hi) & (rn[None, :] < N)
            w = _dequant(w_ptr, rn[None, :], rk[:, None], row_bytes, w_mask, QTYPE)  # W^T tile [BK, BN]
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        y_mask = (rm[:, None] < M) & (rn[None, :] < N)
        y_ptrs = y_ptr + pid_s.to(tl.int64) * stride_ys + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _gguf_dequant_kernel(w_ptr, out_ptr, N, K, row_bytes, QTYPE: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        w = _dequant(w_ptr, rn[:, None], rk[None, :], row_bytes, mask, QTYPE)
        tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def _require(ggml_type: int, raw: torch.Tensor, out_features: int, in_features: int) -> int:
    if triton is None:
        raise RuntimeError(f"triton is not available ({_TRITON_IMPORT_ERROR!r}); the fused GGUF kernels need it")
    if ggml_type not in FUSED_TYPES:
        raise ValueError(f"no fused Triton kernel for GGML type {gq.type_name(ggml_type)}")
    if raw.device.type == "cpu" and not _interpreting():
        raise ValueError("triton_gguf runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
    nbytes = gq.row_bytes(ggml_type, in_features)
    if raw.dtype != torch.uint8 or tuple(raw.shape) != (out_features, nbytes) or not raw.is_contiguous():
        raise ValueError(f"{gq.type_name(ggml_type)} weight needs contiguous uint8 [{out_features}, {nbytes}], "
                         f"got {raw.dtype} {list(raw.shape)}")
    return nbytes


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode (tiny M) is memory bound, so narrow N tiles give more
    programs to stream the weight; prefill uses wider tiles to reuse each decoded weight tile."""
    if m <= 16:
        return 16, 32, 64
    if m <= 64:
        return 64, 64, 64
    return 128, 64, 64


_CPU_SM_COUNT = 8  # the interpreter has no SMs; a small number keeps split-K exercised in tests


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_k(tiles: int, k_blocks: int, sms: int) -> int:
    """Split K when the output tiles alone cannot fill the GPU (decode on narrow layers). Partial
    sums go to a buffer reduced by torch afterwards: deterministic, unlike atomics."""
    if tiles >= sms:
        return 1
    return max(1, min(-(-2 * sms // tiles), k_blocks // 2, 16))


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, out_features: int, in_features: int,
                compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, in] @ dequant(raw)^T -> [M, out] in x's dtype. compute_dtype (default x's dtype) is what
    the tensor-core dot sees: float32 gives exact-ish fp32 ("ieee"), bf16/fp16 the fast path."""
    nbytes = _require(ggml_type, raw, out_features, in_features)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"gguf_linear: x must be [M, {in_features}], got {list(x.shape)}")
    compute_dtype = compute_dtype or x.dtype
    # The CPU interpreter's tl.dot mishandles 16-bit floats: compute in fp32 there.
    dot_fp32 = compute_dtype == torch.float32 or _interpreting()
    xc = x.contiguous() if dot_fp32 else x.to(compute_dtype).contiguous()
    m = xc.shape[0]
    if m == 0:
        return torch.empty(0, out_features, device=x.device, dtype=x.dtype)
    bm, bn, bk = _tiles(m)
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(out_features, bn)
    k_blocks = triton.cdiv(in_features, bk)
    split = _split_k(m_tiles * n_tiles, k_blocks, _sm_count(x.device))
    k_per_split = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(in_features, k_per_split)  # no empty splits
    if split == 1:
        y = torch.empty(m, out_features, device=x.device, dtype=x.dtype)
    else:
        y = torch.empty(split, m, out_features, device=x.device, dtype=torch.float32)
    _gguf_mm_kernel[(m_tiles, n_tiles, split)](
        xc, raw, y, m, out_features, in_features, nbytes, xc.stride(0), y.stride(-2),
        y.stride(0) if split > 1 else 0, k_per_split,
        QTYPE=ggml_type, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=dot_fp32)
    return y if split == 1 else y.sum(0).to(x.dtype)


def gguf_dequantize(raw: torch.Tensor, ggml_type: int, out_features: int, in_features: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight [out, in] decoded on the device (same values as gguf_quants.dequantize)."""
    nbytes = _require(ggml_type, raw, out_features, in_features)
    out = torch.empty(out_features, in_features, device=raw.device, dtype=dtype)
    bn, bk = 32, 64
    grid = (triton.cdiv(out_features, bn), triton.cdiv(in_features, bk))
    _gguf_dequant_kernel[grid](raw, out, out_features, in_features, nbytes, QTYPE=ggml_type, BLOCK_N=bn, BLOCK_K=bk)
    return out
