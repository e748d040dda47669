"""CPU expert kernels (kernels/moe_cpu.py + kernels/csrc/moe.cpp on the matmul library) vs references.

The experts run on the matmul library's raw-row kernels: for every weight row and row of x the
same integer products and fp32 operations as cpu_qgemv.matmul on the weight packed, so a single matmul
equals it bit for bit, on every code path (native, AVX2, scalar). Activations are quantized to the
library's grid (cpu_qgemv.dequantized_activations; two levels by default: at most amax/32512 per
element of a 32-block). So:
- vs a float64 reference on the *same* quantized activations: relative error < 1e-5 (float summation
  order only; < 1e-5 for the whole FFN too, whose intermediate the kernel rounds from float32 sums);
- vs the plain fp32 reference (dequantized weights, unquantized activations): relative Frobenius
  error < 1e-4 for one matmul and for the whole expert FFN (measured 2-4e-5; one level, llama.cpp's
  scheme, was 0.5-0.8% and 1-2%).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import before_a_guard_page
import torch
import torch.nn.functional as F

from kquant_pack import random_rows
from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels import moe_cpu
from nanochat.kernels.cpp_build import LazyLibrary
from nanochat.kernels.cpu_decoder import activation
from nanochat.kernels.moe_cpu import HostExperts, StackedWeight
from nanochat.kernels.options import KernelOptions
from nanochat.kernels.qweight import QuantWeight

KERNEL_CASES = [(t, 96 if gq.BLOCK_SIZES[t][0] == 32 else 512) for t in sorted(moe_cpu.KERNEL_TYPES)]
EXACT = 1e-5
MATMUL_TOL = 1e-4
FFN_TOL = 1e-4


@pytest.fixture(scope="module")
def lib():
    lib = cpu_qgemv.extension()
    if lib is None:
        pytest.skip("the CPU kernels could not be built here (no g++ / ninja)")
    return lib


@pytest.fixture(scope="module")
def other_builds(lib):
    """The library compiled for AVX2 and for no x86 extension (compiled code, not the runtime switch)."""
    return {name: cpu_qgemv.build_variant(name, cpu_qgemv.ISA_FLAGS[name]) for name in ("avx2", "scalar")}


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


def ffn_reference(x, ids, weights, wg, wu, wd, quant=False, act="silu", alpha=1.702, limit=7.0, biases=None):
    """sum_k w * (down act(gate x + bg, up x + bu) + bd) per token, float64 sums (the activation in float32);
    `quant` applies the kernels' activation rounding at the same two places. biases: (bg, bu, bd), each may be
    None."""
    bg, bu, bd = biases or (None, None, None)
    xs = cpu_qgemv.dequantized_activations(x) if quant else x
    out = torch.zeros(x.shape[0], wd.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = wg[e].float() @ xs[t], wu[e].float() @ xs[t]
            g, u = g if bg is None else g + bg[e], u if bu is None else u + bu[e]
            h = (F.silu(g) * u if act == "silu" else moe_cpu.clamped_swiglu(g, u, alpha, limit)).unsqueeze(0)
            if quant:
                h = cpu_qgemv.dequantized_activations(h)
            y = wd[e] @ h[0].double() + (0 if bd is None else bd[e].double())
            out[t] += float(weights[t, j]) * y
    return out


# ----------------------------------------------------------------------------- single matmuls


@pytest.mark.parametrize("ggml_type,k", KERNEL_CASES, ids=lambda v: gq.type_name(v) if v in gq.TYPE_NAMES else str(v))
def test_matmul_each_type(lib, ggml_type, k):
    rng = np.random.default_rng(ggml_type)
    rows = 37                                     # not a multiple of the kernels' 8 or 16 rows
    qw = QuantWeight(ggml_type, (rows, k), torch.from_numpy(random_rows(ggml_type, rows, k, rng)))
    w = gq.dequantize(qw).double()
    packed = cpu_qgemv.pack(qw)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))    # 32 rows of x per pass, and more
    for n in (1, 2, 5, 40):
        y = moe_cpu.quant_matmul(qw, x[:n])
        assert y.shape == (n, rows)
        assert torch.equal(y, cpu_qgemv.matmul(x[:n], packed))             # the dense layers' products
        assert rel(y, cpu_qgemv.dequantized_activations(x[:n]).double() @ w.T) < EXACT
        assert rel(y, x[:n].double() @ w.T) < MATMUL_TOL
        names = list(cpu_qgemv.SIMD_LEVELS.values())
        for level in names[:names.index(cpu_qgemv.simd_level())]:
            cpu_qgemv.set_simd_level(level)       # the lower code paths give the same bits
            try:
                assert torch.equal(moe_cpu.quant_matmul(qw, x[:n]), y), level
            finally:
                cpu_qgemv.set_simd_level(None)


@pytest.mark.parametrize("ggml_type,k", KERNEL_CASES, ids=lambda v: gq.type_name(v) if v in gq.TYPE_NAMES else str(v))
def test_rows_ending_at_unmapped_memory(lib, ggml_type, k):
    """A memory map's last expert ends where the file does: the kernels read no byte past a row's last
    block (their prefetches may run on; they never fault). The rows here end where an inaccessible page
    begins, on every code path."""
    rows = 24
    raw = torch.from_numpy(random_rows(ggml_type, rows, k, np.random.default_rng(ggml_type + 2)))
    qw = QuantWeight(ggml_type, (rows, k), raw)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))
    names = list(cpu_qgemv.SIMD_LEVELS.values())
    with before_a_guard_page(raw) as data:
        try:
            for level in names[:names.index(cpu_qgemv.simd_level()) + 1]:
                cpu_qgemv.set_simd_level(level)
                for n in (1, 5):
                    y = moe_cpu.quant_matmul(QuantWeight(ggml_type, (rows, k), data), x[:n])
                    assert torch.equal(y, moe_cpu.quant_matmul(qw, x[:n])), level
        finally:
            cpu_qgemv.set_simd_level(None)


@pytest.mark.parametrize("levels", [1, 2])
def test_activation_levels_are_the_dense_layers(lib, levels):
    """The experts quantize activations as the dense layers do, with the engine's levels."""
    rng = np.random.default_rng(2)
    qw = QuantWeight(gq.Q4_K, (64, 512), torch.from_numpy(random_rows(gq.Q4_K, 64, 512, rng)))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 4, 512)
    want = cpu_qgemv.matmul(x, cpu_qgemv.pack(qw), levels=levels)
    assert torch.equal(moe_cpu.quant_matmul(qw, x, levels=levels), want)
    g = StackedWeight(gq.Q4_K, (1, 64, 512), qw.data.unsqueeze(0))
    d = StackedWeight(gq.Q8_0, (1, 512, 64), torch.from_numpy(random_rows(gq.Q8_0, 512, 64, rng)).unsqueeze(0))
    ids, weights = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    h = activation("silu", want, want)
    ref = cpu_qgemv.matmul(h, cpu_qgemv.pack(d.expert(0)), levels=levels)
    assert rel(HostExperts(g, g, d, KernelOptions(act_levels=levels))(x, ids, weights), ref) < EXACT


