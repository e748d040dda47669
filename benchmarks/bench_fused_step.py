"""The fused CPU step (kernels/cpu_decoder.py) alone, on a random SmolLM2-135M-shaped stack (30 layers,
hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536), per build of the library.

    python benchmarks/bench_fused_step.py [--builds native avx2] [--type Q4_1] [--kv float16 float32]
                                          [--prompt 2048] [--chunk 512] [--rows 1 3 8] [--threads 2]
                                          [--repeats 3] [--segments]

Prefill: a `prompt`-token prompt in chunks of `chunk` rows (one step each; later chunks attend over the
earlier ones' cached keys), ms per chunk and their mean. Decode: one sequence, `rows` rows per step (1: plain
decoding; more: a speculative verification step), ms per step after the prompt (its attention reads `prompt`
keys). Each figure is the minimum over `repeats` runs (the machine may be shared). "avx2" is the library
compiled with -mavx2 -mfma -mf16c (the AVX2 code paths, as on most laptops) beside the native build.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.cpu_decoder import DecoderDims, DecoderLayer, FusedDecoder
from nanochat.kernels.qweight import QuantWeight

BUILD_FLAGS = {"avx2": ["-mavx2", "-mfma", "-mf16c"], "scalar": []}


def random_weight(t: int, out_f: int, in_f: int, rng) -> cpu_qgemv.PackedWeight:
    """Random blocks with f16 scales (and mins) 0.01: the bit patterns do not change the timing."""
    elems, nbytes = gq.BLOCK_SIZES[t]
    raw = rng.integers(0, 256, (out_f * in_f // elems, nbytes), dtype=np.uint8)
    scale = np.full(raw.shape[0], 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    raw[:, 0:2] = scale
    if t in (gq.Q4_1, gq.Q5_1):
        raw[:, 2:4] = scale
    return cpu_qgemv.pack(QuantWeight(t, (out_f, in_f), torch.from_numpy(raw.reshape(out_f, -1))))


def build_stack(t: int, kv_dtype: torch.dtype, max_tokens: int, block_size: int = 16, segments: bool = False):
    """The stack; segments: q, k, v and gate, up as separate weights (as GGUF files have them)."""
    dims = DecoderDims(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, rotary_dim=64,
                       block_size=block_size, eps=1e-5)
    rng = np.random.default_rng(0)
    blocks = -(-max_tokens // block_size)
    q_rows, kv_rows = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    qkv_split = [q_rows, kv_rows, kv_rows] if segments else [q_rows + 2 * kv_rows]
    gate_up_split = [dims.intermediate] * 2 if segments else [2 * dims.intermediate]
    layers = []
    for _ in range(dims.layers):
        cache = (blocks, block_size, dims.kv_heads, dims.head_dim)
        layers.append(DecoderLayer(
            input_norm=torch.ones(dims.hidden), post_norm=torch.ones(dims.hidden),
            qkv=[random_weight(t, rows, dims.hidden, rng) for rows in qkv_split],
            o=random_weight(t, dims.hidden, dims.hidden, rng),
            gate_up=[random_weight(t, rows, dims.hidden, rng) for rows in gate_up_split],
            down=random_weight(t, dims.hidden, dims.intermediate, rng),
            k_cache=torch.zeros(cache, dtype=kv_dtype), v_cache=torch.zeros(cache, dtype=kv_dtype)))
    freqs = torch.outer(torch.arange(max_tokens, dtype=torch.float32),
                        1.0 / 10000.0 ** (torch.arange(dims.head_dim // 2) / (dims.head_dim // 2)))
    return dims, layers, freqs.cos(), freqs.sin(), torch.ones(dims.hidden)


def step(dec: FusedDecoder, lo: int, hi: int, threads: int, x: torch.Tensor) -> float:
    """Rows for positions [lo, hi) of one sequence whose blocks are 0, 1, 2, ... in order; seconds."""
    bs = dec.dims.block_size
    positions = torch.arange(lo, hi)
    table = torch.arange(-(-hi // bs), dtype=torch.int32).unsqueeze(0)
    cu = torch.tensor([0, hi - lo], dtype=torch.int32)
    lens = torch.tensor([hi], dtype=torch.int32)
    x = x[:hi - lo].clone()
    t0 = time.perf_counter()
    dec.forward(x, positions, positions, cu, table, lens, threads=threads)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", nargs="+", default=["native", "avx2"], choices=["native", *BUILD_FLAGS])
    ap.add_argument("--type", default="Q4_1", help="ggml type of every linear (Q4_1, Q8_0, ...)")
    ap.add_argument("--kv", nargs="+", default=["float16", "float32"], help="KV cache dtypes")
    ap.add_argument("--segments", action="store_true", help="q, k, v and gate, up as separate weights")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--decode", type=int, default=16, help="decode steps per run")
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="rows per decode step (2-9: verification)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    qtype = getattr(gq, args.type)
    x = torch.randn(args.chunk, 576, generator=torch.Generator().manual_seed(0))
    for kv in args.kv:
        stack = build_stack(qtype, getattr(torch, kv), args.prompt + args.decode * max(args.rows),
                            segments=args.segments)
        for build in args.builds:
            lib = cpu_qgemv.extension() if build == "native" else cpu_qgemv.build_variant(build, BUILD_FLAGS[build])
            dec = FusedDecoder(*stack, lib=lib)
            chunks = [(lo, min(args.prompt, lo + args.chunk)) for lo in range(0, args.prompt, args.chunk)]
            prefill, decode = [float("inf")] * len(chunks), {r: float("inf") for r in args.rows}
            for _ in range(args.repeats):
                prefill = [min(a, step(dec, lo, hi, args.threads, x)) for a, (lo, hi) in zip(prefill, chunks)]
                for r in args.rows:
                    starts = range(args.prompt, args.prompt + args.decode * r, r)
                    decode[r] = min([decode[r]] + [step(dec, p, p + r, args.threads, x) for p in starts])
            contexts = ", ".join(str(hi) for _, hi in chunks)
            steps = ", ".join(f"{r} rows {1e3 * t:.2f}" for r, t in decode.items())
            print(f"{build:6s} {args.type} kv {kv}: prefill ms per chunk (context {contexts}):"
                  f" {', '.join(f'{1e3 * t:.0f}' for t in prefill)}, mean {1e3 * sum(prefill) / len(prefill):.0f};"
                  f" decode ms per step at context {args.prompt}: {steps}", flush=True)


if __name__ == "__main__":
    main()
