"""Multi-turn chat: each turn prefills only its new message; eviction, cancellation, threads."""

from __future__ import annotations

import threading

import pytest

from nanochat.engine import LLMEngine, SamplingParams
from nanochat.engine.chat import ChatSession, send, turn_stats_from_event
from nanochat.engine.engine_thread import EngineThread

ARCH = "qwen3"
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
USER_TURNS = ["hello there, how are you?", "what is the capital of France?", "def add(a, b): return a + b",
              "tell me more"]


def make_engine(tiny_models, **kw):
    kw.setdefault("kvcache_block_size", 16)
    return LLMEngine(str(tiny_models[ARCH]), dtype="float32", max_model_len=512, **kw)


def run_turn(engine: LLMEngine, session: ChatSession, user: str, sp=SP):
    ids = session.prepare_turn(user)
    rid = engine.add_request(ids, sp, session_id=session.session_id)
    text, gen, final = [], [], None
    while final is None:
        for ev in engine.step():
            if ev.request_id == rid:
                text.append(ev.text)
                gen.append(ev.token_id)
                final = ev if ev.finished else None
    session.complete_turn("".join(text), gen, turn_stats_from_event(final))
    return ids, gen, final


def test_each_turn_prefills_only_the_new_message(tiny_models):
    engine = make_engine(tiny_models)
    fresh = make_engine(tiny_models, enable_prefix_caching=False)
    session = ChatSession(engine.tokenizer, engine.loaded.chat_template, system_prompt="Be brief.")
    bs = engine.config.kvcache_block_size
    prev_len = 0
    for k, user in enumerate(USER_TURNS):
        history_before = list(session.token_ids)
        ids, gen, final = run_turn(engine, session, user)
        assert ids[:len(history_before)] == history_before          # history never re-rendered
        stats = final.stats
        if k == 0:
            assert stats.cached_tokens == 0
        else:
            # everything computed last turn (all but its final sampled token), up to block alignment
            assert stats.cached_tokens == ((prev_len - 1) // bs) * bs
            assert stats.cached_tokens >= len(history_before) - bs - 1
            assert stats.prompt_tokens - stats.cached_tokens < len(ids) // 2 or k == 1
        # the same ids on a fresh engine (full replay) give exactly the same greedy tokens
        rid = fresh.add_request(ids, SP)
        out = []
        while fresh.has_unfinished():
            out += [ev.token_id for ev in fresh.step() if ev.request_id == rid]
        assert out == gen
        prev_len = len(ids) + len(gen)
    engine.release_session(session.session_id)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


def test_session_history_is_canonical_with_the_template(tiny_models):
    engine = make_engine(tiny_models)
    tok, template = engine.tokenizer, engine.loaded.chat_template
    session = ChatSession(tok, template)
    run_turn(engine, session, "first question")
    run_turn(engine, session, "second question")
    # Re-rendering the whole transcript with the template gives the same text as the ids decode to,
    # since ChatML does not rewrite history (generated text is what we decoded).
    rendered = template.render(session.transcript(), add_generation_prompt=False)
    # (the "\n" after the last <|im_end|> is added when the next turn starts)
    assert tok.decode(session.token_ids) + "\n" == rendered


def test_qwen3_template_strips_think_but_history_stays_canonical(tiny_models):
    from test_chat_template import QWEN3_TEMPLATE   # the real Qwen3 chat template text

    from nanochat.models.chat_template import ChatTemplate

    engine = make_engine(tiny_models)
    tok = engine.tokenizer
    template = ChatTemplate(QWEN3_TEMPLATE, eos_token="<|im_end|>")
    session = ChatSession(tok, template)
    ids1 = session.prepare_turn("question one")
    reply = "<think>\nsome reasoning\n</think>\n\nanswer one"
    gen = tok.encode(reply, add_special_tokens=False) + [tok.token_to_id("<|im_end|>")]
    session.complete_turn("answer one", gen)
    ids2 = session.prepare_turn("question two")
    # The thinking stays in our token history (it is what the KV cache holds) ...
    assert ids2[:len(ids1) + len(gen)] == ids1 + gen
    assert "some reasoning" in tok.decode(ids2)
    # ... although the template, re-rendering, would strip it:
    full = template.render([{"role": "user", "content": "question one"},
                            {"role": "assistant", "content": reply},
                            {"role": "user", "content": "question two"}], add_generation_prompt=True)
    assert "some reasoning" not in full
    # and the new-message part is exactly what the template renders after the assistant turn
    assert tok.decode(ids2[len(ids1) + len(gen):]) == full[full.index("answer one<|im_end|>") + len("answer one<|im_end|>"):]


def test_eviction_under_pressure_keeps_outputs_identical(tiny_models):
    def chat_all(engine):
        sessions = [ChatSession(engine.tokenizer, engine.loaded.chat_template, session_id=f"s{i}")
                    for i in range(5)]
        outs = []
        for turn in USER_TURNS[:3]:
            for s in sessions:
                outs.append(run_turn(engine, s, f"{turn} ({s.session_id})")[1])
        return outs, sessions

    big = make_engine(tiny_models)
    small = make_engine(tiny_models, num_kvcache_blocks=12)
    ref, _ = chat_all(big)
    got, sessions = chat_all(small)
    assert got == ref
    bm = small.block_manager
    bm.check_invariants()
    assert len(bm.sessions) < 5          # some sessions were evicted
    for s in sessions:
        small.release_session(s.session_id)
    assert bm.num_free_blocks == 12


def test_clear_releases_the_session(tiny_models):
    engine = make_engine(tiny_models)
    session = ChatSession(engine.tokenizer, engine.loaded.chat_template, system_prompt="sys")
    run_turn(engine, session, "hello")
    assert engine.block_manager.stats().used > 0
    session.clear()
    engine.release_session(session.session_id)
    assert engine.block_manager.stats().used == 0
    assert session.system_prompt == "sys" and session.token_ids == []


@pytest.fixture()
def engine_thread(tiny_models):
    et = EngineThread(str(tiny_models[ARCH]), dtype="float32", max_model_len=512, kvcache_block_size=16)
    yield et
    et.shutdown()


def test_cancel_mid_generation_frees_blocks(engine_thread):
    et = engine_thread
    started = threading.Event()
    handle = et.submit(list(range(40)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                       on_event=lambda ev: started.set())
    assert started.wait(30)
    handle.cancel()
    text, ids, final = handle.result(timeout=30)
    assert final.finish_reason == "abort" and 0 < len(ids) < 400
    used = et.call(lambda engine: engine.block_manager.stats().used).result(10)
    assert used == 0


def test_concurrent_sessions_from_threads_batch_together(engine_thread, tiny_models):
    et = engine_thread
    tok = et.engine.tokenizer
    template = et.engine.loaded.chat_template
    sessions = [ChatSession(tok, template, session_id=f"t{i}") for i in range(4)]
    results, errors, max_running = {}, [], []
    et.add_stats_listener(lambda s: max_running.append(s.running))

    def worker(s: ChatSession):
        try:
            for turn in USER_TURNS[:2]:
                handle = send(s, et, turn, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                assert handle.done.wait(60)
            results[s.session_id] = s.messages[-1].stats
        except Exception as e:   # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert len(results) == 4
    assert all(st.cached_tokens > 0 for st in results.values())     # second turns hit their own KV
    assert all(len(s.messages) == 4 for s in sessions)


def test_failed_submit_reports_error_and_history_rolls_back(engine_thread):
    et = engine_thread
    session = ChatSession(et.engine.tokenizer, et.engine.loaded.chat_template)
    handle = send(session, et, "x " * 600)         # longer than max_model_len
    text, ids, final = handle.result(timeout=30)
    assert final.finish_reason == "error" and "max_model_len" in final.error
    assert session.messages == [] and session.token_ids == []


def test_load_model_failure_keeps_the_previous_model(engine_thread, tmp_path):
    et = engine_thread
    before = et.engine
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(Exception):
        et.load_model(str(bad)).result(30)
    assert et.engine is before
    _, ids, final = et.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)).result(30)
    assert len(ids) == 3
