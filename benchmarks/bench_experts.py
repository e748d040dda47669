"""Host MoE expert throughput (kernels/moe_cpu.py) against the memory-bandwidth limit.

    .venv/bin/python benchmarks/bench_experts.py [--threads 2] [--type Q4_K] [--experts 256]
                                                 [--hidden 2048] [--inter 512] [--top-k 8]
                                                 [--batches 1,8,64,512] [--seconds 3]
                                                 [--isa native|avx2|scalar] [--act-levels 1|2]

One synthetic MoE layer shaped like Qwen3.6-35B-A3B (256 experts, hidden 2048, expert dim 512, top-8)
with random GGML blocks (the kernels' speed does not depend on the values): ~450 MB of Q4_K, far
beyond the caches, and every call draws fresh random routing, so the selected experts stream from
DRAM as in real decoding.

- Decode (batch 1): bytes of expert weights read per token = top-k x (gate + up + down) bytes of one
  expert; achieved GB/s = those bytes / time per token, compared with the bandwidth limit measured
  here with the same threads: a large read-only reduction (torch sum over 1 GiB of float32) and a
  large copy (bytes copied per second; the copy moves twice that).
- Batches > 1 (prefill chunks): tokens per second; distinct experts touched per call are reported,
  since with many tokens almost every expert is read once per call and the kernel turns compute-bound.
Times are medians over the sampling window (minimum in brackets); on a shared machine trust the minimum.
--isa builds and uses the kernels for a lower ISA (cpu_qgemv.use_isa); --act-levels sets the activation
levels (KernelOptions.act_levels, default 2).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.moe_cpu import HostExperts, StackedWeight
from nanochat.kernels.options import KernelOptions

from bench_quant_matmul import timeit   # beside this script

_F16_FIELDS = {gq.Q4_0: (0,), gq.Q5_0: (0,), gq.Q8_0: (0,), gq.Q2_K: (80, 82), gq.Q3_K: (108,), gq.Q4_K: (0, 2),
               gq.Q5_K: (0, 2), gq.Q6_K: (208,)}


def random_stack(t: int, experts: int, out: int, inp: int, rng: np.random.Generator) -> StackedWeight:
    """Random blocks with sane f16 scales (tests/kquant_pack.py does the same for test fixtures)."""
    elems, nbytes = gq.BLOCK_SIZES[t]
    blocks = rng.integers(0, 256, size=(experts * out * inp // elems, nbytes), dtype=np.uint8)
    if t == gq.MXFP4:   # an E8M0 scale byte: 2^-11 .. 2^-6
        blocks[:, 0] = rng.integers(117, 123, blocks.shape[0], dtype=np.uint8)
    for off in () if t == gq.MXFP4 else _F16_FIELDS[t]:
        scales = rng.uniform(1e-3, 0.05, blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    data = torch.from_numpy(blocks.reshape(experts, out, inp // elems * nbytes))
    return StackedWeight(t, (experts, out, inp), data)


def timed(fn, seconds: float) -> tuple[float, float]:
    """(median, minimum) seconds per call."""
    med, best = timeit(fn, seconds)
    return med / 1e6, best / 1e6


def bandwidth(threads: int, seconds: float) -> dict[str, float]:
    torch.set_num_threads(threads)
    src = torch.ones(1 << 28)                 # 1 GiB of float32
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    read_med, read_min = timed(lambda: src.sum(), seconds)
    copy_med, copy_min = timed(lambda: dst.copy_(src), seconds)
    return {"read": nbytes / read_min / 1e9, "read_median": nbytes / read_med / 1e9,
            "copy": nbytes / copy_min / 1e9, "copy_median": nbytes / copy_med / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--type", default="Q4_K", choices=[gq.type_name(t) for t in (*_F16_FIELDS, gq.MXFP4)])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches", default="1,8,64,512")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--isa", default="native", choices=["native", *cpu_qgemv.ISA_FLAGS])
    ap.add_argument("--act-levels", type=int, choices=[1, 2])
    args = ap.parse_args()

    if cpu_qgemv.extension() is None:
        raise SystemExit("the CPU kernels could not be built (g++ and ninja needed)")
    if args.isa != "native":
        cpu_qgemv.use_isa(args.isa)
    options = KernelOptions(act_levels=args.act_levels or cpu_qgemv.DEFAULT_LEVELS, expert_threads=args.threads)
    t = next(t for t in (*_F16_FIELDS, gq.MXFP4) if gq.type_name(t) == args.type)
    rng = np.random.default_rng(0)
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    gate, up, down = random_stack(t, e, i, h, rng), random_stack(t, e, i, h, rng), random_stack(t, e, h, i, rng)
    host = HostExperts(gate, up, down, options)
    per_expert = host.nbytes_per_expert()
    print(f"layer: {e} experts x (gate {i}x{h} + up {i}x{h} + down {h}x{i}) {args.type}, top-{k}: "
          f"{e * per_expert / 1e6:.0f} MB, {per_expert / 1e6:.2f} MB per expert; "
          f"{args.threads} threads; kernels {cpu_qgemv.simd_level()}, "
          f"{options.act_levels}-level activations")

    bw = bandwidth(args.threads, args.seconds)
    print(f"bandwidth ({args.threads} threads): read-only sum {bw['read']:.1f} GB/s "
          f"(median {bw['read_median']:.1f}), copy {bw['copy']:.1f} GB/s copied (median {bw['copy_median']:.1f}; "
          f"2x that moved)")

    gen = torch.Generator().manual_seed(1)
    for n in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(n, h, generator=gen)
        weights = torch.rand(n, k, generator=gen)
        routings = [torch.rand(n, e, generator=gen).topk(k).indices for _ in range(16)]
        it = iter(range(1 << 62))
        med, best = timed(lambda: host(x, routings[next(it) % len(routings)], weights), args.seconds)
        distinct = statistics.mean(len(r.unique()) for r in routings)
        if n == 1:
            read = k * per_expert
            print(f"decode  batch 1: {med * 1e3:.2f} ms/token (min {best * 1e3:.2f}), {1 / med:.0f} tok/s; "
                  f"{read / 1e6:.1f} MB of experts per token -> {read / med / 1e9:.1f} GB/s "
                  f"(min-time {read / best / 1e9:.1f}) = {read / best / 1e9 / bw['read']:.0%} of the read "
                  f"bandwidth, {read / best / 1e9 / bw['copy']:.0%} of the copy rate")
        else:
            read = distinct * per_expert
            print(f"prefill batch {n}: {med * 1e3:.2f} ms/call (min {best * 1e3:.2f}), {n / med:.0f} tok/s; "
                  f"{distinct:.0f} distinct experts/call, {read / best / 1e9:.1f} GB/s of weights")


if __name__ == "__main__":
    main()
