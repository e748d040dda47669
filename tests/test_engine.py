"""Engine behaviour: batching, preemption, chunked prefill, prefix caching, block accounting."""

from __future__ import annotations

import random

import pytest
import torch

from nanochat.engine import LLM, Config, LLMEngine, RequestError, SamplingParams
from nanochat.engine.block_manager import BlockManager
from nanochat.engine.config import ENV_OVERRIDES
from nanochat.engine.sequence import Sequence

from test_parity import GREEDY, PROMPTS, hf_greedy

ARCH = "qwen3"


@pytest.fixture(scope="module")
def expected(tiny_models, hf_models):
    hf = hf_models(ARCH)
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


def run(tiny_models, prompts=PROMPTS, sp=GREEDY, **cfg):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, **cfg)
    return llm, [r.token_ids for r in llm.generate(prompts, sp)]


def test_preemption_keeps_outputs_identical(tiny_models, expected):
    # 8 blocks of 16 tokens cannot hold all four sequences at once: preemption must happen.
    llm, out = run(tiny_models, num_kvcache_blocks=8, kvcache_block_size=16)
    assert out == expected
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == 8


def test_chunked_prefill_keeps_outputs_identical(tiny_models, expected):
    llm, out = run(tiny_models, max_num_batched_tokens=8)
    assert out == expected


def test_chunked_prefill_runs_decodes_in_the_same_step(tiny_models):
    engine = LLMEngine(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, max_num_batched_tokens=8)
    engine.add_request([1, 2, 3], GREEDY)
    engine.step()                       # prefill of the short prompt
    engine.add_request(list(range(10, 50)), GREEDY)
    chunks = engine.scheduler.schedule()
    kinds = sorted((c.num_tokens, c.samples) for c in chunks)
    assert kinds == [(1, True), (7, False)]   # a decode and a 7-token prefill chunk share the step


@pytest.mark.parametrize("block_size", [16, 256])
def test_block_sizes(tiny_models, expected, block_size):
    _, out = run(tiny_models, kvcache_block_size=block_size)
    assert out == expected


def test_prefix_cache_hit_on_repeated_prompt_plus_output(tiny_models, hf_models):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, kvcache_block_size=16)
    prompt = list(range(30, 70))          # 40 tokens: two full blocks
    first = llm.generate([prompt], GREEDY)[0]
    follow = prompt + first.token_ids + [5, 6, 7]
    second = llm.generate([follow], GREEDY)[0]
    # prompt (40) + 12 generated = 52 tokens computed -> 3 full blocks hashed, generated ones included
    assert second.stats.cached_tokens == 48
    assert second.token_ids == hf_greedy(hf_models(ARCH), follow, GREEDY.max_tokens)
    bm = llm.engine.block_manager
    assert bm.counters.hit_tokens == 48
    llm.engine.block_manager.check_invariants()


def test_hit_is_capped_so_one_token_is_computed(tiny_models):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, kvcache_block_size=16)
    prompt = list(range(32))               # exactly two blocks
    a = llm.generate([prompt], GREEDY)[0]
    b = llm.generate([prompt], GREEDY)[0]
    # not 32: the last token must be computed for its logits; its block is copied up to it (copy-on-write)
    assert b.stats.cached_tokens == 31
    assert a.token_ids == b.token_ids


def test_a_partly_matching_last_block_is_copied_not_recomputed(tiny_models, hf_models):
    """A prompt cached but for its last, partly filled block (a regenerated reply, an edit at the same
    spot) reuses the cached prefix of a full block that starts the same way, copied into a fresh block:
    only the tokens after the match are computed, and the outputs are a full run's."""
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, kvcache_block_size=16)
    long = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = list(range(30, 70))          # 40 tokens: block 2 holds 8 prompt tokens, then the output
    first = llm.generate([prompt], long)[0]
    again = llm.generate([prompt], long)[0]
    assert again.stats.cached_tokens == 39 and again.token_ids == first.token_ids
    hf = hf_models(ARCH)
    for same in (36, 20):                 # an edit: the same first tokens, then others
        edited = prompt[:same] + [7, 8, 9]
        out = llm.generate([edited], long)[0]
        assert out.stats.cached_tokens == same
        assert out.token_ids == hf_greedy(hf, edited, long.max_tokens)
    assert first.token_ids == hf_greedy(hf, prompt, long.max_tokens)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == len(bm.blocks)   # every copy and every borrowed block given back


