"""Paged KV cache store and attention: the torch implementation (CPU path and reference).

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] (flash-attn's paged layout).
Query rows are packed ragged: sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and its KV
(already stored, new tokens included) is context_lens[b] tokens long, laid out by block_tables[b].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, may_skip: bool = True) -> None:
    """Write token i's K/V into flat slot slot_mapping[i]; a slot of -1 is skipped.

    may_skip=False promises no -1 slots (the CPU engine never pads), saving a check per layer."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if may_skip:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:n_blocks]].flatten(0, 1)[:length]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Lq, h, d] at the LAST Lq positions of k/v [Lk, kvh, d]; returns [Lq, h, d]. window: 0 = all earlier
    keys, else W (the query at position p sees keys p - W + 1 .. p). sinks: fp32 [h], one learned logit per
    query head in the softmax's denominator with no value (gpt-oss), or None."""
    lq, lk = q.shape[0], k.shape[0]
    if window and lk - lq - window + 1 > 0:   # keys before the first query's window: never seen
        drop = lk - lq - window + 1
        k, v, lk = k[drop:], v[drop:], lk - drop
    if k.dtype != q.dtype:  # a 16-bit cache under fp32 compute: attention runs in the compute dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    # 4-D [1, heads, L, d]: on CPU, SDPA takes its fused (flash) kernel only for 4-D inputs; 3-D ones
    # fall back to the math path (~3x slower for a 512-token prefill).
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if lq == 1:
        return _decode_attention(q, k, v, scale, sinks)
    if sinks is not None:
        return _sink_attention(qt, kt, vt, scale, window, sinks, gqa)[0].transpose(0, 1)
    if lq == lk and not (window and lk > window):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:   # an offset causal mask, or the last rows' windows starting after key 0
        mask = _visible(lq, lk, window, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _visible(lq: int, lk: int, window: int, device) -> torch.Tensor:
    """[lq, lk] bool: the keys each of the last lq queries sees. Query i sits at absolute position lk - lq + i
    and sees keys up to it (and, with a window W, none W or more behind it)."""
    rows = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)
    cols = torch.arange(lk, device=device).unsqueeze(0)
    visible = cols <= rows
    if window:
        visible &= cols > rows - window
    return visible


def _sink_attention(qt, kt, vt, scale: float, window: int, sinks: torch.Tensor, gqa: bool) -> torch.Tensor:
    """SDPA with attention sinks ([1, heads, L, d] inputs): SDPA has none, so each sink is one more key column,
    a zero key (score 0) plus an additive mask of the sink's value, with a zero value: exactly
    exp(sink) in the softmax's denominator and nothing in its numerator."""
    lq, lk = qt.shape[2], kt.shape[2]
    zero = kt.new_zeros(1, kt.shape[1], 1, kt.shape[3])
    kt, vt = torch.cat([kt, zero], 2), torch.cat([vt, zero], 2)
    visible = _visible(lq, lk, window, qt.device)
    bias = torch.zeros(lq, lk, dtype=qt.dtype, device=qt.device).masked_fill_(~visible, float("-inf"))
    bias = torch.cat([bias.expand(qt.shape[1], lq, lk),
                      sinks.to(qt.dtype).view(-1, 1, 1).expand(-1, lq, 1)], 2).unsqueeze(0)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale, enable_gqa=gqa)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token: two small matmuls per KV-head group. (SDPA's GQA path on CPU falls back to
    its math kernel, which is far slower for a single query.) Sinks: one more score column per head,
    dropped after the softmax."""
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    qg = q.view(kv_heads, heads // kv_heads, d).float()
    scores = torch.matmul(qg, k.float().permute(1, 2, 0)).mul_(scale)       # [kvh, group, L]
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(kv_heads, heads // kv_heads, 1)], -1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float().transpose(0, 1))                    # [kvh, group, d]
    return out.view(1, heads, d).to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float,
                    host_lists: tuple[list[int], list[int]] | None = None, window: int = 0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ragged query rows over each sequence's paged KV (window and sinks as
    causal_attention).

    host_lists: (cu_seqlens_q, context_lens) as Python lists, when the caller already has them, so
    every layer of a step does not read the same small tensors back again."""
    out = torch.empty_like(q)
    starts, lens = host_lists if host_lists is not None else (cu_seqlens_q.tolist(), context_lens.tolist())
    for b, length in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        k = gather_kv(k_cache, block_tables[b], length)
        v = gather_kv(v_cache, block_tables[b], length)
        out[lo:hi] = causal_attention(q[lo:hi], k, v, scale, window, sinks).to(out.dtype)
    return out
