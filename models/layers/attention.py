"""Attention over the paged KV cache, with the backend chosen by device.

CPU: the fused step's attention kernel (kernels/cpu_decoder.paged_attention: a query's output depends
only on it, its position and the cache, never on the batch around it), torch (gather by block table +
SDPA) for caches it does not take or without the compiled kernels. CUDA: flash-attn when installed and
the block size suits it (flash-attn has no attention sinks: layers with sinks take the Triton kernel), else the
Triton paged-attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanochat.kernels import attention as torch_attn
from nanochat.kernels import cpu_decoder


@dataclass
class AttnMetadata:
    """The flat ragged batch of one step (built by the engine's model runner)."""

    slot_mapping: torch.Tensor      # [N] int64 flat cache slot per query token
    cu_seqlens_q: torch.Tensor      # [B+1] int32
    context_lens: torch.Tensor      # [B] int32 KV length per sequence after this step
    block_tables: torch.Tensor      # [B, max_blocks] int32
    max_q_len: int
    max_context_len: int
    # Hybrid (Gated DeltaNet) models only: the state slot of each sequence, and whether this chunk
    # starts the sequence (position 0: the state starts from zeros instead of the slot's content).
    # state_fresh may be None: it is then derived as "this chunk starts at position 0".
    state_slots: torch.Tensor | None = None    # [B] int64
    # The same cu_seqlens_q / context_lens as Python lists (the CPU path loops over sequences).
    host_lists: tuple[list[int], list[int]] | None = None
    state_fresh: torch.Tensor | None = None    # [B] bool
    # Models with two KV groups (windowed layers beside full-attention ones, engine/block_manager.py): the
    # windowed layers' own cache slots and block tables (their blocks behind the window given back).
    window_slot_mapping: torch.Tensor | None = None   # [N] int64
    window_block_tables: torch.Tensor | None = None   # [B, max_window_blocks] int32


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class AttentionBackend:
    """Stores new K/V and attends; one instance per model, shared by its layers."""

    def __init__(self, device: torch.device, block_size: int):
        self.kind = "torch"
        if device.type == "cuda":
            self.kind = "flash" if flash_attn_available() and block_size % 256 == 0 else "triton"

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int = 0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """window: 0 = full causal attention, else W (a query at position p sees keys p - W + 1 .. p). sinks: fp32
        [heads], one learned logit per query head that joins the softmax's denominator and has no value
        (gpt-oss), or None. A windowed layer of a model with two KV groups reads and writes its cache through
        the windowed group's slots and block tables."""
        slots, tables = meta.slot_mapping, meta.block_tables
        if window and meta.window_block_tables is not None:
            slots, tables = meta.window_slot_mapping, meta.window_block_tables
        if self.kind == "torch":
            torch_attn.store_kvcache(k, v, k_cache, v_cache, slots, may_skip=False)
            if cpu_decoder.attention_usable(q, k_cache):
                return cpu_decoder.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                                   tables, scale, window, sinks).to(q.dtype)
            return torch_attn.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                              tables, scale, meta.host_lists, window, sinks)
        from nanochat.kernels import triton_attention as tri
        tri.store_kvcache_triton(k, v, k_cache, v_cache, slots)
        if self.kind == "flash" and sinks is None:
            return _flash_paged(q, k_cache, v_cache, meta, tables, scale, window)
        return tri.paged_attention_triton(q, k_cache, v_cache, meta.cu_seqlens_q,
                                          meta.context_lens, tables, scale, window, sinks)


def _flash_paged(q, k_cache, v_cache, meta: AttnMetadata, tables: torch.Tensor, scale: float,
                 window: int) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    # flash-attn's window is (left, right) keys around the query's own position: W - 1 to the left.
    window_size = (window - 1, 0) if window else (-1, -1)
    batch = meta.context_lens.shape[0]
    if meta.max_q_len == 1 and q.shape[0] == batch:   # pure decode
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                      block_table=tables, softmax_scale=scale, causal=True,
                                      window_size=window_size)
        return out.squeeze(1)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = torch.cumsum(meta.context_lens, 0)
    return flash_attn_varlen_func(q, k_cache, v_cache, max_seqlen_q=meta.max_q_len, cu_seqlens_q=meta.cu_seqlens_q,
                                  max_seqlen_k=meta.max_context_len, cu_seqlens_k=cu_k,
                                  softmax_scale=scale, causal=True, block_table=tables,
                                  window_size=window_size)
