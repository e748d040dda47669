"""CPU timings of quant_linear versus dense fp32 / bf16 F.linear.

    .venv/bin/python benchmarks/bench_quant_matmul.py [--threads 2] [--types Q4_1,Q8_0] [--n 1,64]
                                                      [--skip-table]

1. Per-call table for SmolLM2-135M shapes (one weight called repeatedly: cache-hot).
2. All linears of one SmolLM2-135M forward at N=1 (decode) and N=64 (prefill chunk): ~70 MB of
   weights streamed from memory, as in a real forward.
Weights are random GGML blocks (the kernels' speed does not depend on the values). Times are the
median and the minimum over the sampling window; on a shared machine trust the minimum, and with
2 threads any other load makes OpenMP stall for whole scheduler slices (spikes of milliseconds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.qweight import QuantWeight
from nanochat.kernels.quant_matmul import prepare_quant_weight, quant_linear

SHAPES = [(576, 1536), (1536, 576), (49152, 576)]  # [out, in]: SmolLM2-135M down, gate/up, lm_head


def timeit(fn, seconds: float) -> tuple[float, float]:
    for _ in range(3):
        fn()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6, min(times) * 1e6


def random_weight(t: int, out_f: int, in_f: int, rng) -> QuantWeight:
    elems, nbytes = gq.BLOCK_SIZES[t]
    raw = rng.integers(0, 256, size=(out_f * in_f // elems, nbytes), dtype=np.uint8)
    if elems > 1:  # every f16 scale field set to a small sane value (random bytes may be inf/nan)
        offsets = {gq.Q2_K: (80, 82), gq.Q3_K: (108,), gq.Q6_K: (208,)}.get(t, (0, 2))
        for off in offsets:
            raw[:, off:off + 2] = np.float16(0.01).reshape(1, 1).view(np.uint8)
    return QuantWeight(t, (out_f, in_f), torch.from_numpy(raw.reshape(out_f, -1)))


def model_step(threads_note: str, seconds: float, rng) -> None:
    """All linears of one SmolLM2-135M step (30 layers, fused q|k|v and gate|up, + the Q8_0 tied
    lm_head on the last row only). The ~70 MB of weights do not fit in cache, so unlike the per-call
    table above this streams them from memory as a real forward does."""
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    print(f"\nall linears of one SmolLM2-135M forward (Q4_1 layers, Q8_0 lm_head), {threads_note}")
    layers = [[random_weight(gq.Q4_1, o, i, rng) for o, i in shapes] for _ in range(30)]
    head_q = random_weight(gq.Q8_0, 49152, 576, rng)
    int4 = ([prepare_quant_weight(q, "cpu", torch.bfloat16) for q in layer] for layer in layers)
    int4 = [list(layer) for layer in int4]
    head = prepare_quant_weight(head_q, "cpu", torch.bfloat16)
    dense = [[gq.dequantize(q, torch.bfloat16) for q in layer] for layer in layers]
    head_dense = gq.dequantize(head_q, torch.bfloat16)
    prefill_copy = [[prepare_quant_weight(q, "cpu", torch.bfloat16, prefill_min_rows=8) for q in layer]
                    for layer in layers]
    for n in (1, 64):
        x576, x1536 = torch.randn(n, 576).bfloat16(), torch.randn(n, 1536).bfloat16()

        def run_q(pws):
            for layer in pws:
                for pw in layer:
                    quant_linear(x576 if pw.in_features == 576 else x1536, pw)
            quant_linear(x576[-1:], head)

        def run_dense():
            for layer in dense:
                for w in layer:
                    F.linear(x576 if w.shape[1] == 576 else x1536, w)
            F.linear(x576[-1:], head_dense)

        variants = [("int4 (weights stay 4-bit)", lambda: run_q(int4)),
                    ("dense bf16", run_dense)]
        if n > 1:
            variants.append(("int4 + bf16 prefill copy", lambda: run_q(prefill_copy)))
        for label, fn in variants:
            med, best = timeit(fn, seconds * 4)
            rate = n * 1e6 / best
            print(f"  N={n:<3} {label:<26} median {med / 1e3:7.2f} ms  min {best / 1e3:7.2f} ms"
                  f"  (<= {rate:,.0f} tok/s from linears alone)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K,Q3_K")
    ap.add_argument("--n", default="1,64")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--skip-table", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = {v: k for k, v in gq.TYPE_NAMES.items()}
    types = [names[s] for s in args.types.split(",")]
    ns = [int(s) for s in args.n.split(",")]
    rng = np.random.default_rng(0)
    print(f"torch {torch.__version__}, {args.threads} threads; us per call, median/min")
    if not args.skip_table:
        table(types, ns, args.seconds, rng)
    model_step(f"{args.threads} threads", args.seconds, rng)


def table(types, ns, seconds, rng) -> None:
    print(f"{'weight [out,in]':>16} {'N':>3} {'method':<22} {'median':>9} {'min':>9} {'MiB':>7}")
    for out_f, in_f in SHAPES:
        w32 = torch.randn(out_f, in_f) * 0.02
        w16 = w32.bfloat16()
        for n in ns:
            x32 = torch.randn(n, in_f)
            x16 = x32.bfloat16()
            rows = [("dense fp32", lambda: F.linear(x32, w32), w32.numel() * 4),
                    ("dense bf16", lambda: F.linear(x16, w16), w16.numel() * 2)]
            for t in types:
                if in_f % gq.BLOCK_SIZES[t][0]:
                    continue  # K-quants need in % 256 == 0 (576 is not: llama.cpp then uses other types)
                pw = prepare_quant_weight(random_weight(t, out_f, in_f, rng), "cpu", torch.bfloat16)
                tag = f"{gq.type_name(t)} {pw.backend}"
                rows.append((f"{tag} x=bf16", lambda pw=pw: quant_linear(x16, pw), pw.nbytes()))
                rows.append((f"{tag} x=fp32", lambda pw=pw: quant_linear(x32, pw), pw.nbytes()))
            for label, fn, nbytes in rows:
                med, best = timeit(fn, seconds)
                print(f"{f'{out_f}x{in_f}':>16} {n:>3} {label:<22} {med:>9.0f} {best:>9.0f} {nbytes / 2**20:>7.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