def test_prefix_caching_disabled(tiny_models, expected):
    llm, out = run(tiny_models, enable_prefix_caching=False)
    out2 = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert out == out2 == expected
    assert llm.engine.block_manager.counters.hit_tokens == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_models):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256)
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=10, ignore_eos=True, seed=123)
    alone = llm.generate([PROMPTS[0]], sp)[0].token_ids
    batched = llm.generate(PROMPTS, [sp] * len(PROMPTS))[0].token_ids
    assert alone == batched
    again = llm.generate([PROMPTS[0]], sp)[0].token_ids
    assert again == alone


def test_stop_tokens_and_max_tokens(tiny_models, expected):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256)
    stop_at = expected[0][3]
    first = expected[0].index(stop_at)
    r = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                                                 ignore_eos=True))[0]
    assert r.token_ids == expected[0][:first + 1] and r.finish_reason == "stop"
    r = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert r.token_ids == expected[0][:4] and r.finish_reason == "length"


def test_stop_strings_cut_the_text(tiny_models):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256)
    full = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len(full.text) > 4
    needle = full.text[2:4]
    cut = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop=[needle]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(needle)]


def test_streaming_events_concatenate_to_the_result(tiny_models):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    texts, tokens, finished = {}, {}, []
    for ev in llm.stream(PROMPTS[:2], sp):
        texts.setdefault(ev.request_id, []).append(ev.text)
        tokens.setdefault(ev.request_id, []).append(ev.token_id)
        if ev.finished:
            finished.append(ev)
    results = llm.generate(PROMPTS[:2], sp)
    assert len(finished) == 2 and all(ev.stats.completion_tokens == 12 for ev in finished)
    assert ["".join(texts[k]) for k in sorted(texts)] == [r.text for r in results]


def test_stream_abandoned_early_frees_blocks(tiny_models):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, enable_prefix_caching=False)
    stream = llm.stream(PROMPTS, GREEDY)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == len(bm.blocks)
    assert not llm.engine.has_unfinished()


def test_bad_requests_are_rejected_clearly(tiny_models):
    engine = LLMEngine(str(tiny_models[ARCH]), dtype="float32", max_model_len=64, num_kvcache_blocks=2,
                       kvcache_block_size=16)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request(list(range(64)), GREEDY)
    with pytest.raises(RequestError, match="KV cache"):
        engine.add_request(list(range(40)), GREEDY)
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request([10**6], GREEDY)


