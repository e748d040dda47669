"""Sampling filters: `candidates` against a sort-the-whole-vocabulary reference, and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from nanochat.engine.sampler import FIRST_GUESS, Sampler, candidates
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
