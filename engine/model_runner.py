"""Runs the model on one scheduled step: builds the flat ragged batch, owns the KV cache.

Tensor parallel: every rank has a runner over its shard of the model and its own KV cache (its KV
heads), all with the same number of blocks, so rank 0's block tables serve every rank. Rank 0 builds
each step's inputs (StepInputs: plain lists) and has the workers run the same step
(engine/tensor_parallel.py).

Models that mix windowed and full-attention layers keep two KV-cache groups (engine/block_manager.py): the
windowed layers' caches have blocks of their own (`num_window_blocks`), addressed by a second block table and
slot mapping (AttnMetadata.window_block_tables / window_slot_mapping)."""

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
    window_slots: list[int] | None = None          # two KV groups: the windowed layers' slots and tables
    window_block_tables: list[list[int]] | None = None
    pool_spans: list[tuple[int, int]] | None = None   # embedding requests: the rows each one's pooling sums


@dataclass
class StepOutput:
    """What a step returns on rank 0: fp32 logits for the chunks that sample (in order; a chunk with proposals: one
    row for its last real token and one per proposal), or None; and per pooling chunk (ScheduledChunk.pool_span,
    in order) the fp32 sum of its rows' final hidden states."""

    logits: torch.Tensor | None
    pooled: list[torch.Tensor]


def kv_window(model_config) -> int:
    """How far back any query of the model reads keys, when every attention layer is windowed (0: some
    layer reads them all, so nothing can be given back)."""
    windows = getattr(model_config, "layer_windows", ())
    return max(windows) if windows and all(w > 0 for w in windows) else 0


def window_group(model) -> int:
    """The windowed layers' KV group's window (their widest) when the model mixes windowed and full-attention
    layers, else 0 (one group: every layer windowed is the block manager's windowed mode)."""
    windows = [getattr(layer, "window", 0) for layer in model.attention_layers()]
    return max(windows) if any(windows) and not all(windows) else 0


