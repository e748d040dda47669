"""Speculative decoding: the n-gram proposer, the choice of k, verification (greedy and rejection sampling),
and the engine keeping plain decoding's tokens and its block accounting whatever is proposed."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from nanochat.engine import LLMEngine, SamplingParams
from nanochat.engine.sampler import Sampler, verify
from nanochat.engine.speculative import PromptLookup, Speculation, SpeculationConfig, StepTimes, expected_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 5, 17, 42], [11, 12, 13], list(range(20, 61)),
           [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 1, 2, 3]]


# ---------------------------------------------------------------------------------- the proposer
def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    look = PromptLookup(min_n=2, max_n=3)
    # "1 2" occurs twice before the end; the latest occurrence is followed by 9 8; "7 1 2" (longer) by 3 4.
    tokens = [7, 1, 2, 3, 4, 5, 1, 2, 9, 8, 6, 7, 1, 2]
    assert look.match(tokens, 2)[0] == [3, 4]          # the 3-gram wins over the later 2-gram
    assert look.match(tokens + [6], 3)[0] == []        # "2 6" never occurred, nor any shorter suffix >= 2
    look2 = PromptLookup(min_n=2, max_n=2)
    assert look2.match(tokens, 5)[0] == [9, 8, 6, 7, 1]   # only 2-grams: the latest "1 2"
    assert look2.match(tokens, 0)[0] == []


def test_prompt_lookup_index_grows_with_the_sequence_and_never_proposes_past_it():
    look = PromptLookup(min_n=1, max_n=4)
    seq = [1, 2, 3]
    assert look.match(seq, 4)[0] == []
    seq += [1, 2]
    assert look.match(seq, 4)[0] == [3, 1, 2]          # what followed "1 2": up to the end of the tokens
    rng = random.Random(0)
    for _ in range(300):                               # incremental == rebuilt from scratch, at every length
        seq.append(rng.randrange(6))
        assert look.match(seq, 3)[0] == PromptLookup(1, 4).match(seq, 3)[0]


def test_k_follows_acceptance_and_costs_and_pauses_when_it_does_not_pay():
    cfg = SpeculationConfig(k_max=8, prior_acceptance=0.6, backoff=4)
    assert Speculation(SpeculationConfig(prior_acceptance=0.95), "ngram").choose_k(8, lambda k: 1.0) == 8
    assert Speculation(SpeculationConfig(prior_acceptance=0.95), "ngram").choose_k(3, lambda k: 1.0) == 3   # room
    spec = Speculation(cfg, "ngram")
    flat = spec.choose_k(8, lambda k: 1.0)           # free rows, 60%: up to where one more adds under 2%
    assert 5 <= flat < 8
    costly = spec.choose_k(8, lambda k: 1.0 + 0.7 * k)   # 0.7 of a step per row at 60% acceptance: none pays,
    assert costly == 1 and spec.paused == 0          # but one proposal measures a sequence never judged
    stepped = spec.choose_k(8, lambda k: 1.05 if k <= 3 else 2.0)   # a 4-row tile is cheap, 5 rows are not
    assert stepped == 3
    for _ in range(6):                               # everything accepted: k grows to the cap
        spec.record(3, 3)
    assert 0.95 < spec.acceptance < 1.0              # (a quarter step's worth of the prior stays in)
    assert spec.choose_k(8, lambda k: 1.0 + 0.1 * k) == 8
    for _ in range(12):                              # nothing accepted: it stops paying, and pauses
        spec.record(3, 0)
    assert spec.acceptance < 0.25
    assert spec.choose_k(8, lambda k: 1.0 + 0.2 * k) == 0
    assert spec.paused == 4
    # afresh after the pause, from the prior, but k at most twice the last run (none accepted: 2 tokens)
    assert [spec.choose_k(8, lambda k: 1.0) for _ in range(5)] == [0, 0, 0, 0, 2]
    assert spec.proposed == 54 and spec.accepted == 18


def test_one_rejected_proposal_does_not_stop_free_ones():
    """A kind whose first proposal was rejected keeps a share of the prior in its estimate: where a second row costs
    nothing (AVX-512, a small model) it still proposes one token instead of pausing; where rows cost, it pauses."""
    spec = Speculation(SpeculationConfig(), "ngram")
    spec.kind = 3
    spec.record(2, 0)
    assert 0 < spec.acceptance < 0.2
    assert spec.choose_k(8, lambda k: 1.0 if k == 1 else 1.0 + 0.15 * k) == 1 and spec.paused == 0
    assert spec.choose_k(8, lambda k: 1.0 + 0.3 * k) == 0 and spec.paused > 0


def test_guesses_that_fail_do_not_pause_a_copy():
    """Prompt lookup judges its proposals by the length of the suffix they follow: one-token matches that keep
    failing pause themselves, while a four-token match (text being copied) is proposed at once."""
    spec = Speculation(SpeculationConfig(backoff=16), "ngram")
    cost = lambda k: 1.0 + 0.3 * k                 # an extra row: 0.3 of a step
    guess = [5, 1, 2, 3, 4, 9, 5]                  # "5" again: it proposes what followed the first 5
    assert spec.propose_ngram(guess, 8, cost) == [1]   # a one-token match (the prior, 60%, pays for one row)
    assert spec.kind == 1
    spec.record(1, 0)
    assert spec.propose_ngram(guess, 8, cost) == [] and spec.paused == 16   # rejected: one-token guesses pause
    copy = guess + [1, 2, 3]                       # "5 1 2 3" was written before: copying
    assert spec.propose_ngram(copy, 8, cost) == [4] and spec.kind == 4   # a four-token match: its own prior
    spec.record(1, 1)
    assert spec.propose_ngram(copy + [4], 8, cost) == [9, 5, 1, 2]   # accepted: k doubles the run (1 + 1)
    assert spec.propose_ngram(copy + [4, 7, 5], 8, cost) == [] and spec.kind == 1 and spec.paused == 15
    # (a guess again: its pause runs on)
    assert spec.proposed == 2 and spec.accepted == 1


def test_a_guess_proposes_one_token_unless_rows_are_cheap():
    """A one-token match is a guess: it proposes one token even after a guess held (its estimate then 0.92), and the
    token after a guess that held is weighed as a two-token match's. Where rows cost little it proposes on."""
    costly = lambda k: 1.0 + 0.3 * k  # noqa: E731   (an extra row: 0.3 of a step)
    spec = Speculation(SpeculationConfig(), "ngram")
    tokens = [5, 1, 2, 3, 4, 6, 7, 8, 9, 5]
    assert spec.propose_ngram(tokens, 8, costly) == [1] and spec.kind == 1
    spec.record(1, 1)
    assert spec.acceptance == pytest.approx((1 + 0.6 * 0.25) / (1 + 0.25))
    assert spec.propose_ngram(tokens + [1], 8, costly) == [2] and spec.kind == 2   # the two-token kind's prior
    later = tokens + [1, 2, 0, 7]                  # "7" once before: another guess
    assert spec.propose_ngram(later, 8, costly) == [8] and spec.kind == 1   # one token, not 2 * (1 + 1)
    assert spec.propose_ngram(later, 8, lambda k: 1.0 + 0.05 * k) == [8, 9, 5, 1]   # cheap rows: up to the cap


