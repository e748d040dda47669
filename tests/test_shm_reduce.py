"""The shared-memory all-reduce of CPU tensor-parallel ranks on one machine (models/parallel/shm_reduce.py)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from nanochat.models.parallel.shm_reduce import SLOT_BYTES, ShmAllReduce

SHAPES = [(1, 576), (7, 64), (3, 5), (64, 4096), (1,)]


def _rank(path: str, rank: int, size: int, out) -> None:
    reducer = ShmAllReduce(path, rank, size)
    results = []
    for step in range(40):   # more calls than buffers: the two buffers are reused many times
        for i, shape in enumerate(SHAPES):
            g = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
            x = torch.randn(shape, generator=g)
            results.append(reducer.all_reduce(x).numpy().copy())   # numpy: pickled by value
    out.put((rank, results))


def test_every_rank_gets_the_same_sum():
    size = 3
    reducer = ShmAllReduce.create(size)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(reducer.path, r, size, out)) for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        mine = []
        for step in range(40):
            for i, shape in enumerate(SHAPES):
                parts = [torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + 10 * i + r))
                         for r in range(size)]
                x = parts[0].clone()
                assert reducer.all_reduce(x) is x
                assert torch.allclose(x, sum(parts), atol=1e-5)
                mine.append(x)
        others = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
        reducer.unlink()
        reducer.close()
    for rank in range(1, size):   # the same bits on every rank, as a process group's all-reduce gives
        assert all(torch.equal(a, torch.from_numpy(b)) for a, b in zip(mine, others[rank]))
    assert not os.path.exists(reducer.path)


def test_what_fits_a_slot():
    reducer = ShmAllReduce.create(2)
    try:
        assert reducer.fits(torch.zeros(SLOT_BYTES // 4))
        assert not reducer.fits(torch.zeros(SLOT_BYTES // 4 + 1))
        assert not reducer.fits(torch.zeros(8, 8).t())           # not contiguous
    finally:
        reducer.unlink()
        reducer.close()


def test_a_rank_that_never_comes_is_an_error_not_a_hang():
    reducer = ShmAllReduce.create(2, alive=lambda: False)
    try:
        with pytest.raises(RuntimeError, match="stopped during an all-reduce"):
            reducer.all_reduce(torch.ones(4))
    finally:
        reducer.unlink()
        reducer.close()
