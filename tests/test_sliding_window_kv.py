"""Sliding-window models give back the KV blocks no later query reads (engine/block_manager.py): a long
sequence or chat holds a bounded number of blocks, sessions resume their last turn, and every block comes back."""

from __future__ import annotations

import random

import pytest
import torch

from nanochat.engine import SamplingParams
from nanochat.engine.block_manager import DROPPED, BlockManager
from nanochat.engine.model_runner import kv_window
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


def computed(bm: BlockManager, seq: Sequence, n: int) -> None:
    """n more of seq's tokens computed, as the engine's step ends: their blocks hashed, those behind the window
    given back."""
    seq.num_computed_tokens += n
    bm.commit_computed(seq)
    bm.drop_outside_window(seq)


def walk(bm: BlockManager, seq: Sequence, chunk: int, window: int, until: int = 400):
    """Run seq to `until` tokens in chunks, as the engine does (blocks, commit, drop behind the window, the
    invariants checked); yields the first key the next query reads after each step."""
    while len(seq) < until:
        n = min(chunk, len(seq) - seq.num_computed_tokens) or 1
        if seq.num_computed_tokens == len(seq):
            seq.append_token(len(seq) % 50)
        assert bm.ensure_slots(seq, seq.num_computed_tokens + n)
        computed(bm, seq, n)
        yield seq.num_computed_tokens - window + 1
        bm.check_invariants()


def end_turn(bm: BlockManager, seq: Sequence, sid, history: dict, pin: bool) -> None:
    """A finished turn of random chat traffic: pinned as its session's last turn (pin), then given back."""
    if pin:
        bm.pin_session(sid, seq)
        history[sid] = list(seq.token_ids[:seq.num_computed_tokens])
    bm.deallocate(seq)
    bm.check_invariants()


def release_all(bm: BlockManager) -> None:
    for sid in list(bm.sessions):
        bm.release_session(sid)
    bm.check_invariants()


def test_a_long_sequence_holds_only_the_blocks_its_window_reads():
    window, bs, chunk = 10, 4, 3
    bm = BlockManager(num_blocks=12, block_size=bs, window=window)
    seq = Sequence(list(range(7)), SP)
    assert bm.allocate(seq)
    most = 0
    for first_key in walk(bm, seq, chunk, window):   # far more tokens than 12 blocks hold
        # every key a later query reads is still there; nothing before the block holding first_key is
        kept = [i for i, b in enumerate(seq.block_table) if b != DROPPED]
        assert kept[0] == max(0, first_key) // bs
        most = max(most, len(live(seq)))
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
            computed(bm, seq, step)
            # exactly the blocks from the one holding the first key a later query reads to the end
            first_kept = max(0, seq.num_computed_tokens - 9 + 1) // 4
            assert seq.block_table[:first_kept] == [DROPPED] * first_kept and DROPPED not in seq.block_table[first_kept:]
        end_turn(bm, seq, sid, history, rng.random() < 0.8)
    release_all(bm)
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



# ---------------------------------------------------------------- two KV groups: windowed layers beside global ones


def test_the_groups_the_runner_sees():
    from types import SimpleNamespace as NS

    from nanochat.engine.model_runner import window_group

    def model(*windows):
        return NS(attention_layers=lambda: [NS(window=w) for w in windows])
    assert window_group(model(12, 12, 0, 12)) == 12            # Gemma 3 style: two groups
    assert window_group(model(8, 0, 16)) == 16                 # the widest window serves the group
    assert window_group(model(12, 12)) == 0 and window_group(model(0, 0)) == 0   # one kind of layer: one group


def windowed_live(seq: Sequence) -> list[int]:
    return [b for b in seq.window_block_table if b != DROPPED]