def test_in_a_batch_the_rows_a_sequence_adds_are_weighed_against_the_whole_step():
    """Every sequence of a batch waits for one sequence's extra rows: on a compute-bound step (64 sequences, each
    row its 64th of the time) even proposals that are always accepted do not pay; on a memory-bound one they do;
    alone, the same costs pay."""
    def sure():
        spec = Speculation(SpeculationConfig(k_max=8), "ngram")
        for _ in range(4):
            spec.record(4, 4)
        return spec

    compute_bound = lambda k: (64 + k) / 64  # noqa: E731
    assert sure().choose_k(8, compute_bound, batch=64) == 0
    fresh = Speculation(SpeculationConfig(k_max=8), "ngram")      # never measured: no probe where none could pay,
    assert fresh.choose_k(8, compute_bound, batch=64) == 0 and fresh.paused == 0   # and no pause: batches change
    assert fresh.choose_k(8, compute_bound, batch=1) > 0
    assert sure().choose_k(8, lambda k: 1 + 0.001 * k, batch=64) == 8
    assert sure().choose_k(8, compute_bound, batch=1) == 8


def test_step_times_interpolate_and_fall_back_on_the_prior():
    t = StepTimes(row_cost=0.2)
    assert t.ratio(1, 3) == pytest.approx(1.6)        # nothing measured: the prior
    for _ in range(StepTimes.SETTLE):
        t.record(1, 0.010)
    assert t.ratio(1, 2) == pytest.approx(1.4)        # one point: the prior's slope from it
    for _ in range(StepTimes.SETTLE):
        t.record(5, 0.020)
    assert t.estimate(3) == pytest.approx(0.015)      # between measured points: linear
    assert t.ratio(1, 4) == pytest.approx(2.0)
    t.record(1, 0.014)
    t.record(1, 0.500)                                # a step slowed by another process: the median stays
    assert t.estimate(1) == pytest.approx(0.010)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 3) == 4