def _padded(table: list[int], width: int) -> list[int]:
    """A block table as the step's tensor row: padded with block 0 to `width`, and blocks given back behind a
    sliding window (DROPPED, -1) replaced by 0 (never read: any valid id stands in). Checking for them first
    spares a Python max() per entry, 2.8 ms a step at 256 sequences of 60 blocks."""
    return (table if min(table, default=0) >= 0 else [max(b, 0) for b in table]) + [0] * (width - len(table))


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
        self.group_window = 0 if self.is_hybrid else window_group(model)
        self.num_blocks, self.num_window_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        if self.is_hybrid:
            model.allocate_state(self.num_state_slots, device)
        self.graphs = None
        # Hybrid models (GDN state slots) and host-offloaded experts (CPU work mid-forward) run eagerly.
        from nanochat.models.layers.moe import has_host_experts
        # Two KV groups: the captured graphs have one block table (engine/cuda_graphs.py).
        if device.type == "cuda" and not config.enforce_eager and not self.is_hybrid \
                and not has_host_experts(model) and not self.group_window:
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

    def _windowed(self, layer) -> bool:
        """Whether the layer's KV lives in the windowed group."""
        return bool(self.group_window and getattr(layer, "window", 0))

    def _window_reach(self) -> int:
        """Two groups: the windowed blocks the running set can use at most (a sequence: its window behind a whole
        step's chunk), twice that for the chats pinned between turns."""
        c = self.config
        per_seq = (self.group_window - 1 + c.max_num_batched_tokens + self.block_size - 1) // self.block_size + 1
        return 2 * c.max_num_seqs * per_seq

    def _num_kv_blocks(self) -> tuple[int, int]:
        """(blocks of the full-attention group, blocks of the windowed group: 0 with one group). Two groups:
        the windowed group gets at most _window_reach() blocks, at most its layers' share of the budget; the full
        group the rest (num_kvcache_blocks: that many, and the windowed group as many or its reach)."""
        if self.config.num_kvcache_blocks is not None:
            n = self.config.num_kvcache_blocks
            return n, min(n, self._window_reach()) if self.group_window else 0
        per_block = self.kv_bytes_per_block()
        # Never allocate more than the running set could ever use.
        cap = self.config.max_num_seqs * ((self.config.max_model_len + self.block_size - 1) // self.block_size)
        if not per_block:   # an encoder keeps no KV: its blocks only count the tokens of the running inputs
            return cap, 0
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.config.gpu_memory_utilization - used
        else:
            budget = self.config.kv_cache_gib * 2**30
        if self.is_hybrid:
            budget -= self.num_state_slots * self.model.hybrid_state_spec()
        n, n_window = min(int(budget // per_block), cap), 0
        if self.group_window:
            layers = self.model.attention_layers()
            per_layer = per_block // len(layers)
            windowed = sum(self._windowed(layer) for layer in layers)
            n_window = min(int(budget // per_block), self._window_reach())
            n = min(int((budget - n_window * windowed * per_layer) // (per_layer * (len(layers) - windowed))), cap)
        if self.ranks is not None:   # one block table for all ranks: the smallest cache sets the count
            n = self.ranks.min(n)
            n_window = self.ranks.min(n_window) if self.group_window else 0
        if n < 1:
            knob = "kv_cache_gib" if self.device.type == "cpu" else "gpu_memory_utilization"
            raise ValueError(f"one KV-cache block ({self.block_size} tokens, {per_block / 2**20:,.1f} MiB) does "
                              f"not fit in the KV budget ({max(budget, 0) / 2**20:,.1f} MiB): lower "
                              f"kvcache_block_size (NANO_VLLM_KVCACHE_BLOCK_SIZE) or raise {knob}")
        return n, n_window

    def _allocate_kv_cache(self) -> None:
        # On the CPU the cache is left unwritten: a slot is always stored before it is read, and the OS maps
        # a page only when it is first written, so memory grows with the blocks in use, not the budget.
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        for layer in self.model.attention_layers():
            blocks = self.num_window_blocks if self._windowed(layer) else self.num_blocks
            shape = (blocks, self.block_size, *self.kv_heads())
            layer.k_cache = alloc(shape, dtype=self.kv_dtype, device=self.device)
            layer.v_cache = alloc(shape, dtype=self.kv_dtype, device=self.device)

    @torch.inference_mode()
    def copy_kv(self, src: int, dst: int, num_tokens: int, group: int | None = None) -> None:
        """Copy the first num_tokens slots of block src's KV into block dst, in every attention layer
        (copy-on-write of a partly reused cached block); two KV groups: in the full-attention (group 0) or the
        windowed (1) layers."""
        if self.workers is not None:
            self.workers.call("copy_kv", src, dst, num_tokens, group)
        for layer in self.model.attention_layers():
            if group is not None and self._windowed(layer) != bool(group):
                continue
            layer.k_cache[dst, :num_tokens].copy_(layer.k_cache[src, :num_tokens])
            layer.v_cache[dst, :num_tokens].copy_(layer.v_cache[src, :num_tokens])

    # ------------------------------------------------------------------ batch
    def prepare(self, chunks: list[ScheduledChunk]):
        """The step's tensors: (input_ids, positions, AttnMetadata, logit rows)."""
        return self.tensors(self.step_inputs(chunks))

    def step_inputs(self, chunks: list[ScheduledChunk]) -> StepInputs:
        input_ids, positions, slots = [], [], []
        cu_q, context_lens, logit_rows, pool_spans = [0], [], [], []
        bs = self.block_size
        for c in chunks:
            input_ids.extend(c.input_ids())
            positions.extend(range(c.start, c.stop))
            table = c.seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, c.stop))
            cu_q.append(cu_q[-1] + c.stop - c.start)
            context_lens.append(c.stop)
            if c.samples:   # the last real token's row, and each proposal's
                logit_rows.extend(range(cu_q[-1] - 1 - len(c.draft), cu_q[-1]))
            if (pool := c.pool_span) is not None:
                pool_spans.append((cu_q[-2] + pool[0] - c.start, cu_q[-2] + pool[1] - c.start))
        width = max(len(c.seq.block_table) for c in chunks)
        step = StepInputs(input_ids, positions, slots, cu_q, context_lens,
                          [_padded(c.seq.block_table, width) for c in chunks], logit_rows,
                          pool_spans=pool_spans or None)
        if self.group_window:
            width = max(len(c.seq.window_block_table) for c in chunks)
            step.window_slots = [c.seq.window_block_table[p // bs] * bs + p % bs for c in chunks
                                 for p in range(c.start, c.stop)]
            step.window_block_tables = [_padded(c.seq.window_block_table, width) for c in chunks]
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
        if step.window_slots is not None:
            meta.window_slot_mapping = t(step.window_slots, torch.int64)
            meta.window_block_tables = t(step.window_block_tables, torch.int32)
        if step.state_slots is not None:
            meta.state_slots = t(step.state_slots, torch.int64)
            meta.state_fresh = t(step.state_fresh, torch.bool)
        return t(step.input_ids, torch.int64), t(step.positions, torch.int64), meta, step.logit_rows

    def run(self, chunks: list[ScheduledChunk]) -> StepOutput:
        """Forward one step (StepOutput: the logits of the chunks that sample, the pooled rows of those that pool)."""
        step = self.step_inputs(chunks)
        if self.workers is None:
            return self.forward(step)
        self.workers.call("forward", step)
        try:
            return self.forward(step)
        except RuntimeError as e:   # a collective with a rank that stopped
            raise self.workers.lost(e) from None

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> StepOutput:
        """The model on one step's inputs (every rank); the outputs are rank 0's to use."""
        input_ids, positions, meta, logit_rows = self.tensors(step)
        pure_decode = meta.max_q_len == 1
        batch = len(step.context_lens)
        if self.graphs is not None and pure_decode and self.graphs.fits(batch, meta.block_tables.shape[1]):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        pooled = [hidden[a:b].float().sum(0) for a, b in step.pool_spans or ()]
        if not logit_rows:
            return StepOutput(None, pooled)
        rows = torch.tensor(logit_rows, device=self.device)
        return StepOutput(self.model.compute_logits(hidden.index_select(0, rows)), pooled)
