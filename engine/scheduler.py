"""Continuous batching with a token budget per step, chunked prefill and preemption by recompute.

Each step gives every running sequence its next chunk (a decode is a chunk of one token), running
sequences first, then admits waiting ones while the budget, the sequence cap and the KV blocks
allow. When blocks run out, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue, keeping its generated tokens, to be recomputed later.

Recompute runs the prefill kernels over tokens that decode produced; on the CPU they give a row the
same bits as decode did (every reduction runs in an order fixed by the row alone, not by the batch:
tests/test_batch_invariance.py), so a preempted sequence goes on exactly as it would have.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nanochat.engine.block_manager import BlockManager
from nanochat.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int          # first position computed this step
    num_tokens: int     # tokens computed this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence, so a token is sampled from it."""
        return self.end == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        # 1. running sequences, oldest first; preempt from the newest end when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                scheduled.add(seq.seq_id)
                budget -= n
                i += 1
                continue
            # seq itself was preempted; the list shrank, do not advance i
        # 2. admit waiting sequences
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.allocate(seq, budget):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return chunks

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