def test_one_slow_step_does_not_stop_speculation_for_good():
    """The first 2-row step paid one-off costs (3x a 1-row step): it does not stand for 2 rows until more 2-row
    steps were measured, so proposals go on, measure them, and pay once they do."""
    t = StepTimes(row_cost=0.15)
    for _ in range(5):
        t.record(1, 0.010)
    t.record(2, 0.030)
    spec = Speculation(SpeculationConfig(), "ngram")
    spec.kind = 3
    assert spec.choose_k(1, lambda k: t.ratio(1, k)) == 1   # a one-token match: room for one proposal
    t.record(2, 0.011)
    t.record(2, 0.011)
    assert t.ratio(1, 1) == pytest.approx(1.1)
    assert spec.choose_k(1, lambda k: t.ratio(1, k)) == 1
    slow = StepTimes(row_cost=0.15)                   # rows that do cost that much: settled, the proposals stop
    for rows, seconds in [(1, 0.010)] * 5 + [(2, 0.030)] * 3 + [(3, 0.045)] * 3:
        slow.record(rows, seconds)
    assert Speculation(SpeculationConfig(), "ngram").choose_k(1, lambda k: slow.ratio(1, k)) == 0


def test_a_batchs_step_cost_is_a_line_through_noisy_measurements():
    """From StepTimes.BATCH rows on, neighbours' medians that disagree by more than a row costs (here 38 rows
    measured faster than 36) do not make extra rows look free: the ratio comes from a line through them all."""
    import random

    rng, t = random.Random(0), StepTimes(row_cost=0.15)
    for n in range(2, 80, 3):
        for _ in range(StepTimes.SETTLE):
            t.record(n, (0.01 + 0.002 * n) * rng.uniform(0.9, 1.1))
    for _ in range(StepTimes.SETTLE):
        t.record(36, 0.090)
        t.record(38, 0.080)
    assert t.estimate(38) < t.estimate(36)                       # the measurements alone: an extra row is free
    for base, extra in ((36, 2), (64, 5), (12, 1)):
        want = (0.01 + 0.002 * (base + extra)) / (0.01 + 0.002 * base)
        assert t.ratio(base, extra) == pytest.approx(want, rel=0.03)
    assert t.ratio(1, 2) == pytest.approx(t.estimate(3) / t.estimate(1))   # one stream: the measured points
    steep = StepTimes(row_cost=0.15)       # costs that grow faster than the rows: no line starts below zero
    for n in range(2, 80, 3):
        steep.record(n, 0.001 * n * n)
    assert steep.ratio(36, 4) == pytest.approx(40 / 36)


