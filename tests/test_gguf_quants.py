"""Dequantization must equal gguf-py's reference bit for bit (float32, max abs diff 0)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.qweight import QuantWeight
from tests.kquant_pack import quantize_k, random_rows

REF_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4]
K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
SMALL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]


def _gguf_ref(t, raw: np.ndarray) -> np.ndarray:
    if t == T.F32:  # gguf's F32 path is a view and expects float32-typed input
        return raw.view(np.float32)
    return gguf.quants.dequantize(raw, t)


def _assert_exact(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.shape == ref_t.shape
    # equal_nan would hide layout bugs, and the fixtures contain no nan.
    assert torch.equal(ours, ref_t), f"max abs diff {(ours - ref_t).abs().max().item()}"


def test_block_table_matches_gguf():
    for t in gq.SUPPORTED_TYPES:
        if t == gq.Q8_1:  # gguf-py still lists the legacy 40-byte float layout
            continue
        assert gq.BLOCK_SIZES[t] == gguf.GGML_QUANT_SIZES[T(t)], T(t).name
        assert gq.TYPE_NAMES[t] == T(t).name


@pytest.mark.parametrize("t", REF_TYPES, ids=lambda t: t.name)
def test_random_blocks_exact(t):
    rng = np.random.default_rng(int(t))
    elems, _ = gq.BLOCK_SIZES[t]
    rows, cols = 6, max(elems, 32) * 3
    raw = random_rows(t, rows, cols, rng)
    ours = gq.dequantize(QuantWeight(int(t), (rows, cols), torch.from_numpy(raw)))
    _assert_exact(ours, _gguf_ref(t, raw))


@pytest.mark.parametrize("t", SMALL_TYPES, ids=lambda t: t.name)
def test_gguf_quantized_floats_exact(t):
    """Realistic blocks: floats quantized by gguf-py itself."""
    x = np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32)
    raw = gguf.quants.quantize(x, t)
    ours = gq.dequantize_raw(int(t), torch.from_numpy(raw), x.shape)
    _assert_exact(ours, gguf.quants.dequantize(raw, t))


@pytest.mark.parametrize("t", K_TYPES, ids=lambda t: t.name)
def test_k_packer_roundtrip(t):
    """The test packer produces valid blocks (gguf agrees with us) that approximate the input."""
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    raw = quantize_k(int(t), x)
    ref = gguf.quants.dequantize(raw, t)
    _assert_exact(gq.dequantize_raw(int(t), torch.from_numpy(raw), x.shape), ref)
    bits = {T.Q2_K: 2, T.Q3_K: 3, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}[t]
    # Error per element is about half a quant step of the group (range / 2**bits), plus scale rounding.
    rel = np.abs(ref - x).mean() / np.abs(x).mean()
    assert rel < 1.5 / 2 ** bits, rel


def _mxfp4_numpy(raw: np.ndarray) -> np.ndarray:
    """ggml's block_mxfp4 read byte by byte: e (E8M0), then 16 bytes whose low nibbles are elements 0..15 and
    high nibbles 16..31, value = kvalues_mxfp4[q] * 2^(e - 128) (a double, exact, rounded once to float32)."""
    kvalues = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    out = []
    for block in raw.reshape(-1, 17):
        scale = 2.0 ** (int(block[0]) - 128)
        codes = [b & 15 for b in block[1:]] + [b >> 4 for b in block[1:]]
        out += [kvalues[q] * scale for q in codes]
    with np.errstate(over="ignore"):
        return np.array(out, dtype=np.float64).astype(np.float32)


def test_mxfp4_against_the_byte_layout():
    """Every nibble, the subnormal scales (e = 0, 1), e = 2 and the largest (e = 255: 12 * 2^127 overflows
    to inf, as in ggml), against the block layout of ggml-common.h read independently of gguf-py."""
    raw = random_rows(gq.MXFP4, 6, 128, np.random.default_rng(6))
    raw.reshape(-1, 17)[:5, 0] = [0, 1, 2, 254, 255]
    raw.reshape(-1, 17)[0, 1:] = np.arange(16, dtype=np.uint8) * 17   # nibble q in both halves
    ours = gq.dequantize_raw(gq.MXFP4, torch.from_numpy(raw), (6, 128))
    ref = _mxfp4_numpy(raw).reshape(6, 128)
    _assert_exact(ours, ref)
    assert np.isinf(ref).any() and (ref[0, :16] == ref[0, 16:32]).all()
    with np.errstate(over="ignore"):
        _assert_exact(ours, gguf.quants.dequantize(raw, T.MXFP4))


def test_mxfp4_quantize_matches_ggml():
    """quantize_mxfp4 gives gguf-py's bytes (ggml's quantize_row_mxfp4_ref): the shared exponent, the
    nearest value (the first on a tie), all-zero blocks."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 256)).astype(np.float32) * np.logspace(-6, 3, 16, dtype=np.float32)[:, None]
    x[0, :32] = 0
    x[1, :32] = np.array([0.25, 0.75, -1.25, 6, 3, -0.5] + [0] * 26, dtype=np.float32)   # ties and exact values
    ours = gq.quantize_mxfp4(torch.from_numpy(x))
    assert np.array_equal(ours.numpy(), gguf.quants.quantize(x, T.MXFP4))
    back = gq.dequantize_raw(gq.MXFP4, ours, x.shape).numpy()
    amax = np.abs(x).reshape(-1, 32).max(-1, keepdims=True)
    # amax in [2^f, 2^(f+1)) gets the scale 2^(f-3): half the widest step (8 -> 12) is 2^(f-2), values above
    # the largest (12 * 2^(f-3)) clamp to it, off by less than 2^(f-1) <= amax / 2
    assert (np.abs(back - x).reshape(-1, 32) <= amax / 2).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        gq.quantize_mxfp4(torch.zeros(2, 48))


