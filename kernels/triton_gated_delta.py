"""Gated DeltaNet: Triton kernels for the GPU path.

Mirror nanochat.kernels.gated_delta (the torch reference) argument for argument:
  recurrent_gated_delta_rule_triton(q, k, v, g, beta, cu_seqlens, state, slots, fresh, scale, use_qk_l2norm)
  chunk_gated_delta_rule_triton(..., chunk_size=64)
q, k [N, nk, dk] and v [N, nv, dv] may be strided views (e.g. slices of the conv output); g, beta [N, nv];
state [num_slots, nv, dk, dv] fp32 is read at state[slots[b]] (zeros where fresh[b]) and written back in
place, so no gather/scatter copies of the (large) states are made. Output: fp32 o [N, nv, dv].

Design: one program per (sequence, value head, block of dv columns); the state tile [dk, BV] stays in
registers for the whole sequence (columns of S evolve independently, so splitting dv is exact).
- recurrent: a loop over the sequence's tokens (decode: one step).
- chunked: a loop over chunks of C tokens; per chunk the WY form: A = strictly-lower(beta K K^T * decay),
  T = (I + A)^-1 by forward substitution, U = T (beta V), W = T (beta K exp(gcum)), then
  V' = U - W S, O = (Q exp(gcum)) S + (Q K^T * decay) V', S = exp(g_last) S + (K exp(g_last - gcum))^T V'.
Every product is an fp32 tl.dot with input_precision="ieee" (the default would be TF32 on NVIDIA).

The triton import is guarded: importing this module without triton works, calling a function raises.
"""

from __future__ import annotations

import torch

try:  # GPU-only dependency: keep `import nanochat.kernels.triton_gated_delta` working without it.
    import triton
    import triton.language as tl
    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # ImportError, or a broken install raising something else
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = exc