def test_the_policy_replay_decides_on_the_costs_it_is_given():
    """benchmarks/spec_policy.py charges each step the given cost of its rows, and the policy must choose k on
    those same costs: with one record per row count (none settled) it chose on the prior's 0.15 a row, so a replay
    at costs where extra rows do not pay proposed anyway and read below 1x."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        from spec_policy import replay
    finally:
        sys.path.pop(0)
    ids = list(range(100, 160))
    reply = ids[:40]                      # a reply that copies the prompt: every proposal after the first holds
    expensive = {n: 1.0 * n for n in range(1, 10)}           # a row costs a whole step: no k pays
    cheap = {n: 1.0 + 0.05 * (n - 1) for n in range(1, 10)}
    assert replay(ids, reply, expensive, 64)["proposed"] <= 1   # at most the one probe of an unjudged kind
    assert replay(ids, reply, cheap, 64)["gain"] > 3

# ---------------------------------------------------------------------------------- verification
def test_greedy_verification_keeps_the_agreeing_prefix_then_the_targets_token():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 2]):
        logits[row, best] = 1.0
    sp = SamplingParams(temperature=0)
    assert verify(logits.clone(), [3, 5, 7], sp, None) == [3, 5, 7, 2]   # all accepted, plus the bonus token
    assert verify(logits.clone(), [3, 6, 7], sp, None) == [3, 5]         # the second is rejected: corrected
    assert verify(logits.clone(), [4, 5, 7], sp, None) == [3]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target gives no probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# The 0.999 quantile of chi-square for 7 degrees of freedom (8 tokens): a correct sampler fails once in 1000
# seeds; the test is seeded, so it is deterministic.
CHI2_7_999 = 24.32


@pytest.mark.parametrize("draft_kind", ["ngram", "draft-model"])
@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.8),
                                SamplingParams(temperature=1.3, top_k=5, top_p=0.9, repetition_penalty=1.4)],
                         ids=["temperature", "top-k-top-p-penalty"])
def test_speculative_sampling_follows_the_targets_distribution(draft_kind, sp):
    """Rejection sampling: the first emitted token follows the target's row 0 exactly as plain sampling does, and
    the second (after the first proposal was accepted) row 1 — whatever the proposals and their distribution."""
    vocab, n = 8, 12000
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(3, vocab, generator=gen) * 1.5
    draft = [2, 5]       # a deterministic proposer's; a draft model's are drawn from q below
    history = ([1, 2, 2, 7], 2)
    q = None
    if draft_kind == "draft-model":
        q = torch.softmax(torch.randn(2, vocab, generator=gen), -1)
    # The target's distributions as plain sampling draws them: the Sampler's own penalties, then temperature,
    # top-k and top-p, per row with the row's history (the ids and the proposals before it).
    from nanochat.engine.sampler import apply_penalties, target_probs
    rows = logits.clone()
    if sp.penalized:
        apply_penalties(rows, [0, 1], [sp, sp], [history, (history[0] + draft[:1], history[1])])
    p0, p1 = target_probs(rows[0], sp), target_probs(rows[1], sp)
    firsts, seconds = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(n):
        if q is not None:   # a draft model's proposals are its own samples
            draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        out = verify(logits.clone(), draft, sp, gen, history, q)
        firsts[out[0]] += 1
        if len(out) > 1 and draft[0] == 2:   # the first proposal (2, as row 1's history says) was accepted
            seconds[out[1]] += 1
    assert _chi_square(firsts, p0) < CHI2_7_999
    assert seconds.sum() > 500
    assert _chi_square(seconds, p1) < CHI2_7_999
    # And plain sampling from the same row, for scale: the same test passes for it.
    plain = torch.zeros(vocab)
    sampler = Sampler()
    for _ in range(2000):
        plain[sampler(logits[:1].clone(), [sp], [gen], [history])[0]] += 1
    assert _chi_square(plain, p0) < CHI2_7_999


# ---------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    """Dense HF (module path), a GGUF on the fused CPU path, Gemma 3 (windowed and global layers: two KV
    groups) and gpt-oss (sinks, alternating windows, MoE)."""
    from gguf_writer import write_gguf_from_hf
    from test_gemma3 import make_gemma3
    from test_gpt_oss import make_gpt_oss

    from gguf import GGMLQuantizationType as T

    root = tmp_path_factory.mktemp("speculative")
    gguf = root / "llama" / "model.gguf"
    gguf.parent.mkdir()
    write_gguf_from_hf(tiny_models["llama"], gguf, "llama", T.Q8_0)
    shutil.copy(tiny_models["llama"] / "tokenizer.json", gguf.parent / "tokenizer.json")
    return {"qwen3-hf": tiny_models["qwen3"], "llama-gguf": gguf, "gemma3": make_gemma3(root / "gemma3"),
            "gpt-oss": make_gpt_oss(root / "gpt_oss")}


def engine_for(path, **cfg) -> LLMEngine:
    """An engine that speculates with prompt lookup unless told otherwise, on every model (HF folders' dense weights
    on the q8 kernels' dense tiles: the rows of a step are exact, as GGUF weights' are)."""
    cfg = {"kvcache_block_size": 16, "max_model_len": 256, "speculative": "ngram", **cfg}
    return LLMEngine(str(path), dtype="float32", **cfg)


def drain(engine: LLMEngine, rids: list[str], check=None) -> dict[str, list[int]]:
    out = {rid: [] for rid in rids}
    done = set()
    while len(done) < len(rids):
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev.token_id)
            if ev.finished:
                done.add(ev.request_id)
        if check is not None:
            check(engine)
    return out


def plain(path, prompts, sp=GREEDY) -> list[list[int]]:
    engine = engine_for(path, speculative="off")
    rids = [engine.add_request(p, sp) for p in prompts]
    out = drain(engine, rids)
    return [out[r] for r in rids]


class Oracle:
    """Proposes plain decoding's own continuation, corrupted at random: long runs of accepted proposals, and
    rejections at every position of a draft."""

    def __init__(self, engine: LLMEngine, expected: dict[tuple[int, ...], list[int]], seed: int = 0):
        self.expected, self.rng = expected, random.Random(seed)
        self.engine = engine

    def __call__(self, seq, room: int) -> list[int]:
        room = min(room, seq.sampling_params.max_tokens - seq.num_completion_tokens - 1,
                   self.engine.config.max_model_len - len(seq) - 1)
        prompt = tuple(seq.token_ids[:seq.num_prompt_tokens])
        done = seq.num_completion_tokens
        draft = self.expected[prompt][done:done + self.rng.randint(0, min(room, 7))] if room > 0 else []
        if draft and self.rng.random() < 0.5:
            draft[self.rng.randrange(len(draft))] = self.rng.randrange(300)
        return draft


def table_fits(engine: LLMEngine) -> None:
    """No sequence keeps blocks past its end between steps (rejected proposals' blocks went back)."""
    bm = engine.block_manager
    for seq in engine.scheduler.running:
        assert len(seq.block_table) <= bm.num_blocks_for(len(seq)), (len(seq.block_table), len(seq))


@pytest.mark.parametrize("name", ["qwen3-hf", "llama-gguf", "gemma3", "gpt-oss"])
@pytest.mark.parametrize("setting", ["batched", "preempted", "chunked"])
def test_greedy_tokens_equal_plain_decoding_whatever_is_proposed(models, name, setting):
    path = models[name]
    expected = plain(path, PROMPTS)
    extra = {"batched": {}, "preempted": {"num_kvcache_blocks": 8}, "chunked": {"max_num_batched_tokens": 8}}
    engine = engine_for(path, **extra[setting])
    engine._propose = Oracle(engine, {tuple(p): e for p, e in zip(PROMPTS, expected)})
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    out = drain(engine, rids, check=table_fits)
    assert [out[r] for r in rids] == expected
    stats = engine.stats()
    assert 0 < stats.total_spec_accepted < stats.total_spec_proposed   # accepted runs and rejections both ran
    if setting == "preempted":
        assert engine.scheduler.num_preemptions > 0
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == len(bm.blocks)
    if bm.wpool is not None:
        assert bm.wpool.num_free_blocks == len(bm.wpool.blocks)
    # A second run of the same prompts hits the prefix cache: only accepted tokens were hashed, so the hits
    # (prompt + reply blocks) hold the right KV and the replies are the same again.
    del engine._propose   # the engine's own proposer from here
    again = engine.add_request(PROMPTS[2] + expected[2], GREEDY)
    follow = drain(engine, [again])[again]
    assert follow == plain(path, [PROMPTS[2] + expected[2]])[0]


def test_logit_bias_steers_plain_decoding_and_verification_alike(models):
    """A -100 bias bans tokens from greedy replies; proposals of plain decoding's unbiased tokens (banned ones among
    them) are rejected where the bias says so, leaving the biased plain tokens. An id past the vocabulary is
    refused when the request is added."""
    from dataclasses import replace

    from nanochat.engine.output import RequestError

    path = models["llama-gguf"]
    unbiased = plain(path, PROMPTS)
    banned = {unbiased[0][0], unbiased[1][0], unbiased[2][3]}
    sp = replace(GREEDY, logit_bias={t: -100 for t in banned})
    expected = plain(path, PROMPTS, sp)
    assert expected != unbiased and not banned & {t for out in expected for t in out}
    engine = engine_for(path)
    engine._propose = Oracle(engine, {tuple(p): e for p, e in zip(PROMPTS, unbiased)})
    rids = [engine.add_request(p, sp) for p in PROMPTS]
    out = drain(engine, rids)
    assert [out[r] for r in rids] == expected
    assert engine.stats().total_spec_proposed > 0
    with pytest.raises(RequestError, match="past the vocabulary"):
        engine.add_request(PROMPTS[0], replace(GREEDY, logit_bias={10 ** 6: 1.0}))


def test_chat_sessions_with_the_ngram_proposer_match_plain_decoding(models):
    """Multi-turn chats whose replies repeat earlier turns (the n-gram proposer's case): the same tokens with and
    without speculation, each turn prefilling only its new message."""
    from test_chat_session import run_turn

    from nanochat.engine.serve.session import ChatSession

    turns = ["1 2 3 4 5 6 7 8 9 10 11 12", "1 2 3 4 5 6 7 8 9 10 11 12 13 14", "again: 1 2 3 4 5 6 7 8"]
    replies = {}
    for mode in ("off", "ngram"):
        engine = engine_for(models["qwen3-hf"], speculative=mode, max_model_len=512)
        session = ChatSession(engine.tokenizer, engine.loaded.chat_template, session_id="s")
        replies[mode] = [run_turn(engine, session, t, SamplingParams(temperature=0, max_tokens=30))[1:]
                         for t in turns]
        replies[mode] = [(gen, final.stats.prompt_tokens - final.stats.cached_tokens) for gen, final in replies[mode]]
        if mode == "ngram":
            assert engine.total_spec_proposed > 0
        engine.release_session("s")
        engine.block_manager.check_invariants()
        assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    assert replies["ngram"] == replies["off"]


def test_a_speculating_engine_reports_acceptance_and_tokens_per_step(models):
    path = models["llama-gguf"]
    expected = plain(path, PROMPTS[:1])
    engine = engine_for(path)
    oracle = Oracle(engine, {tuple(PROMPTS[0]): expected[0]}, seed=3)
    engine._propose = oracle
    engine.add_request(PROMPTS[0], GREEDY)
    final = None
    while final is None:
        final = next((e for e in engine.step() if e.finished), None)
    stats = engine.stats()
    assert 0 < stats.spec_acceptance < 1
    assert stats.spec_tokens_per_step > 1.0
    assert stats.total_decode_tokens == GREEDY.max_tokens - 1   # the first token came from the prefill
    assert final.stats.completion_tokens == GREEDY.max_tokens


def test_real_proposer_runs_in_the_engine_and_counts_per_request(models):
    """A prompt that repeats itself: the n-gram proposer finds matches and the request's stats count them."""
    engine = engine_for(models["qwen3-hf"])
    prompt = [7, 8, 9, 10, 11] * 6
    rid = engine.add_request(prompt, GREEDY)
    out = drain(engine, [rid])
    assert out[rid] == plain(models["qwen3-hf"], [prompt])[0]
    assert engine.total_spec_proposed > 0


def test_which_requests_speculate(models, tiny_models):
    engine = engine_for(models["qwen3-hf"])
    cases = {"greedy": GREEDY, "unseeded": SamplingParams(temperature=0.7), "off": SamplingParams(speculative="off"),
             "seeded": SamplingParams(temperature=0.7, seed=1)}
    modes = {}
    for name, sp in cases.items():
        rid = engine.add_request([1, 2, 3], sp)
        spec = engine.requests[rid].seq.spec
        modes[name] = spec.mode if spec else "off"
        engine.abort(rid)
    # A seed promises the same tokens every run: such a request runs plainly.
    assert modes == {"greedy": "ngram", "unseeded": "ngram", "off": "off", "seeded": "off"}
    with pytest.raises(ValueError, match="draft model"):
        engine.add_request([1, 2, 3], SamplingParams(speculative="draft"))
    assert engine_for(models["qwen3-hf"], speculative="off").speculative == "off"


def test_auto_speculates_where_rows_are_exact(models):
    """auto: prompt lookup where every matmul is on the CPU kernels (GGUF blocks, HF folders' dense weights in their
    own type); torch's GEMMs (quant_backend dense, dequantize, int4) decode plainly unless a request asks (a
    proposal's rows could round otherwise than a decode row)."""
    auto = {"speculative": "auto"}
    assert engine_for(models["llama-gguf"], **auto).speculative == "ngram"
    assert engine_for(models["llama-gguf"], **auto, quant_backend="int4").speculative == "off"
    assert engine_for(models["qwen3-hf"], **auto).speculative == "ngram"
    assert engine_for(models["qwen3-hf"], **auto, dequantize=True).speculative == "off"
    assert engine_for(models["qwen3-hf"], **auto, quant_backend="dense", batch_invariant=True).speculative == "ngram"
    dense = engine_for(models["qwen3-hf"], **auto, quant_backend="dense")
    assert dense.speculative == "off"
    rid = dense.add_request([1, 2, 3], SamplingParams(speculative="ngram"))
    assert dense.requests[rid].seq.spec.mode == "ngram"


@pytest.mark.parametrize("kw, msg", [({"speculative": "maybe"}, "speculative must be off, ngram or draft")])
def test_sampling_params_check_the_proposer(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, msg", [({"speculative": ""}, "speculative must be auto, off, ngram"),
                                     ({"speculative": "draft"}, "speculative must be"),
                                     ({"speculative_k": 0}, "speculative_k must be from 1 to 32")])