@pytest.mark.parametrize("ggml_type,k", KERNEL_CASES, ids=lambda v: gq.type_name(v) if v in gq.TYPE_NAMES else str(v))
def test_other_builds_matmul_is_bit_identical(other_builds, ggml_type, k):
    """The AVX2 and scalar builds' raw-row matmul gives the native build's bits."""
    rng = np.random.default_rng(ggml_type + 1)
    qw = QuantWeight(ggml_type, (21, k), torch.from_numpy(random_rows(ggml_type, 21, k, rng)))
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(3))
    for levels in (1, 2):
        for n in (1, 11):
            want = moe_cpu.quant_matmul(qw, x[:n], levels=levels)
            for name, other in other_builds.items():
                y = torch.empty(n, 21)
                assert other.nc_qg_matmul_rows(ggml_type, qw.data.data_ptr(), 21, k, qw.data.stride(0), x.data_ptr(), n,
                                               k, y.data_ptr(), 21, levels == 2, 2) == 0
                assert torch.equal(y, want), (name, levels, n)


def test_other_builds_are_bit_identical(lib, other_builds):
    """The AVX2 and scalar builds' expert FFN gives the native build's bits."""
    rng = np.random.default_rng(4)
    e, hidden, inter = 5, 256, 256
    g, u, d = stack(gq.Q4_K, e, inter, hidden, rng), stack(gq.Q5_K, e, inter, hidden, rng), stack(gq.Q6_K, e, hidden, inter, rng)
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(4))
    ids, weights = routing(9, e, 2)
    host = HostExperts(g, u, d, KernelOptions(expert_threads=2))
    want = host(x, ids, weights)
    for name, other in other_builds.items():
        host._lib = other
        assert torch.equal(host(x, ids, weights), want), name


