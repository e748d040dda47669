"""All-reduce through shared memory, for CPU tensor-parallel ranks on one machine.

gloo's all-reduce goes through loopback TCP: 0.3-0.9 ms a call on a 2-core machine, and a dense model
makes two per layer per step, so on the CPU the collectives cost more than the matmuls. Ranks that share
a machine can add their partial sums through one shared buffer instead, in microseconds.

Layout of the shared file: one 64-byte line per rank holding its sequence number (int64), then two
buffers (alternate calls use alternate buffers) of one slot per rank. A call with sequence number s:
1. each rank copies its tensor into its slot of buffer s % 2, then stores s in its line;
2. each rank waits until every line holds at least s;
3. each rank adds the slots in rank order (every rank gets the same bits, as with gloo) into its tensor.
A rank can only start call s + 2 (which reuses buffer s % 2) after every rank stored s + 1, that is after
every rank finished reading call s: two buffers are enough. x86's stores are seen in program order, so
a sequence number is seen after the data stored before it (the engine's CPU kernels are x86 only).

Tensors larger than a slot (long prefill chunks, which are compute-bound anyway) go through the
process group as before; every rank takes the same path, since all ranks see the same shapes.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

LINE = 64                      # bytes per rank's sequence number (one cache line: no false sharing)
SLOT_BYTES = 1 << 20           # per rank and buffer: decode steps of up to ~64 rows x 4096 fp32
SPINS_BEFORE_YIELD = 2000


class ShmAllReduce:
    """Sum of a CPU tensor over the ranks of one machine. Rank 0 creates the file (`create`), the others
    map it (`attach`); once all have, rank 0 removes its name (`unlink`), so nothing is left behind."""

    def __init__(self, path: str, rank: int, size: int, alive: Callable[[], bool] | None = None):
        self.rank, self.size, self.path = rank, size, path
        self.alive = alive              # rank 0: are the workers still there (a dead one would never store)
        total = self.bytes_for(size)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        raw = np.frombuffer(self._map, dtype=np.uint8)
        self._seq = np.frombuffer(self._map, dtype=np.int64, count=size * LINE // 8)[::LINE // 8]
        self._bufs = [torch.from_numpy(raw[size * LINE + b * size * SLOT_BYTES:
                                           size * LINE + (b + 1) * size * SLOT_BYTES]) for b in (0, 1)]
        self._calls = int(self._seq[rank])

    @staticmethod
    def bytes_for(size: int) -> int:
        return size * LINE + 2 * size * SLOT_BYTES

    @classmethod
    def create(cls, size: int, alive: Callable[[], bool] | None = None) -> "ShmAllReduce":
        folder = "/dev/shm" if Path("/dev/shm").is_dir() else None   # memory, not a disk, where there is one
        fd, path = tempfile.mkstemp(prefix="nanochat-tp-", dir=folder)
        try:
            os.ftruncate(fd, cls.bytes_for(size))
        finally:
            os.close(fd)
        return cls(path, 0, size, alive)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous, on the CPU, at most SLOT_BYTES) becomes the sum over the ranks, in place."""
        self._calls += 1
        s = self._calls
        n = x.numel() * x.element_size()
        buf = self._bufs[s % 2]
        flat = x.view(-1).view(torch.uint8)
        buf[self.rank * SLOT_BYTES:self.rank * SLOT_BYTES + n].copy_(flat)
        self._seq[self.rank] = s
        self._wait(s)
        parts = [buf[r * SLOT_BYTES:r * SLOT_BYTES + n].view(x.dtype).view(x.shape) for r in range(self.size)]
        x.copy_(parts[0])   # x's own values are in its slot: sum into x directly, in rank order
        for part in parts[1:]:
            x += part
        return x

    def _wait(self, s: int) -> None:
        seq, spins, since = self._seq, 0, None
        while int(seq.min()) < s:
            spins += 1
            if spins % SPINS_BEFORE_YIELD == 0:
                os.sched_yield()
                now = time.monotonic()
                since = since or now
                if self.alive is not None and now - since > 0.5 and not self.alive():
                    raise RuntimeError("a tensor-parallel rank stopped during an all-reduce")
                if now - since > 1.0:
                    time.sleep(0.0005)   # a rank that is busy for long (a long prefill): stop spinning hard

    def close(self) -> None:
        self._seq = self._bufs = None
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass   # tensors still view it: the mapping goes with the process
