"""CPU expert kernels (kernels/moe_cpu.py + kernels/csrc/moe_cpu.cpp) vs float references.

Tolerances. The kernels quantize activations to int8 per block (256 elements with an fp32 scale for
the K-quants, 32 for Q8_0): the rounding error is at most amax/254 per element, rms about 0.6% of the
activations' rms for Gaussian rows. So:
- vs a float64 reference that uses the *same* int8 activations (`dequantized_activations`): relative
  error < 1e-5, i.e. only float summation order differs: checks block layouts and integer maths
  (< 1e-3 for the whole FFN, whose intermediate is rounded from float32 sums in the kernel);
- vs the plain fp32 reference (dequantized weights, unquantized activations): relative Frobenius
  error < 1e-2 for one matmul (measured 0.5-0.8%), < 3e-2 for the whole expert FFN, where both x and
  the heavy-tailed silu(gate)*up intermediate are rounded (measured 1-2%).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kquant_pack import random_rows
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels import moe_cpu
from nanochat.kernels.cpp_build import LazyLibrary
from nanochat.kernels.moe_cpu import HostExperts, StackedWeight
from nanochat.kernels.qweight import QuantWeight

KERNEL_CASES = [(gq.Q8_0, 96), (gq.Q4_K, 512), (gq.Q5_K, 512), (gq.Q6_K, 512)]
EXACT = 1e-5
MATMUL_TOL = 1e-2
FFN_TOL = 3e-2


@pytest.fixture(scope="module")
def lib():
    lib = moe_cpu.extension()
    if lib is None:
        pytest.skip("the CPU expert kernels could not be built here (no g++ / ninja)")
    return lib


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def stack(t: int, e: int, out: int, inp: int, rng) -> StackedWeight:
    data = np.stack([random_rows(t, out, inp, rng) for _ in range(e)])
    return StackedWeight(t, (e, out, inp), torch.from_numpy(data))


def dense(s: StackedWeight) -> torch.Tensor:
    return torch.stack([s.dense_expert(e) for e in range(s.num_experts)]).double()


def routing(t: int, e: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


def ffn_reference(x, ids, weights, wg, wu, wd, quant=None):
    """sum_k w * down(silu(gate x) * up x) per token, float64; `quant` = (gate/up type, down type)
    applies the kernels' activation rounding at the same two places."""
    xs = x if quant is None else moe_cpu.dequantized_activations(quant[0], x)
    out = torch.zeros(x.shape[0], wd.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = (F.silu(wg[e].float() @ xs[t]) * (wu[e].float() @ xs[t])).unsqueeze(0)
            if quant is not None:
                h = moe_cpu.dequantized_activations(quant[1], h)
            out[t] += float(weights[t, j]) * (wd[e] @ h[0].double())
    return out


# ----------------------------------------------------------------------------- single matmuls


@pytest.mark.parametrize("ggml_type,k", KERNEL_CASES, ids=lambda v: gq.type_name(v) if v in gq.TYPE_NAMES else str(v))
def test_matmul_each_type(lib, ggml_type, k):
    rng = np.random.default_rng(ggml_type)
    rows = 37                                     # not a multiple of the 16-row tiles
    qw = QuantWeight(ggml_type, (rows, k), torch.from_numpy(random_rows(ggml_type, rows, k, rng)))
    w = gq.dequantize(qw).double()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    y = moe_cpu.quant_matmul(qw, x)
    assert y.shape == (5, rows)
    assert rel(y, moe_cpu.dequantized_activations(ggml_type, x).double() @ w.T) < EXACT
    assert rel(y, x.double() @ w.T) < MATMUL_TOL
    lib.nc_set_simd(0)                            # the portable scalar path gives the same sums
    try:
        y_scalar = moe_cpu.quant_matmul(qw, x)
    finally:
        lib.nc_set_simd(1)
    assert rel(y_scalar, y) < EXACT


@pytest.mark.parametrize("ggml_type,block", [(gq.Q8_0, 32), (gq.Q4_K, 256)])
def test_activation_rounding_bound(lib, ggml_type, block):
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 4, 512)
    xq = moe_cpu.dequantized_activations(ggml_type, x)
    amax = x.abs().view(3, -1, block).amax(-1, keepdim=True)
    err = (xq - x).abs().view(3, -1, block)
    assert (err <= amax / 254 * (1 + 1e-5)).all()
    assert torch.equal(moe_cpu.dequantized_activations(ggml_type, torch.zeros(1, 512)), torch.zeros(1, 512))


