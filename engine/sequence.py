"""A request as the scheduler sees it: token ids, progress, and its KV block table."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

from nanochat.engine.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceStats:
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0      # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    stop_string: str | None = None  # the stop string that ended it

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


class Sequence:
    def __init__(self, token_ids: list[int], sampling_params: SamplingParams,
                 session_id: str | None = None):
        self.seq_id = next(_ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.session_id = session_id
        self.request_id = ""
        self.num_computed_tokens = 0    # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.window_block_table: list[int] = []   # two KV groups: the windowed layers' (block_manager.py)
        self.block_hashes: list[int] = []   # chained hashes of the leading full, computed blocks
        self.state_slot: int | None = None  # hybrid models: the recurrent-state slot
        self.spec = None                    # engine/speculative.py Speculation, when the sequence speculates
        self.pooling = None                 # engine/pooling.py PoolingParams: an embedding request
        self.pool_sum = None                # its pooled rows' sum so far, and how many rows
        self.pool_count = 0
        self.finish_reason: str | None = None
        self.stats = SequenceStats(arrival_time=time.perf_counter())

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
