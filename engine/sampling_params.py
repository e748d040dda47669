"""Per-request sampling settings."""

from __future__ import annotations

from dataclasses import dataclass

from nanochat.engine.rules import LOGPROBS, SAMPLING_RULES, SPECULATIVE, check, shown


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
    # Speculative decoding's proposer for this request: off, ngram or draft; None: the engine's (Config.speculative).
    # It changes speed only: greedy tokens are the same, sampled ones follow the same distribution.
    speculative: str | None = None

    def __post_init__(self):
        # Accept lists for convenience, keep the object hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        for name, rule in SAMPLING_RULES.items():
            value = getattr(self, name)
            if value is not None or name != "seed":
                check(name, rule, value)
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {shown(self.stop_token_ids)}")
        if any((not isinstance(s, str)) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {shown(self.stop)}")
        if self.logprobs is not None:
            check("logprobs", LOGPROBS, self.logprobs)
        if self.speculative is not None:
            check("speculative", SPECULATIVE, self.speculative)
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Any penalty is on: the sampler needs this request's token ids."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
