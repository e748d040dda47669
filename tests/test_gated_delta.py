"""Gated DeltaNet kernels: chunked == recurrent == a direct per-token reading of the equations, varlen
batches with per-slot states, the causal conv with state, transformers' reference, and the Triton
kernels under TRITON_INTERPRET=1."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch
import torch.nn.functional as F

from nanochat.kernels import gated_delta as gd

NK, NV, DK, DV = 2, 4, 8, 16


def make_inputs(lens, seed=0, g_scale=0.5, strided=False):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    if strided:   # q, k, v as views of one conv output, as the model passes them
        mixed = torch.randn(n, 2 * NK * DK + NV * DV, generator=g)
        q = mixed[:, :NK * DK].view(n, NK, DK)
        k = mixed[:, NK * DK:2 * NK * DK].view(n, NK, DK)
        v = mixed[:, 2 * NK * DK:].view(n, NV, DV)
    else:
        q, k = torch.randn(n, NK, DK, generator=g), torch.randn(n, NK, DK, generator=g)
        v = torch.randn(n, NV, DV, generator=g)
    decay = -torch.rand(n, NV, generator=g) * g_scale
    beta = torch.rand(n, NV, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, decay, beta, cu


def make_pool(num_slots=6, seed=1):
    return torch.randn(num_slots, NV, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.5


def direct(q, k, v, g, beta, cu, init):
    """REFERENCE.md's per-token equations, one value head at a time (init: [B, nv, dk, dv])."""
    out = torch.zeros(v.shape, dtype=torch.float64)
    finals = []
    group = NV // NK
    for b in range(len(cu) - 1):
        heads = []
        for h in range(NV):
            s = init[b, h].double().clone()
            for t in range(int(cu[b]), int(cu[b + 1])):
                qt, kt = q[t, h // group].double(), k[t, h // group].double()
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) * DK ** -0.5
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                s = torch.exp(g[t, h].double()) * s
                u = kt @ s
                s = s + torch.outer(kt, beta[t, h].double() * (v[t, h].double() - u))
                out[t, h] = qt @ s
            heads.append(s)
        finals.append(torch.stack(heads))
    return out, torch.stack(finals)


# ----------------------------------------------------------------------------- torch forms


@pytest.mark.parametrize("lens", [[1], [64], [130], [70, 1, 129, 5]])
def test_chunked_equals_recurrent_with_initial_states(lens):
    q, k, v, g, beta, cu = make_inputs(lens, seed=len(lens))
    pool = make_pool()
    slots = torch.tensor([4, 0, 5, 2][:len(lens)])
    fresh = torch.tensor([False, True, False, False][:len(lens)])
    s_rec, s_chk = pool.clone(), pool.clone()
    o_rec = gd.recurrent_gated_delta_rule(q, k, v, g, beta, cu, s_rec, slots, fresh)
    o_chk = gd.chunk_gated_delta_rule(q, k, v, g, beta, cu, s_chk, slots, fresh)
    torch.testing.assert_close(o_chk, o_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_chk, s_rec, atol=1e-5, rtol=1e-5)
    untouched = [i for i in range(pool.shape[0]) if i not in slots.tolist()]
    assert torch.equal(s_chk[untouched], pool[untouched])


def test_torch_forms_equal_direct_equations():
    lens = [9, 1, 70]
    q, k, v, g, beta, cu = make_inputs(lens, seed=3)
    pool = make_pool(3)
    fresh = torch.tensor([False, False, True])
    init = pool.clone()
    init[2] = 0
    ref_o, ref_s = direct(q, k, v, g, beta, cu, init)
    for fn in (gd.recurrent_gated_delta_rule, gd.chunk_gated_delta_rule, gd.gated_delta_rule):
        s = pool.clone()
        o = fn(q, k, v, g, beta, cu, s, torch.arange(3), fresh)
        torch.testing.assert_close(o.double(), ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.double(), ref_s, atol=1e-5, rtol=1e-5)


def test_varlen_batch_equals_per_sequence():
    lens = [33, 1, 100, 64]
    q, k, v, g, beta, cu = make_inputs(lens, seed=4)
    pool = make_pool()
    slots = torch.tensor([1, 3, 0, 5])
    batch_state = pool.clone()
    o = gd.gated_delta_rule(q, k, v, g, beta, cu, batch_state, slots)
    one_state = pool.clone()
    for b in range(len(lens)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        ob = gd.gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                 torch.tensor([0, hi - lo], dtype=torch.int32), one_state, slots[b:b + 1])
        torch.testing.assert_close(o[lo:hi], ob, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch_state, one_state, atol=1e-5, rtol=1e-5)


def test_sequence_in_chunks_equals_one_pass():
    """Chunked prefill: state carried in the slot between calls, then a decode step."""
    q, k, v, g, beta, cu = make_inputs([150], seed=5)
    slot = torch.tensor([2])
    whole = make_pool()
    o_whole = gd.gated_delta_rule(q, k, v, g, beta, cu, whole, slot, torch.tensor([True]))
    parts = make_pool()
    outs = []
    for i, (lo, hi) in enumerate([(0, 40), (40, 149), (149, 150)]):
        outs.append(gd.gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                        torch.tensor([0, hi - lo], dtype=torch.int32), parts, slot,
                                        torch.tensor([i == 0])))
    torch.testing.assert_close(torch.cat(outs), o_whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)