def test_config_checks_the_proposer(kw, msg):
    from nanochat.engine import Config
    with pytest.raises(ValueError, match=msg):
        Config.create("x", **kw)


# ---------------------------------------------------------------------------------- a draft model
@pytest.fixture
def fixed_k(monkeypatch):
    """Propose 4 tokens every step (the real choice of k stops a draft as costly as its target)."""
    monkeypatch.setattr(Speculation, "choose_k", lambda self, room, ratio, batch=1: min(room, 4))


def draft_free(engine: LLMEngine) -> None:
    blocks = engine.draft.blocks
    blocks.check_invariants()
    assert not engine.draft.seqs
    assert blocks.num_free_blocks == len(blocks.blocks)


@pytest.mark.parametrize("setting", ["batched", "preempted", "chunked"])
def test_a_draft_model_keeps_greedy_tokens(models, tiny_models, fixed_k, setting):
    """The tiny Llama drafting for the tiny Qwen3 (same tokenizer, other weights: mostly rejected) and Qwen3 drafting
    for itself (everything accepted): plain decoding's tokens either way."""
    path = models["qwen3-hf"]
    expected = plain(path, PROMPTS)
    extra = {"batched": {}, "preempted": {"num_kvcache_blocks": 8}, "chunked": {"max_num_batched_tokens": 8}}
    for draft, accepted_all in ((tiny_models["llama"], False), (path, True)):
        engine = engine_for(path, speculative=str(draft), **extra[setting])
        rids = [engine.add_request(p, GREEDY) for p in PROMPTS]
        out = drain(engine, rids, check=table_fits)
        assert [out[r] for r in rids] == expected
        stats = engine.stats()
        assert stats.total_spec_proposed > 0
        if accepted_all:
            assert stats.total_spec_accepted == stats.total_spec_proposed
        if setting == "preempted":
            assert engine.scheduler.num_preemptions > 0
        engine.block_manager.check_invariants()
        draft_free(engine)


