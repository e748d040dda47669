"""Sampling filters: `candidates` against a sort-the-whole-vocabulary reference, seeded sampling, and the
repetition / presence / frequency penalties against transformers and a per-row reference, and the logit bias."""

from __future__ import annotations

import pytest
import torch

from nanochat.engine.sampler import (FIRST_GUESS, Sampler, TokenHistory, apply_penalties, argmax_rows, candidates,
                                     draw, filtered_probs, sample_rows, target_probs, verify)
from nanochat.engine.sampling_params import SamplingParams


def reference(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities over the whole vocabulary after top-k then top-p (zeros where filtered)."""
    logits = row.clone()
    if 0 < top_k < row.shape[-1]:
        logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
    if top_p < 1.0:
        srt, order = torch.sort(logits, descending=True)
        p = srt.softmax(-1)
        drop = torch.zeros_like(p, dtype=torch.bool).scatter(0, order, p.cumsum(-1) - p >= top_p)
        logits[drop] = float("-inf")
    return logits.softmax(-1)


def _mass_before(row: torch.Tensor, top_k: int, token: int) -> float:
    """Probability (top-k distribution, float64) of the tokens more likely than `token`."""
    logits = row.double()
    if 0 < top_k < row.shape[-1]:
        logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
    p = logits.softmax(-1)
    return float(p[p > p[token]].sum())


@pytest.mark.parametrize("peak", [0.5, 3.0, 12.0], ids=["flat", "moderate", "peaked"])
@pytest.mark.parametrize("top_k,top_p", [(-1, 0.95), (-1, 0.5), (-1, 0.999), (40, 1.0), (40, 0.9), (1, 0.9),
                                         (5000, 0.99)])
def test_candidates_match_full_sort(peak, top_k, top_p):
    g = torch.Generator().manual_seed(int(peak * 100) + top_k)
    for _ in range(5):
        row = torch.randn(49152, generator=g) * peak
        ids, probs = candidates(row, top_k, top_p)
        want = reference(row, top_k, top_p)
        got = torch.zeros_like(want).index_put_((ids,), probs)
        # The sets agree but for a token whose preceding mass is top_p to float rounding (either
        # summation order may keep it); such a token carries little mass.
        for tok in set(ids.tolist()) ^ set(torch.nonzero(want).flatten().tolist()):
            assert abs(_mass_before(row, top_k, tok) - top_p) < 1e-4
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)
        assert bool((probs[:-1] >= probs[1:]).all())     # most likely first


def test_candidates_widen_past_the_first_guess():
    row = torch.zeros(10_000)                     # flat: the nucleus is far larger than FIRST_GUESS
    ids, probs = candidates(row, -1, 0.5)
    assert len(ids) in (5000, 5001) and len(ids) > FIRST_GUESS   # 0.5 of the mass (+1 by rounding)
    assert candidates(row, -1, 1.0) is None and candidates(row, 0, 1.0) is None


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]]).repeat(1, 1)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=-1, seed=7)
    draws = [Sampler()(logits, [sp], [torch.Generator().manual_seed(s)])[0] for s in range(4000)]
    again = [Sampler()(logits, [sp], [torch.Generator().manual_seed(s)])[0] for s in range(4000)]
    assert draws == again
    want = reference(logits[0], -1, 0.9)
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    assert freq[4] == 0 and freq[3] == 0          # outside the nucleus: never drawn
    torch.testing.assert_close(freq, want, atol=0.03, rtol=0)


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = [draw(probs * 3, g) for _ in range(4000)]       # any positive total
    freq = torch.bincount(torch.tensor(draws), minlength=6).float() / len(draws)
    assert freq[0] == 0 and freq[2] == 0 and freq[5] == 0
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_unfiltered_sampling_over_a_large_vocabulary():
    """No top-k / top-p: the whole softmax, here a 151,936-token row with three likely tokens."""
    logits = torch.full((1, 151_936), -30.0)
    logits[0, [7, 70_000, 151_935]] = torch.tensor([2.0, 1.0, 0.0])
    sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1)
    draws = torch.tensor([Sampler()(logits, [sp], [torch.Generator().manual_seed(s)])[0] for s in range(1500)])
    want = torch.tensor([2.0, 1.0, 0.0]).softmax(-1)
    got = torch.stack([(draws == i).float().mean() for i in (7, 70_000, 151_935)])
    assert got.sum() == 1.0
    torch.testing.assert_close(got, want, atol=0.04, rtol=0)


def test_the_batched_filters_give_each_rows_own_distribution():
    """The GPU's batched path (filtered_probs): per row, the distribution the per-row path draws from, rows with
    and without filters mixed in one batch."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g) * torch.tensor([0.5, 2.0, 4.0, 1.0, 8.0, 3.0])[:, None]
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.2, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.9, top_k=50, top_p=0.6),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.5, top_k=1000, top_p=0.999)]
    probs, ids = filtered_probs(logits, params)
    full = torch.zeros_like(probs).scatter_(1, ids, probs)
    for i, sp in enumerate(params):
        torch.testing.assert_close(full[i], target_probs(logits[i], sp), atol=1e-6, rtol=0)
    plain, none = filtered_probs(logits[:1], params[:1])     # no filter anywhere: no sort
    assert none is None
    torch.testing.assert_close(plain[0], target_probs(logits[0], params[0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=3, top_p=0.9)],
                         ids=["temperature", "top-k-top-p"])
