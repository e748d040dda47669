"""What the q8 kernels' activation levels cost and buy: the basis of act_levels' default (two levels).

    .venv/bin/python benchmarks/act_levels.py [--model FILE.gguf] [--threads 2] [--types Q4_K,Q6_K,Q4_0]
                                              [--skip-accuracy] [--skip-timing]

1. Accuracy: teacher-forced decode over 400 tokens of this repository's README with act_levels 1 and
   2, each against the exact maths on the same weights (dequantize=True, fp32): mean and p99 KL
   divergence of the next-token distribution, top-1 agreement, and the largest logit error relative
   to the largest logit; then each one's greedy reply to the built-in model's own question.
2. Time: the linears of six Qwen3-0.6B layers (random GGML blocks, ~20-60 MB: streamed from memory,
   as in a forward) for 1 to 16 rows of x at one and at two levels: where two levels cost no more
   than one, the calls are memory-bound (decode).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_quant_matmul import random_weight  # noqa: E402

from nanochat.engine import SamplingParams  # noqa: E402
from nanochat.engine.llm_engine import LLMEngine  # noqa: E402
from nanochat.kernels import cpu_qgemv  # noqa: E402
from nanochat.kernels import gguf_quants as gq  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"


def teacher_forced_logits(model: str, tokens: int, **engine_kwargs) -> torch.Tensor:
    """Next-token logits at each position after the first 16 tokens of README.md, one decode step each."""
    eng = LLMEngine(model, dtype="float32", max_model_len=1024, kv_cache_dtype="float32", **engine_kwargs)
    ids = eng.tokenizer.encode(README.read_text()[:8000], add_special_tokens=False)[:tokens + 16]
    eng.add_request(ids[:16], SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True))
    out = []
    for nxt in ids[16:]:
        chunks = eng.scheduler.schedule()
        out.append(eng.runner.run(chunks).logits[0].float().clone())
        chunks[0].seq.num_computed_tokens = chunks[0].end
        chunks[0].seq.append_token(nxt)
    return torch.stack(out)


def accuracy(model: str, tokens: int) -> None:
    print(f"accuracy vs exact maths on the same weights: {Path(model).name}, {tokens} positions")
    ref = teacher_forced_logits(model, tokens, dequantize=True)
    log_ref = ref.log_softmax(-1)
    for levels in (1, 2):
        x = teacher_forced_logits(model, tokens, act_levels=levels)
        kl = (log_ref.exp() * (log_ref - x.log_softmax(-1))).sum(-1)
        top1 = (ref.argmax(-1) == x.argmax(-1)).float().mean().item()
        rel = (x - ref).abs().amax(-1) / ref.abs().amax(-1)
        print(f"  act_levels={levels} KL mean {kl.mean():.5f}  p99 {kl.quantile(0.99):.5f}  "
              f"top-1 {100 * top1:5.1f}%  max|dlogit|/max|logit| median {rel.median():.4f} max {rel.max():.4f}")


def answers(model: str, question: str) -> None:
    from nanochat.engine import LLM

    print(f"greedy replies to {question!r} (the default system prompt of the file's template):")
    for levels in (1, 2):
        llm = LLM(model, max_model_len=512, act_levels=levels)
        prompt = llm.engine.loaded.chat_template.render([{"role": "user", "content": question}],
                                                        add_generation_prompt=True)
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        text = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0].text
        print(f"  act_levels={levels}: {text!r}")


def timing(types: list[str], rows: list[int], repeats: int) -> None:
    rng = np.random.default_rng(0)
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * 6   # q|k|v, o, gate|up, down
    print(f"time of six Qwen3-0.6B layers' linears, {cpu_qgemv.simd_level()}, {cpu_qgemv.num_threads()} threads: "
          f"one level / two levels (best of {repeats})")
    for name in types:
        t = getattr(gq, name)
        weights = [cpu_qgemv.pack(random_weight(t, o, i, rng)) for o, i in shapes]
        cells = []
        for n in rows:
            xs = {k: torch.randn(n, k) for k in (1024, 2048, 3072)}
            best = {}
            for levels in (1, 2, 1, 2):          # interleaved: a slow phase of the machine hits both
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for w in weights:
                        cpu_qgemv.matmul(xs[w.in_features], w, levels=levels)
                    best[levels] = min(best.get(levels, 1e9), time.perf_counter() - t0)
            cells.append(f"{n}: {best[1] * 1e3:.1f}/{best[2] * 1e3:.1f} ms ({best[2] / best[1]:.2f}x)")
        print(f"  {name:<5} " + " | ".join(cells), flush=True)


def main() -> None:
    from nanochat.models.formats.catalog import embedded_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the built-in SmolLM2-135M Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q4_0")
    ap.add_argument("--rows", default="1,2,3,4,6,8,16")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)   # the kernels' default thread count
    if not args.skip_timing:
        timing(args.types.split(","), [int(n) for n in args.rows.split(",")], args.repeats)
    if not args.skip_accuracy:
        model = args.model or str(embedded_model_path())
        accuracy(model, args.tokens)
        answers(model, args.question)


if __name__ == "__main__":
    main()