# ----------------------------------------------------------------------------- whole expert FFN


# (gate, up, down types), hidden, expert dim, experts, tokens: few tokens per expert (decode-like,
# activations quantized before the thread team starts) and many (prefill: chunks of 4 tokens per row)
FFN_CASES = {
    "q8_0": ((gq.Q8_0, gq.Q8_0, gq.Q8_0), 64, 96, 6, 5),
    "q4k-q5k-q6k": ((gq.Q4_K, gq.Q5_K, gq.Q6_K), 256, 512, 6, 9),
    "q4k-q4k-q8_0": ((gq.Q4_K, gq.Q4_K, gq.Q8_0), 256, 256, 6, 3),
    "q6k-q6k-q4k-many-tokens": ((gq.Q6_K, gq.Q6_K, gq.Q4_K), 256, 256, 3, 23),
    "q8_0-many-tokens": ((gq.Q8_0, gq.Q8_0, gq.Q8_0), 96, 64, 3, 30),
}


@pytest.mark.parametrize("case", list(FFN_CASES))
def test_expert_ffn_matches_reference(lib, case):
    (tg, tu, td), hidden, inter, e, t = FFN_CASES[case]
    rng = np.random.default_rng(len(case))
    k = 2
    g, u, d = stack(tg, e, inter, hidden, rng), stack(tu, e, inter, hidden, rng), stack(td, e, hidden, inter, rng)
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(3))
    ids, weights = routing(t, e, k)
    host = HostExperts(g, u, d, threads=2)
    assert host.backend == "kernel"
    out = host(x, ids, weights)
    wg, wu, wd = dense(g), dense(u), dense(d)
    if tg == tu:   # the emulated rounding needs one activation format for gate and up
        # (float32 vs float64 sums can push an element of silu(gate)*up across an int8 rounding
        # boundary: one step, amax/127 of its block, in a few elements)
        assert rel(out, ffn_reference(x, ids, weights, wg, wu, wd, quant=(tg, td))) < 1e-3
    ref = ffn_reference(x, ids, weights, wg, wu, wd)
    assert rel(out, ref) < FFN_TOL
    torch_path = HostExperts(g, u, d, backend="torch")(x, ids, weights)
    assert rel(torch_path, ref) < EXACT


def test_fused_gate_up_rows_are_strided_views(lib):
    """ffn_gate_up_exps: gate and up are row-block views of one tensor (strided across experts)."""
    rng = np.random.default_rng(5)
    e, hidden, inter = 4, 256, 256
    fused = torch.from_numpy(np.stack([random_rows(gq.Q4_K, 2 * inter, hidden, rng) for _ in range(e)]))
    gate = StackedWeight(gq.Q4_K, (e, inter, hidden), fused[:, :inter])
    up = StackedWeight(gq.Q4_K, (e, inter, hidden), fused[:, inter:])
    assert not gate.data.is_contiguous()
    down = stack(gq.Q6_K, e, hidden, inter, rng)
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(6))
    ids, weights = routing(6, e, 2, seed=1)
    strided = HostExperts(gate, up, down)(x, ids, weights)
    copies = [StackedWeight(s.ggml_type, s.shape, s.data.contiguous()) for s in (gate, up)]
    assert torch.equal(strided, HostExperts(*copies, down)(x, ids, weights))


def test_deterministic_and_thread_count(lib):
    rng = np.random.default_rng(7)
    g, u, d = stack(gq.Q4_K, 8, 256, 256, rng), stack(gq.Q4_K, 8, 256, 256, rng), stack(gq.Q6_K, 8, 256, 256, rng)
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(8))
    ids, weights = routing(12, 8, 3)
    one = HostExperts(g, u, d, threads=1)
    y1 = one(x, ids, weights)
    assert lib.nc_last_threads() == 1
    two = HostExperts(g, u, d, threads=2)
    y2 = two(x, ids, weights)
    if lib.nc_omp_threads(2) == 2:                # OpenMP present: the team has the asked size
        assert lib.nc_last_threads() == 2
    assert torch.equal(y1, y2)                    # fixed per-element summation order
    assert torch.equal(y2, two(x, ids, weights))
    empty = two(torch.zeros(0, 256), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3))
    assert empty.shape == (0, 256)


