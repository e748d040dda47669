"""Test helper: build GGML blocks that gguf-py cannot make itself.

- `random_blocks(t, n, rng)`: random bytes for any supported type, with sane f16 scale fields
  (no inf/nan, moderate magnitude; MXFP4: a moderate E8M0 exponent), so every bit pattern of the quants gets exercised.
- `quantize_k(t, x)`: a simple (not llama.cpp-optimal) packer from float rows to Q2_K..Q6_K
  blocks, for fixtures that need K-quant weights close to given values.
Layouts follow the block tables in /work/shared/REFERENCE.md; gguf.quants.dequantize checks them.
"""

from __future__ import annotations

import numpy as np

from nanochat.kernels.gguf_quants import (
    BF16, BLOCK_SIZES, F16, F32, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, QK_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1,
)

# Byte offsets of the f16 fields inside each block type.
_F16_FIELDS = {
    Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q8_1: (0, 2),
    Q2_K: (80, 82), Q3_K: (108,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,),
}


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def random_blocks(ggml_type: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n_blocks, block_bytes] of random quants with sane f16 scales."""
    elems, nbytes = BLOCK_SIZES[ggml_type]
    if ggml_type in (F32, F16, BF16):
        x = rng.standard_normal(n_blocks).astype(np.float32)
        if ggml_type == F32:
            raw = x
        elif ggml_type == F16:
            raw = x.astype(np.float16)
        else:
            raw = (x.view(np.uint32) >> 16).astype(np.uint16)
        return raw.view(np.uint8).reshape(n_blocks, nbytes)
    blocks = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    if ggml_type == MXFP4:  # the E8M0 byte: scales 2^-13 .. 2^-1 (values up to 6 * 2^0)
        blocks[:, 0] = rng.integers(115, 128, n_blocks, dtype=np.uint8)
        return blocks
    for off in _F16_FIELDS[ggml_type]:
        mag = rng.uniform(1e-3, 0.1, n_blocks)
        sign = rng.choice([-1.0, 1.0], n_blocks)
        _put_f16(blocks, off, mag * sign)
    return blocks


def random_rows(ggml_type: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes_per_row] of random blocks for a [rows, cols] weight."""
    elems, nbytes = BLOCK_SIZES[ggml_type]
    assert cols % elems == 0, (cols, elems)
    return random_blocks(ggml_type, rows * cols // elems, rng).reshape(rows, cols // elems * nbytes)


# ---------------------------------------------------------------- simple K-quant packer

def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def _asym(groups: np.ndarray, qmax: int, smax: int):
    """Groups [n, G, g] -> (d, dmin f16-rounded [n], sc, m ints [n, G], q ints [n, G, g]) with
    x ~= d*sc*q - dmin*m, q in [0, qmax], sc and m in [0, smax]."""
    lo = np.minimum(groups.min(-1), 0.0)
    hi = groups.max(-1)
    scale, mins = (hi - lo) / qmax, -lo
    d = _f16_round(scale.max(-1) / smax)
    dmin = _f16_round(mins.max(-1) / smax)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, smax)
    m = np.clip(np.rint(_safe_div(mins, dmin[:, None])), 0, smax)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(_safe_div(groups + (dmin[:, None] * m)[..., None], step)), 0, qmax)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _sym(groups: np.ndarray, qlo: int, qhi: int, slo: int, shi: int):
    """Groups [n, G, g] -> (d [n], sc ints [n, G], q ints [n, G, g]), x ~= d*sc*q."""
    scale = np.abs(groups).max(-1) / max(-qlo, qhi)
    d = _f16_round(scale.max(-1) / shi)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), slo, shi)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(_safe_div(groups, step)), qlo, qhi)
    return d, sc.astype(np.int32), q.astype(np.int32)


def _pack_bits(q: np.ndarray, width: int) -> np.ndarray:
    """[..., 8 // width, n] fields -> [..., n] bytes; field k goes to bits k*width."""
    out = np.zeros(q.shape[:-2] + q.shape[-1:], dtype=np.uint8)
    for k in range(q.shape[-2]):
        out |= (q[..., k, :].astype(np.uint8) & ((1 << width) - 1)) << np.uint8(k * width)
    return out


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> the 12-byte Q4_K/Q5_K scale field."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _q2_k(x):
    n = x.shape[0]
    d, dmin, sc, m, q = _asym(x.reshape(n, 16, 16), 3, 15)
    b = np.zeros((n, 84), dtype=np.uint8)
    b[:, 0:16] = sc | (m << 4)
    b[:, 16:80] = _pack_bits(q.reshape(n, 2, 4, 32), 2).reshape(n, 64)
    _put_f16(b, 80, d)
    _put_f16(b, 82, dmin)
    return b


def _q3_k(x):
    n = x.shape[0]
    d, sc, q = _sym(x.reshape(n, 16, 16), -4, 3, -32, 31)
    b = np.zeros((n, 110), dtype=np.uint8)
    b[:, 0:32] = _pack_bits((q >= 0).reshape(n, 8, 32), 1)
    b[:, 32:96] = _pack_bits((q & 3).reshape(n, 2, 4, 32), 2).reshape(n, 64)
    v = (sc + 32).astype(np.uint8)
    b[:, 96:104] = _pack_bits((v & 15).reshape(n, 2, 8), 4)
    b[:, 104:108] = _pack_bits((v >> 4).reshape(n, 4, 4), 2)
    _put_f16(b, 108, d)
    return b


def _q4_k(x):
    n = x.shape[0]
    d, dmin, sc, m, q = _asym(x.reshape(n, 8, 32), 15, 63)
    b = np.zeros((n, 144), dtype=np.uint8)
    _put_f16(b, 0, d)
    _put_f16(b, 2, dmin)
    b[:, 4:16] = _pack_k_scales(sc, m)
    b[:, 16:144] = _pack_bits(q.reshape(n, 4, 2, 32), 4).reshape(n, 128)
    return b


def _q5_k(x):
    n = x.shape[0]
    d, dmin, sc, m, q = _asym(x.reshape(n, 8, 32), 31, 63)
    b = np.zeros((n, 176), dtype=np.uint8)
    _put_f16(b, 0, d)
    _put_f16(b, 2, dmin)
    b[:, 4:16] = _pack_k_scales(sc, m)
    b[:, 16:48] = _pack_bits((q >> 4).reshape(n, 8, 32), 1)
    b[:, 48:176] = _pack_bits((q & 15).reshape(n, 4, 2, 32), 4).reshape(n, 128)
    return b


def _q6_k(x):
    n = x.shape[0]
    d, sc, q = _sym(x.reshape(n, 16, 16), -32, 31, -128, 127)
    u = (q + 32).astype(np.uint8).reshape(n, 2, 128)
    b = np.zeros((n, 210), dtype=np.uint8)
    b[:, 0:128] = _pack_bits((u & 15).reshape(n, 2, 2, 64), 4).reshape(n, 128)
    b[:, 128:192] = _pack_bits((u >> 4).reshape(n, 2, 4, 32), 2).reshape(n, 64)
    b[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    _put_f16(b, 208, d)
    return b


_PACKERS = {Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}


def quantize_k(ggml_type: int, x: np.ndarray) -> np.ndarray:
    """Float rows [..., K] (K % 256 == 0) -> uint8 [..., K // 256 * block_bytes]."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of {QK_K}")
    blocks = _PACKERS[ggml_type](x.reshape(-1, QK_K))
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // QK_K * BLOCK_SIZES[ggml_type][1])
