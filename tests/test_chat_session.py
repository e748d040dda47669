"""Chat sessions on the engine: each turn prefills only its new message; canonical history; eviction."""

from __future__ import annotations

import re

from nanochat.engine import LLMEngine, SamplingParams
from nanochat.engine.serve.session import ChatSession

ARCH = "qwen3"
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
USER_TURNS = ["hello there, how are you?", "what is the capital of France?", "def add(a, b): return a + b",
              "tell me more"]


def make_engine(tiny_models, **kw):
    kw.setdefault("kvcache_block_size", 16)
    return LLMEngine(str(tiny_models[ARCH]), dtype="float32", max_model_len=512, **kw)


def run_turn(engine: LLMEngine, session: ChatSession, user: str, sp=SP, template_kwargs: dict | None = None):
    ids = session.prepare_turn(user, template_kwargs)
    rid = engine.add_request(ids, sp, session_id=session.session_id)
    text, gen, final = [], [], None
    while final is None:
        for ev in engine.step():
            if ev.request_id == rid:
                text.append(ev.text)
                gen.append(ev.token_id)
                final = ev if ev.finished else None
    session.complete_turn("".join(text), gen)
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
            # everything computed last turn (all but its final sampled token): its whole blocks and the
            # partly filled last one, which the session pinned too
            assert stats.cached_tokens == prev_len - 1
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
    # (the "\n" after the last <|im_end|> is added when the next turn starts). A reply cut by its token
    # limit mid-character keeps those bytes in the ids (the KV holds them) but not in its text (one
    # U+FFFD before each reply's end-of-turn, at most).
    cut = re.compile("\ufffd(?=<\\|im_end\\|>)")
    assert cut.sub("", tok.decode(session.token_ids) + "\n", count=2) == rendered


def test_qwen3_template_strips_think_but_history_stays_canonical(tiny_models):
    from test_chat_template import QWEN3_TEMPLATE   # the real Qwen3 chat template text

    from nanochat.models.text.chat_template import ChatTemplate

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


def test_releasing_a_session_frees_its_blocks(tiny_models):
    engine = make_engine(tiny_models)
    session = ChatSession(engine.tokenizer, engine.loaded.chat_template, system_prompt="sys")
    run_turn(engine, session, "hello")
    assert engine.block_manager.stats().used > 0
    engine.release_session(session.session_id)
    assert engine.block_manager.stats().used == 0


def test_a_session_from_its_transcript_continues_like_the_original(tiny_models):
    """from_history (a model switch, a rebuilt session) renders the transcript to the same ids the
    turns produced, so the next turn's prompt is identical; a fork shares the history."""
    engine = make_engine(tiny_models)
    tok, template = engine.tokenizer, engine.loaded.chat_template
    session = ChatSession(tok, template, system_prompt="Be brief.")
    session.prepare_turn("first question")   # a reply whose ids are its text's own encoding
    session.complete_turn("answer one", tok.encode("answer one", add_special_tokens=False))
    rebuilt = ChatSession.from_history(tok, template, "Be brief.", session.transcript_messages)
    fork = session.fork()
    assert rebuilt.token_ids == session.token_ids == fork.token_ids
    assert rebuilt.prepare_turn("second") == session.prepare_turn("second") == fork.prepare_turn("second")
    session.abandon_turn()
    assert session.token_ids == fork.token_ids[:len(session.token_ids)] and not session.in_turn


def test_template_variables_reach_each_turns_prompt_and_earlier_turns_keep_their_ids(tiny_models):
    from test_chat_template import QWEN3_TEMPLATE

    from nanochat.models.text.chat_template import ChatTemplate

    engine = make_engine(tiny_models)
    tok = engine.tokenizer
    template = ChatTemplate(QWEN3_TEMPLATE, eos_token="<|im_end|>")
    session = ChatSession(tok, template)
    off = {"enable_thinking": False}
    ids1 = session.prepare_turn("question one", off)
    assert tok.decode(ids1).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # thinking off
    session.complete_turn("answer one", tok.encode("answer one", add_special_tokens=False))
    history = list(session.token_ids)
    ids2 = session.prepare_turn("question two", {"enable_thinking": True})
    assert ids2[:len(history)] == history and tok.decode(ids2).endswith("<|im_start|>assistant\n")
    # a session rebuilt from its transcript renders its turns with the variables given
    rebuilt = ChatSession.from_history(tok, template, None, session.transcript_messages, template_kwargs=off)
    assert rebuilt.token_ids == history