def test_two_groups_a_long_sequence_holds_the_window_in_one_and_everything_in_the_other():
    window, bs, chunk = 10, 4, 3
    bm = BlockManager(num_blocks=120, block_size=bs, window_group=(window, 12))
    seq = Sequence(list(range(7)), SP)
    assert bm.allocate(seq, chunk)
    most = 0
    for first_key in walk(bm, seq, chunk, window):
        kept = [i for i, b in enumerate(seq.window_block_table) if b != DROPPED]
        assert kept[0] == max(0, first_key) // bs and DROPPED not in seq.block_table
        # the windowed group grows chunk by chunk; the full group took the whole prompt at admission
        assert len(seq.window_block_table) == bm.num_blocks_for(seq.num_computed_tokens) <= len(seq.block_table)
        most = max(most, len(windowed_live(seq)))
    assert most <= (window - 1 + chunk + bs - 1) // bs + 1
    bm.deallocate(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 120 and bm.wpool.num_free_blocks == 12


def test_two_groups_a_prefix_hit_needs_both_groups_blocks():
    """A hit reaches as far as the windowed group still holds the window behind it: the full group's blocks alone
    (the windowed pool's reused meanwhile) give no hit."""
    bs, window = 4, 6
    bm = BlockManager(num_blocks=80, block_size=bs, window_group=(window, 40))
    first = Sequence(list(range(30)), SP)
    assert bm.allocate(first)
    first.num_computed_tokens = 30
    bm.commit_computed(first)
    bm.drop_outside_window(first)
    bm.deallocate(first)
    same = Sequence(list(range(30)) + [77], SP)
    assert bm.allocate(same) and same.num_computed_tokens == 28       # whole blocks, both groups still there
    assert same.window_block_table[:5] == [DROPPED] * 5 and len(windowed_live(same)) == 3
    bm.deallocate(same)
    # a sequence that takes every windowed block (the full group: 40 of its 80, not the cached ones)
    hog = Sequence([900 + i for i in range(40 * bs - 1)], SP)
    assert bm.allocate(hog)
    bm.deallocate(hog)
    assert len(bm.hash_to_block) == 7 and not bm.wpool.hash_to_block
    again = Sequence(list(range(30)) + [78], SP)
    assert bm.allocate(again) and again.num_computed_tokens == 0
    assert DROPPED not in again.window_block_table
    bm.deallocate(again)
    bm.check_invariants()
    assert bm.num_free_blocks == 80 and bm.wpool.num_free_blocks == 40


def test_two_groups_random_chat_traffic_keeps_every_block_of_both_pools_accounted_for():
    rng = random.Random(5)
    bs, window = 4, 9
    bm = BlockManager(num_blocks=60, block_size=bs, window_group=(window, 24))
    bm.copy_kv = lambda src, dst, n, group=None: None
    history: dict[str, list[int]] = {}
    resumed = hits = 0
    for _ in range(1500):
        sid = f"s{rng.randrange(4)}"
        base = history.get(sid, [])
        if base and rng.random() < 0.3:                      # a branch: cut somewhere, then other tokens
            base = base[:rng.randrange(len(base))]
        seq = Sequence(base + [rng.randrange(7) for _ in range(rng.randrange(1, 9))], SP,
                       session_id=sid if rng.random() < 0.8 else None)
        pinned = bm.sessions.get(sid)
        budget = rng.randrange(1, 6)
        if not bm.allocate(seq, budget):
            continue
        resumed += pinned is not None and sid not in bm.sessions
        hits += seq.num_computed_tokens > 0
        while seq.num_computed_tokens < len(seq) or rng.random() < 0.7:
            if seq.num_computed_tokens == len(seq):
                seq.append_token(rng.randrange(7))
            step = min(len(seq) - seq.num_computed_tokens, budget)
            if not bm.ensure_slots(seq, seq.num_computed_tokens + step):
                break
            computed(bm, seq, step)
            first_kept = max(0, seq.num_computed_tokens - window + 1) // bs
            table = seq.window_block_table
            assert table[:first_kept] == [DROPPED] * first_kept and DROPPED not in table[first_kept:]
            assert DROPPED not in seq.block_table
            # the windowed group's blocks hold the same tokens as the full group's (one chain of hashes)
            for i, h in enumerate(seq.block_hashes):
                if table[i] != DROPPED:
                    assert bm.wpool.blocks[table[i]].hash in (h, None)
        end_turn(bm, seq, sid, history, seq.session_id is not None and rng.random() < 0.8)
    release_all(bm)
    assert bm.num_free_blocks == 60 and bm.wpool.num_free_blocks == 24
    assert all(b.ref_count == 0 for b in bm.blocks + bm.wpool.blocks)
    assert resumed > 30 and hits > 100


def test_kv_bytes_of_a_32k_chat_on_gemma_3_4b_shapes():
    """The figure: gemma-3-4b's attention (34 layers, every 6th global, window 1024, 4 KV heads of 256, fp16 KV),
    a 32k-token chat prefilled in 512-token chunks, 16-token blocks: the KV bytes held at the end with one group
    (every block kept) and with two (the windowed layers' blocks behind the window given back)."""
    layers, window, heads, dim, bs, chunk, tokens = 34, 1024, 4, 256, 16, 512, 32_768
    windowed = sum(1 for i in range(layers) if (i + 1) % 6)          # 29 local, 5 global
    per_layer_block = 2 * bs * heads * dim * 2                        # K and V, fp16
    bm = BlockManager(num_blocks=tokens // bs + 8, block_size=bs, window_group=(window, 2 * (window + chunk) // bs))
    seq = Sequence([i % 1000 for i in range(tokens)], SP)
    assert bm.allocate(seq, chunk)
    while seq.num_computed_tokens < tokens:
        n = min(chunk, tokens - seq.num_computed_tokens)
        assert bm.ensure_slots(seq, seq.num_computed_tokens + n)
        computed(bm, seq, n)
    one_group = layers * len(seq.block_table) * per_layer_block
    two_groups = ((layers - windowed) * len(seq.block_table) + windowed * len(windowed_live(seq))) * per_layer_block
    print(f"\n32k-token chat on gemma-3-4b shapes: {one_group / 2**30:.2f} GiB of KV with one group, "
          f"{two_groups / 2**30:.2f} GiB with two ({len(windowed_live(seq))} windowed blocks per sequence)")
    assert one_group == 34 * tokens * 2 * heads * dim * 2                        # 4.25 GiB
    assert len(windowed_live(seq)) <= (window - 1 + bs - 1) // bs + 1
    assert two_groups < 0.2 * one_group


# ---------------------------------------------------------------- two KV groups through the engine


def _engine(folder, grouped: bool, monkeypatch, **kw):
    import nanochat.engine.model_runner as model_runner
    from nanochat.engine import LLMEngine

    kw = {"dtype": "float32", "max_model_len": 256, "kv_cache_dtype": "float32", "kvcache_block_size": 4,
          "batch_invariant": True, **kw}
    with monkeypatch.context() as m:
        if not grouped:   # the reference: one group, every block kept
            m.setattr(model_runner, "window_group", lambda model: 0)
        engine = LLMEngine(str(folder), **kw)
    assert (engine.block_manager.wpool is not None) == grouped
    return engine


def _run(engine, prompts, sp, sessions=None):
    ids = [engine.add_request(p, sp, session_id=None if sessions is None else sessions[i])
           for i, p in enumerate(prompts)]
    out = {rid: [] for rid in ids}
    peak = 0
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev.token_id)
        bm = engine.block_manager
        if bm.wpool is not None:
            peak = max(peak, max((len(windowed_live(s)) for s in engine.scheduler.running), default=0))
        bm.check_invariants()
    return [out[rid] for rid in ids], peak


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from tests.test_gemma3 import make_gemma3
    return make_gemma3(tmp_path_factory.mktemp("gemma3-groups") / "g")


PROMPTS = [[(13 * i + 7 * k) % 290 + 5 for i in range(n)] for k, n in enumerate((70, 33, 121, 9))]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "modules"])
@pytest.mark.parametrize("chunk,blocks", [(512, 400), (16, 400), (16, 40)], ids=["batched", "chunked", "preempted"])
def test_two_groups_greedy_tokens_equal_the_reference(gemma, monkeypatch, fused, chunk, blocks):
    """Gemma 3 (window 12, layers 1-5 windowed, 6 global): every prompt's greedy tokens with two groups equal those
    of the same engine keeping every block, batched, in 16-token chunks (the windowed caches then fewer blocks than
    the full group's block ids reach: their layers must use their own tables), and under preemption (40 blocks,
    three 60-token prompts growing to 21 blocks each); the windowed group holds about window / block_size blocks
    per sequence."""
    from tests.test_gemma3 import WINDOW
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(fused_forward=fused, max_num_batched_tokens=chunk, num_kvcache_blocks=blocks, max_num_seqs=4)
    prompts = PROMPTS if blocks > 40 else [[(11 * i + k) % 290 + 5 for i in range(60)] for k in range(3)]
    grouped = _engine(gemma, True, monkeypatch, **kw)
    assert grouped.runner.group_window == WINDOW
    if chunk == 16 and blocks == 400:
        assert grouped.runner.num_window_blocks == 2 * 4 * ((WINDOW - 1 + 16 + 3) // 4 + 1) == 64
    got, peak = _run(grouped, prompts, sp)
    want, _ = _run(_engine(gemma, False, monkeypatch, **kw), prompts, sp)
    assert got == want
    assert peak <= (WINDOW - 1 + chunk + 3) // 4 + 1
    if blocks == 40:
        assert grouped.scheduler.num_preemptions > 0
    bm = grouped.block_manager
    assert bm.num_free_blocks == len(bm.blocks) and bm.wpool.num_free_blocks == len(bm.wpool.blocks)


def test_two_groups_match_transformers(gemma, monkeypatch):
    from tests.test_families import oracle_greedy
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32).eval()
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got, _ = _run(_engine(gemma, True, monkeypatch, max_num_batched_tokens=16), PROMPTS[:3], sp)
    assert got == [oracle_greedy(hf, p, 16) for p in PROMPTS[:3]]


