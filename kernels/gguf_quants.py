"""GGML block types and vectorised torch dequantization.

Every formula reproduces `gguf.quants.dequantize` bit for bit in float32: the same float32
operations in the same order (products and sums are separate ops, never fused), so results
are torch.equal to the reference. Works on any device the raw bytes live on.
"""

from __future__ import annotations

import torch

from nanochat.kernels.qweight import QuantWeight

# The type table lives in ggml_types (torch-free); re-exported here for the callers that use gq.*.
from nanochat.kernels.ggml_types import (BF16, BLOCK_SIZES, F16, F32, MXFP4, MXFP4_VALUES, Q2_K, Q3_K, Q4_0,  # noqa: F401
                                         Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, Q8_1, QK_K, SUPPORTED_TYPES,
                                         TYPE_NAMES, UnsupportedQuantError, check_supported, row_bytes, type_name)

# The GGML type of a dense matrix of each torch dtype the kernels read as it is.
DENSE_TYPE_OF = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}


# ---------------------------------------------------------------- byte helpers

def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 at `offset` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _shifts(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _split_bits(b: torch.Tensor, width: int) -> torch.Tensor:
    """[..., n] bytes -> [..., 8 // width, n]: the width-bit fields, lowest bits first."""
    shifts = _shifts(list(range(0, 8, width)), b.device).view(-1, 1)
    return (b.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bits, bit j for element j."""
    return _split_bits(qh, 1).transpose(1, 2).reshape(qh.shape[0], 32)


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (as float32 [n, 8])."""
    a, b, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=1)
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=1)
    return scale.float(), mins.float()


# ---------------------------------------------------------------- per-type block decoders
# Each takes uint8 blocks [n, block_bytes] and returns float32 [n, block_elems].

def _q4_0(b):
    d = _f16(b, 0)
    return d * (_nibbles(b[:, 2:18]).float() - 8)


def _q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    return d * _nibbles(b[:, 4:20]).float() + m


def _q5_0(b):
    d = _f16(b, 0)
    q = _nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
    return d * (q.float() - 16)


def _q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
    return d * q.float() + m


def _q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q8_1(b):  # the sum field s is redundant for dequantization
    return b[:, 4:36].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q2_k(b):
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 15).float()).view(n, 16, 1)
    ml = (dmin * (sc >> 4).float()).view(n, 16, 1)
    # 64 bytes = 2 halves of 32 bytes; each half holds 4 two-bit planes of 32 elements.
    q = _split_bits(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    d = _f16(b, 108)
    sc = b[:, 96:108]
    low = _split_bits(sc[:, 0:8], 4).reshape(n, 16)
    high = _split_bits(sc[:, 8:12], 2).reshape(n, 16)
    scale = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scale).view(n, 16, 1)
    ql = _split_bits(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16).to(torch.int8)
    hbit = _split_bits(b[:, 0:32], 1).reshape(n, 16, 16).to(torch.int8)
    # A clear high bit means "subtract 4".
    q = (ql - ((hbit ^ 1) << 2)).float()
    return (dl * q).view(n, QK_K)


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scale, mins = _k_scale_min(b[:, 4:16])
    ds = (d * scale).view(n, 8, 1)
    dm = (dmin * mins).view(n, 8, 1)
    q = _split_bits(b[:, 16:144].reshape(n, 4, 32), 4).reshape(n, 8, 32).float()
    return (ds * q - dm).view(n, QK_K)


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scale, mins = _k_scale_min(b[:, 4:16])
    ds = (d * scale).view(n, 8, 1)
    dm = (dmin * mins).view(n, 8, 1)
    ql = _split_bits(b[:, 48:176].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    qh = _split_bits(b[:, 16:48], 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (ds * q - dm).view(n, QK_K)


def _q6_k(b):
    n = b.shape[0]
    scale = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scale).view(n, 16, 1)
    ql = _split_bits(b[:, 0:128].reshape(n, 2, 64), 4).reshape(n, 8, 32)
    qh = _split_bits(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).view(n, 16, 16).float()
    return (d * q).view(n, QK_K)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> 2^(e - 128) as float32 (half the scale: the values are doubled), by its bits as
    ggml's ggml_e8m0_to_fp32_half: e < 2 are the subnormals 2^-128, 2^-127; e = 255 is 2^127, not NaN."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b):
    table = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)
    return e8m0_half(b[:, 0:1]) * table[_nibbles(b[:, 1:17]).long()]


def _f32(b):
    return b.contiguous().view(torch.float32)


def _f16_plain(b):
    return b.contiguous().view(torch.float16).float()