# ----------------------------------------------------------------------------- whole expert FFN


# (gate, up, down types), hidden, expert dim, experts, tokens: few tokens per expert (decode-like) and
# many (prefill: more than one pass of 32 tokens over an expert's rows)
FFN_CASES = {
    "q8_0": ((gq.Q8_0, gq.Q8_0, gq.Q8_0), 64, 96, 6, 5),
    "q4k-q5k-q6k": ((gq.Q4_K, gq.Q5_K, gq.Q6_K), 256, 512, 6, 9),
    "q4k-q4k-q8_0": ((gq.Q4_K, gq.Q4_K, gq.Q8_0), 256, 256, 6, 3),
    "q6k-q6k-q4k-many-tokens": ((gq.Q6_K, gq.Q6_K, gq.Q4_K), 256, 256, 3, 23),
    "q8_0-many-tokens": ((gq.Q8_0, gq.Q8_0, gq.Q8_0), 96, 64, 3, 30),
    "q4_0-q5_1-q4_1": ((gq.Q4_0, gq.Q5_1, gq.Q4_1), 64, 96, 4, 7),
    "q5_0-q3k-many-tokens": ((gq.Q5_0, gq.Q5_0, gq.Q3_K), 256, 256, 3, 40),
    "q2k-q3k-q2k": ((gq.Q2_K, gq.Q3_K, gq.Q2_K), 256, 256, 4, 6),
}


@pytest.mark.parametrize("case", list(FFN_CASES))
def test_expert_ffn_matches_reference(lib, case):
    (tg, tu, td), hidden, inter, e, t = FFN_CASES[case]
    rng = np.random.default_rng(len(case))
    k = 2
    g, u, d = stack(tg, e, inter, hidden, rng), stack(tu, e, inter, hidden, rng), stack(td, e, hidden, inter, rng)
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(3))
    ids, weights = routing(t, e, k)
    host = HostExperts(g, u, d, KernelOptions(expert_threads=2))
    assert host.backend == "kernel"
    out = host(x, ids, weights)
    wg, wu, wd = dense(g), dense(u), dense(d)
    # (float32 vs float64 sums can push an element of silu(gate)*up across a rounding boundary of the
    # activation grid: one step, amax/32512 of its block, in a few elements)
    assert rel(out, ffn_reference(x, ids, weights, wg, wu, wd, quant=True)) < EXACT
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
    one = HostExperts(g, u, d, KernelOptions(expert_threads=1))
    y1 = one(x, ids, weights)
    assert lib.nc_qg_last_threads() == 1
    two = HostExperts(g, u, d, KernelOptions(expert_threads=2))
    y2 = two(x, ids, weights)
    assert lib.nc_qg_last_threads() == 2          # the pool was given the asked threads
    assert torch.equal(y1, y2)                    # fixed per-element summation order
    assert torch.equal(y2[5:7], two(x[5:7], ids[5:7], weights[5:7]))   # a token's result is its own
    assert torch.equal(y2, two(x, ids, weights))
    empty = two(torch.zeros(0, 256), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3))
    assert empty.shape == (0, 256)


