"""What the engine reports: per-token events, finished results, and engine-wide stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens served from the prefix cache
    completion_tokens: int = 0
    ttft: float | None = None         # seconds from arrival to first token
    decode_tok_s: float | None = None # completion tokens after the first / time after the first
    elapsed: float = 0.0
    preemptions: int = 0

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


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
    extra: dict = field(default_factory=dict)
