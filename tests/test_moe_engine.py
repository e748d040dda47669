"""MoE and hybrid models through the whole engine: batching, preemption, chunked prefill, and chat
sessions that resume from their resident KV + recurrent state (no transcript replay)."""

from __future__ import annotations

import pytest
import torch

from conftest import build_tokenizer
from nanochat.engine import LLM, LLMEngine, SamplingParams
from nanochat.engine.serve.session import ChatSession
from test_moe_models import VOCAB, _build

ARCHS = ["qwen3_moe", "qwen3_next", "qwen3_5_moe"]
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(20, 61)), [11, 12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_engine")
    tok = build_tokenizer(VOCAB)
    return {arch: (root / arch, _build(arch, root / arch, tok)) for arch in ARCHS}


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_generation_matches_transformers(arch, models):
    folder, hf = models[arch]
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    base = dict(dtype="float32", max_model_len=256, kvcache_block_size=16)
    assert [r.token_ids for r in LLM(str(folder), **base).generate(PROMPTS, GREEDY)] == expected
    # preemption (tiny KV budget: three 14-token prompts each grow into a second block) ...
    growing = [list(range(30 + i, 44 + i)) for i in range(3)]
    small = LLM(str(folder), **base, num_kvcache_blocks=4)
    assert [r.token_ids for r in small.generate(growing, GREEDY)] == [hf_greedy(hf, p, 8) for p in growing]
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.block_manager.check_invariants()
    # ... and chunked prefill change nothing
    chunked = LLM(str(folder), **base, max_num_batched_tokens=8)
    assert [r.token_ids for r in chunked.generate(PROMPTS, GREEDY)] == expected


def run_turn(engine, session, user):
    ids = session.prepare_turn(user)
    rid = engine.add_request(ids, GREEDY, session_id=session.session_id)
    gen, final = [], None
    while final is None:
        for ev in engine.step():
            if ev.request_id == rid:
                gen.append(ev.token_id)
                final = ev if ev.finished else None
    session.complete_turn("", gen)
    return ids, gen, final.stats


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_chat_resumes_its_state_each_turn(arch, models):
    folder, hf = models[arch]
    engine = LLMEngine(str(folder), dtype="float32", max_model_len=512, kvcache_block_size=16)
    assert engine.runner.is_hybrid
    session = ChatSession(engine.tokenizer, engine.loaded.chat_template, system_prompt="sys")
    prev_computed = 0
    for k, user in enumerate(["hello there", "what is two plus two?", "and three?"]):
        ids, gen, stats = run_turn(engine, session, user)
        # resumes exactly where the last turn stopped: all but its final sampled token
        assert stats.cached_tokens == prev_computed
        assert gen == hf_greedy(hf, ids, GREEDY.max_tokens)    # identical to a full replay
        prev_computed = len(ids) + len(gen) - 1
    assert engine.block_manager.stats().hit_tokens > 0
    engine.release_session(session.session_id)
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == len(bm.blocks) and len(bm.free_slots) == bm.num_state_slots


def test_hybrid_session_evicted_under_pressure_reprefills_correctly(models):
    folder, hf = models["qwen3_next"]
    engine = LLMEngine(str(folder), dtype="float32", max_model_len=256, kvcache_block_size=16,
                       num_kvcache_blocks=8, max_num_seqs=2)
    sessions = [ChatSession(engine.tokenizer, engine.loaded.chat_template, session_id=f"h{i}") for i in range(4)]
    for turn in ["first turn here", "second"]:
        for s in sessions:
            ids, gen, _ = run_turn(engine, s, f"{turn} {s.session_id}")
            assert gen == hf_greedy(hf, ids, GREEDY.max_tokens)
    bm = engine.block_manager
    bm.check_invariants()
    assert len(bm.sessions) < 4       # slots (2 * max_num_seqs = 4) or blocks forced evictions
    for s in sessions:
        engine.release_session(s.session_id)
    assert bm.num_free_blocks == 8 and len(bm.free_slots) == bm.num_state_slots


def test_hybrid_branches_reprefill_and_answer_as_from_scratch(models):
    """A branch of a hybrid chat (an edit at turn k) cannot resume another sequence's recurrent state
    from shared blocks: it is prefilled whole, stated by its cached count of 0, and answers as a
    full replay does; the branch it came from still resumes its own state."""
    from nanochat.engine.serve.client import EngineClient

    folder, hf = models["qwen3_next"]
    client = EngineClient(in_process=True)
    client.load_model(str(folder), dtype="float32", max_model_len=512, kvcache_block_size=16)
    try:
        session = client.open_session("sys")
        for user in ["hello there", "what is two plus two?"]:
            client.submit_turn(session, user, GREEDY).result(30)
        branch = client.branch_session(session, 1)
        assert branch.token_ids == session.token_ids[:session.turn_starts[1]]
        reply = client.submit_turn(branch, "and three?", GREEDY).result(30)
        prompt = branch.token_ids[:reply.stats.prompt_tokens]
        assert reply.stats.cached_tokens == 0 and reply.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
        held = len(session.token_ids)
        again = client.submit_turn(session, "and four?", GREEDY).result(30)
        # its own state, resumed: all but the last sampled token and the end-of-turn token closing it
        assert again.stats.cached_tokens == held - 2
        ids = session.token_ids[:again.stats.prompt_tokens]
        assert again.token_ids == hf_greedy(hf, ids, GREEDY.max_tokens)
    finally:
        client.shutdown()
