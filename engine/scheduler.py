"""Continuous batching with a token budget per step, chunked prefill and preemption by recompute.

Each step gives every running sequence its next chunk (a decode is a chunk of one token), running
sequences first, then admits waiting ones while the budget, the sequence cap and the KV blocks
allow. When blocks run out, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue, keeping its generated tokens, to be recomputed later.

A decoding sequence that speculates (engine/speculative.py) carries proposed tokens in its chunk (`draft`):
the step computes them after its last real token, on slots that only free blocks provide (proposals never
evict a resident chat or preempt a sequence).

Recompute runs the prefill kernels over tokens that decode produced; on the CPU they give a row the
same bits as decode did (every reduction runs in an order fixed by the row alone, not by the batch:
tests/test_batch_invariance.py), so a preempted sequence goes on exactly as it would have.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from nanochat.engine.block_manager import BlockManager
from nanochat.engine.pooling import span
from nanochat.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int          # first position computed this step
    num_tokens: int     # the sequence's own tokens computed this step
    draft: list[int] = field(default_factory=list)   # proposed tokens computed after them (a decode only)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def stop(self) -> int:
        """One past the last position computed this step, proposals included."""
        return self.end + len(self.draft)

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence, so a token is sampled from it (from each of its rows
        from the last real token on, when it carries proposals); an embedding request samples nothing."""
        return self.end == len(self.seq) and self.seq.pooling is None

    @property
    def pool_span(self) -> tuple[int, int] | None:
        """An embedding request's positions in this chunk that its pooling reads (engine/pooling.py), or None."""
        pooling = self.seq.pooling
        return None if pooling is None else span(pooling.pooling, self.start, self.end, len(self.seq))

    def input_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.end] + self.draft


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 whole: bool = False):
        """whole: every sequence is computed in one chunk (an encoder's inputs attend both ways), admitted only
        when the step's budget holds all of it."""
        self.block_manager = block_manager
        self.whole = whole
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, propose: Callable[[Sequence, int], list[int]] | None = None) -> list[ScheduledChunk]:
        """propose(seq, room): up to `room` proposed tokens for a decoding sequence (speculative decoding)."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        # 1. running sequences, oldest first; preempt from the newest end when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            draft = self._draft(seq, n, budget, propose)
            while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n, draft))
                scheduled.add(seq.seq_id)
                budget -= n + len(draft)
                i += 1
                continue
            # seq itself was preempted; the list shrank, do not advance i
        # 2. admit waiting sequences
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.whole and len(seq) > budget:
                break
            if not self.block_manager.allocate(seq, budget):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return chunks

    def _draft(self, seq: Sequence, n: int, budget: int, propose) -> list[int]:
        """A decoding sequence's proposals, with their KV slots taken from free blocks only."""
        if propose is None or n != 1 or len(seq) - seq.num_computed_tokens != 1 or budget < 2:
            return []
        draft = propose(seq, min(budget - 1, self.block_manager.spare_slots(seq, len(seq))))
        if draft and not self.block_manager.ensure_slots(seq, len(seq) + len(draft)):
            return []   # spare_slots said they were free: never reached
        return draft

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and release its blocks (they stay cached for later hits)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.deallocate(seq)