def test_sequence_outgrowing_the_cache_ends_with_error_not_hang(tiny_models):
    engine = LLMEngine(str(tiny_models[ARCH]), dtype="float32", max_model_len=128, num_kvcache_blocks=2,
                       kvcache_block_size=16)
    rid = engine.add_request(list(range(20)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    events = []
    for _ in range(200):
        events += engine.step()
        if not engine.has_unfinished():
            break
    assert events[-1].request_id == rid and events[-1].finished and events[-1].finish_reason == "error"
    assert engine.block_manager.num_free_blocks == 2


@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(seed=-1), "seed"), (dict(stop=[""]), "stop"),
])
def test_sampling_params_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_config_env_overrides_and_validation(monkeypatch):
    monkeypatch.setenv("NANO_VLLM_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("NANO_VLLM_KVCACHE_BLOCK_SIZE", "32")
    cfg = Config.create("m")
    assert cfg.max_num_seqs == 3 and cfg.kvcache_block_size == 32
    assert Config.create("m", max_num_seqs=5).max_num_seqs == 5     # explicit wins
    with pytest.raises(Exception):
        cfg.max_num_seqs = 9                                         # frozen
    monkeypatch.setenv("NANO_VLLM_MAX_MODEL_LEN", "lots")
    with pytest.raises(ValueError, match="NANO_VLLM_MAX_MODEL_LEN"):
        Config.create("m")
    monkeypatch.delenv("NANO_VLLM_MAX_MODEL_LEN")
    for bad in (dict(kvcache_block_size=24), dict(max_num_seqs=0), dict(device="tpu"), dict(device="cuda:abc"),
                dict(bogus=1), dict(quant_backend="fast"), dict(act_levels=3)):
        with pytest.raises(ValueError):
            Config.create("m", **bad)


@pytest.mark.parametrize("env, raw, field, value", [
    ("NANOCHAT_QUANT_BACKEND", "int4", "quant_backend", "int4"),
    ("NANOCHAT_FUSED_FORWARD", "0", "fused_forward", False),
    ("NANOCHAT_FUSED_FORWARD", "yes", "fused_forward", True),
    ("NANOCHAT_ACT_LEVELS", "1", "act_levels", 1),
    ("NANOCHAT_CPU_ISA", "scalar", "cpu_isa", "scalar"),
    ("NANO_VLLM_CPU_THREADS", "3", "cpu_threads", 3),
])
def test_config_kernel_knobs_from_env(monkeypatch, env, raw, field, value):
    assert env in ENV_OVERRIDES and ENV_OVERRIDES[env][0] == field
    monkeypatch.setenv(env, raw)
    assert getattr(Config.create("m"), field) == value


@pytest.mark.parametrize("env, raw", [
    ("NANOCHAT_QUANT_BACKEND", "fast"), ("NANOCHAT_FUSED_FORWARD", "maybe"), ("NANOCHAT_ACT_LEVELS", "3"),
    ("NANOCHAT_ACT_LEVELS", "two"), ("NANOCHAT_CPU_ISA", "avx9"), ("NANO_VLLM_CPU_THREADS", "0"),
    ("NANO_VLLM_MAX_NUM_SEQS", "0"), ("NANOCHAT_PACK_CACHE", "2"),
])
def test_config_bad_env_value_is_one_line_naming_the_variable(monkeypatch, env, raw):
    monkeypatch.setenv(env, raw)
    with pytest.raises(ValueError) as info:
        Config.create("m")
    message = str(info.value)
    assert f"{env}={raw!r}" in message and "\n" not in message


def test_two_engines_in_one_process_keep_their_own_kernel_options(tiny_models, tmp_path):
    """Kernel options are arguments, not process-wide switches: building a second engine with another
    quant backend, activation levels, fused forward and thread count changes nothing for the first."""
    from test_families import tokenizer_metadata
    from tests.gguf_writer import T, write_gguf_from_hf

    folder = tiny_models["llama"]
    path = str(write_gguf_from_hf(folder, tmp_path / "q8.gguf", "llama", T.Q8_0, output_qtype=T.F16,
                                  tokenizer=tokenizer_metadata(folder)))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(llm):
        events = [e for e in llm.stream([[3, 9, 14, 27, 5]], greedy) if e.token_id is not None]
        return [e.token_id for e in events], [e.logprobs.logprob for e in events], torch.get_num_threads()

    def weights(llm):
        return [p for m in llm.engine.runner.model.modules() if hasattr(m, "quant_parts") for p in m.quant_parts() or ()]

    a = LLM(path, max_model_len=64, act_levels=1, cpu_threads=1, pack_cache=False)
    first = run(a)
    b = LLM(path, max_model_len=64, act_levels=2, cpu_threads=2, quant_backend="dense", fused_forward=False,
            pack_cache=False)
    c = LLM(path, max_model_len=64, act_levels=2, cpu_threads=2, pack_cache=False)
    assert run(a) == first and first[2] == 1             # a's tokens, log-probabilities and threads, as before
    assert run(b)[2] == 2 and run(c)[2] == 2 and run(a) == first
    assert run(c)[1] != first[1]                         # (the levels do move the numbers: the check can fail)
    assert {(w.backend, w.levels, w.threads) for w in weights(a)} == {("q8", 1, 1)}
    assert {w.backend for w in weights(b)} == {"dense"} and {(w.levels, w.threads) for w in weights(c)} == {(2, 2)}
    assert a.engine.runner.model.fused.usable() and not b.engine.runner.model.fused.usable()


def test_block_invariant_after_random_workload():
    """Random add / compute / finish / abort / preempt / session pins: every block comes back."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=24, block_size=4)
    live: list[Sequence] = []
    sp = SamplingParams(max_tokens=8)
    vocab = [rng.randrange(5) for _ in range(64)]
    for step in range(2000):
        op = rng.random()
        if op < 0.3:
            seq = Sequence(vocab[:rng.randrange(1, 30)] + [rng.randrange(5)], sp)
            if bm.allocate(seq):
                live.append(seq)
        elif op < 0.7 and live:
            seq = rng.choice(live)
            seq.num_computed_tokens = len(seq)
            bm.commit_computed(seq)
            if bm.ensure_slots(seq, len(seq) + 1):
                seq.append_token(rng.randrange(5))
            else:                                  # preempt
                bm.deallocate(seq)
                live.remove(seq)
        elif op < 0.8 and live:
            seq = live.pop(rng.randrange(len(live)))
            bm.pin_session(f"s{rng.randrange(4)}", seq)
            bm.deallocate(seq)
        elif live:
            bm.deallocate(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
    for seq in live:
        bm.deallocate(seq)
    for sid in list(bm.sessions):
        bm.release_session(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == 24
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.counters.hit_tokens > 0


def test_the_branch_shown_is_evicted_last():
    """Two branches' sessions pinned; the one shown is touched (the client's focus_session): under
    memory pressure the other one's blocks go first."""
    bm = BlockManager(num_blocks=8, block_size=4)
    sp = SamplingParams(max_tokens=1)
    for sid, first in (("shown", 0), ("hidden", 50)):
        seq = Sequence(list(range(first, first + 12)), sp, session_id=sid)
        assert bm.allocate(seq)
        seq.num_computed_tokens = len(seq)
        bm.commit_computed(seq)
        bm.pin_session(sid, seq)
        bm.deallocate(seq)
    bm.touch_session("shown")                                  # moved back to: most recently used
    big = Sequence(list(range(100, 113)), sp)                  # needs 4 blocks; 2 are free
    assert bm.allocate(big)
    assert list(bm.sessions) == ["shown"]
    bm.deallocate(big)
    bm.release_session("shown")
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_sessions_copies_and_pins_keep_every_block_accounted_for():
    """Chat-like random traffic: sessions that go on from their last turn (taking over its partly filled
    block), branches that part mid-block (copy-on-write), evictions under pressure; the invariants hold,
    every copy goes from a cached block into a fresh one, and every block comes back."""
    rng = random.Random(1)
    bm = BlockManager(num_blocks=40, block_size=4)
    copies = []

    def copy_kv(src, dst, n):
        assert bm.blocks[src].hash is not None and bm.blocks[dst].hash is None and 0 < n < 4
        copies.append((src, dst, n))

    bm.copy_kv = copy_kv
    sp = SamplingParams(max_tokens=8)
    history: dict[str, list[int]] = {}
    adopted = 0
    for step in range(1500):
        sid = f"s{rng.randrange(5)}"
        base = history.get(sid, [])
        if base and rng.random() < 0.3:                      # a branch: cut somewhere, then other tokens
            base = base[:rng.randrange(len(base))]
        seq = Sequence(base + [rng.randrange(7) for _ in range(rng.randrange(1, 7))], sp, session_id=sid)
        pin = bm.sessions.get(sid)
        if not bm.allocate(seq):
            continue
        adopted += pin is not None and pin.tail is not None and pin.tail[0] in seq.block_table
        for _ in range(rng.randrange(1, 6)):                 # prefill, then a few decode steps
            seq.num_computed_tokens = len(seq)
            bm.commit_computed(seq)
            if not bm.ensure_slots(seq, len(seq) + 1):
                break
            seq.append_token(rng.randrange(7))
        if rng.random() < 0.8:
            bm.pin_session(sid, seq)
            history[sid] = list(seq.token_ids)
        bm.deallocate(seq)
        bm.check_invariants()
    for sid in list(bm.sessions):
        bm.release_session(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == 40 and all(b.ref_count == 0 for b in bm.blocks)
    assert copies and adopted > 0


def test_a_block_bigger_than_the_kv_budget_names_the_block_size(tiny_models):
    with pytest.raises(ValueError, match="lower kvcache_block_size"):
        LLMEngine(str(tiny_models[ARCH]), dtype="float32", kvcache_block_size=1 << 20, kv_cache_gib=0.001)


def test_stats_say_whether_the_context_or_max_tokens_ended_a_reply(tiny_models):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=32)
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    full, capped = llm.generate([list(range(1, 21)), [1, 2, 3]], [sp, SamplingParams(temperature=0, max_tokens=4,
                                                                                    ignore_eos=True)])
    assert full.finish_reason == capped.finish_reason == "length"
    assert full.stats.context_full and full.stats.prompt_tokens + full.stats.completion_tokens == 32
    assert not capped.stats.context_full


