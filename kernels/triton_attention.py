"""Paged KV cache store and paged attention: Triton kernels for the GPU path.

Mirrors nanochat.kernels.attention (the torch reference) argument for argument:
  store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
  paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window, sinks)

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] (flash-attn's paged layout).
Query rows are packed ragged; sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1], and its query
row i sits at absolute position context_lens[b] - q_len_b + i (so one kernel serves decode, prefill
from scratch, chunked prefill and prefix-cache hits).

Attention design (flash-attention style online softmax, fp32 accumulation):
- One program owns a tile of BLOCK_Q query tokens x all GROUP query heads of one KV head, so each K/V
  tile is loaded once per GQA group (rows of the tile = token-major, head-minor).
- Tiles are numbered without a host sync: sequence b's tiles start at cu_seqlens_q[b] // BLOCK_Q + b,
  which bounds the tiles of all earlier sequences; a program finds its sequence by binary search and
  exits if its tile is past the end. The grid depends only on shapes, so it is CUDA-graph safe.
- Decode batches too small to fill the GPU split the KV range (flash-decoding): each split writes an
  unnormalised partial (acc, max, sum) and a second kernel merges them.
- Attention sinks (one logit per query head in the softmax's denominator, no value): the online softmax
  starts from the sink (running max = sink, sum = 1); with split KV the merge adds it once instead.

The triton import is guarded: importing this module without triton works, calling a function raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:  # GPU-only dependency: keep `import nanochat.kernels.triton_attention` working without it.
    import triton
    import triton.language as tl
    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # ImportError, or a broken install raising something else
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = exc

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError(f"triton is not available ({_TRITON_IMPORT_ERROR!r}); "
                           "the Triton attention kernels need it (use nanochat.kernels.attention instead)")


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr,
        s_kn, s_kh, s_kd, s_vn, s_vh, s_vd,
        s_kcb, s_kct, s_kch, s_kcd, s_vcb, s_vct, s_vch, s_vcd,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        KVH_P2: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        if slot < 0:  # padding token (e.g. CUDA-graph filler): nothing to store
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        hh = tl.arange(0, KVH_P2)
        d = tl.arange(0, HEAD_P2)
        mask = (hh[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + i * s_kn + hh[:, None] * s_kh + d[None, :] * s_kd, mask=mask)
        v = tl.load(value_ptr + i * s_vn + hh[:, None] * s_vh + d[None, :] * s_vd, mask=mask)
        kc = kc_ptr + blk * s_kcb + off * s_kct + hh[:, None] * s_kch + d[None, :] * s_kcd
        vc = vc_ptr + blk * s_vcb + off * s_vct + hh[:, None] * s_vch + d[None, :] * s_vcd
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _mm(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        if UPCAST:  # CPU interpreter only: its tl.dot multiplies bf16 bit patterns as integers
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:  # fp32 inputs: true fp32 products (the default would be TF32 on NVIDIA)
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _find_seq(cu_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
        """Largest b with cu_seqlens_q[b] // BLOCK_Q + b <= tile (the sequence owning this tile)."""
        lo = tl.full([], 0, tl.int32)
        hi = tl.full([], 0, tl.int32) + num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_tile = tl.load(cu_ptr + mid).to(tl.int32) // BLOCK_Q + mid
            go_right = first_tile <= tile
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(go_right, hi, mid)
        return lo - 1

    @triton.jit
    def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        cu_ptr, ctx_ptr, bt_ptr, sinks_ptr,
        scale_log2, num_seqs, num_heads, window,
        s_qn, s_qh, s_qd,
        s_kb, s_kt, s_kh, s_kd,
        s_vb, s_vt, s_vh, s_vd,
        s_on, s_oh, s_od,
        s_bt,
        HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        b = _find_seq(cu_ptr, tile, num_seqs, BLOCK_Q)
        q_begin = tl.load(cu_ptr + b).to(tl.int32)
        q_len = tl.load(cu_ptr + b + 1).to(tl.int32) - q_begin
        q_start = (tile - (q_begin // BLOCK_Q + b)) * BLOCK_Q
        if q_start >= q_len:  # spare program: the grid is an upper bound on the tile count
            return
        ctx = tl.load(ctx_ptr + b).to(tl.int32)

        # Tile rows: token-major, GQA head-minor; padded rows/heads are masked.
        rows = tl.arange(0, BLOCK_M)
        q_local = rows // GROUP_P2
        g = rows % GROUP_P2
        tok = q_start + q_local
        row_ok = (q_local < BLOCK_Q) & (tok < q_len) & (g < GROUP)
        head = kvh * GROUP + g
        pos = ctx - q_len + tok  # absolute position: sees keys 0..pos
        n_row = (q_begin + tok).to(tl.int64)
        d = tl.arange(0, HEAD_P2)
        d_ok = d < HEAD_DIM

        q = tl.load(q_ptr + n_row[:, None] * s_qn + head[:, None] * s_qh + d[None, :] * s_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # Keys this tile can see at all: up to the position of its last valid row.
        kv_end = ctx - q_len + tl.minimum(q_start + BLOCK_Q, q_len)
        # and from the first key of its first row's window (window 0: full attention).
        kv_first = 0
        if window > 0:
            kv_first = tl.maximum(ctx - q_len + q_start - window + 1, 0)
        if NUM_SPLITS == 1:
            kv_lo = kv_first
            kv_hi = kv_end
        else:
            per_split = tl.cdiv(tl.cdiv(kv_end - kv_first, BLOCK_N), NUM_SPLITS) * BLOCK_N
            kv_lo = kv_first + split * per_split
            kv_hi = tl.minimum(kv_end, kv_lo + per_split)

        # Masked scores are -inf but the running max starts at a finite floor, so a row (or split)
        # with no visible key gets exp2(-inf - floor) = 0 rather than NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS and NUM_SPLITS == 1:   # the sink as the first "key": exp2(sink - sink) = 1, value 0
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i += 1.0
        acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * s_bt
        for start in range(kv_lo, kv_hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < kv_hi
            # Per-key block lookup, so BLOCK_N need not match block_size.
            blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            off = (n % BLOCK_SIZE).to(tl.int64)
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k_t = tl.load(k_ptr + (blk * s_kb + off * s_kt + kvh * s_kh)[None, :] + d[:, None] * s_kd,
                          mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptr + (blk * s_vb + off * s_vt + kvh * s_vh)[:, None] + d[None, :] * s_vd,
                        mask=kv_mask, other=0.0)

            s = _mm(q, k_t.to(q.dtype), IEEE, UPCAST) * scale_log2
            in_window = (n[None, :] > pos[:, None] - window) | (window == 0)
            visible = (n[None, :] <= pos[:, None]) & n_ok[None, :] & in_window
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _mm(p.to(q.dtype), v.to(q.dtype), IEEE, UPCAST)
            m_i = m_new

        if NUM_SPLITS == 1:
            l_safe = tl.where(l_i > 0, l_i, 1.0)
            o = acc / l_safe[:, None]
            tl.store(out_ptr + n_row[:, None] * s_on + head[:, None] * s_oh + d[None, :] * s_od,
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            # Scratch is contiguous [N, num_heads, NUM_SPLITS(, HEAD_DIM)].
            part = (n_row * num_heads + head) * NUM_SPLITS + split
            tl.store(part_m_ptr + part, m_i, mask=row_ok)
            tl.store(part_l_ptr + part, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_splits_kernel(
        part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, sinks_ptr,
        num_heads, s_on, s_oh, s_od,
        HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS_P2)
        sp_ok = sp < NUM_SPLITS
        d = tl.arange(0, HEAD_P2)
        d_ok = d < HEAD_DIM
        part = (n * num_heads + h) * NUM_SPLITS + sp
        m = tl.load(part_m_ptr + part, mask=sp_ok, other=-1.0e30)
        l = tl.load(part_l_ptr + part, mask=sp_ok, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                      mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
        top = tl.max(m, 0)
        if HAS_SINKS:   # the sink's term, once: exp2(sink - top) in the denominator, nothing in the sum of values
            sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
            top = tl.maximum(top, sink)
        w = tl.exp2(m - top)  # empty splits carry the floor max, so weigh ~0
        denom = tl.sum(w * l, 0)
        if HAS_SINKS:
            denom += tl.exp2(sink - top)
        denom = tl.where(denom > 0, denom, 1.0)
        o = tl.sum(acc * w[:, None], 0) / denom
        tl.store(out_ptr + n * s_on + h * s_oh + d * s_od, o.to(out_ptr.dtype.element_ty), mask=d_ok)


# ----------------------------------------------------------------------------- host side


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, kv_heads, head_dim]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not supported (fp16, bf16, fp32)")


def _check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    if dev.type == "cpu" and not _interpreting():
        raise ValueError("Triton attention kernels need GPU tensors (CPU tensors only work under "
                         "TRITON_INTERPRET=1); use nanochat.kernels.attention on CPU")


def _check_int(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a {dim}-D int32/int64 tensor; got {t.dtype} {tuple(t.shape)}")


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token i's K/V into flat slot slot_mapping[i]; a slot of -1 is skipped."""
    _require_triton()
    _check_cache(k_cache, v_cache)
    _, block_size, kvh, head_dim = k_cache.shape
    if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (kvh, head_dim):
        raise ValueError(f"key/value must be [N, {kvh}, {head_dim}] to match the cache; "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    _check_int("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    _check_device(key, value, k_cache, v_cache, slot_mapping)
    n = key.shape[0]
    if n == 0:
        return
    _store_kv_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=kvh, HEAD_DIM=head_dim,
        KVH_P2=_next_pow2(kvh), HEAD_P2=_next_pow2(head_dim), BLOCK_SIZE=block_size,
    )


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pick_num_splits(n_tokens: int, n_seqs: int, kvh: int, kv_capacity: int, block_n: int,
                     device: torch.device) -> int:
    """Split the KV range only for pure-decode batches that leave most SMs idle.

    Depends on shapes alone (never on tensor values), so CUDA-graph capture stays valid.
    """
    if n_tokens != n_seqs:  # prefill rows already give plenty of parallelism
        return 1
    programs = n_seqs * kvh
    target = 2 * _sm_count(device)
    if programs >= target:
        return 1
    splits = _next_pow2(-(-target // programs))
    # Keep at least ~2 KV tiles per split at full capacity.
    splits = min(splits, _next_pow2(max(1, kv_capacity // (2 * block_n))), _MAX_SPLITS)
    return max(1, splits)


@dataclass(frozen=True)
class _Tiles:
    block_m: int  # query rows per program (tokens x GQA heads)
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


def _pick_tiles(head_p2: int, dtype: torch.dtype, decode: bool) -> _Tiles:
    """Tile sizes chosen so that ptxas reports no register spills for sm_80/sm_90 (bf16/fp16).

    Checked by compiling ahead of time for those targets; not yet timed on a GPU.
    fp32 (a correctness path on GPUs) uses small tiles; it still spills a little on sm_90.
    """
    if dtype == torch.float32:
        return _Tiles(16 if decode else 32, 32, 4, 2)
    if head_p2 > 128:
        return _Tiles(16 if decode else 32, 32, 4, 2)
    if decode:
        return _Tiles(16, 64, 4, 2)
    return _Tiles(64, 64, 4 if head_p2 <= 64 else 8, 2)


def _paged_attention_impl(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window: int = 0,
                          sinks: torch.Tensor | None = None, *, block_m: int | None = None, block_n: int | None = None,
                          num_splits: int | None = None) -> torch.Tensor:
    """paged_attention_triton with the tiling knobs exposed (tests use them to cover every path)."""
    _require_triton()
    _check_cache(k_cache, v_cache)
    _, block_size, kvh, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [N, heads, {head_dim}]; got {tuple(q.shape)}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported (fp16, bf16, fp32)")
    n_tok, n_heads, _ = q.shape
    if n_heads % kvh != 0:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of kv heads ({kvh})")
    _check_int("cu_seqlens_q", cu_seqlens_q, 1)
    _check_int("context_lens", context_lens, 1)
    _check_int("block_tables", block_tables, 2)
    n_seqs = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != n_seqs + 1 or block_tables.shape[0] != n_seqs:
        raise ValueError(f"cu_seqlens_q must be [B+1] and block_tables [B, max_blocks] for B={n_seqs}; got "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(block_tables.shape)}")
    _check_device(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    if sinks is not None:
        if sinks.shape != (n_heads,):
            raise ValueError(f"sinks must be [{n_heads}] (one per query head); got {tuple(sinks.shape)}")
        _check_device(q, sinks)
        sinks = sinks.to(torch.float32).contiguous()

    out = torch.empty_like(q)
    if n_tok == 0 or n_seqs == 0:
        return out

    group = n_heads // kvh
    group_p2 = _next_pow2(group)
    head_p2 = max(16, _next_pow2(head_dim))
    decode = n_tok == n_seqs
    cfg = _pick_tiles(head_p2, q.dtype, decode)
    block_m = block_m or cfg.block_m
    block_n = block_n or cfg.block_n
    block_q = max(1, block_m // group_p2)
    block_m = max(16, block_q * group_p2)  # tl.dot wants every dim >= 16
    if num_splits is None:
        num_splits = _pick_num_splits(n_tok, n_seqs, kvh, block_tables.shape[1] * block_size,
                                      block_n, q.device)

    if num_splits > 1:
        part_acc = torch.empty((n_tok, n_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((n_tok, n_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel; any tensor will do as a pointer
        part_acc = part_m = part_l = out

    grid = (n_tok // block_q + n_seqs, kvh, num_splits)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_m, part_l,
        cu_seqlens_q, context_lens, block_tables, out if sinks is None else sinks,
        float(scale) * _LOG2E, n_seqs, n_heads, int(window),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_P2=head_p2, GROUP=group, GROUP_P2=group_p2,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32,
        UPCAST=q.dtype == torch.bfloat16 and _interpreting(), HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(n_tok, n_heads)](
            part_acc, part_m, part_l, out, out if sinks is None else sinks, n_heads, *out.stride(),
            HEAD_DIM=head_dim, HEAD_P2=head_p2, NUM_SPLITS=num_splits, SPLITS_P2=_next_pow2(num_splits),
            HAS_SINKS=sinks is not None,
        )
    return out


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, window: int = 0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ragged query rows over each sequence's paged KV (decode and prefill alike); window:
    0 = full, else W (the query at position p sees keys p - W + 1 .. p); sinks: fp32 [heads], a logit per query
    head in the softmax's denominator only (gpt-oss), or None."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be 0 (full attention) or a positive integer; got {window!r}")
    return _paged_attention_impl(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window, sinks)
