"""Our logits and greedy tokens match transformers on tiny random Llama / Qwen2 / Qwen3 models."""

from __future__ import annotations

import pytest
import torch

from nanochat.engine import LLM, LLMEngine, SamplingParams

ARCHS = ["llama", "llama_tied", "qwen2", "qwen3", "llama3_rope"]
PROMPTS = [
    [5, 17, 42, 99, 3, 250, 7],
    [11, 12, 13],
    list(range(20, 61)),
    [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                      pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_prefill_and_decode(arch, tiny_models, hf_models):
    hf = hf_models(arch)
    engine = LLMEngine(str(tiny_models[arch]), dtype="float32", max_model_len=256, num_kvcache_blocks=64,
                       kv_cache_dtype="float32")   # fp32 KV: compared at fp32 tolerances
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    seqs = {rid: engine.requests[rid].seq for rid in rids}
    for step in range(5):
        chunks = engine.scheduler.schedule()
        logits = engine.runner.run(chunks).logits
        assert logits.shape[0] == len(PROMPTS)
        for row, c in enumerate(chunks):
            ids = torch.tensor([c.seq.token_ids])
            with torch.no_grad():
                ref = hf(ids).logits[0, -1].float()
            err = (logits[row] - ref).abs().max().item()
            assert err <= 1e-4, f"{arch} step {step} seq {row}: max abs err {err}"
        # advance with greedy tokens, as the engine would
        for row, c in enumerate(chunks):
            c.seq.num_computed_tokens = c.end
            c.seq.append_token(int(logits[row].argmax()))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(arch, tiny_models, hf_models):
    hf = hf_models(arch)
    llm = LLM(str(tiny_models[arch]), dtype="float32", max_model_len=256, kv_cache_dtype="float32")
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    batched = llm.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in batched] == expected
    one_by_one = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert one_by_one == expected
