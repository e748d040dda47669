"""What the 16-bit KV cache costs in accuracy: logits with a float16 (or bfloat16) cache against the
float32 cache, teacher-forced on the fp32 run's greedy tokens so every step sees the same context.

    .venv/bin/python benchmarks/kv_dtype_accuracy.py [--model FILE.gguf] [--tokens 128] [--dtype float16]

Prints, per prompt: the largest |logit difference| relative to the largest |logit|, the mean of that
ratio over steps, and how many greedy tokens agree.
"""

from __future__ import annotations

import argparse

import torch

PROMPTS = ["Write a short story about a cloud.", "Explain how a CPU cache works, step by step.",
           "List ten fruits and one fact about each."]


def step_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits of every position of `ids` after the prompt, from one prefill (the KV cache is written
    and read back in the cache's dtype)."""
    from nanochat.engine import SamplingParams
    model = llm.engine.runner.model
    captured, orig = [], model.compute_logits
    model.compute_logits = lambda h: captured.append(orig(h)) or captured[-1]
    try:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    finally:
        del model.compute_logits
    return captured[-1]


def main() -> None:
    from nanochat.engine import LLM, SamplingParams
    from nanochat.models.formats.catalog import resolve_default_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = ap.parse_args()
    model = resolve_default_model(args.model)
    ref = LLM(model, kv_cache_dtype="float32", enable_prefix_caching=False)
    low = LLM(model, kv_cache_dtype=args.dtype, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    print(f"{model}: {args.dtype} KV vs float32 KV, {args.tokens} greedy tokens per prompt")
    for prompt in PROMPTS:
        ids = ref.tokenizer.encode(ref.engine.loaded.chat_template.render(
            [{"role": "user", "content": prompt}], add_generation_prompt=True))
        out = ref.generate([ids], greedy)[0].token_ids
        worst, ratios, agree = 0.0, [], 0
        for k in range(len(out)):   # teacher-forced: both caches see the fp32 run's tokens
            context = ids + out[:k]
            a, b = step_logits(low, context)[-1], step_logits(ref, context)[-1]
            ratio = ((a - b).abs().max() / b.abs().max()).item()
            worst, agree = max(worst, ratio), agree + int(a.argmax() == b.argmax())
            ratios.append(ratio)
        print(f"  {prompt[:40]!r:44} max {worst:.2e}  mean {sum(ratios) / len(ratios):.2e}  "
              f"top-1 agree {agree}/{len(out)}")


if __name__ == "__main__":
    main()
