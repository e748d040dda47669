"""Embeddings: a request whose answer is its prompt's final hidden states pooled into one vector, not tokens.

The model runs the prompt as any prefill (batched with other requests, in chunks, preempted and recomputed);
the rows a pooling needs come back from each chunk (engine/model_runner.py StepInputs.pool_spans) and are summed
here until the last chunk. The hidden states are the final norm's output, as transformers' last_hidden_state and
llama.cpp's embeddings are.
- mean: the average over every prompt position (sentence-transformers' mean pooling, and what Ollama uses for a
  model that states none);
- cls: the first position's; last: the last position's (decoder embedding models: Qwen3-Embedding, e5-mistral).
mean and cls read positions a prefix-cache hit would skip, so those requests compute their whole prompt; a last
pooling reads only the last position, which every request computes, and may reuse cached blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanochat.engine.rules import POOLING, POOLINGS, POSITIVE_INT, check


@dataclass(frozen=True)
class PoolingParams:
    pooling: str = "mean"
    normalize: bool = True          # to unit L2 length (OpenAI's and Ollama's /api/embed vectors are)
    dimensions: int | None = None   # keep the first N values (Matryoshka models), before normalizing

    def __post_init__(self):
        check("pooling", POOLING, self.pooling)
        if self.dimensions is not None:
            check("dimensions", POSITIVE_INT, self.dimensions)

    @property
    def reads_every_position(self) -> bool:
        """Whether the pooling reads positions a prefix-cache hit would leave uncomputed."""
        return self.pooling != "last"


def default_pooling(stated: str | None) -> str:
    """The pooling a model's requests get: the files' own where they state one we compute, else mean."""
    return stated if stated in POOLINGS else "mean"


def span(pooling: str, start: int, end: int, length: int) -> tuple[int, int] | None:
    """The positions of a chunk [start, end) of a `length`-token prompt that the pooling reads, or None."""
    if pooling == "mean":
        return start, end
    if pooling == "cls":
        return (0, 1) if start == 0 else None
    return (length - 1, length) if end == length else None


def finish(total, count: int, params: PoolingParams) -> list[float]:
    """The embedding from the sum (a torch tensor) of the pooled rows (`count` of them); dimensions were checked at
    admission. This module imports no torch: front ends build PoolingParams."""
    vec = total.double() / count
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    if params.normalize:
        norm = vec.norm()
        if norm > 0:
            vec = vec / norm
    return vec.float().tolist()