def test_two_groups_sessions_prefix_reuse_branches_and_cancel(gemma, monkeypatch):
    """Multi-turn chats (sessions resuming their pinned turn in both groups), a branch (an earlier turn's
    history with another message: a prefix hit), a new chat sharing the first's start (hit through the hashes
    of both groups), and a cancelled request: tokens as the reference engine's, no block leaked in either pool."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(max_num_batched_tokens=16, num_kvcache_blocks=300)
    engines = [_engine(gemma, True, monkeypatch, **kw), _engine(gemma, False, monkeypatch, **kw)]
    results = []
    for engine in engines:
        replies, history = [], []
        for turn in ([5, 6, 7] * 10, [40, 41, 42, 43] * 4, [99, 98] * 5):
            ids = history + turn
            [out], _ = _run(engine, [ids], sp, sessions=["chat"])
            replies.append(out)
            history = ids + out
        branch = [5, 6, 7] * 10 + replies[0] + [77] * 9          # turn 2 again, another message
        [out], _ = _run(engine, [branch], sp, sessions=["chat"])
        replies.append(out)
        [out], _ = _run(engine, [[5, 6, 7] * 10 + [200, 201]], sp)          # a new chat, same start
        replies.append(out)
        rid = engine.add_request(list(range(5, 60)), sp)
        engine.step()
        engine.abort(rid)
        engine.release_session("chat")
        bm = engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == len(bm.blocks)
        if bm.wpool is not None:
            assert bm.wpool.num_free_blocks == len(bm.wpool.blocks)
        results.append(replies)
    assert results[0] == results[1]
    # the later turns, the branch and the new chat were served from the cache (their old tokens not computed)
    assert engines[0].block_manager.counters.hit_tokens > 150