def _q8_1_numpy(raw: np.ndarray) -> np.ndarray:
    """ggml's Q8_1: x = d * q (the f16 sum field s is not needed to dequantize)."""
    blocks = raw.reshape(-1, 36)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 4:36].copy().view(np.int8).astype(np.float32)
    return q * d


def test_q8_1_against_formula():
    raw = random_rows(gq.Q8_1, 5, 96, np.random.default_rng(3))
    ours = gq.dequantize_raw(gq.Q8_1, torch.from_numpy(raw), (5, 96))
    _assert_exact(ours, _q8_1_numpy(raw).reshape(5, 96))


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_dequantize_rows(t):
    rng = np.random.default_rng(4)
    rows, cols = 20, 512
    qw = QuantWeight(int(t), (rows, cols), torch.from_numpy(random_rows(t, rows, cols, rng)))
    full = gq.dequantize(qw)
    ids = torch.tensor([3, 0, 19, 3, 7])
    assert torch.equal(gq.dequantize_rows(qw, ids), full[ids])
    ids2 = torch.tensor([[1, 2], [5, 6]])
    assert gq.dequantize_rows(qw, ids2).shape == (2, 2, cols)
    assert torch.equal(gq.dequantize_rows(qw, ids2, torch.bfloat16), full[ids2].bfloat16())


def test_chunked_decode_matches():
    """Weights bigger than one decode chunk give the same result as the reference."""
    old = gq._CHUNK_ELEMS
    gq._CHUNK_ELEMS = 512
    try:
        raw = random_rows(T.Q4_1, 40, 256, np.random.default_rng(5))
        ours = gq.dequantize_raw(int(T.Q4_1), torch.from_numpy(raw), (40, 256))
    finally:
        gq._CHUNK_ELEMS = old
    _assert_exact(ours, gguf.quants.dequantize(raw, T.Q4_1))


def test_unsupported_type_error():
    with pytest.raises(gq.UnsupportedQuantError) as e:
        gq.check_supported(int(T.IQ2_XXS), "blk.0.ffn_down.weight")
    msg = str(e.value)
    assert "blk.0.ffn_down.weight" in msg and "IQ2_XXS" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)
    qw = QuantWeight(int(T.IQ4_NL), (2, 32), torch.zeros(2, 18, dtype=torch.uint8))
    with pytest.raises(gq.UnsupportedQuantError, match="IQ4_NL"):
        gq.dequantize(qw)


def test_bad_sizes_error():
    with pytest.raises(ValueError, match="needs 36 bytes"):
        gq.dequantize_raw(gq.Q4_0, torch.zeros(35, dtype=torch.uint8), (2, 32))
    with pytest.raises(ValueError, match="block size 256"):
        gq.dequantize_raw(gq.Q4_K, torch.zeros(144, dtype=torch.uint8), (2, 128))
