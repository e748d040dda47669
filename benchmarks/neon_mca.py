"""Cycles per quant block of nanochat's NEON tile kernels and of ggml's NEON dot products, on paper (llvm-mca).

    python benchmarks/neon_mca.py [--llama-src DIR] [--clang clang] [--mca llvm-mca-19] [--markdown]

Both are compiled here for AArch64 with the same clang and flags: nanochat's kernels/csrc/qgemv.cpp (its tile kernel
tile_simd<V128, TYPE, T, X2> for T = 1 row of x, decode, and T = 8 rows, prefill) and ggml-cpu's arch/arm/quants.c
from a llama.cpp tree (ggml_vec_dot_<type>_q8_0 / _q8_K: one weight row times one row of x, or with i8mm 2 x 2 rows
per call, nrc = 2, its prefill path), never modified or copied. Constant-trip inner loops are fully unrolled
(-mllvm -unroll-threshold) in both, so that the innermost loop left is the one over blocks, whose body then holds
all of a block's work; llvm-mca estimates that loop's steady-state cycles per iteration on each scheduling model.
A "block-dot" is one weight block (32 or 256 values) times one row of x: the loop's int8 multiply-accumulates
(16 per SDOT, 32 per SMMLA) divided by the block's size give the block-dots per iteration. Memory is not modelled
(loads hit L1): the figures are the kernels' arithmetic, what decodes a weight that streams from DRAM when the core
keeps up. nanochat's one-level activations (X2 = false, llama.cpp's scheme) are the like-for-like column; its
default, two levels, does the integer work twice.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SRC = Path("/work/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp")
MODELS = ("apple-m1", "neoverse-n1", "neoverse-v1")
I8MM_MODELS = {"neoverse-v1"}  # the models whose CPUs have i8mm (SMMLA): ggml's prefill takes its 2 x 2 loop there
# name, ggml type id (qgemv.cpp's enum), values per block, ggml function
TYPES = [("Q4_0", 2, 32, "ggml_vec_dot_q4_0_q8_0"), ("Q8_0", 8, 32, "ggml_vec_dot_q8_0_q8_0"),
         ("Q4_K", 12, 256, "ggml_vec_dot_q4_K_q8_K"), ("Q5_K", 13, 256, "ggml_vec_dot_q5_K_q8_K"),
         ("Q6_K", 14, 256, "ggml_vec_dot_q6_K_q8_K"), ("MXFP4", 39, 32, "ggml_vec_dot_mxfp4_q8_0")]
UNROLL = ["-mllvm", "-unroll-threshold=5000", "-mllvm", "-unroll-max-upperbound=64"]
TARGET = ["--target=aarch64-linux-gnu", "-O3", *UNROLL]
DOTPROD = "-march=armv8.2-a+dotprod"
I8MM = "-march=armv8.6-a+dotprod+i8mm"

BRANCH = re.compile(r"^\s+(?:b\.\w+|b|cbnz|cbz|tbnz|tbz)\s+.*?(\.LBB\w+)\s*(?://.*)?$")


def function(asm: list[str], name: str) -> list[str]:
    start = next(i for i, line in enumerate(asm) if line.startswith(name + ":"))
    end = next(i for i in range(start, len(asm)) if asm[i].startswith(".Lfunc_end"))
    return asm[start:end]


def instructions(lines: list[str]) -> list[str]:
    return [line.split("//")[0].rstrip() for line in lines
            if line.startswith("\t") and not line.strip().startswith((".", "//", "#"))]


def macs(body: list[str]) -> int:
    return sum(16 for i in body if i.split()[0] == "sdot") + sum(32 for i in body if i.split()[0] == "smmla")


def block_loops(lines: list[str]) -> list[list[str]]:
    """The innermost loops (ones that hold no other) with the most int8 multiply-accumulates, longest first: one,
    or the versions of one loop the compiler made (nanochat's tiles: with the prefetches of the first quarter of a
    tile, and without them for the other three)."""
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if re.match(r"^\.LBB\w+:", line)}
    loops = [(labels[m.group(1)], j) for j, line in enumerate(lines)
             if (m := BRANCH.match(line)) and m.group(1) in labels and labels[m.group(1)] < j]
    inner = [instructions(lines[a + 1:b + 1]) for a, b in loops
             if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    most = max((macs(body) for body in inner), default=0)
    if not most:
        raise RuntimeError("no loop of integer dot products found")
    return sorted((body for body in inner if macs(body) == most), key=len, reverse=True)


def block_loop(lines: list[str]) -> list[str]:
    return block_loops(lines)[0]


def tile_cycles(mca: str, versions: list[list[str]], model: str) -> float:
    """Cycles per iteration of nanochat's block loop over a tile's 4 quarters: the longest version (the
    prefetching one) for one quarter, the shortest for the other three."""
    return (mca_cycles(mca, versions[0], model) + 3 * mca_cycles(mca, versions[-1], model)) / 4


def mca_cycles(mca: str, body: list[str], model: str) -> float:
    r = subprocess.run([mca, "-mtriple=aarch64", f"-mcpu={model}", "-mattr=+dotprod,+i8mm", "-iterations=200"],
                       input="\n".join(body) + "\n", capture_output=True, text=True, check=True)
    return float(re.search(r"Total Cycles:\s+(\d+)", r.stdout).group(1)) / 200


def compile_asm(cmd: list[str], out: Path) -> list[str]:
    r = subprocess.run([*cmd, "-S", "-o", str(out)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"compile failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return out.read_text().splitlines()


def nanochat_asm(clang: str, tmp: Path, march: str) -> list[str]:
    src = tmp / "nc_tiles.cpp"
    lines = ['#include "qgemv.cpp"']
    for _, t, _, _ in TYPES:
        for rows in (1, 8):
            for x2 in (False, True):
                lines.append(f'extern "C" __attribute__((noinline)) void {wrapper(t, rows, x2)}(const uint8_t* w, '
                             f"int64_t nblk, const Acts& a, const Out& o) {{ tile_simd<V128, {t}, {rows}, "
                             f"{str(x2).lower()}>(w, nblk, a, 0, o, 0); }}")
    src.write_text("\n".join(lines) + "\n")
    cmd = [clang, *TARGET, march, "-std=c++20", "-ffp-contract=off", f"-I{ROOT / 'kernels' / 'csrc'}", str(src)]
    return compile_asm(cmd, tmp / f"nc{march.replace('+', '_')}.s")


def wrapper(t: int, rows: int, x2: bool) -> str:
    return f"nc_tile_{t}_{rows}_{int(x2)}"


def nanochat_kernel(asm: list[str], t: int, rows: int, x2: bool) -> list[str]:
    """tile_simd<V128, t, rows, x2>'s code: its own function, or the wrapper's where clang inlined it there."""
    name = f"_ZN12_GLOBAL__N_19tile_simdINS_4V128ELi{t}ELi{rows}ELb{int(x2)}EEEvPKhlRKN2nc2qg4ActsElRKNS_3OutEl"
    return function(asm, name if any(line.startswith(name + ":") for line in asm) else wrapper(t, rows, x2))


def ggml_asm(clang: str, llama: Path, march: str, tmp: Path) -> list[str]:
    g = llama / "ggml"
    cmd = [clang.replace("clang++", "clang"), *TARGET, march, f"-I{g / 'include'}", f"-I{g / 'src'}",
           f"-I{g / 'src' / 'ggml-cpu'}", str(g / "src" / "ggml-cpu" / "arch" / "arm" / "quants.c")]
    return compile_asm(cmd, tmp / f"ggml{march.replace('+', '_')}.s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-src", type=Path, default=LLAMA_SRC, help="a llama.cpp tree (ggml/src/ggml-cpu/...)")
    ap.add_argument("--clang", default="clang++")
    ap.add_argument("--mca", default=next((m for m in ("llvm-mca-19", "llvm-mca") if shutil.which(m)), "llvm-mca"))
    ap.add_argument("--markdown", action="store_true", help="the table as benchmarks/README.md has it")
    args = ap.parse_args()
    for tool in (args.clang, args.mca):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found (apt-get install clang llvm-19)")
    version = subprocess.run([args.mca, "--version"], capture_output=True, text=True).stdout
    clang_version = subprocess.run([args.clang, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        nc = nanochat_asm(args.clang, tmp, DOTPROD)  # its i8mm level runs the same SDOT kernels
        gg = {"dotprod": ggml_asm(args.clang, args.llama_src, DOTPROD, tmp),
              "i8mm": ggml_asm(args.clang, args.llama_src, I8MM, tmp)}
        rows = []
        for name, t, elems, fn in TYPES:
            for tile, nrows in (("decode", 1), ("prefill", 8)):
                bodies = {x2: block_loops(nanochat_kernel(nc, t, nrows, x2)) for x2 in (False, True)}
                per = {x2: macs(b[0]) / elems / (2 if x2 else 1) for x2, b in bodies.items()}
                # ggml: decode is the one-row vec_dot (dotprod); prefill its i8mm 2 x 2 loop where the type has one
                # and the CPU has i8mm, else the one-row loop for each row of x
                dot = block_loop(function(gg["dotprod"], fn))
                i8 = block_loop(function(gg["i8mm"], fn))
                for model in MODELS:
                    body = i8 if (tile == "prefill" and model in I8MM_MODELS
                                  and any(i.split()[0] == "smmla" for i in i8)) else dot
                    c1 = tile_cycles(args.mca, bodies[False], model) / per[False]
                    c2 = tile_cycles(args.mca, bodies[True], model) / per[True]
                    cg = mca_cycles(args.mca, body, model) / (macs(body) / elems)
                    rows.append((name, tile, model, c1, c2, cg,
                                 "i8mm" if any(i.split()[0] == "smmla" for i in body) else "dotprod"))
    head = ["type", "tile", "model", "nanochat 1 level", "nanochat 2 levels", "ggml", "ggml kernel", "1 level / ggml"]
    print("llvm-mca: " + " ".join(line.strip() for line in version.splitlines()[:2]))
    print(f"compiler: {clang_version}; nanochat {DOTPROD}, ggml {DOTPROD} (decode) / {I8MM} (prefill)")
    print("cycles per block-dot (one weight block x one row of x)")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for name, tile, model, c1, c2, cg, kind in rows:
            print(f"| {name} | {tile} | {model} | {c1:.1f} | {c2:.1f} | {cg:.1f} | {kind} | {c1 / cg:.2f} |")
    else:
        print("  ".join(f"{h:>17}" for h in head))
        for name, tile, model, c1, c2, cg, kind in rows:
            print("  ".join(f"{v:>17}" for v in (name, tile, model, f"{c1:.1f}", f"{c2:.1f}", f"{cg:.1f}", kind,
                                                    f"{c1 / cg:.2f}")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