def test_cpu_threads_from_the_engine_config(monkeypatch):
    """Config.cpu_threads (env NANO_VLLM_CPU_THREADS) reaches the host expert kernels at engine start-up."""
    import os

    from nanochat.engine.config import Config

    default = max(1, (os.cpu_count() or 2) // 2)
    monkeypatch.delenv("NANO_VLLM_CPU_THREADS", raising=False)
    Config.create().apply_kernel_switches()
    assert moe_cpu.cpu_threads() == default
    monkeypatch.setenv("NANO_VLLM_CPU_THREADS", str(default + 2))
    assert moe_cpu.cpu_threads() == default          # the environment is read by Config only
    Config.create().apply_kernel_switches()
    assert moe_cpu.cpu_threads() == default + 2
    rng = np.random.default_rng(9)
    s = stack(gq.Q8_0, 2, 32, 32, rng)
    assert HostExperts(s, s, s).threads == default + 2
    assert HostExperts(s, s, s, threads=1).threads == 1
    for bad in ("0", "two"):
        monkeypatch.setenv("NANO_VLLM_CPU_THREADS", bad)
        with pytest.raises(ValueError, match="NANO_VLLM_CPU_THREADS"):
            Config.create()
    with pytest.raises(ValueError, match=">= 1"):
        moe_cpu.set_threads(0)


def test_torch_fallback_when_the_extension_cannot_be_built(monkeypatch):
    def no_compiler():
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(moe_cpu, "_load_extension", no_compiler)
    monkeypatch.setattr(moe_cpu, "_kernels", LazyLibrary())     # not built yet in this process
    rng = np.random.default_rng(10)
    g, u, d = stack(gq.Q4_K, 4, 256, 256, rng), stack(gq.Q4_K, 4, 256, 256, rng), stack(gq.Q8_0, 4, 256, 256, rng)
    with pytest.warns(RuntimeWarning, match=r"expert kernels could not be built \(g\+\+: command not found\)") as w:
        host = HostExperts(g, u, d)
    assert w[0].filename == __file__                 # points at the code that asked for the kernels
    assert host.backend == "torch" and moe_cpu.extension() is None and not moe_cpu.available()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")           # warned once only
        again = HostExperts(g, u, d)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(11))
    ids, weights = routing(5, 4, 2)
    assert rel(again(x, ids, weights), ffn_reference(x, ids, weights, dense(g), dense(u), dense(d))) < EXACT
    with pytest.raises(RuntimeError, match="unavailable"):
        HostExperts(g, u, d, backend="kernel")


def test_other_types_and_dense_experts_use_torch(lib):
    rng = np.random.default_rng(12)
    q4_0 = stack(gq.Q4_0, 3, 64, 64, rng)
    assert HostExperts(q4_0, q4_0, q4_0).backend == "torch"
    with pytest.raises(RuntimeError, match="unavailable"):
        HostExperts(q4_0, q4_0, q4_0, backend="kernel")
    w = torch.randn(3, 64, 64)
    s = StackedWeight(gq.F32, (3, 64, 64), w)
    x = torch.randn(4, 64)
    ids, weights = routing(4, 3, 2)
    ref = ffn_reference(x, ids, weights, w.double(), w.double(), w.double())
    assert rel(HostExperts(s, s, s)(x, ids, weights), ref) < EXACT


def test_bad_inputs_are_clear_errors(lib):
    rng = np.random.default_rng(13)
    g, d = stack(gq.Q8_0, 4, 64, 32, rng), stack(gq.Q8_0, 4, 32, 64, rng)
    host = HostExperts(g, g, d)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="expert id out of range"):
        host(x, torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="hidden size"):
        host(torch.randn(2, 16), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
    with pytest.raises(ValueError, match="do not fit"):
        HostExperts(g, g, g)
    with pytest.raises(ValueError, match="need uint8 rows"):
        StackedWeight(gq.Q8_0, (4, 64, 32), g.data[:, :, :10]).check()