# ---------------------------------------------------------------- penalties through the engine

PENALIZED = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                           presence_penalty=0.4, frequency_penalty=0.3)


def hf_penalized_greedy(hf, prompt, sp):
    """Greedy decoding with transformers' logits (no KV cache) and the reference penalties."""
    from test_sampler import reference_penalties

    ids = list(prompt)
    for _ in range(sp.max_tokens):
        with torch.no_grad():
            row = hf(torch.tensor([ids])).logits[0, -1].float()
        ids.append(int(reference_penalties(row, ids, len(prompt), sp).argmax()))
    return ids[len(prompt):]


def _finish(engine, rid):
    tokens = []
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.request_id == rid:
                tokens.append(ev.token_id)
    return tokens


def test_repetition_penalty_breaks_a_greedy_loop_as_transformers_does(tiny_models, hf_models):
    looping = [100, 101, 102]        # the tiny qwen3 repeats one token from the fourth step on
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256)
    plain = llm.generate([looping], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    penalized = llm.generate([looping], sp)[0].token_ids
    assert len(set(plain)) < len(set(penalized)) and penalized != plain
    assert llm.generate([looping], sp)[0].token_ids == penalized          # deterministic
    hf = hf_models(ARCH)
    want = hf.generate(torch.tensor([looping]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                       repetition_penalty=1.3, pad_token_id=0, eos_token_id=None)[0, len(looping):].tolist()
    assert penalized == want


def test_penalties_survive_preemption_chunking_and_prefix_hits(tiny_models, hf_models, expected):
    """Penalties depend on token ids only: recompute after preemption, chunked prefill and prefix-cache
    hits give the reference tokens; a plain request batched alongside is unaffected."""
    hf = hf_models(ARCH)
    want = [hf_penalized_greedy(hf, p, PENALIZED) for p in PROMPTS]
    assert want != expected                                     # the penalties change the replies
    llm, out = run(tiny_models, sp=PENALIZED, num_kvcache_blocks=8, kvcache_block_size=16)
    assert out == want and llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(PROMPTS, PENALIZED)                   # the long prompt's blocks are cached now
    assert [r.token_ids for r in again] == want and any(r.stats.cached_tokens for r in again)
    _, out = run(tiny_models, sp=PENALIZED, max_num_batched_tokens=8)
    assert out == want
    _, mixed = run(tiny_models, sp=[PENALIZED, GREEDY, PENALIZED, GREEDY])
    assert mixed[0::2] == want[0::2] and mixed[1::2] == expected[1::2]


def test_penalties_on_a_chat_session_turn_count_the_whole_conversation(tiny_models):
    """A second turn reuses the first turn's resident KV; its penalties still see every id of the
    conversation, as a fresh engine without any cache does."""
    engine = LLMEngine(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, kvcache_block_size=16)
    turn1 = list(range(30, 70))
    first = _finish(engine, engine.add_request(turn1, PENALIZED, session_id="chat"))
    turn2 = turn1 + first + [5, 6, 7]
    rid = engine.add_request(turn2, PENALIZED, session_id="chat")
    req = engine.requests[rid]
    second = _finish(engine, rid)
    assert req.seq.stats.num_cached_tokens > 0
    fresh = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, enable_prefix_caching=False)
    assert second == fresh.generate([turn2], PENALIZED)[0].token_ids


def test_a_load_runs_no_garbage_collection_and_restores_the_collector(tiny_models, tmp_path):
    """Full collections walk every object torch's import left (a fraction of a second each on a slow machine)
    and a load would trigger several; none runs during one, and the collector is left as it was found,
    after a failed load too."""
    import gc

    from nanochat.models.errors import ModelLoadError

    runs = []
    record = lambda phase, info: runs.append(info["generation"]) if phase == "start" else None  # noqa: E731
    gc.collect()   # counts at zero: what follows cannot start a collection before the load begins
    gc.callbacks.append(record)
    try:   # a load makes thousands of tracked objects (modules, tensors, dicts): collections would start
        LLMEngine(str(tiny_models[ARCH]), dtype="float32", max_model_len=256)
        assert runs in ([], [0]) and gc.isenabled()   # at most the young collection as the collector returns
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGUF not really")
        with pytest.raises(ModelLoadError):
            LLMEngine(str(bad))
        assert gc.isenabled()
        gc.disable()
        LLMEngine(str(tiny_models[ARCH]), dtype="float32", max_model_len=256)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(record)


def test_a_dropped_engine_frees_its_model_at_once(tiny_models):
    """Reference counting alone frees an engine's model (no cycle waiting for a full collection), so a
    model the picker replaces gives its memory back before the next one fills the cache."""
    import gc
    import weakref

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256)
        llm.generate(PROMPTS[:1], GREEDY)
        gone = [weakref.ref(x) for x in (llm.engine, llm.engine.runner.model, llm.engine.runner)]
        del llm
        assert [ref() is None for ref in gone] == [True, True, True]
    finally:
        if was_enabled:
            gc.enable()