def test_a_draft_models_samples_are_accepted_when_it_is_the_target(models, fixed_k):
    """Drafting with the target's own weights, q equals p: (nearly) every sampled proposal is accepted."""
    path = models["llama-gguf"]
    engine = engine_for(path, speculative=str(path))
    rids = [engine.add_request(p, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True))
            for p in PROMPTS]
    out = drain(engine, rids)
    assert all(len(v) == 24 for v in out.values())
    stats = engine.stats()
    assert stats.total_spec_accepted >= 0.9 * stats.total_spec_proposed > 0
    draft_free(engine)


def test_a_draft_model_keeps_its_own_chat_sessions(models, tiny_models, fixed_k):
    from test_chat_session import run_turn

    from nanochat.engine.serve.session import ChatSession

    engine = engine_for(models["qwen3-hf"], speculative=str(tiny_models["llama"]), max_model_len=512)
    session = ChatSession(engine.tokenizer, engine.loaded.chat_template, session_id="s")
    for turn in ("hello there", "tell me more", "and again"):
        run_turn(engine, session, turn, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    draft = engine.draft.blocks
    assert "s" in draft.sessions                      # the draft's KV of the conversation stays with it
    assert draft.counters.hit_tokens > 0              # and later turns' drafts started from it
    engine.release_session("s")
    draft_free(engine)


def test_a_draft_model_with_another_tokenizer_is_refused(models, tmp_path):
    from conftest import build_tokenizer, make_hf_model
    other = make_hf_model("llama", tmp_path / "other", seed=9, vocab_size=330)
    build_tokenizer(330).save(str(other / "tokenizer.json"))
    with pytest.raises(ValueError, match="does not share the model's tokenizer"):
        engine_for(models["qwen3-hf"], speculative=str(other))
