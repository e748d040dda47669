"""Triton paged KV store / paged attention vs the torch reference, on CPU under TRITON_INTERPRET=1."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton; the tests use CPU tensors

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from nanochat.kernels import triton_attention as ta  # noqa: E402

try:
    from nanochat.kernels.attention import paged_attention, store_kvcache
except ImportError:  # the lead's reference not there yet: the private one below still checks
    paged_attention = store_kvcache = None

ATOL = 1e-4


# ----------------------------------------------------------------------------- private reference


def ref_store(key, value, k_cache, v_cache, slot_mapping):
    bs = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // bs, slot % bs] = key[i].to(k_cache.dtype)
            v_cache[slot // bs, slot % bs] = value[i].to(v_cache.dtype)


def ref_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window=0, sinks=None):
    """Token-by-token gather, explicit causal mask with offset (and the sliding window: keys p - window + 1 .. p),
    float64 softmax; sinks: one more score column per head (the sink's logit) with no value."""
    bs = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        lo, hi = cu[b], cu[b + 1]
        slots = [(int(block_tables[b, t // bs]), t % bs) for t in range(ctx)]
        k = torch.stack([k_cache[blk, off] for blk, off in slots]).double().repeat_interleave(group, 1)
        v = torch.stack([v_cache[blk, off] for blk, off in slots]).double().repeat_interleave(group, 1)
        qb = q[lo:hi].double()
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale
        pos = torch.arange(hi - lo).unsqueeze(1) + (ctx - (hi - lo))
        keys = torch.arange(ctx).unsqueeze(0)
        s = s.masked_fill((keys > pos) | ((keys <= pos - window) if window else False), float("-inf"))
        if sinks is not None:
            sink_col = sinks.double().view(-1, 1, 1).expand(-1, hi - lo, 1)
            p = torch.cat([s, sink_col], -1).softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out


# ----------------------------------------------------------------------------- inputs


def make_batch(q_lens, ctx_lens, *, block_size=16, h=4, kvh=2, d=32, dtype=torch.float32,
               spare_blocks=3, seed=0):
    """Random q and caches; each sequence gets blocks from a random permutation of all block ids.

    The whole cache is random (unused blocks too), so reading a wrong slot shows up as an error.
    Unused block-table entries are -1, which must never be dereferenced.
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    max_blocks = max(need) + 1
    block_tables = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        block_tables[b, :n] = perm[used:used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), h, d, generator=g).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return q, k_cache, v_cache, cu, ctx, block_tables


# decode; prefill from scratch; chunk after prior context (chunked prefill / prefix-cache hit)
MIXED = ([1, 19, 7], [21, 19, 40])


def check(out, args, scale, atol=ATOL):
    f32 = [t.float() if t.is_floating_point() else t for t in args]
    expected = ref_attention(*f32, scale)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
    if paged_attention is not None:
        lead = paged_attention(*f32, scale)
        torch.testing.assert_close(out.float(), lead, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- store_kvcache


def test_store_kvcache_matches_reference_and_skips_minus_one():
    g = torch.Generator().manual_seed(1)
    nb, bs, kvh, d = 5, 16, 2, 32
    k_cache = torch.randn(nb, bs, kvh, d, generator=g)
    v_cache = torch.randn(nb, bs, kvh, d, generator=g)
    n = 9
    # key/value as strided views of a fused qkv buffer, as the model produces them
    qkv = torch.randn(n, 3 * kvh * d, generator=g)
    key = qkv[:, kvh * d:2 * kvh * d].view(n, kvh, d)
    value = qkv[:, 2 * kvh * d:].view(n, kvh, d)
    slots = torch.randperm(nb * bs, generator=g)[:n].to(torch.int64)
    slots[[2, 6]] = -1
    orig_k, orig_v = k_cache.clone(), v_cache.clone()
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    ref_store(key, value, exp_k, exp_v, slots)

    ta.store_kvcache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)
    if store_kvcache is not None:
        lead_k, lead_v = orig_k, orig_v
        store_kvcache(key, value, lead_k, lead_v, slots)
        assert torch.equal(k_cache, lead_k) and torch.equal(v_cache, lead_v)


def test_store_kvcache_casts_to_cache_dtype():
    k_cache = torch.zeros(2, 16, 1, 32, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    # bf16-representable values: the interpreter truncates fp32->bf16 where GPUs round to nearest
    key = torch.randn(3, 1, 32).bfloat16().float()
    value = torch.randn(3, 1, 32).bfloat16().float()
    slots = torch.tensor([17, -1, 0])
    ta.store_kvcache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 1], key[0].bfloat16()) and torch.equal(v_cache[0, 0], value[2].bfloat16())
    assert k_cache.flatten(0, 1).float().abs().sum(-1).gt(0).sum() == 2


# ----------------------------------------------------------------------------- paged attention


def test_mixed_batch_default_config():
    args = make_batch(*MIXED)
    check(ta.paged_attention_triton(*args, 0.25), args, 0.25)


@pytest.mark.parametrize("block_m,block_n,num_splits", [
    (16, 16, 1),   # several query tiles per sequence; one KV block per tile
    (32, 64, 1),   # KV tiles spanning several cache blocks
    (16, 32, 3),   # split-KV (non-power-of-two count) + merge kernel, on prefill rows too
])
def test_mixed_batch_tilings(block_m, block_n, num_splits):
    args = make_batch(*MIXED, seed=2)
    out = ta._paged_attention_impl(*args, 0.25, block_m=block_m, block_n=block_n, num_splits=num_splits)
    check(out, args, 0.25)


def test_decode_batch_with_splits():
    args = make_batch([1, 1, 1, 1], [1, 16, 33, 70], seed=3)
    check(ta.paged_attention_triton(*args, 0.25), args, 0.25)
    check(ta._paged_attention_impl(*args, 0.25, num_splits=4), args, 0.25)


@pytest.mark.parametrize("h,kvh", [(4, 1), (6, 2), (2, 2)])  # group 4, group 3 (padded), MHA
def test_gqa_groups(h, kvh):
    args = make_batch([3, 1], [10, 5], h=h, kvh=kvh, seed=4)
    check(ta.paged_attention_triton(*args, 0.25), args, 0.25)


def test_block_size_256_and_head_dim_64():
    args = make_batch([1, 5], [300, 260], block_size=256, h=2, kvh=1, d=64, spare_blocks=1, seed=5)
    check(ta._paged_attention_impl(*args, 0.125, block_n=128), args, 0.125)


def test_non_power_of_two_head_dim():
    args = make_batch([4], [9], d=40, seed=6)
    check(ta.paged_attention_triton(*args, 0.2), args, 0.2)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 3e-3), (torch.bfloat16, 3e-2)])
def test_half_precision(dtype, atol):
    args = make_batch(*MIXED, dtype=dtype, seed=7)
    out = ta.paged_attention_triton(*args, 0.25)
    assert out.dtype == dtype
    check(out, args, 0.25, atol=atol)


def test_chunked_prefill_equals_full_prefill():
    """Prefilling in two chunks over the paged cache gives the rows a single prefill gives."""
    q, k_cache, v_cache, _, _, bt = make_batch([23], [23], seed=8)
    scale = 0.2
    full = ta.paged_attention_triton(q, k_cache, v_cache, torch.tensor([0, 23], dtype=torch.int32),
                                     torch.tensor([23], dtype=torch.int32), bt, scale)
    first = ta.paged_attention_triton(q[:10], k_cache, v_cache, torch.tensor([0, 10], dtype=torch.int32),
                                      torch.tensor([10], dtype=torch.int32), bt, scale)
    second = ta.paged_attention_triton(q[10:], k_cache, v_cache, torch.tensor([0, 13], dtype=torch.int32),
                                       torch.tensor([23], dtype=torch.int32), bt, scale)
    torch.testing.assert_close(torch.cat([first, second]), full, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- errors / import guard


@pytest.mark.parametrize("window", [1, 5, 16, 33])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_sliding_window(window, num_splits):
    """The window cuts keys in decode, prefill from scratch and chunks after cached context (the torch fallback
    and the CPU kernel too), also with the KV range split."""
    from nanochat.kernels import cpu_decoder, cpu_qgemv

    args = make_batch([1, 19, 7, 1], [60, 19, 40, 9], seed=window)
    out = ta._paged_attention_impl(*args, 0.2, window, block_m=16, block_n=16, num_splits=num_splits)
    expected = ref_attention(*args, 0.2, window)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert (expected - ref_attention(*args, 0.2)).abs().max() > 1e-2   # the window changed something
    if paged_attention is not None:
        torch.testing.assert_close(paged_attention(*args, 0.2, window=window), expected, atol=ATOL, rtol=0)
    if cpu_qgemv.available():
        torch.testing.assert_close(cpu_decoder.paged_attention(*args, 0.2, window), expected, atol=ATOL, rtol=0)


def _sinks(h, seed=0):
    """Sinks of the size of the scores here (|score| ~ 1-3), so they take a real share of each softmax."""
    return (torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2).float()


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("block_m,block_n,num_splits", [(None, None, None), (16, 16, 1), (16, 32, 3)])
def test_attention_sinks(window, block_m, block_n, num_splits):
    """Sinks in decode rows, prefill from scratch and chunks after cached keys, windowed or not, with the KV range
    split (the merge kernel adds the sink) or not; GQA of 2."""
    args = make_batch([1, 19, 7, 1], [60, 19, 40, 9], seed=10 + window)
    sinks = _sinks(args[0].shape[1])
    out = ta._paged_attention_impl(*args, 0.2, window, sinks, block_m=block_m, block_n=block_n,
                                   num_splits=num_splits)
    expected = ref_attention(*args, 0.2, window, sinks)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert (expected - ref_attention(*args, 0.2, window)).abs().max() > 1e-2   # the sinks changed something


@pytest.mark.parametrize("h,kvh", [(4, 1), (6, 2), (2, 2)])
def test_attention_sinks_gqa_and_decode_splits(h, kvh):
    args = make_batch([1, 1, 1], [3, 33, 70], h=h, kvh=kvh, seed=11)
    sinks = _sinks(h, seed=1)
    expected = ref_attention(*args, 0.25, 0, sinks)
    for splits in (1, 4):
        out = ta._paged_attention_impl(*args, 0.25, 0, sinks, num_splits=splits)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(ta.paged_attention_triton(*args, 0.25, sinks=sinks), expected, atol=ATOL, rtol=0)


def test_attention_sinks_half_precision():
    args = make_batch(*MIXED, dtype=torch.float16, seed=12)
    sinks = _sinks(args[0].shape[1], seed=2)
    out = ta.paged_attention_triton(*args, 0.25, sinks=sinks)
    f32 = [t.float() if t.is_floating_point() else t for t in args]
    torch.testing.assert_close(out.float(), ref_attention(*f32, 0.25, 0, sinks), atol=3e-3, rtol=0)


def test_bad_inputs_raise_value_error():
    q, k_cache, v_cache, cu, ctx, bt = make_batch([2], [4])
    with pytest.raises(ValueError, match="q must be"):
        ta.paged_attention_triton(q[..., :16], k_cache, v_cache, cu, ctx, bt, 1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ta.paged_attention_triton(q[:, :3], k_cache, v_cache, cu, ctx, bt, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ta.paged_attention_triton(q, k_cache, v_cache, cu[:1], ctx, bt, 1.0)
    with pytest.raises(ValueError, match="sinks must be"):
        ta.paged_attention_triton(q, k_cache, v_cache, cu, ctx, bt, 1.0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="slot_mapping"):
        ta.store_kvcache_triton(q[:, :2], q[:, :2], k_cache, v_cache, torch.zeros(2))


def test_import_without_triton_fails_only_on_call(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_ta_no_triton", ta.__file__)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    with pytest.raises(RuntimeError, match="triton is not available"):
        mod.paged_attention_triton(*make_batch([1], [1]), 1.0)
    with pytest.raises(RuntimeError, match="triton is not available"):
        mod.store_kvcache_triton(None, None, None, None, None)


# ----------------------------------------------------------------------------- real GPU compile

_AOT = textwrap.dedent("""
    import os, warnings
    os.environ.pop("TRITON_INTERPRET", None)
    warnings.filterwarnings("ignore")
    import triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from nanochat.kernels import triton_attention as ta

    def build(fn, ptrs, cx, floats=()):
        sig = {a: "constexpr" if a in cx else ptrs.get(a, "fp32" if a in floats else "i32") for a in fn.arg_names}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 2})

    attn = {p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    attn.update({p: "*fp32" for p in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")})
    attn.update({p: "*i32" for p in ("cu_ptr", "ctx_ptr", "bt_ptr")})
    attn["sinks_ptr"] = "*fp32"
    for splits in (1, 4):
        for sinks in (False, True):
            build(ta._paged_attn_kernel, attn, dict(HEAD_DIM=128, HEAD_P2=128, GROUP=4, GROUP_P2=4, BLOCK_Q=16,
                  BLOCK_M=64, BLOCK_N=64, BLOCK_SIZE=16, NUM_SPLITS=splits, IEEE=False, UPCAST=False,
                  HAS_SINKS=sinks), floats=("scale_log2",))
    for sinks in (False, True):
        build(ta._merge_splits_kernel, {p: "*fp32" for p in ("part_acc_ptr", "part_m_ptr", "part_l_ptr", "out_ptr",
                                                             "sinks_ptr")},
              dict(HEAD_DIM=128, HEAD_P2=128, NUM_SPLITS=4, SPLITS_P2=4, HAS_SINKS=sinks))
    build(ta._store_kv_kernel, {"key_ptr": "*bf16", "value_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
          "slot_ptr": "*i64"}, dict(NUM_KV_HEADS=8, HEAD_DIM=128, KVH_P2=8, HEAD_P2=128, BLOCK_SIZE=256))
    print("compiled")
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """The interpreter accepts code the GPU compiler rejects: compile ahead of time for sm_90 (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=300)
    if "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-2000:]
