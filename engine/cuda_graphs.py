"""CUDA graphs for pure-decode steps: one graph per padded batch size, replayed with new inputs.

Decode steps are launch-bound on GPUs (hundreds of small kernels per token), so the whole forward
is captured once per batch size in [1, 2, 4, 8, 16, 24, ...] and replayed; a batch is padded to the
next captured size. Padding rows write no KV (slot -1) and attend to one cached token of block 0.
"""

from __future__ import annotations

import torch

from nanochat.models.layers.attention import AttnMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 513, 8))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        z = lambda *shape, dt=torch.int32: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        self.input_ids, self.positions = z(n, dt=torch.int64), z(n, dt=torch.int64)
        self.slot_mapping = z(n, dt=torch.int64)
        self.context_lens = z(n)
        self.block_tables = z(n, max_blocks_per_seq)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._capture_all()

    def _meta(self, bs: int) -> AttnMetadata:
        return AttnMetadata(slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                            context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
                            max_q_len=1, max_context_len=self.block_tables.shape[1])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        for bs in reversed(self.sizes):          # largest first, so smaller graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            meta = self._meta(bs)
            self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)   # warm-up
            with torch.cuda.graph(graph, self.pool):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.sizes[-1] and max_blocks <= self.block_tables.shape[1]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:bs].fill_(-1)
        self.slot_mapping[:n] = meta.slot_mapping
        self.context_lens[:bs].fill_(1)
        self.context_lens[:n] = meta.context_lens
        self.block_tables[:bs].zero_()
        self.block_tables[:n, :meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[bs].replay()
        return self.hidden[:n]
