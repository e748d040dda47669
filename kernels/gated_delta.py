"""Gated DeltaNet kernels: torch forms (the reference for the compiled and the Triton ones) and the CPU path.

Per sequence, token t and value head h, with the state S [dk, dv] kept in fp32:
    q, k = l2norm(q) * dk**-0.5, l2norm(k)        (key head h // (nv // nk) serves value head h)
    S = exp(g_t) * S;  u = k_t^T S;  S = S + k_t (x) (beta_t * (v_t - u));  o_t = q_t^T S
`recurrent_gated_delta_rule` runs that loop (decode: one step for the whole batch);
`chunk_gated_delta_rule` is the equivalent chunked (WY) form for prefill: within a chunk of C tokens
the delta-rule updates collapse into one triangular solve and a few matmuls, and only the chunk-to-chunk
scan is sequential. On the CPU `gated_delta_rule` runs every chunk token by token, compiled
(`recurrent_gated_delta_rule_cpu`): faster than either torch form, and a token's result does not depend
on where its prompt's chunks start.

Batches are flat and ragged (varlen): sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1]. States live
in a pool indexed by slot: each call reads state[slots[b]] (zeros where fresh[b]) and writes the
final state back, so a sequence can arrive in several chunks across steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanochat.kernels import cpu_decoder, cpu_qgemv

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _seq_ids(lens: torch.Tensor, n: int) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=n)


def _read_states(pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    s = pool.index_select(0, slots).to(dtype)
    if fresh is not None:
        s = s.masked_fill(fresh.view(-1, *([1] * (s.dim() - 1))), 0)
    return s


# ----------------------------------------------------------------------------- causal conv1d


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         conv_state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None = None,
                         activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal conv over each sequence, continuing from its conv state.

    x [N, C] (flat ragged rows), weight [C, K], conv_state [num_slots, C, K-1] holds the last K-1 inputs
    of each slot (updated in place). Returns [N, C] in x's dtype, computed in fp32.
    """
    n, c = x.shape
    km1 = weight.shape[1] - 1
    batch = slots.shape[0]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    init = _read_states(conv_state, slots, fresh, torch.float32)           # [B, C, K-1]
    # One flat buffer holding, per sequence, its K-1 state rows followed by its tokens: every output
    # then reads a fixed window of K rows ending at its own token, whatever the sequence boundaries.
    seq = _seq_ids(lens, n)
    tok_rows = torch.arange(n, device=x.device) + km1 * (seq + 1)
    starts = cu_seqlens[:-1].long() + km1 * torch.arange(batch, device=x.device)
    state_rows = (starts.unsqueeze(1) + torch.arange(km1, device=x.device)).reshape(-1)
    ext = torch.empty(n + batch * km1, c, dtype=torch.float32, device=x.device)
    ext[tok_rows] = x.float()
    ext[state_rows] = init.transpose(1, 2).reshape(-1, c)
    w = weight.float()
    out = ext[tok_rows] * w[:, km1]
    for j in range(km1):
        out += ext[tok_rows - km1 + j] * w[:, j]
    ends = cu_seqlens[1:].long() + km1 * torch.arange(1, batch + 1, device=x.device)
    tail = ends.unsqueeze(1) - km1 + torch.arange(km1, device=x.device)    # last K-1 rows per sequence
    conv_state.index_copy_(0, slots, ext[tail.reshape(-1)].view(batch, km1, c).transpose(1, 2).to(conv_state.dtype))
    if activation == "silu":
        out = cpu_decoder.activation("silu", out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- gated delta rule


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float | None, use_qk_l2norm: bool):
    """fp32 q/k expanded to the value heads (grouped: value head h reads key head h // group)."""
    group = num_v_heads // q.shape[1]
    if group * q.shape[1] != num_v_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({q.shape[1]})")
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    if group > 1:
        q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    return q, k


def recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, state, slots, fresh=None, scale=None,
                               use_qk_l2norm: bool = True) -> torch.Tensor:
    """Token-by-token form. q, k [N, nk, dk]; v [N, nv, dv]; g (log decay, <= 0), beta [N, nv];
    state [num_slots, nv, dk, dv] fp32 (slots [B] read, then written back). Returns fp32 o [N, nv, dv]."""
    nv = v.shape[1]
    q, k = _prepare_qk(q, k, nv, scale, use_qk_l2norm)
    v, g, beta = v.float(), g.float(), beta.float()
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    s = _read_states(state, slots, fresh, torch.float32)                   # [B, nv, dk, dv]
    starts = cu_seqlens[:-1].long()
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    uniform = len(set(lens)) <= 1
    for t in range(max(lens, default=0)):
        active = None if uniform else torch.tensor([b for b, n in enumerate(lens) if n > t], device=v.device)
        rows = starts + t if active is None else starts[active] + t
        st = s if active is None else s[active]
        st = st * g[rows].exp()[..., None, None]
        kt = k[rows]
        u = torch.einsum("bhk,bhkv->bhv", kt, st)
        st = st + kt.unsqueeze(-1) * (beta[rows].unsqueeze(-1) * (v[rows] - u)).unsqueeze(-2)
        o[rows] = torch.einsum("bhk,bhkv->bhv", q[rows], st)
        if active is None:
            s = st
        else:
            s[active] = st
    state.index_copy_(0, slots, s.to(state.dtype))
    return o


