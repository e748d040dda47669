"""Per-request sampling settings."""

from __future__ import annotations

import math
from dataclasses import dataclass


# Below this the logits / temperature overflow (1e-300 made the sampler's softmax NaN); vLLM's floor
# too. Such a temperature is greedy in all but name, and 0 says so.
MIN_TEMPERATURE = 0.01
MAX_LOGPROBS = 20   # alternatives per token a request may ask for (OpenAI's top_logprobs limit)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0: disabled
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()        # stop strings (not included in the output text)
    seed: int | None = None
    # Penalties (engine/sampler.py apply_penalties has the definitions): the defaults are off.
    repetition_penalty: float = 1.0   # > 0; HF/CTRL, over prompt + generated tokens
    presence_penalty: float = 0.0     # [-2, 2]; OpenAI/vLLM, over generated tokens
    frequency_penalty: float = 0.0    # [-2, 2]; OpenAI/vLLM, over generated tokens
    # None: none; k: each token's log-probability and the k most likely tokens' (engine/sampler.py token_logprobs)
    logprobs: int | None = None

    def __post_init__(self):
        # Accept lists for convenience, keep the object hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or from {MIN_TEMPERATURE} up, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        if any((not isinstance(s, str)) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed}")
        if not (_finite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 is off), "
                             f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_finite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be a number from -2 to 2 (0 is off), got {value!r}")
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Any penalty is on: the sampler needs this request's token ids."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
