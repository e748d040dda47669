"""The kernels' AArch64 builds, checked bit for bit on this x86-64 machine under emulation: the library's sources and
tests/native/neon_harness.cpp cross-compiled (aarch64-linux-gnu-g++) for baseline ASIMD, for +dotprod (the i8mm
level runs the same kernels: only its selection is checked) and for no SIMD (NC_NO_SIMD), run under
`qemu-aarch64 -cpu max`. The harness hashes the outputs of every matmul type on 1, 3, 8 and 17 rows of x, one and
two activation levels, 1 and 2 threads (tiles, raw GGML rows, row reads), the MoE experts (SwiGLU, gpt-oss's clamped
SwiGLU with MXFP4) and a fused decoder step (two layers, a prefill chunk beside a decode row, fp16 and fp32 caches,
SiLU and GELU, window and sinks). Every AArch64 build must give the x86 scalar build's hashes; the fused step and
activations, whose vector code runs 8 fp32 lanes as the AVX2 build does, the x86 AVX2 build's. Also: the x86
kernels built with clang give g++'s bits, and the build flags per platform. The builds are cached by their sources
and flags: a cold run compiles 7 of them (1.5-3.5 min on 2 cores), a warm one takes seconds.

Skips, saying why, where the cross compiler or qemu is missing (.ci/run installs them when it runs as root).
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from nanochat.kernels import cpu_qgemv
from nanochat.kernels.cpp_build import arm_features, build_root

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests" / "native" / "neon_harness.cpp",
           *(ROOT / "kernels" / "csrc" / f for f in ("qgemv.cpp", "decoder.cpp", "moe.cpp"))]
# -O1: the check is of bits, not speed (-ffp-contract=off, no fast-math: any -O gives the same bits), and the
# seven builds (cross, x86, clang) compile faster: the cold test took 1.5 min on an idle 2-core machine
FLAGS = ["-O1", "-std=c++20", "-ffp-contract=off", "-pthread"]
CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
# name -> (compiler, target flags, simd level the build must report)
BUILDS = {
    "x86-scalar": ("g++", [], 0),
    "x86-avx2": ("g++", ["-mavx2", "-mfma", "-mf16c"], 1),
    "arm-neon": (CROSS, ["-march=armv8-a"], 3),
    "arm-dotprod": (CROSS, ["-march=armv8.2-a+dotprod"], 4),
    "arm-scalar": (CROSS, ["-march=armv8-a", "-DNC_NO_SIMD"], 0),
}
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]


def _missing() -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the emulation check runs on x86-64 hosts (this is {platform.machine()})"
    for tool, package in ((CROSS, "g++-aarch64-linux-gnu"), (QEMU, "qemu-user"), ("g++", "g++")):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install {package})"
    return None


def _build_all(builds: dict[str, tuple[str, list[str], int]], out_dir: Path) -> dict[str, Path]:
    """Compile the builds in parallel (each one keyed by its sources and flags, so a rerun reuses them)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*SOURCES, *(ROOT / "kernels" / "csrc").glob("*.h")]))
    out_dir.mkdir(parents=True, exist_ok=True)
    exes, procs = {}, {}
    for name, (cc, flags, _) in builds.items():
        key = hashlib.sha256(digest.digest() + repr((cc, flags, FLAGS)).encode()).hexdigest()[:12]
        exe = out_dir / f"{name}-{key}"
        exes[name] = exe
        if not exe.is_file():
            procs[name] = subprocess.Popen([cc, *FLAGS, *flags, *map(str, SOURCES), "-o", str(exe) + ".tmp"],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, p in procs.items():
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"{name} did not build:\n{err[-3000:]}"
        Path(str(exes[name]) + ".tmp").rename(exes[name])
    return exes


def _run(exe: Path, arm: bool) -> dict[str, str]:
    cmd = [QEMU, "-cpu", "max", "-L", "/usr/aarch64-linux-gnu", str(exe)] if arm else [str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line.rsplit(" ", 1) for line in r.stdout.splitlines()]
    return {label: value for label, value in lines}


@pytest.fixture(scope="session")
def hashes() -> dict[str, dict[str, str]]:
    reason = _missing()
    if reason:
        print(f"\ntest_neon_kernels: skipped: {reason}")
        pytest.skip(reason)
    exes = _build_all(BUILDS, build_root() / "neon-check")
    return {name: _run(exe, BUILDS[name][0] == CROSS) for name, exe in exes.items()}


def _fused(label: str) -> bool:
    return label.startswith(("decoder ", "activation "))


def test_harness_covers_every_type_row_count_and_thread_count(hashes):
    labels = set(hashes["x86-scalar"])
    for t in TYPES + ["F32", "F16", "BF16"]:
        for n in (1, 3, 8, 17):
            for th in (1, 2):
                assert f"matmul {t} n={n} levels=2 threads={th}" in labels
                if t in TYPES:
                    assert f"rows {t} n={n} levels=1 threads={th}" in labels
    assert sum(label.startswith("moe ") for label in labels) == 24
    assert sum(label.startswith("decoder ") for label in labels) == 28
    # the inputs reach the kernels: different types give different outputs
    assert len({hashes["x86-scalar"][f"matmul {t} n=3 levels=2 threads=1"] for t in TYPES}) == len(TYPES)


@pytest.mark.parametrize("build", ["arm-neon", "arm-dotprod", "arm-scalar"])
def test_arm_build_gives_the_x86_scalar_bits(build, hashes):
    """Matmul tiles, raw-row (expert) kernels, row reads and the MoE experts: the x86 scalar build's bits."""
    got, want = hashes[build], hashes["x86-scalar"]
    assert got["simd"] == str(BUILDS[build][2]), "the build did not take its own code path"
    diff = [label for label in want if label != "simd" and not _fused(label) and got.get(label) != want[label]]
    assert not diff, f"{len(diff)} cases differ from the x86 scalar build, e.g. {diff[:5]}"


@pytest.mark.parametrize("build", ["arm-neon", "arm-dotprod"])
def test_arm_fused_step_gives_the_avx2_bits(build, hashes):
    """The fused decoder step (outputs and the K/V written) and the activations: the x86 AVX2 build's bits."""
    got, want = hashes[build], hashes["x86-avx2"]
    fused = [label for label in want if _fused(label)]
    assert len(fused) == 33
    diff = [label for label in fused if got.get(label) != want[label]]
    assert not diff, f"{len(diff)} fused-step cases differ from the AVX2 build, e.g. {diff[:5]}"


@pytest.mark.parametrize("flags,level", [(["-march=armv8-a"], 3), (["-march=armv8.2-a+dotprod"], 4),
                                         (["-march=armv8.6-a+i8mm"], 5), (["-mcpu=neoverse-n1"], 4),
                                         (["-march=armv8.6-a+i8mm", "-DNC_NO_SIMD"], 0)])
def test_arm_levels_come_from_the_compiler_macros(flags, level, tmp_path):
    """simd.h's level for each target (the i8mm level runs the dotprod kernels: no build of its own above)."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    src = tmp_path / "level.cpp"
    src.write_text(f'#include "simd.h"\nstatic_assert(NC_ISA == {level}, "level");\n')
    r = subprocess.run([CROSS, "-std=c++20", *flags, f"-I{ROOT / 'kernels' / 'csrc'}", "-fsyntax-only", str(src)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_arm_scalar_fused_step_gives_the_x86_scalar_bits(hashes):
    got, want = hashes["arm-scalar"], hashes["x86-scalar"]
    diff = [label for label in want if _fused(label) and got.get(label) != want[label]]
    assert not diff, f"{len(diff)} cases differ, e.g. {diff[:5]}"


def test_x86_kernels_built_with_clang_give_the_gcc_bits(hashes):
    """Debian's clang builds the x86 kernels (scalar and native) with g++'s results bit for bit."""
    clang = shutil.which("clang++")
    if clang is None:
        print("\ntest_x86_kernels_built_with_clang: skipped: clang++ not found (apt-get install clang)")
        pytest.skip("clang++ not found (apt-get install clang)")
    builds = {"clang-scalar": (clang, [], 0), "clang-avx2": (clang, ["-mavx2", "-mfma", "-mf16c"], 1)}
    exes = _build_all(builds, build_root() / "neon-check")
    for name, ref in (("clang-scalar", "x86-scalar"), ("clang-avx2", "x86-avx2")):
        got, want = _run(exes[name], arm=False), hashes[ref]
        assert got == want, f"{name}: {[label for label in want if got.get(label) != want[label]][:5]}"


# ---------------------------------------------------------------- build flags and feature detection


def test_native_flags_per_platform():
    assert cpu_qgemv.native_flags("Linux", "x86_64") == ["-march=native"]
    assert cpu_qgemv.native_flags("Linux", "aarch64") == ["-mcpu=native"]
    assert cpu_qgemv.native_flags("Darwin", "x86_64") == ["-march=native"]
    assert cpu_qgemv.native_flags("Darwin", "arm64", frozenset({"dotprod"})) == ["-mcpu=apple-m1"]
    assert cpu_qgemv.native_flags("Darwin", "arm64", frozenset({"dotprod", "i8mm"})) == ["-mcpu=apple-m1+i8mm"]
    assert "scalar" in cpu_qgemv.isa_flags("aarch64") and "-DNC_NO_SIMD" in cpu_qgemv.isa_flags("aarch64")["scalar"]
    assert cpu_qgemv.isa_flags("x86_64") is cpu_qgemv.ISA_FLAGS


def test_arm_features_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n"
                    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp i8mm bf16\n")
    assert arm_features("Linux", str(info)) == {"dotprod", "i8mm"}
    info.write_text("Features\t: fp asimd evtstrm crc32 cpuid\n")            # a Cortex-A53 (Raspberry Pi 3)
    assert arm_features("Linux", str(info)) == frozenset()
    assert arm_features("Linux", str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize("mcpu,macros", [("apple-m1", {"__ARM_FEATURE_DOTPROD"}),
                                          ("apple-m1+i8mm", {"__ARM_FEATURE_DOTPROD", "__ARM_FEATURE_MATMUL_INT8"})])
def test_apple_flags_select_the_neon_levels(mcpu, macros):
    """macOS's flags, checked with Debian's clang as far as it goes without Apple's SDK: the Apple target takes
    them and defines the macros simd.h picks its level from; the sources compile for AArch64 with them."""
    clang = shutil.which("clang++")
    if clang is None:
        pytest.skip("clang++ not found (apt-get install clang)")
    r = subprocess.run([clang, "--target=arm64-apple-macos11", f"-mcpu={mcpu}", "-dM", "-E", "-x", "c++", "/dev/null"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    defined = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define")}
    assert {"__aarch64__", "__ARM_NEON", "__APPLE__"} | macros <= defined
    assert "__x86_64__" not in defined and "_OPENMP" not in defined


# ---------------------------------------------------------------- the fallback order


def test_auto_backend_skips_a_scalar_build():
    """A CPU with no SIMD build (here: the scalar build forced) gets torch's int4 kernel (dense where the type has
    none), which outruns the scalar q8 kernels (benchmarks/README.md); q8 stays selectable by name."""
    import torch

    from nanochat.kernels import gguf_quants as gq
    from nanochat.kernels import quant_matmul as qm

    native = cpu_qgemv.extension()
    if native is None:
        pytest.skip("no compiled kernels")
    cpu = torch.device("cpu")
    try:
        cpu_qgemv.use_isa("scalar")
        assert cpu_qgemv.simd_compiled() == "scalar"
        want = "int4" if qm._INT4MM is not None and gq.Q4_1 in qm.CPU_INT4_TYPES else "dense"
        assert qm._pick_backend(gq.Q4_1, cpu, torch.bfloat16, "auto") == want
        assert qm._pick_backend(gq.Q6_K, cpu, torch.bfloat16, "auto") in ("int4", "dense")
        assert qm._pick_backend(gq.Q4_1, cpu, torch.bfloat16, "q8") == "q8"
    finally:
        cpu_qgemv._kernels.replace(native)
    if cpu_qgemv.simd_compiled() != "scalar":
        assert qm._pick_backend(gq.Q4_1, cpu, torch.bfloat16, "auto") == "q8"