def _chunk_layout(cu_seqlens: torch.Tensor, chunk: int, n: int):
    """Token index [num_chunks, chunk] per chunk (padding -> row n) and each sequence's chunk ids
    [B, max_chunks] (missing -> the dummy chunk num_chunks)."""
    starts = cu_seqlens[:-1].long()
    lens = cu_seqlens[1:].long() - starts
    per_seq = (lens + chunk - 1) // chunk
    total = int(per_seq.sum())
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), per_seq, output_size=total)
    first = torch.cumsum(per_seq, 0) - per_seq                           # first chunk id of each sequence
    offset = (torch.arange(total, device=lens.device) - first[seq]) * chunk
    within = offset.unsqueeze(1) + torch.arange(chunk, device=lens.device)   # token offset in its sequence
    tok = torch.where(within < lens[seq].unsqueeze(1), starts[seq].unsqueeze(1) + within, n)
    max_chunks = int(per_seq.max()) if per_seq.numel() else 0
    cols = torch.arange(max_chunks, device=lens.device)
    chunk_ids = torch.where(cols < per_seq.unsqueeze(1), first.unsqueeze(1) + cols, total)
    return tok, chunk_ids


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, state, slots, fresh=None, scale=None,
                           use_qk_l2norm: bool = True, chunk_size: int = 64) -> torch.Tensor:
    """Chunked (WY) form; same contract as recurrent_gated_delta_rule.

    All chunks of all sequences are processed together for the intra-chunk part. Padding rows have
    k = v = beta = g = 0, which leaves the state untouched, so a partial last chunk needs no special case.
    """
    n, nv, dv = v.shape
    q, k = _prepare_qk(q, k, nv, scale, use_qk_l2norm)
    tok, chunk_ids = _chunk_layout(cu_seqlens, chunk_size, n)
    nc = tok.shape[0]

    def chunked(x):   # [N, nv, ...] -> [num_chunks, nv, C, ...] with a zero row for padding
        x = torch.cat([x.float(), x.new_zeros(1, *x.shape[1:], dtype=torch.float32)])[tok]
        return x.transpose(1, 2)

    qc, kc, vc, gc, bc = chunked(q), chunked(k), chunked(v), chunked(g), chunked(beta)
    # Cumulative log decay in fp64: with strong decay its values get large and fp32 differences of
    # them (below) would lose the digits that matter.
    gcum = gc.double().cumsum(-1)                                          # [nc, nv, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    # decay[i, j] = exp(gcum_i - gcum_j) for j <= i: the decay from token j to token i (<= 1).
    decay = (gcum.unsqueeze(-1) - gcum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp().float()
    from_start = gcum.exp().float().unsqueeze(-1)                          # decay since the chunk start
    to_end = (gcum[..., -1:] - gcum).exp().float().unsqueeze(-1)           # decay until the chunk end
    chunk_decay = gcum[..., -1].exp().float()[..., None, None]
    kb = kc * bc.unsqueeze(-1)
    # (I + A) with A strictly lower: the delta-rule corrections tokens make to later ones in the chunk.
    a = ((kb @ kc.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([vc * bc.unsqueeze(-1), kb * from_start], -1)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = sol[..., :dv], sol[..., dv:]                  # u: new values, w: decayed keys reading the state
    intra = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * from_start
    k_decayed = kc * to_end

    def with_dummy(x, fill=0.0):   # a no-op chunk for sequences that have run out of chunks
        return torch.cat([x, torch.full_like(x[:1], fill)])

    u, w, intra, q_decayed, k_decayed = map(with_dummy, (u, w, intra, q_decayed, k_decayed))
    chunk_decay = with_dummy(chunk_decay, 1.0)
    out = torch.empty(nc + 1, nv, chunk_size, dv, dtype=torch.float32, device=v.device)
    s = _read_states(state, slots, fresh, torch.float32)                   # [B, nv, dk, dv]
    for i in range(chunk_ids.shape[1]):
        c = chunk_ids[:, i]
        v_new = u[c] - w[c] @ s
        out[c] = q_decayed[c] @ s + intra[c] @ v_new
        s = s * chunk_decay[c] + k_decayed[c].transpose(-1, -2) @ v_new
    state.index_copy_(0, slots, s.to(state.dtype))
    flat = out[:nc].transpose(1, 2).reshape(nc * chunk_size, nv, dv)
    valid = tok.reshape(-1) < n
    o = torch.empty(n, nv, dv, dtype=torch.float32, device=v.device)
    o[tok.reshape(-1)[valid]] = flat[valid]
    return o


def recurrent_gated_delta_rule_cpu(q, k, v, g, beta, cu_seqlens, state, slots, fresh=None, scale=None,
                                   use_qk_l2norm: bool = True) -> torch.Tensor:
    """recurrent_gated_delta_rule in one compiled call (csrc/decoder.cpp, nc_gdn_recurrent): each (sequence,
    value head) runs its tokens in order on its own, so a token's output and state depend neither on the other
    sequences of the call nor on where the chunks of its prompt start (the chunked form sums each chunk of 64
    from where a prefill chunk started). As fast as the chunked form in torch for a prefill, and
    far faster for ragged batches. CPU tensors, a contiguous float32 state pool."""
    lib = cpu_qgemv.extension()
    nv = v.shape[1]
    q, k = (t.contiguous() for t in _prepare_qk(q, k, nv, scale, use_qk_l2norm))
    v, beta = v.float().contiguous(), beta.float().contiguous()
    decay = cpu_decoder.activation("exp", g.float().contiguous())
    cu = cu_seqlens.to(torch.int32).contiguous()
    slots = slots.to(torch.int64).contiguous()
    fresh = None if fresh is None else fresh.to(torch.uint8).contiguous()
    out = torch.empty(v.shape, dtype=torch.float32)
    rc = lib.nc_gdn_recurrent(q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(), v.shape[0],
                              slots.shape[0], cu.data_ptr(), slots.data_ptr(), 0 if fresh is None else fresh.data_ptr(),
                              nv, q.shape[-1], v.shape[-1], state.data_ptr(), out.data_ptr(), cpu_qgemv.num_threads())
    if rc:
        raise ValueError("gated delta rule: the rows of cu_seqlens do not cover the batch")
    return out


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, state, slots, fresh=None, scale=None,
                     use_qk_l2norm: bool = True, chunk_size: int = 64) -> torch.Tensor:
    """On the CPU every sequence in recurrent_gated_delta_rule_cpu; elsewhere single-token sequences take the
    recurrent step, longer ones the chunked form (one call each)."""
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm)
    if state.is_cpu and state.dtype == torch.float32 and state.is_contiguous() and cpu_qgemv.available():
        return recurrent_gated_delta_rule_cpu(q, k, v, g, beta, cu_seqlens, state, slots, fresh, **kw)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    single = lens == 1
    if bool(single.all()):
        return recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, state, slots, fresh, **kw)
    if not bool(single.any()):
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, state, slots, fresh, chunk_size=chunk_size, **kw)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    seq = _seq_ids(lens.long(), v.shape[0])
    for pick, fn in ((single, recurrent_gated_delta_rule), (~single, chunk_gated_delta_rule)):
        rows = torch.nonzero(pick[seq]).squeeze(1)
        sub_cu = F.pad(torch.cumsum(lens[pick], 0), (1, 0)).to(cu_seqlens.dtype)
        sub_fresh = None if fresh is None else fresh[pick]
        extra = {"chunk_size": chunk_size} if fn is chunk_gated_delta_rule else {}
        o[rows] = fn(q[rows], k[rows], v[rows], g[rows], beta[rows], sub_cu, state, slots[pick], sub_fresh,
                     **kw, **extra)
    return o
