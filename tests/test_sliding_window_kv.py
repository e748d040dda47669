"""Sliding-window models give back the KV blocks no later query reads (engine/block_manager.py): a long
sequence or chat holds a bounded number of blocks, sessions resume their last turn, and every block comes back."""

from __future__ import annotations

import random

from nanochat.engine import SamplingParams
from nanochat.engine.block_manager import DROPPED, BlockManager
from nanochat.engine.llm_engine import kv_window
from nanochat.engine.sequence import Sequence

SP = SamplingParams(max_tokens=8)


def live(seq: Sequence) -> list[int]:
    return [b for b in seq.block_table if b != DROPPED]


def test_the_window_the_engine_uses():
    from types import SimpleNamespace as NS
    assert kv_window(NS(layer_windows=(16, 16, 16))) == 16
    assert kv_window(NS(layer_windows=(8, 16))) == 16            # the widest window decides
    assert kv_window(NS(layer_windows=(8, 8, 0))) == 0           # one full-attention layer reads everything
    assert kv_window(NS(layer_windows=())) == 0 and kv_window(NS()) == 0


def test_a_long_sequence_holds_only_the_blocks_its_window_reads():
    window, bs, chunk = 10, 4, 3
    bm = BlockManager(num_blocks=12, block_size=bs, window=window)
    seq = Sequence(list(range(7)), SP)
    assert bm.allocate(seq)
    most = 0
    while len(seq) < 400:                     # far more tokens than 12 blocks hold
        n = min(chunk, len(seq) - seq.num_computed_tokens) or 1
        if seq.num_computed_tokens == len(seq):
            seq.append_token(len(seq) % 50)
        assert bm.ensure_slots(seq, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        bm.commit_computed(seq)
        bm.drop_outside_window(seq)
        first_key = seq.num_computed_tokens - window + 1
        # every key a later query reads is still there; nothing before the block holding first_key is
        kept = [i for i, b in enumerate(seq.block_table) if b != DROPPED]
        assert kept[0] == max(0, first_key) // bs
        most = max(most, len(live(seq)))
        bm.check_invariants()
    assert most <= (window - 1 + chunk + bs - 1) // bs + 1
    bm.deallocate(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 12


def test_a_session_takes_its_pinned_turn_back_and_dropped_blocks_stay_hittable():
    bm = BlockManager(num_blocks=16, block_size=4, window=6)
    first = Sequence(list(range(30)), SP, session_id="chat")
    assert bm.allocate(first)
    first.num_computed_tokens = 30
    bm.commit_computed(first)
    bm.drop_outside_window(first)
    assert first.block_table[:6] == [DROPPED] * 6 and len(live(first)) == 2
    bm.pin_session("chat", first)
    bm.deallocate(first)
    bm.check_invariants()
    # The next turn goes on from the whole last turn: only its new tokens are computed.
    turn = Sequence(list(range(30)) + [40, 41, 42], SP, session_id="chat")
    assert bm.allocate(turn)
    assert turn.num_computed_tokens == 30 and "chat" not in bm.sessions
    assert turn.block_table[:6] == [DROPPED] * 6
    bm.deallocate(turn)
    # A new prompt with the same start still hits the dropped blocks while nothing has reused them.
    other = Sequence(list(range(12)) + [99], SP)
    assert bm.allocate(other) and other.num_computed_tokens == 12
    bm.deallocate(other)
    bm.check_invariants()
    assert bm.num_free_blocks == 16


def test_random_chat_traffic_with_a_window_keeps_every_block_accounted_for():
    rng = random.Random(3)
    bm = BlockManager(num_blocks=30, block_size=4, window=9)
    history: dict[str, list[int]] = {}
    resumed = 0
    for _ in range(1500):
        sid = f"s{rng.randrange(4)}"
        base = history.get(sid, [])
        if base and rng.random() < 0.3:                      # a branch: cut somewhere, then other tokens
            base = base[:rng.randrange(len(base))]
        seq = Sequence(base + [rng.randrange(7) for _ in range(rng.randrange(1, 9))], SP, session_id=sid)
        pinned = bm.sessions.get(sid)
        budget = rng.randrange(1, 6)   # tokens per step: blocks are taken as the chunks need them
        if not bm.allocate(seq, budget):
            continue
        resumed += pinned is not None and sid not in bm.sessions
        while seq.num_computed_tokens < len(seq) or rng.random() < 0.7:
            if seq.num_computed_tokens == len(seq):
                seq.append_token(rng.randrange(7))
            step = min(len(seq) - seq.num_computed_tokens, budget)
            if not bm.ensure_slots(seq, seq.num_computed_tokens + step):
                break
            assert len(seq.block_table) <= bm.num_blocks_for(seq.num_computed_tokens + budget)   # no more ahead
            seq.num_computed_tokens += step
            bm.commit_computed(seq)
            bm.drop_outside_window(seq)
            # exactly the blocks from the one holding the first key a later query reads to the end
            first_kept = max(0, seq.num_computed_tokens - 9 + 1) // 4
            assert seq.block_table[:first_kept] == [DROPPED] * first_kept and DROPPED not in seq.block_table[first_kept:]
        if rng.random() < 0.8:
            bm.pin_session(sid, seq)
            history[sid] = list(seq.token_ids[:seq.num_computed_tokens])
        bm.deallocate(seq)
        bm.check_invariants()
    for sid in list(bm.sessions):
        bm.release_session(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == 30 and all(b.ref_count == 0 for b in bm.blocks)
    assert resumed > 50


def test_a_32k_token_chat_on_a_windowed_model_stays_within_its_bound_and_answers_alike(tmp_path, monkeypatch):
    """A tiny Mistral-style model (every layer windowed, W = 12): a chat whose first message is 32k tokens,
    then three more turns, through the engine with chunked prefill. The blocks in use never pass the
    window's bound, every later turn prefills only its new message, and every reply equals the same chat
    run with nothing given back (the whole history's KV kept)."""
    import nanochat.engine.llm_engine as llm_engine
    from nanochat.engine import LLMEngine
    from tests.conftest import TINY
    from tests.test_families import WINDOW, make_family_model

    monkeypatch.setitem(TINY, "max_position_embeddings", 33_000)
    folder = make_family_model("mistral", tmp_path / "mistral")
    rng = random.Random(0)
    turns = [[rng.randrange(5, 300) for _ in range(32_000)]] + [[rng.randrange(5, 300) for _ in range(40)]
                                                                 for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    chunk, bs = 512, 16

    def chat(engine):
        history, replies, peak, fresh = [], [], 0, []
        for k, user in enumerate(turns):
            ids = history + user
            engine.add_request(ids, greedy, session_id="chat")
            out, final = [], None
            while final is None:
                for ev in engine.step():
                    out += [ev.token_id] if ev.token_id is not None else []
                    final = ev if ev.finished else None
                bm = engine.block_manager
                peak = max(peak, len(bm.blocks) - bm.num_free_blocks)   # the session's pin included
            fresh.append(final.stats.prompt_tokens - final.stats.cached_tokens)
            replies.append(out)
            history = ids + out
        return replies, peak, fresh

    kw = dict(dtype="float32", max_model_len=32_800, kvcache_block_size=bs, max_num_batched_tokens=chunk)
    windowed = LLMEngine(str(folder), **kw)
    assert windowed.block_manager.window == WINDOW
    replies, peak, fresh = chat(windowed)
    bound = (WINDOW - 1 + chunk + bs - 1) // bs + 1     # the window behind the chunk, and the chunk's blocks
    assert peak <= bound, f"{peak} blocks in use, bound {bound}"
    assert fresh[0] == len(turns[0]) and all(n <= len(turns[k]) + 1 for k, n in enumerate(fresh[1:], 1))

    monkeypatch.setattr(llm_engine, "kv_window", lambda cfg: 0)   # the same chat keeping every block
    full = LLMEngine(str(folder), **kw)
    assert full.block_manager.window == 0
    full_replies, full_peak, _ = chat(full)
    assert full_replies == replies
    assert full_peak > 2000 > 10 * peak            # 32k tokens of KV against a window's worth

