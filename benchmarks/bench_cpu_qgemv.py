"""Per-call time of the CPU quantized linear backends on SmolLM2-135M's shapes.

    python benchmarks/bench_cpu_qgemv.py [--threads 1 2] [--rows 1 4 16 64] [--repeats 7] [--isa avx2]

For each (shape, type) and rows of x: the int8 kernels ("q8": two-level activations, the default;
"q8x1": one level, as llama.cpp; kernels/cpu_qgemv.py), torch's int4 kernel ("int4") and a dense
bf16 F.linear ("bf16"), fp32 activations in and out (as the engine runs on CPU). Each timing is the minimum over `repeats` runs of the mean of a timed loop (min-of-N: the
machine may be shared), in microseconds per call; "GB/s" is the q8 weight bytes read per second.
--step: the matmuls of one whole decode token (30 layers of qkv, o, gate_up, down, then the LM
head: 121 calls, ~96 MB of weights, so they stream from DRAM as in the model), per backend.
--types Q4_K Q3_K Q2_K F16 [--shape 4096 1024] [--levels 2 1]: the kernels of cpu_qgemv per weight type
on one shape, "hot" (the same weight each call: it stays in cache) and "cold" (rotating over copies of
it, 256 MB in all: read from DRAM, as in decode), per activation levels (dense types: one line).
--decode: also time whole-model decode (benchmarks/bench_decode.py).
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
import torch
import torch.nn.functional as F

from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.options import KernelOptions
from nanochat.kernels.quant_matmul import prepare_quant_weight, quant_linear
from nanochat.kernels.qweight import QuantWeight

# (name, out, in, type): SmolLM2-135M (hidden 576, intermediate 1536, 9 heads / 3 kv heads of 64)
SHAPES = [("o_proj", 576, 576, gq.Q4_1), ("qkv", 960, 576, gq.Q4_1), ("gate_up", 3072, 576, gq.Q4_1),
          ("down", 576, 1536, gq.Q4_1), ("lm_head", 49152, 576, gq.Q8_0)]


# byte offsets of the f16 scale fields per block (default: d at 0)
_F16_FIELDS = {gq.Q4_1: (0, 2), gq.Q5_1: (0, 2), gq.Q2_K: (80, 82), gq.Q3_K: (108,), gq.Q4_K: (0, 2),
               gq.Q5_K: (0, 2), gq.Q6_K: (208,)}
COLD_BYTES = 256 << 20


def random_weight(t: int, out_f: int, in_f: int, seed: int = 0) -> QuantWeight:
    """Random blocks with f16 scales 0.01 (MXFP4: 2^-8; the quants' bit patterns do not change the timing); dense
    types: N(0, 0.02) values."""
    rng = np.random.default_rng(seed)
    if t in cpu_qgemv.DENSE_TYPES:
        w = torch.from_numpy(rng.standard_normal((out_f, in_f), dtype=np.float32) * 0.02)
        return QuantWeight(t, (out_f, in_f), w.to(getattr(torch, cpu_qgemv.DENSE_TYPES[t])).view(torch.uint8))
    elems, nbytes = gq.BLOCK_SIZES[t]
    raw = rng.integers(0, 256, (out_f * in_f // elems, nbytes), dtype=np.uint8)
    scale = np.full(raw.shape[0], 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    if t == gq.MXFP4:   # its scale is an E8M0 byte: 2^-8
        raw[:, 0] = 120
    for off in () if t == gq.MXFP4 else _F16_FIELDS.get(t, (0,)):
        raw[:, off:off + 2] = scale
    return QuantWeight(t, (out_f, in_f), torch.from_numpy(raw.reshape(out_f, -1)))


def time_call(fn, repeats: int, min_time: float = 0.05) -> float:
    fn()
    n = 1
    while True:  # calibrate the loop to ~min_time
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t > min_time / 4 or n > 1 << 16:
            break
        n *= 2
    n = max(1, int(n * min_time / max(time.perf_counter() - t, 1e-9)))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def bench(threads: list[int], rows: list[int], repeats: int) -> None:
    print(f"simd: {cpu_qgemv.simd_level()}; times in us per call (min of {repeats})")
    print(f"{'shape':<24}{'thr':>4}{'rows':>6}{'q8':>10}{'q8x1':>10}{'int4':>10}{'bf16':>10}{'q8 GB/s':>9}")
    for name, out_f, in_f, t in SHAPES:
        qw = random_weight(t, out_f, in_f)
        q8 = prepare_quant_weight(qw, "cpu", torch.float32, backend="q8")
        q8_1 = prepare_quant_weight(qw, "cpu", torch.float32, backend="q8", options=KernelOptions(act_levels=1))
        i4 = prepare_quant_weight(qw, "cpu", torch.float32, backend="int4")
        dense = gq.dequantize(qw).to(torch.bfloat16)
        nbytes = qw.data.numel()
        for th in threads:
            torch.set_num_threads(th)
            for n in rows:
                x = torch.randn(n, in_f)
                tq = time_call(lambda: quant_linear(x, q8), repeats)
                t1 = time_call(lambda: quant_linear(x, q8_1), repeats)
                ti = time_call(lambda: quant_linear(x, i4), repeats)
                td = time_call(lambda: F.linear(x.bfloat16(), dense).float(), repeats)
                label = f"{name} {out_f}x{in_f} {gq.type_name(t)}"
                print(f"{label:<24}{th:>4}{n:>6}{tq:>10.1f}{t1:>10.1f}{ti:>10.1f}{td:>10.1f}{nbytes / tq / 1e3:>9.1f}",
                      flush=True)


def bench_types(names: list[str], out_f: int, in_f: int, threads: list[int], rows: list[int], repeats: int,
                levels: list[int] | None = None) -> None:
    """cpu_qgemv per weight type on one shape: hot (cached) and cold (DRAM) weights, per activation levels
    (default: cpu_qgemv.DEFAULT_LEVELS)."""
    ids = {v: k for k, v in gq.TYPE_NAMES.items()}
    print(f"simd: {cpu_qgemv.simd_level()}; {out_f}x{in_f}; us per call (min of {repeats}); GB/s = weight bytes / time")
    print(f"{'type':<6}{'MB':>7}{'thr':>4}{'rows':>6}{'lev':>4}{'hot':>10}{'cold':>10}{'hot GB/s':>10}{'cold GB/s':>10}")
    for name in names:
        t = ids[name.upper()]
        pw = cpu_qgemv.pack(random_weight(t, out_f, in_f))
        nbytes = pw.data.numel()
        copies = [pw.data] + [pw.data.clone() for _ in range(-(-COLD_BYTES // nbytes) - 1)]
        for th in threads:
            torch.set_num_threads(th)
            for n in rows:
                x = torch.randn(n, in_f)
                for lev in ([2] if t in cpu_qgemv.DENSE_TYPES else levels or [cpu_qgemv.DEFAULT_LEVELS]):
                    hot = time_call(lambda: cpu_qgemv.linear(x, t, pw.data, out_f, levels=lev), repeats)
                    cycle = itertools.cycle(copies)
                    cold = time_call(lambda: cpu_qgemv.linear(x, t, next(cycle), out_f, levels=lev), repeats)
                    print(f"{name:<6}{nbytes / 1e6:>7.2f}{th:>4}{n:>6}{'-' if t in cpu_qgemv.DENSE_TYPES else lev:>4}"
                          f"{hot:>10.1f}{cold:>10.1f}{nbytes / hot / 1e3:>10.1f}{nbytes / cold / 1e3:>10.1f}", flush=True)
        del copies  # before the next type's copies are made


def bench_step(threads: list[int], repeats: int, layers: int = 30) -> None:
    """One decode token's matmuls, in model order, weights distinct per layer (no cache reuse)."""
    per_layer = SHAPES[:4]
    head = SHAPES[4]
    q = {name: [random_weight(t, o, i, seed=li) for li in range(layers)] for name, o, i, t in per_layer}
    hq = random_weight(head[3], head[1], head[2])
    nbytes = sum(w.data.numel() for ws in q.values() for w in ws) + hq.data.numel()
    print(f"decode-token matmuls: {len(per_layer) * layers + 1} calls, {nbytes / 1e6:.1f} MB of weights; "
          f"ms per token (min of {repeats})")
    for backend in ("q8", "int4"):
        ws = [[prepare_quant_weight(q[name][li], "cpu", torch.float32, backend=backend) for name, *_ in per_layer]
              for li in range(layers)]
        hw = prepare_quant_weight(hq, "cpu", torch.float32, backend=backend)
        xs = {i: torch.randn(1, i) for _, _, i, _ in SHAPES}

        def step():
            for layer in ws:
                for (name, o, i, t), w in zip(per_layer, layer):
                    quant_linear(xs[i], w)
            quant_linear(xs[head[2]], hw)

        for th in threads:
            torch.set_num_threads(th)
            ms = time_call(step, repeats, min_time=0.2) / 1e3
            print(f"  {backend:<5} threads {th}: {ms:7.2f} ms  ({nbytes / ms / 1e6:5.1f} GB/s)", flush=True)
        del ws, hw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--step", action="store_true", help="time one decode token's matmuls (real model order)")
    ap.add_argument("--types", nargs="+", metavar="TYPE", help="time cpu_qgemv per type (e.g. Q4_K Q3_K Q2_K F16)")
    ap.add_argument("--shape", type=int, nargs=2, default=[4096, 1024], metavar=("OUT", "IN"),
                    help="the weight shape for --types")
    ap.add_argument("--levels", type=int, nargs="+", choices=[1, 2], help="activation levels for --types")
    ap.add_argument("--decode", action="store_true", help="also run benchmarks/bench_decode.py")
    ap.add_argument("--isa", choices=list(cpu_qgemv.isa_flags()),
                    help="build and use the kernels for this lower ISA (as NANOCHAT_CPU_ISA does)")
    args = ap.parse_args()
    if not cpu_qgemv.available():
        raise SystemExit("the int8 CPU kernels could not be built")
    if args.isa:
        cpu_qgemv.use_isa(args.isa)
    if args.step:
        bench_step(args.threads, args.repeats)
    elif args.types:
        bench_types(args.types, *args.shape, args.threads, args.rows, args.repeats, args.levels)
    else:
        bench(args.threads, args.rows, args.repeats)
    if args.decode:
        import runpy
        import sys
        from pathlib import Path

        for th in args.threads:
            sys.argv = ["bench_decode.py", f"--threads={th}"]
            runpy.run_path(str(Path(__file__).with_name("bench_decode.py")), run_name="__main__")


if __name__ == "__main__":
    main()