def test_strong_decay_stays_finite():
    q, k, v, g, beta, cu = make_inputs([200], seed=6, g_scale=40.0)
    s_rec, s_chk = make_pool(1), make_pool(1)
    o_rec = gd.recurrent_gated_delta_rule(q, k, v, g, beta, cu, s_rec, torch.tensor([0]))
    o_chk = gd.chunk_gated_delta_rule(q, k, v, g, beta, cu, s_chk, torch.tensor([0]))
    assert torch.isfinite(o_chk).all() and torch.isfinite(s_chk).all()
    torch.testing.assert_close(o_chk, o_rec, atol=1e-5, rtol=1e-5)


def test_matches_transformers_reference():
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, cu = make_inputs([77], seed=7)
    pool = make_pool(1)
    ref_o, ref_s = qn.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                   initial_state=pool.clone(), output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    s = pool.clone()
    o = gd.chunk_gated_delta_rule(q, k, v, g, beta, cu, s, torch.tensor([0]))
    torch.testing.assert_close(o, ref_o[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- causal conv1d


def conv_reference(x, weight, init):
    """Plain F.conv1d over [init state | x] for one sequence, then silu."""
    ext = torch.cat([init, x.t()], dim=1).unsqueeze(0)             # [1, C, K-1+T]
    return F.silu(F.conv1d(ext, weight.unsqueeze(1), groups=x.shape[1])[0].t())


def test_conv_varlen_with_states_matches_reference():
    g = torch.Generator().manual_seed(8)
    c, kk, lens = 12, 4, [5, 1, 2, 17]
    x = torch.randn(sum(lens), c, generator=g)
    weight = torch.randn(c, kk, generator=g)
    pool = torch.randn(5, c, kk - 1, generator=g)
    slots = torch.tensor([3, 0, 4, 1])
    fresh = torch.tensor([False, False, True, False])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    state = pool.clone()
    out = gd.causal_conv1d_varlen(x, weight, cu, state, slots, fresh)
    for b, slot in enumerate(slots.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        init = torch.zeros(c, kk - 1) if fresh[b] else pool[slot]
        torch.testing.assert_close(out[lo:hi], conv_reference(x[lo:hi], weight, init), atol=1e-5, rtol=1e-5)
        ext = torch.cat([init, x[lo:hi].t()], dim=1)
        torch.testing.assert_close(state[slot], ext[:, -(kk - 1):])   # last K-1 inputs, state included
    assert torch.equal(state[2], pool[2])


def test_conv_two_chunks_equal_one():
    g = torch.Generator().manual_seed(9)
    c, kk = 10, 4
    x = torch.randn(23, c, generator=g)
    weight = torch.randn(c, kk, generator=g)
    whole = torch.zeros(2, c, kk - 1)
    one = gd.causal_conv1d_varlen(x, weight, torch.tensor([0, 23]), whole, torch.tensor([1]), torch.tensor([True]))
    parts = torch.full((2, c, kk - 1), 7.0)                     # garbage in the slot: fresh ignores it
    a = gd.causal_conv1d_varlen(x[:2], weight, torch.tensor([0, 2]), parts, torch.tensor([1]), torch.tensor([True]))
    b = gd.causal_conv1d_varlen(x[2:], weight, torch.tensor([0, 21]), parts, torch.tensor([1]), torch.tensor([False]))
    torch.testing.assert_close(torch.cat([a, b]), one, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(parts[1], whole[1])


def test_conv_matches_transformers():
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    g = torch.Generator().manual_seed(10)
    x = torch.randn(19, 8, generator=g)
    weight = torch.randn(8, 4, generator=g)
    ref = qn.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    out = gd.causal_conv1d_varlen(x, weight, torch.tensor([0, 19]), torch.zeros(1, 8, 3), torch.tensor([0]),
                                  torch.tensor([True]))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- Triton (interpreter)


@pytest.fixture(scope="module")
def tgd():
    pytest.importorskip("triton")
    from nanochat.kernels import triton_gated_delta
    return triton_gated_delta


@pytest.mark.parametrize("with_fresh", [True, False])
def test_triton_recurrent_matches_torch(tgd, with_fresh):
    lens = [3, 1, 6]
    q, k, v, g, beta, cu = make_inputs(lens, seed=11, strided=True)
    pool = make_pool()
    slots = torch.tensor([5, 0, 2])
    fresh = torch.tensor([True, False, False]) if with_fresh else None
    s_ref, s_tri = pool.clone(), pool.clone()
    ref = gd.recurrent_gated_delta_rule(q, k, v, g, beta, cu, s_ref, slots, fresh)
    out = tgd.recurrent_gated_delta_rule_triton(q, k, v, g, beta, cu, s_tri, slots, fresh)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_tri, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens,chunk,g_scale", [([20, 1, 35], 16, 0.5), ([70, 2], 64, 0.5), ([40], 16, 40.0)])
def test_triton_chunked_matches_torch(tgd, lens, chunk, g_scale):
    q, k, v, g, beta, cu = make_inputs(lens, seed=12, g_scale=g_scale, strided=True)
    pool = make_pool()
    slots = torch.tensor([1, 4, 3][:len(lens)])
    fresh = torch.tensor([False, True, False][:len(lens)])
    s_ref, s_tri = pool.clone(), pool.clone()
    ref = gd.recurrent_gated_delta_rule(q, k, v, g, beta, cu, s_ref, slots, fresh)
    out = tgd.chunk_gated_delta_rule_triton(q, k, v, g, beta, cu, s_tri, slots, fresh, chunk_size=chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_tri, s_ref, atol=1e-5, rtol=1e-5)


def test_triton_rejects_bad_state(tgd):
    q, k, v, g, beta, cu = make_inputs([2])
    with pytest.raises(ValueError, match="fp32"):
        tgd.recurrent_gated_delta_rule_triton(q, k, v, g, beta, cu, make_pool().half(), torch.tensor([0]))