def test_cpu_threads_from_the_engine_config(monkeypatch):
    """Config.cpu_threads (env NANO_VLLM_CPU_THREADS) reaches the host expert kernels as the engine's kernel
    options; the default is one per physical core (kernels/options.physical_cores, tested in test_options)."""
    from nanochat.engine.config import Config
    from nanochat.kernels.options import physical_cores

    default = physical_cores()
    rng = np.random.default_rng(9)
    s = stack(gq.Q8_0, 2, 32, 32, rng)
    monkeypatch.delenv("NANO_VLLM_CPU_THREADS", raising=False)
    assert HostExperts(s, s, s, Config.create().kernel_options()).threads == default
    monkeypatch.setenv("NANO_VLLM_CPU_THREADS", str(default + 2))
    assert HostExperts(s, s, s).threads == default          # the environment is read by Config only
    assert HostExperts(s, s, s, Config.create().kernel_options()).threads == default + 2
    assert HostExperts(s, s, s, KernelOptions(expert_threads=1)).threads == 1
    for bad in ("0", "two"):
        monkeypatch.setenv("NANO_VLLM_CPU_THREADS", bad)
        with pytest.raises(ValueError, match="NANO_VLLM_CPU_THREADS"):
            Config.create()


def test_torch_fallback_when_the_extension_cannot_be_built(monkeypatch):
    def no_compiler():
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(cpu_qgemv, "_load_extension", no_compiler)
    monkeypatch.setattr(cpu_qgemv, "_kernels", LazyLibrary())     # not built yet in this process
    rng = np.random.default_rng(10)
    g, u, d = stack(gq.Q4_K, 4, 256, 256, rng), stack(gq.Q4_K, 4, 256, 256, rng), stack(gq.Q8_0, 4, 256, 256, rng)
    with pytest.warns(RuntimeWarning, match=r"kernels could not be built \(g\+\+: command not found\).*experts") as w:
        host = HostExperts(g, u, d)
    assert w[0].filename == __file__                 # points at the code that asked for the kernels
    assert host.backend == "torch" and cpu_qgemv.extension() is None and not moe_cpu.available()
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
    q8_1 = stack(gq.Q8_1, 3, 64, 64, rng)
    assert HostExperts(q8_1, q8_1, q8_1).backend == "torch"
    with pytest.raises(RuntimeError, match="unavailable"):
        HostExperts(q8_1, q8_1, q8_1, backend="kernel")
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


# ----------------------------------------------------------------------------- gpt-oss experts