L2NORM_EPS = 1e-6


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError(f"triton is not available ({_TRITON_IMPORT_ERROR!r}); "
                           "use nanochat.kernels.gated_delta instead")


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _load_qk(ptr, rows, s_n, s_h, head, rk, row_ok, k_ok, L2: tl.constexpr):
        x = tl.load(ptr + rows[:, None] * s_n + head * s_h + rk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if L2:
            x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
        return x

    @triton.jit
    def _sequence_state(state_ptr, cu_ptr, slot_ptr, fresh_ptr, s_ss, s_sh, GROUP: tl.constexpr, DK: tl.constexpr,
                        DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_FRESH: tl.constexpr):
        """This program's sequence (its token range), head, key/value lanes and state tile, loaded (zero
        for a fresh sequence)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        start = tl.load(cu_ptr + b).to(tl.int64)
        end = tl.load(cu_ptr + b + 1).to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        rk = tl.arange(0, BK)
        rv = vb * BV + tl.arange(0, BV)
        k_ok = rk < DK
        v_ok = rv < DV
        s_ptrs = state_ptr + slot * s_ss + h * s_sh + rk[:, None] * DV + rv[None, :]
        s_mask = k_ok[:, None] & v_ok[None, :]
        s = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
        if HAS_FRESH:
            fresh = tl.load(fresh_ptr + b)
            s = tl.where(fresh != 0, 0.0, s)
        return start, end, h // GROUP, rk, rv, k_ok, v_ok, s_ptrs, s_mask, s

    @triton.jit
    def _recurrent_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, cu_ptr, slot_ptr, fresh_ptr,
        s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_bn, s_on, s_oh, s_ss, s_sh,
        scale,
        GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        L2: tl.constexpr, HAS_FRESH: tl.constexpr,
    ):
        h = tl.program_id(1)
        start, end, hk, rk, rv, k_ok, v_ok, s_ptrs, s_mask, s = _sequence_state(
            state_ptr, cu_ptr, slot_ptr, fresh_ptr, s_ss, s_sh, GROUP, DK, DV, BK, BV, HAS_FRESH)
        for t in range(start, end):
            q = tl.load(q_ptr + t * s_qn + hk * s_qh + rk, mask=k_ok, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t * s_kn + hk * s_kh + rk, mask=k_ok, other=0.0).to(tl.float32)
            if L2:
                q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
                k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
            q = q * scale
            v = tl.load(v_ptr + t * s_vn + h * s_vh + rv, mask=v_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + t * s_gn + h).to(tl.float32)
            beta = tl.load(beta_ptr + t * s_bn + h).to(tl.float32)
            s = s * tl.exp(g)
            u = tl.sum(s * k[:, None], 0)
            s = s + k[:, None] * ((v - u) * beta)[None, :]
            o = tl.sum(s * q[:, None], 0)
            tl.store(o_ptr + t * s_on + h * s_oh + rv, o, mask=v_ok)
        tl.store(s_ptrs, s, mask=s_mask)

    @triton.jit
    def _chunk_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, cu_ptr, slot_ptr, fresh_ptr,
        s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_bn, s_on, s_oh, s_ss, s_sh,
        scale,
        GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        CHUNK: tl.constexpr, L2: tl.constexpr, HAS_FRESH: tl.constexpr,
    ):
        h = tl.program_id(1)
        start, end, hk, rk, rv, k_ok, v_ok, s_ptrs, s_mask, s = _sequence_state(
            state_ptr, cu_ptr, slot_ptr, fresh_ptr, s_ss, s_sh, GROUP, DK, DV, BK, BV, HAS_FRESH)
        rc = tl.arange(0, CHUNK)
        causal = rc[:, None] >= rc[None, :]
        strict = rc[:, None] > rc[None, :]
        eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
        for c0 in range(start, end, CHUNK):
            rows = c0 + rc
            row_ok = rows < end
            # Padding rows load k = v = beta = g = 0: they leave the state untouched.
            q = _load_qk(q_ptr, rows, s_qn, s_qh, hk, rk, row_ok, k_ok, L2) * scale
            k = _load_qk(k_ptr, rows, s_kn, s_kh, hk, rk, row_ok, k_ok, L2)
            v = tl.load(v_ptr + rows[:, None] * s_vn + h * s_vh + rv[None, :],
                        mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
            g = tl.load(g_ptr + rows * s_gn + h, mask=row_ok, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + rows * s_bn + h, mask=row_ok, other=0.0).to(tl.float32)
            # Cumulative log decay in fp64: under strong decay its values get large, and fp32
            # differences of them would lose the digits that matter.
            gcum64 = tl.cumsum(g.to(tl.float64), 0)
            gcum = gcum64.to(tl.float32)
            # decay[i, j] = exp(gcum_i - gcum_j) for j <= i (<= 1: no overflow), 0 above the diagonal.
            diff = (gcum64[:, None] - gcum64[None, :]).to(tl.float32)
            decay = tl.exp(tl.where(causal, diff, float("-inf")))
            kb = k * beta[:, None]
            a = tl.where(strict, tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0)
            # T = (I + A)^-1, row by row: T_i = e_i - sum_{j<i} A_ij T_j.
            t_inv = eye
            for i in range(1, CHUNK):
                a_i = tl.sum(tl.where(rc[:, None] == i, a, 0.0), 0)
                row = tl.sum(a_i[:, None] * t_inv, 0)
                t_inv = tl.where(rc[:, None] == i, t_inv - row[None, :], t_inv)
            u = tl.dot(t_inv, v * beta[:, None], input_precision="ieee")
            w = tl.dot(t_inv, kb * tl.exp(gcum)[:, None], input_precision="ieee")
            v_new = u - tl.dot(w, s, input_precision="ieee")
            intra = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
            o = tl.dot(q * tl.exp(gcum)[:, None], s, input_precision="ieee") \
                + tl.dot(intra, v_new, input_precision="ieee")
            tl.store(o_ptr + rows[:, None] * s_on + h * s_oh + rv[None, :], o,
                     mask=row_ok[:, None] & v_ok[None, :])
            g_last = tl.sum(tl.where(rc == CHUNK - 1, gcum64, 0.0), 0)   # padding has g = 0
            k_decayed = k * tl.exp((g_last - gcum64).to(tl.float32))[:, None]
            s = s * tl.exp(g_last.to(tl.float32)) + tl.dot(tl.trans(k_decayed), v_new, input_precision="ieee")
        tl.store(s_ptrs, s, mask=s_mask)


def _launch(kernel, q, k, v, g, beta, cu_seqlens, state, slots, fresh, scale, use_qk_l2norm, **consts):
    _require_triton()
    n, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    if nv % nk:
        raise ValueError(f"value heads ({nv}) must be a multiple of key heads ({nk})")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("q, k, v must be contiguous along the head dimension")
    if state.dtype != torch.float32 or not state[0].is_contiguous():
        raise ValueError("state must be an fp32 pool [num_slots, nv, dk, dv] with contiguous slots")
    if g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("g and beta must be contiguous along the head dimension")
    batch = slots.shape[0]
    o = torch.empty(n, nv, dv, dtype=torch.float32, device=v.device)
    if batch == 0 or n == 0:
        return o
    bk = max(16, _next_pow2(dk))
    bv = max(16, min(64, _next_pow2(dv)))
    fresh_arg = fresh.to(torch.int32) if fresh is not None else slots
    scale = float(scale if scale is not None else dk ** -0.5)
    grid = (batch, nv, triton.cdiv(dv, bv))
    kernel[grid](
        q, k, v, g, beta, o, state, cu_seqlens, slots, fresh_arg,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), o.stride(0), o.stride(1), state.stride(0), state.stride(1),
        scale,
        GROUP=nv // nk, DK=dk, DV=dv, BK=bk, BV=bv, L2=bool(use_qk_l2norm), HAS_FRESH=fresh is not None,
        **consts,
    )
    return o


def recurrent_gated_delta_rule_triton(q, k, v, g, beta, cu_seqlens, state, slots, fresh=None, scale=None,
                                      use_qk_l2norm: bool = True) -> torch.Tensor:
    return _launch(_recurrent_kernel if triton is not None else None, q, k, v, g, beta, cu_seqlens, state,
                   slots, fresh, scale, use_qk_l2norm)


def chunk_gated_delta_rule_triton(q, k, v, g, beta, cu_seqlens, state, slots, fresh=None, scale=None,
                                  use_qk_l2norm: bool = True, chunk_size: int = 64) -> torch.Tensor:
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    return _launch(_chunk_kernel if triton is not None else None, q, k, v, g, beta, cu_seqlens, state,
                   slots, fresh, scale, use_qk_l2norm, CHUNK=chunk_size)
