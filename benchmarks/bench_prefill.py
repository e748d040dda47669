"""Prompt processing time on the CPU: the fused forward vs the module-by-module forward, alternating in
one process (the same engine, the same weights; fresh token ids every run so no prefix cache helps).

    python benchmarks/bench_prefill.py [--tokens 512 1024 2048] [--repeats 2] [--threads 2] [--model F.gguf]

Prints seconds to the first token per run and the ratio of the medians (module / fused: above 1 the
fused path is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", help="a model file or folder (default: the built-in SmolLM2-135M Q4_1)")
    args = ap.parse_args()
    from nanochat.engine import LLMEngine, SamplingParams
    from nanochat.models.formats.catalog import resolve_default_model

    args.model = args.model or resolve_default_model(None)

    longest = max(args.tokens)
    eng = LLMEngine(args.model, max_model_len=longest + 16, max_num_batched_tokens=longest, cpu_threads=args.threads)
    fused = eng.runner.model.fused
    if fused.why_not is not None:
        sys.exit(f"this model has no fused CPU path: {fused.why_not}")
    vocab = eng.model_config.vocab_size
    next_id = [100]

    def ttft(n: int) -> float:
        ids = [(next_id[0] + i) % vocab for i in range(n)]
        next_id[0] += n
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t0

    ttft(32)   # warm-up
    for n in args.tokens:
        runs = {"fused": [], "module": []}
        for _ in range(args.repeats):
            for mode in runs:
                fused.why_not = None if mode == "fused" else "benchmark: module path"
                runs[mode].append(ttft(n))
        fused.why_not = None
        f, m = statistics.median(runs["fused"]), statistics.median(runs["module"])
        print(f"{n:5d} tokens: fused {', '.join(f'{t:.2f}' for t in runs['fused'])} s, module "
              f"{', '.join(f'{t:.2f}' for t in runs['module'])} s, module / fused {m / f:.2f}x")


if __name__ == "__main__":
    main()