def _bf16(b):
    return b.contiguous().view(torch.bfloat16).float()


_DECODERS = {
    F32: _f32, F16: _f16_plain, BF16: _bf16,
    Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0, Q8_1: _q8_1,
    Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k, MXFP4: _mxfp4,
}

# Rows decoded per chunk: bounds the int/float temporaries to a few MiB-ish per step.
_CHUNK_ELEMS = 1 << 22


# ---------------------------------------------------------------- public API

def dequantize_raw(ggml_type: int, data: torch.Tensor, shape, dtype=torch.float32,
                   tensor_name: str = "<tensor>") -> torch.Tensor:
    """Raw GGML bytes (uint8, any shape whose last dim is a whole number of rows' bytes) ->
    a `dtype` tensor of `shape` (torch order, last dim = row length in elements)."""
    check_supported(ggml_type, tensor_name)
    shape = tuple(int(s) for s in shape)
    elems, nbytes = BLOCK_SIZES[ggml_type]
    numel = 1
    for s in shape:
        numel *= s
    if data.dtype != torch.uint8:
        raise ValueError(f"tensor {tensor_name!r}: raw GGML data must be uint8, got {data.dtype}")
    if shape and shape[-1] % elems:
        raise ValueError(
            f"tensor {tensor_name!r}: row length {shape[-1]} is not a multiple of the "
            f"{type_name(ggml_type)} block size {elems}"
        )
    n_blocks = numel // elems
    if data.numel() != n_blocks * nbytes:
        raise ValueError(
            f"tensor {tensor_name!r}: {type_name(ggml_type)} {list(shape)} needs {n_blocks * nbytes} bytes, "
            f"got {data.numel()}"
        )
    blocks = data.reshape(n_blocks, nbytes)
    decode = _DECODERS[ggml_type]
    out = torch.empty(n_blocks, elems, dtype=dtype, device=data.device)
    step = max(1, _CHUNK_ELEMS // elems)
    for start in range(0, n_blocks, step):
        out[start:start + step] = decode(blocks[start:start + step])
    return out.view(shape)


def dequantize(qw: QuantWeight, dtype=torch.float32) -> torch.Tensor:
    """The whole weight as a dense [out, in] tensor."""
    return dequantize_raw(qw.ggml_type, qw.data, qw.shape, dtype)


def dequantize_rows(qw: QuantWeight, row_ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Rows `row_ids` of the weight, [len(ids), in]: an embedding lookup that decodes only those rows."""
    ids = row_ids.reshape(-1).to(device=qw.data.device, dtype=torch.long)
    rows = qw.data.index_select(0, ids)
    out = dequantize_raw(qw.ggml_type, rows, (ids.numel(), qw.in_features), dtype)
    return out.view(*row_ids.shape, qw.in_features)


# ---------------------------------------------------------------- quantization (load-time, --quantize)

def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Dense [rows, k] (k a multiple of 32) -> raw Q8_0 blocks uint8 [rows, k / 32 * 34], bit for bit as
    gguf.quants.quantize (= ggml's reference): d = amax / 127 per 32 values, q = round-half-away(x / d)
    computed as x * (1 / d), d stored as f16."""
    rows, k = w.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs rows that are a multiple of 32 long, got {k}")
    blocks = w.detach().to(torch.float32).reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = blocks * inv
    a = v.abs()
    floored = a.floor()
    q = torch.sign(v) * (floored + (2 * (a - floored)).floor())   # gguf's np_roundf, operation by operation
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1)
    return out.reshape(rows, k // 32 * 34)


def quantize_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """Dense [rows, k] (k a multiple of 32) -> raw MXFP4 blocks uint8 [rows, k / 32 * 17], as ggml's
    quantize_row_mxfp4_ref (and gguf.quants.quantize): e = floor(log2(amax)) - 2 + 127 (0 for an all-zero
    block), each value the nearest of the 16 doubled E2M1 values times 2^(e - 128), the first on a tie."""
    rows, k = w.shape
    if k % 32:
        raise ValueError(f"MXFP4 needs rows that are a multiple of 32 long, got {k}")
    blocks = w.detach().to(torch.float32).reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).to(torch.uint8)
    table = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=w.device)
    err = (e8m0_half(e).unsqueeze(-1) * table - blocks.unsqueeze(-1)).abs()   # [n, 32, 16]
    q = err.argmin(dim=-1).to(torch.uint8)   # argmin: the first minimum, as ggml's strict `<` scan
    qs = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([e, qs], dim=1).reshape(rows, k // 32 * 17)
