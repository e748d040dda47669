"""Runs the model on one scheduled step: builds the flat ragged batch, owns the KV cache.

Tensor parallel: every rank has a runner over its shard of the model and its own KV cache (its KV
heads), all with the same number of blocks, so rank 0's block tables serve every rank. Rank 0 builds
each step's inputs (StepInputs: plain lists) and has the workers run the same step
(engine/tensor_parallel.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanochat.engine.config import Config
from nanochat.engine.scheduler import ScheduledChunk
from nanochat.models.layers.attention import AttnMetadata


@dataclass
class StepInputs:
    """One step's flat ragged batch as host lists (what rank 0 sends its workers)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    cu_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logit_rows: list[int]
    state_slots: list[int] | None = None
    state_fresh: list[bool] | None = None


class ModelRunner:
    def __init__(self, config: Config, model, device: torch.device, dtype: torch.dtype, ranks=None):
        """ranks: the tensor-parallel group (engine.tensor_parallel: Workers on rank 0, a RankGroup on
        a worker), None without tensor parallelism."""
        self.config, self.model, self.device, self.dtype = config, model, device, dtype
        self.ranks = ranks
        if config.batch_invariant and device.type == "cpu":
            from nanochat.models.layers.common import use_batch_invariant_kernels
            use_batch_invariant_kernels(model)
        self.workers = ranks if ranks is not None and ranks.tp.rank == 0 else None   # rank 0 sends the calls
        self.kv_dtype = config.resolved_kv_dtype(device, dtype)
        self.block_size = config.kvcache_block_size
        # Hybrid models: one recurrent-state slot per running sequence plus as many for resident chats.
        self.is_hybrid = getattr(model, "is_hybrid", False)
        self.num_state_slots = 2 * config.max_num_seqs if self.is_hybrid else 0
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        if self.is_hybrid:
            model.allocate_state(self.num_state_slots, device)
        self.graphs = None
        # Hybrid models (GDN state slots) and host-offloaded experts (CPU work mid-forward) run eagerly.
        from nanochat.models.layers.moe import has_host_experts
        if device.type == "cuda" and not config.enforce_eager and not self.is_hybrid \
                and not has_host_experts(model):
            from nanochat.engine.cuda_graphs import DecodeGraphs
            max_blocks = (config.max_model_len + self.block_size - 1) // self.block_size
            self.graphs = DecodeGraphs(model, config.max_num_seqs, max_blocks, model.config.hidden_size,
                                       dtype, device)

    # ------------------------------------------------------------------ KV cache
    def kv_heads(self) -> tuple[int, int]:
        """(KV heads, head dim) of this rank's attention layers."""
        layers = self.model.attention_layers()
        return (layers[0].num_kv_heads, layers[0].head_dim) if layers else (0, 0)

    def kv_bytes_per_block(self) -> int:
        layers = len(self.model.attention_layers())
        heads, head_dim = self.kv_heads()
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * layers * self.block_size * heads * head_dim * elem

    def _num_kv_blocks(self) -> int:
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.config.gpu_memory_utilization - used
        else:
            budget = self.config.kv_cache_gib * 2**30
        if self.is_hybrid:
            budget -= self.num_state_slots * self.model.hybrid_state_spec()
        # Never allocate more than the running set could ever use.
        cap = self.config.max_num_seqs * ((self.config.max_model_len + self.block_size - 1) // self.block_size)
        n = min(int(budget // per_block), cap)
        if self.ranks is not None:   # one block table for all ranks: the smallest cache sets the count
            n = self.ranks.min(n)
        if n < 1:
            knob = "kv_cache_gib" if self.device.type == "cpu" else "gpu_memory_utilization"
            raise ValueError(f"one KV-cache block ({self.block_size} tokens, {per_block / 2**20:,.1f} MiB) does "
                              f"not fit in the KV budget ({max(budget, 0) / 2**20:,.1f} MiB): lower "
                              f"kvcache_block_size (NANO_VLLM_KVCACHE_BLOCK_SIZE) or raise {knob}")
        return n

    def _allocate_kv_cache(self) -> None:
        shape = (self.num_blocks, self.block_size, *self.kv_heads())
        # On the CPU the cache is left unwritten: a slot is always stored before it is read, and the OS maps
        # a page only when it is first written, so memory grows with the blocks in use, not the budget.
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        for layer in self.model.attention_layers():
            layer.k_cache = alloc(shape, dtype=self.kv_dtype, device=self.device)
            layer.v_cache = alloc(shape, dtype=self.kv_dtype, device=self.device)

    @torch.inference_mode()
    def copy_kv(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first num_tokens slots of block src's KV into block dst, in every attention layer
        (copy-on-write of a partly reused cached block)."""
        if self.workers is not None:
            self.workers.call("copy_kv", src, dst, num_tokens)
        for layer in self.model.attention_layers():
            layer.k_cache[dst, :num_tokens].copy_(layer.k_cache[src, :num_tokens])
            layer.v_cache[dst, :num_tokens].copy_(layer.v_cache[src, :num_tokens])

    # ------------------------------------------------------------------ batch
    def prepare(self, chunks: list[ScheduledChunk]):
        """The step's tensors: (input_ids, positions, AttnMetadata, logit rows)."""
        return self.tensors(self.step_inputs(chunks))

    def step_inputs(self, chunks: list[ScheduledChunk]) -> StepInputs:
        input_ids, positions, slots = [], [], []
        cu_q, context_lens, logit_rows = [0], [], []
        bs = self.block_size
        for c in chunks:
            seq = c.seq
            input_ids.extend(seq.token_ids[c.start:c.end])
            positions.extend(range(c.start, c.end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, c.end))
            cu_q.append(cu_q[-1] + c.num_tokens)
            context_lens.append(c.end)
            if c.samples:
                logit_rows.append(cu_q[-1] - 1)
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        # blocks given back behind a sliding window (DROPPED) are never read: any valid id stands in
        tables = [[max(b, 0) for b in c.seq.block_table] + [0] * (max_blocks - len(c.seq.block_table)) for c in chunks]
        step = StepInputs(input_ids, positions, slots, cu_q, context_lens, tables, logit_rows)
        if self.is_hybrid:
            step.state_slots = [c.seq.state_slot for c in chunks]
            step.state_fresh = [c.start == 0 for c in chunks]
        return step

    def tensors(self, step: StepInputs):
        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=self.device)

        q_lens = [b - a for a, b in zip(step.cu_q, step.cu_q[1:])]
        meta = AttnMetadata(
            slot_mapping=t(step.slots, torch.int64), cu_seqlens_q=t(step.cu_q, torch.int32),
            context_lens=t(step.context_lens, torch.int32), block_tables=t(step.block_tables, torch.int32),
            max_q_len=max(q_lens), max_context_len=max(step.context_lens),
            host_lists=(step.cu_q, step.context_lens))
        if step.state_slots is not None:
            meta.state_slots = t(step.state_slots, torch.int64)
            meta.state_fresh = t(step.state_fresh, torch.bool)
        return t(step.input_ids, torch.int64), t(step.positions, torch.int64), meta, step.logit_rows

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Forward one step; returns fp32 logits for the chunks that sample (in order), or None."""
        step = self.step_inputs(chunks)
        if self.workers is None:
            return self.forward(step)
        self.workers.call("forward", step)
        try:
            return self.forward(step)
        except RuntimeError as e:   # a collective with a rank that stopped
            raise self.workers.lost(e) from None

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor | None:
        """The model on one step's inputs (every rank); the logits come back on rank 0 only."""
        input_ids, positions, meta, logit_rows = self.tensors(step)
        pure_decode = meta.max_q_len == 1
        batch = len(step.context_lens)
        if self.graphs is not None and pure_decode and self.graphs.fits(batch, meta.block_tables.shape[1]):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        if not logit_rows:
            return None
        rows = torch.tensor(logit_rows, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
