"""Tensor parallelism inside a model: which slice of each weight a rank holds, and the collectives.

Megatron's split, as nano-vllm and vLLM do it:
- column-parallel (q/k/v, gate/up, the lm_head): each rank holds a slice of the output rows;
- row-parallel (o_proj, down_proj, out_proj): each rank holds the matching slice of the input columns,
  and the partial outputs are summed with one all-reduce per block;
- the token embedding is split by vocabulary rows (vocab-parallel): a rank looks up the ids it holds,
  zeros the others, and the all-reduce puts the rows together;
- attention is split by KV heads with their query heads; when there are fewer KV heads than ranks each
  rank holds one KV head (replicated) and its share of the query heads.

Slices are balanced and may be uneven (SmolLM2's 3 KV heads over 2 ranks: 2 and 1). A row-parallel
slice of GGML blocks must start and end on a block boundary (32 elements, or 256 for the K-quants), so
heads and MLP columns are split in units that keep every boundary on one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanochat.models.errors import ModelLoadError


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part `index` when `total` units are split into `parts` balanced slices."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group; size 1 is no parallelism (no collectives)."""

    rank: int = 0
    size: int = 1
    group: object = None        # torch.distributed ProcessGroup of the ranks (None: the default group)
    shm: object = None          # models.shm_reduce.ShmAllReduce: CPU ranks of one machine add through it

    @property
    def on(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.shm is not None and self.shm.fits(x):   # the same choice on every rank: same shapes
                return self.shm.all_reduce(x)
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0 gets every rank's x [n, widths[r]] side by side; other ranks get None."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        width = max(widths)
        padded = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        padded = padded.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0, group=self.group)
        if self.rank != 0:
            return None
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)


SINGLE = TensorParallel()


@dataclass(frozen=True)
class HeadShard:
    """The attention heads a rank holds: query heads [q_start, q_start + q_count), KV heads likewise."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(tp: TensorParallel, heads: int, kv_heads: int, head_dim: int, align: int, what: str) -> HeadShard:
    """Split attention over the ranks by whole KV groups (a KV head with its query heads), in units of
    groups whose o_proj columns end on a block boundary (`align` elements); fewer KV heads than ranks:
    one KV head per rank, replicated, with an even share of its query heads."""
    if tp.size == 1:
        return HeadShard(0, heads, 0, kv_heads)
    group = heads // kv_heads
    if kv_heads >= tp.size:
        unit = next((u for u in range(1, kv_heads + 1)
                     if kv_heads % u == 0 and (u * group * head_dim) % align == 0), None)
        if unit is None or kv_heads // unit < tp.size:
            raise ModelLoadError(f"{what}: {kv_heads} KV heads of {group * head_dim} output columns cannot be "
                                 f"split over {tp.size} ranks on {align}-element block boundaries")
        start, count = split(kv_heads // unit, tp.size, tp.rank)
        kv_start, kv_count = start * unit, count * unit
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if tp.size % kv_heads or heads % tp.size or (heads // tp.size * head_dim) % align:
        raise ModelLoadError(f"{what}: {heads} query heads and {kv_heads} KV heads cannot be split over "
                             f"{tp.size} ranks (with fewer KV heads than ranks, the ranks must be a multiple "
                             f"of the KV heads and divide the query heads)")
    q_count = heads // tp.size
    q_start = tp.rank * q_count
    return HeadShard(q_start, q_count, q_start // group, 1)


def column_units(tp: TensorParallel, total: int, align: int, what: str) -> tuple[int, int]:
    """(start, count) of this rank's slice of `total` columns, on `align`-element boundaries."""
    if tp.size == 1:
        return 0, total
    if total % align or total // align < tp.size:
        raise ModelLoadError(f"{what}: {total} columns cannot be split over {tp.size} ranks on "
                             f"{align}-element block boundaries")
    start, count = split(total // align, tp.size, tp.rank)
    return start * align, count * align