def test_batched_draws_follow_the_distribution_and_their_seeds(sp):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    want = target_probs(logits[0], sp)
    draws = [sample_rows(logits, [sp], [torch.Generator().manual_seed(s)])[0] for s in range(4000)]
    assert draws == [sample_rows(logits, [sp], [torch.Generator().manual_seed(s)])[0] for s in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=6).float() / len(draws)
    assert (freq[want == 0] == 0).all()
    torch.testing.assert_close(freq, want, atol=0.03, rtol=0)


# ---------------------------------------------------------------- penalties

def reference_penalties(row: torch.Tensor, ids: list[int], num_prompt: int, sp: SamplingParams) -> torch.Tensor:
    """One row penalized the slow way: transformers' RepetitionPenaltyLogitsProcessor over prompt +
    generated ids, then vLLM's frequency / presence penalties counted over the generated ids."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    out = row.clone()
    if sp.repetition_penalty != 1.0 and ids:
        out = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(torch.tensor([ids]), out[None])[0]
    counts: dict[int, int] = {}
    for t in ids[num_prompt:]:
        counts[t] = counts.get(t, 0) + 1
    for t, n in counts.items():
        out[t] -= sp.frequency_penalty * n + sp.presence_penalty
    return out


def _history(g: torch.Generator, vocab: int, n_prompt: int, n_gen: int) -> list[int]:
    # Draw from a small range so ids repeat (within and across prompt and generated).
    hot = torch.randint(vocab, (24,), generator=g)
    return hot[torch.randint(24, (n_prompt + n_gen,), generator=g)].tolist()


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    g = torch.Generator().manual_seed(int(penalty * 10))
    vocab, rows = 1000, 6
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, :10] = 0.0                                   # zero logits: unchanged either way
    sp = SamplingParams(temperature=0, repetition_penalty=penalty)
    hist = [(_history(g, vocab, 5 + 7 * i, 3 * i), 5 + 7 * i) for i in range(rows)]
    hist[0] = (list(range(10)) + hist[0][0], 15)           # the zero logits are in a history too
    got = logits.clone()
    apply_penalties(got, list(range(rows)), [sp] * rows, hist)
    for i, (ids, _) in enumerate(hist):
        want = reference_penalties(logits[i], ids, 0, sp)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=0)   # the same fp32 divide / multiply


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.4), (-2.0, 2.0)])
def test_presence_and_frequency_match_a_per_row_reference(presence, frequency):
    g = torch.Generator().manual_seed(17)
    vocab, rows = 151936, 4
    logits = torch.randn(rows, vocab, generator=g)
    sp = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    hist = [(_history(g, vocab, 9, n_gen), 9) for n_gen in (0, 1, 40, 300)]
    got = logits.clone()
    apply_penalties(got, list(range(rows)), [sp] * rows, hist)
    for i, (ids, n_prompt) in enumerate(hist):
        want = reference_penalties(logits[i], ids, n_prompt, sp)
        # float32 rounding of f * count + p (up to ~600) subtracted from logits of a few units
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-4)
    assert torch.equal(got[0], logits[0])                  # nothing generated yet: nothing penalized


def test_a_mixed_batch_equals_its_rows_sampled_one_by_one():
    """Penalized and plain rows, greedy and sampled, in one call: each row equals the reference
    penalties followed by the same row sampled alone without them; plain rows are left untouched."""
    g = torch.Generator().manual_seed(3)
    vocab = 49152
    rows = [
        SamplingParams(temperature=0),                                              # plain greedy
        SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.3),  # penalized greedy
        SamplingParams(temperature=0.8, top_k=40, seed=1),                          # plain sampled
        SamplingParams(temperature=0.7, top_p=0.9, frequency_penalty=1.0, seed=2),  # penalized sampled
        SamplingParams(temperature=1.0, repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0, frequency_penalty=2.0),
    ]
    logits = torch.randn(len(rows), vocab, generator=g) * 4
    hist = [None if not sp.penalized else (_history(g, vocab, 20, 30), 20) for sp in rows]
    for i, h in enumerate(hist):       # make the penalties matter: a generated id just tops each row
        if h is not None:
            logits[i, h[0][-1]] = logits[i].max() + 0.5
    batch = logits.clone()
    got = Sampler()(batch, rows, [torch.Generator().manual_seed(100 + i) for i in range(len(rows))], hist)
    for i, sp in enumerate(rows):
        row = logits[i] if hist[i] is None else reference_penalties(logits[i], *hist[i], sp)
        plain = SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)
        want = Sampler()(row[None].clone(), [plain], [torch.Generator().manual_seed(100 + i)])[0]
        assert got[i] == want, f"row {i}"
        assert torch.equal(batch[i], logits[i]) == (not sp.penalized)   # penalized in place, the rest untouched
    assert got[1] != int(logits[1].argmax()) and got[5] != int(logits[5].argmax())  # the penalties mattered


def test_argmax_rows_equals_torch_on_ties_nans_views_and_other_dtypes():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (9, 513), generator=g).float()     # many ties: the first must win
    logits[2, 7] = logits[4, 0] = logits[4, 9] = float("nan")          # NaN counts as the largest
    logits[5] = -float("inf")
    with torch.inference_mode():
        for x in (logits, logits[1:7], logits[:, 100:], logits.T.contiguous().T, logits[3], logits.double(),
                  logits.half()):
            assert argmax_rows(x) == x.argmax(-1).tolist()


def test_greedy_takes_the_argmax_after_a_repetition_penalty():
    logits = torch.tensor([[1.0, 3.0, 2.5, -1.0]])
    hist = [([1, 1], 1)]
    assert Sampler()(logits.clone(), [SamplingParams(temperature=0)], [None], hist) == [1]
    sp = SamplingParams(temperature=0, repetition_penalty=1.3)           # 3.0 / 1.3 < 2.5
    assert Sampler()(logits.clone(), [sp], [None], hist) == [2]
    sp = SamplingParams(temperature=0, presence_penalty=0.2, frequency_penalty=0.2)   # 3.0 - 0.2 - 0.2 > 2.5
    assert Sampler()(logits.clone(), [sp], [None], hist) == [1]


def test_penalties_skip_ids_past_the_logits_and_need_a_history():
    logits = torch.zeros(1, 8)
    logits[0, 2] = 4.0
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    got = logits.clone()
    apply_penalties(got, [0], [sp], [([2, 9], 1)])         # 9: an embedding row the head does not have
    assert got[0, 2] == 2.0 and got[0, 3:].eq(0).all()
    with pytest.raises(ValueError, match="history"):
        Sampler()(logits.clone(), [sp], [None])
    assert Sampler()(logits.clone(), [SamplingParams(temperature=0)], [None]) == [2]   # no penalty: no history


def test_token_history_mirrors_an_append_only_list():
    hist, ids = TokenHistory(), [5, 6, 7]
    assert hist.sync(ids).tolist() == ids
    for t in range(200):                                   # grows past its first buffer
        ids.append(t)
        view = hist.sync(ids)
        assert view.dtype == torch.int64 and view.tolist() == ids
    assert hist.sync(ids[:10]).tolist() == ids[:10]        # a shorter list resyncs instead of going stale


@pytest.mark.parametrize("kw, msg", [
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty="1.2"), "repetition_penalty"), (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(frequency_penalty=3), "frequency_penalty"),
    (dict(frequency_penalty=float("-inf")), "frequency_penalty"), (dict(frequency_penalty=None), "frequency_penalty"),
])
def test_penalty_validation(kw, msg):
    with pytest.raises(ValueError, match=msg) as info:
        SamplingParams(**kw)
    assert "\n" not in str(info.value)


def test_penalty_params_are_plain_fields():
    import pickle

    sp = SamplingParams(repetition_penalty=1, presence_penalty=-2, frequency_penalty=2)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, -2.0, 2.0)
    assert isinstance(sp.repetition_penalty, float) and sp.penalized
    assert pickle.loads(pickle.dumps(sp)) == sp
    assert not SamplingParams().penalized and not SamplingParams(repetition_penalty=1.0).penalized


def test_logit_bias_moves_greedy_sampling_and_verification_alike():
    logits = torch.tensor([[1.0, 3.0, 2.5, -1.0]])
    assert Sampler()(logits.clone(), [SamplingParams(temperature=0, logit_bias={1: -100})], [None]) == [2]
    assert Sampler()(logits.clone(), [SamplingParams(temperature=0, logit_bias={3: 5})], [None]) == [3]   # 4 > 3
    gen = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=1.0, logit_bias={1: -100, 2: -100})
    assert {Sampler()(logits.clone(), [sp], [gen])[0] for _ in range(300)} == {0, 3}   # banned ones never drawn
    mixed = Sampler()(torch.cat([logits, logits]), [SamplingParams(temperature=0, logit_bias={1: -100}),
                                                    SamplingParams(temperature=0)], [None, None])
    assert mixed == [2, 1]                                  # a row's bias is its own
    rows = torch.tensor([[1.0, 3.0, 2.5, -1.0], [0.0, 1.0, 4.0, 0.0]])
    sp = SamplingParams(temperature=0, logit_bias={1: -100})
    assert verify(rows.clone(), [1], sp, None) == [2]       # the banned proposal is rejected
    assert verify(rows.clone(), [2], sp, None) == [2, 2]


@pytest.mark.parametrize("bias, msg", [
    ({-1: 1.0}, "keys must be token ids"), ({"5": 1.0}, "keys must be token ids"), ({True: 1.0}, "keys must be"),
    ({5: 101}, "from -100 to 100"), ({5: float("nan")}, "from -100 to 100"), ({5: "1"}, "from -100 to 100"),
    ([5, 6], "must map token ids to numbers"),
])
def test_logit_bias_validation(bias, msg):
    with pytest.raises(ValueError, match=msg) as info:
        SamplingParams(logit_bias=bias)
    assert "\n" not in str(info.value)


def test_logit_bias_is_kept_as_sorted_pairs():
    import pickle

    sp = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert sp.logit_bias == ((2, -3.5), (9, 1.0)) and hash(sp) == hash(SamplingParams(logit_bias=[(2, -3.5), (9, 1)]))
    assert pickle.loads(pickle.dumps(sp)) == sp and not SamplingParams().logit_bias