def test_chat_renders_each_conversation_as_transformers_does_and_generates(tiny_models, tmp_path):
    """LLM.chat (vLLM's): a conversation's prompt is the chat template's render of it with the generation prompt,
    ids equal to transformers' apply_chat_template, tools included; the replies are generate()'s on those ids."""
    import json
    import shutil

    import transformers

    from test_chat_template import QWEN3_TEMPLATE

    folder = shutil.copytree(tiny_models[ARCH], tmp_path / "qwen3-template")
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": QWEN3_TEMPLATE}))
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}}}}]
    conversations = [
        [{"role": "user", "content": "hi there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "and then?"}],
    ]
    def hf_ids(conversation, **kw) -> list[int]:   # the text transformers renders, in the tokenizer's ids
        return hf.encode(hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kw),
                         add_special_tokens=False)

    for conversation in conversations:
        assert llm.chat_prompt(conversation) == hf_ids(conversation)
    assert llm.chat_prompt(conversations[0], tools=tools) == hf_ids(conversations[0], tools=tools)
    off = llm.chat_prompt(conversations[0], chat_template_kwargs={"enable_thinking": False})
    assert off != llm.chat_prompt(conversations[0])   # Qwen3's template opens an empty think block
    got = llm.chat(conversations, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in llm.generate([llm.chat_prompt(c)
                                                                              for c in conversations], GREEDY)]
    assert llm.chat(conversations[0], GREEDY)[0].token_ids == got[0].token_ids
