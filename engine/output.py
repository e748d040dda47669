"""What the engine reports: per-token events, the one stats type, finished results, engine-wide stats.

Everything here is plain data without torch, so it crosses the engine-process boundary and is
importable by front ends that never load torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


class RequestError(ValueError):
    """A request the engine cannot take (empty, longer than the context, larger than the KV cache)."""


def embeddings_only(name: str) -> str:
    """Why an encoder (ModelInfo.writes_text False) takes no message: one line for every front end."""
    return (f"{name} is an embedding model: it writes no text (ask it for embeddings: LLM.embed, or /v1/embeddings "
            "of `nanochat serve`)")


class ContextExceeded(RequestError):
    """The prompt does not fit in the context (max_model_len) with room for one generated token."""

    def __init__(self, prompt_tokens: int, limit: int):
        super().__init__(f"the prompt has {prompt_tokens} tokens, but the context holds {limit} "
                         "(max_model_len) including at least one generated token")
        self.prompt_tokens, self.limit = prompt_tokens, limit


@dataclass
class RequestStats:
    """One request's (or chat turn's) numbers, from the engine to the store and the screen."""

    prompt_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens served from the prefix cache
    completion_tokens: int = 0
    ttft: float | None = None         # seconds from arrival to first token
    decode_tok_s: float | None = None # completion tokens after the first / time after the first
    elapsed: float = 0.0
    preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    context_full: bool = False        # it reached max_model_len (a "length" end that max_tokens did not cause)
    stop_string: str | None = None    # the stop string that ended it (a "stop" end that no stop token caused)
    spec_proposed: int = 0            # speculative decoding: tokens proposed for this request, and accepted
    spec_accepted: int = 0

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "prefilled_tokens": self.prefilled_tokens}

    @classmethod
    def from_dict(cls, data: dict | None) -> "RequestStats | None":
        """Stats read back from storage; unknown keys (older or newer versions) are ignored."""
        if not data:
            return None
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class TokenLogprobs:
    """A sampled token's log-probability and the most likely tokens' (SamplingParams.logprobs asks)."""

    token: str                                 # the token's own text (decoded alone)
    logprob: float
    top: list[tuple[str, float, int]] = field(default_factory=list)   # (text, log-probability, id), best first


@dataclass
class TokenEvent:
    """One step's news for one request: a new token (with its finalised text delta) or the end."""

    request_id: str
    token_id: int | None
    text: str                       # text delta (may be "" while a multi-byte char is incomplete)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stats: RequestStats | None = None # set on the final event
    error: str = ""                   # why, when finish_reason is "error"
    logprobs: TokenLogprobs | None = None   # the token's, when its request asks
    embedding: list[float] | None = None    # an embedding request's answer, on its final event


@dataclass
class Reply:
    """A request's events folded into its text, token ids and final event (the one place that does it)."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    final: TokenEvent | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    embedding: list[float] | None = None

    def add(self, event: TokenEvent) -> "Reply":
        if event.text:
            self.parts.append(event.text)
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
        if event.embedding is not None:
            self.embedding = event.embedding
        if event.finished:
            self.final = event
        return self

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    @property
    def done(self) -> bool:
        return self.final is not None

    @property
    def stats(self) -> RequestStats:
        """The final event's stats (with its finish reason), or what is known so far."""
        final = self.final
        stats = final.stats if final is not None and final.stats is not None else \
            RequestStats(completion_tokens=len(self.token_ids))
        if final is not None:
            stats.finish_reason = final.finish_reason
        return stats

    def result(self, request_id: str) -> "RequestResult":
        return RequestResult(request_id, self.text, self.token_ids, self.final.finish_reason, self.stats)


@dataclass
class EmbeddingResult:
    request_id: str
    embedding: list[float]
    stats: RequestStats   # prompt_tokens: the input's tokens


@dataclass
class RequestResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: RequestStats

    def __getitem__(self, key):   # dict-style access, as nano-vllm returns dicts
        return getattr(self, key)

    def keys(self):
        return ("request_id", "text", "token_ids", "finish_reason", "stats")


@dataclass
class EngineStats:
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_free: int = 0
    prefix_hit_rate: float = 0.0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    pinned_sessions: int = 0
    preemptions: int = 0
    total_prefill_tokens: int = 0
    total_decode_tokens: int = 0
    # Speculative decoding, over the same recent window as the rates: proposals accepted / proposed, and the
    # tokens a decoding sequence gets per target step (1.0 without speculation); 0 when nothing was decoded.
    spec_acceptance: float = 0.0
    spec_tokens_per_step: float = 0.0
    total_spec_proposed: int = 0
    total_spec_accepted: int = 0
    extra: dict = field(default_factory=dict)