def test_clamped_swiglu_is_transformers_gpt_oss():
    """moe_cpu.clamped_swiglu against GptOssExperts._apply_gate (gate and up interleaved there), on values
    around and beyond the clamp limit."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    g = torch.Generator().manual_seed(20)
    gate, up = torch.randn(5, 64, generator=g) * 6, torch.randn(5, 64, generator=g) * 6
    gate_up = torch.stack([gate, up], dim=-1).reshape(5, 128)
    want = GptOssExperts._apply_gate(SimpleNamespace(alpha=1.702, limit=7.0), gate_up)
    assert (gate > 7).any() and (up < -7).any() and (up > 7).any()
    torch.testing.assert_close(moe_cpu.clamped_swiglu(gate, up, 1.702, 7.0), want, rtol=1e-6, atol=1e-6)


def _gpt_oss_host(types, e, hidden, inter, rng, with_bias, threads=2, act="swiglu_oai"):
    g, u, d = (stack(types[0], e, inter, hidden, rng), stack(types[1], e, inter, hidden, rng),
               stack(types[2], e, hidden, inter, rng))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    biases = ((torch.randn(e, inter, generator=gen), torch.randn(e, inter, generator=gen),
               torch.randn(e, hidden, generator=gen)) if with_bias else (None, None, None))
    host = HostExperts(g, u, d, KernelOptions(expert_threads=threads), activation=act, alpha=1.702, limit=7.0,
                       gate_bias=biases[0], up_bias=biases[1], down_bias=biases[2])
    return host, (g, u, d), biases


# (gate, up, down types), hidden, expert dim, experts
OAI_CASES = {
    "mxfp4": ((gq.MXFP4, gq.MXFP4, gq.MXFP4), 96, 64, 5),
    "mxfp4-q8_0-down": ((gq.MXFP4, gq.MXFP4, gq.Q8_0), 64, 96, 4),
    "q4k-q4k-q6k": ((gq.Q4_K, gq.Q4_K, gq.Q6_K), 256, 256, 4),
}


@pytest.mark.parametrize("act", ["swiglu_oai", "silu"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", list(OAI_CASES))
def test_gpt_oss_experts_match_reference(lib, case, with_bias, act):
    """The kernel's expert FFN with the clamped SwiGLU (and SiLU) and biases against the formula on the
    dequantized weights: on the kernels' activation grid (EXACT), in plain fp32 (FFN_TOL); the torch backend
    too; 1, 5 and 40 tokens (more than a pass of 32 over an expert), 1 and 2 threads; a token's result is
    its own."""
    types, hidden, inter, e = OAI_CASES[case]
    rng = np.random.default_rng(len(case) + 100 * with_bias)
    host, (g, u, d), biases = _gpt_oss_host(types, e, hidden, inter, rng, with_bias, act=act)
    assert host.backend == "kernel"
    one = _gpt_oss_host(types, e, hidden, inter, np.random.default_rng(len(case) + 100 * with_bias), with_bias,
                        threads=1, act=act)[0]
    wg, wu, wd = dense(g), dense(u), dense(d)
    x = torch.randn(40, hidden, generator=torch.Generator().manual_seed(21))
    # x scaled to gate / up pre-activations of std 5, as a trained model's: the clamps at 7 are reached
    x = x * (5 / torch.einsum("eih,th->tei", wg.float(), x).std())
    ids, weights = routing(40, e, 2, seed=3)
    pre = torch.einsum("eih,th->tei", wg.float(), x)
    assert 0.05 < (pre > 7).float().mean() < 0.3
    for n in (1, 5, 40):
        out = host(x[:n], ids[:n], weights[:n])
        assert torch.equal(out, one(x[:n], ids[:n], weights[:n]))        # thread count
        assert torch.equal(out[n - 1:], host(x[n - 1:n], ids[n - 1:n], weights[n - 1:n]))   # batch
        kw = dict(act=act, alpha=1.702, limit=7.0, biases=biases)
        assert rel(out, ffn_reference(x[:n], ids[:n], weights[:n], wg, wu, wd, quant=True, **kw)) < EXACT
        ref = ffn_reference(x[:n], ids[:n], weights[:n], wg, wu, wd, **kw)
        assert rel(out, ref) < FFN_TOL
        torch_host = HostExperts(g, u, d, backend="torch", activation=act, alpha=1.702, limit=7.0,
                                 gate_bias=biases[0], up_bias=biases[1], down_bias=biases[2])
        assert rel(torch_host(x[:n], ids[:n], weights[:n]), ref) < EXACT


def test_gpt_oss_experts_bit_identical_across_isa(lib, other_builds):
    """MXFP4 experts with the clamped SwiGLU and biases: the AVX2 and scalar builds, and the native build's
    lower code paths, give the native bits."""
    rng = np.random.default_rng(22)
    host, _, _ = _gpt_oss_host((gq.MXFP4, gq.MXFP4, gq.MXFP4), 6, 128, 96, rng, True)
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(22)) * 0.5   # pre-activations of std ~5
    ids, weights = routing(37, 6, 3, seed=4)
    for levels in (1, 2):
        host.levels = levels
        host._lib = lib
        want = host(x, ids, weights)
        for name, other in other_builds.items():
            host._lib = other
            assert torch.equal(host(x, ids, weights), want), (name, levels)
        host._lib = lib
        names = list(cpu_qgemv.SIMD_LEVELS.values())
        for level in names[:names.index(cpu_qgemv.simd_level())]:
            cpu_qgemv.set_simd_level(level)
            try:
                assert torch.equal(host(x, ids, weights), want), level
            finally:
                cpu_qgemv.set_simd_level(None)


def test_gpt_oss_expert_arguments_are_checked(lib):
    rng = np.random.default_rng(23)
    s = stack(gq.MXFP4, 2, 32, 32, rng)
    with pytest.raises(ValueError, match="unknown expert activation 'gelu'"):
        HostExperts(s, s, s, activation="gelu")
    with pytest.raises(ValueError, match=r"experts.up_bias: expert biases need a float tensor \[2, 32\]"):
        HostExperts(s, s, s, up_bias=torch.zeros(2, 31))
    with pytest.raises(ValueError, match="down_bias"):
        HostExperts(s, s, s, down_bias=torch.zeros(2, 32, dtype=torch.long))
    host = HostExperts(s, s, s, activation="swiglu_oai", down_bias=torch.zeros(2, 32, dtype=torch.float64))
    assert host.down_bias.dtype == torch.float32 and host.gate_bias is None
