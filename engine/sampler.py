"""Batched sampling: greedy, temperature, top-k, top-p, with reproducible per-request seeds."""

from __future__ import annotations

import torch

from nanochat.engine.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and outside the top-p nucleus of one row."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first one always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits [B, V] (fp32); one params/generator per row. Greedy rows take the argmax."""
        greedy = logits.argmax(-1).tolist()
        out = []
        for i, sp in enumerate(params):
            if sp.greedy:
                out.append(greedy[i])
                continue
            row = _filter_top_k_top_p(logits[i] / sp.temperature, sp.top_k, sp.top_p)
            probs = row.softmax(-1)
            out.append(int(torch.multinomial(probs.cpu(), 1, generator=generators[i]).item()))
        return out
