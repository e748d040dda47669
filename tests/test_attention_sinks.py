"""Attention sinks (gpt-oss): one learned logit per query head that joins the softmax's denominator and has no
value, p_j = exp(s_j - m) / (exp(sink_h - m) + sum_k exp(s_k - m)). Every CPU attention path against a float64
dense reference with the sink as one more score column: the torch path (kernels/attention.py: SDPA with the sink
as an extra masked key column, and the single-query path), the compiled kernel (kernels/cpu_decoder.paged_attention,
native, AVX2 and scalar builds), the backend the models call, and the fused whole-stack step on a tiny model
against the module-by-module forward. Decode rows, prefill from scratch and chunks after cached keys, windows 0
and W, GQA, ragged batches; sinks=None stays exactly what it was. (The Triton kernel: tests/test_triton_attention.py.)
"""

from __future__ import annotations

import pytest
import torch

from nanochat.kernels import attention as torch_attn
from nanochat.kernels import cpu_decoder, cpu_qgemv

# fp32 kernels against a float64 reference over contexts of up to ~70 keys
ATOL = 1e-5
needs_kernels = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")


def reference(q, k_cache, v_cache, cu, lens, tables, scale, window=0, sinks=None):
    """Per sequence: gather its keys, causal (and window) mask, the sink as one more score column dropped after a
    float64 softmax."""
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, ctx in enumerate(lens.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        rows = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(ctx)])
        k = k_cache.flatten(0, 1)[rows].double().repeat_interleave(group, 1)
        v = v_cache.flatten(0, 1)[rows].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), k) * scale
        pos = torch.arange(hi - lo).unsqueeze(1) + (ctx - (hi - lo))
        keys = torch.arange(ctx).unsqueeze(0)
        hidden = (keys > pos) | ((keys <= pos - window) if window else torch.zeros_like(keys > pos))
        s = s.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, hi - lo, 1)], -1)
        p = s.softmax(-1)[..., :ctx]
        out[lo:hi] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def batch(q_lens, ctx_lens, *, h=4, kvh=2, d=32, block_size=8, dtype=torch.float32, seed=0):
    """Random q and paged caches, each sequence's blocks scattered over the cache (unused blocks random too)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(ctx_lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at:at + n]
        at += n
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), h, d, generator=g)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return q, k_cache, v_cache, cu, torch.tensor(ctx_lens, dtype=torch.int32), tables


def sinks_for(h, seed=1):
    """Sinks the size of the scores here (|score| ~ 1-3): a real share of every softmax, some above every score."""
    return torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2


# decode rows (one at a context of 1), a whole prompt, a chunk after cached keys
RAGGED = ([1, 19, 7, 1, 1], [60, 19, 40, 9, 1])
GQA = pytest.mark.parametrize("h,kvh", [(4, 2), (6, 2), (4, 1), (2, 2)], ids=["g2", "g3", "g4", "mha"])
WINDOWS = pytest.mark.parametrize("window", [0, 5, 16])


@GQA
@WINDOWS
def test_torch_path(h, kvh, window):
    args = batch(*RAGGED, h=h, kvh=kvh, seed=h + window)
    sinks = sinks_for(h)
    got = torch_attn.paged_attention(*args, 0.2, window=window, sinks=sinks)
    want = reference(*args, 0.2, window, sinks)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
    assert (want - reference(*args, 0.2, window)).abs().max() > 1e-2   # the sinks change the output


@needs_kernels
@GQA
@WINDOWS
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv32", "kv16"])
def test_compiled_kernel(h, kvh, window, kv_dtype):
    args = batch(*RAGGED, h=h, kvh=kvh, seed=h + window, dtype=kv_dtype)
    sinks = sinks_for(h)
    got = cpu_decoder.paged_attention(*args, 0.2, window, sinks)
    # the reference reads the same fp16 values widened: the cache's rounding is no error of the kernel
    torch.testing.assert_close(got.double(), reference(*args, 0.2, window, sinks), atol=ATOL, rtol=0)


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_compiled_kernel_fixed_head_dims_and_long_contexts(head_dim):
    """The kernel's fixed-size instantiations, and contexts of several 128-key parts (merged with the sink)."""
    args = batch([1, 1, 150, 1], [300, 7, 290, 129], h=4, kvh=2, d=head_dim, block_size=16, seed=head_dim)
    sinks = sinks_for(4, seed=head_dim)
    for window in (0, 100):
        got = cpu_decoder.paged_attention(*args, head_dim ** -0.5, window, sinks)
        torch.testing.assert_close(got.double(), reference(*args, head_dim ** -0.5, window, sinks), atol=ATOL,
                                   rtol=0)


@needs_kernels
@pytest.mark.parametrize("build", ["avx2", "scalar"])
def test_compiled_kernel_without_avx512(build):
    native = cpu_qgemv.extension()
    args = batch(*RAGGED, h=6, kvh=2, d=64, seed=7)
    sinks = sinks_for(6)
    try:
        cpu_qgemv.use_isa(build)
        got = cpu_decoder.paged_attention(*args, 0.2, 5, sinks)
    finally:
        cpu_qgemv._kernels.replace(native)
    torch.testing.assert_close(got.double(), reference(*args, 0.2, 5, sinks), atol=ATOL, rtol=0)


@needs_kernels
def test_chunks_and_decode_rows_agree_with_the_whole_prompt():
    """A row's output does not depend on the rows beside it (the kernel's batch invariance), with sinks too:
    the prompt at once, in two chunks, and its last rows as decode rows give bit-equal rows."""
    q, kc, vc, _, _, tables = batch([40], [40], seed=3)
    sinks = sinks_for(4)

    def run(lo, hi):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        return cpu_decoder.paged_attention(q[lo:hi], kc, vc, cu, torch.tensor([hi], dtype=torch.int32), tables, 0.2,
                                           0, sinks)
    whole = run(0, 40)
    assert torch.equal(torch.cat([run(0, 17), run(17, 40)]), whole)
    assert torch.equal(torch.cat([run(p, p + 1) for p in range(35, 40)]), whole[35:])


@pytest.mark.parametrize("window", [0, 5])
def test_without_sinks_nothing_changes(window):
    args = batch(*RAGGED, seed=9)
    want = reference(*args, 0.2, window)
    torch.testing.assert_close(torch_attn.paged_attention(*args, 0.2, window=window).double(), want, atol=ATOL,
                               rtol=0)
    if cpu_qgemv.available():
        torch.testing.assert_close(cpu_decoder.paged_attention(*args, 0.2, window).double(), want, atol=ATOL, rtol=0)


@needs_kernels
def test_bad_sinks_are_one_line_errors():
    args = batch([1], [4])
    with pytest.raises(ValueError, match="sinks must have 4 values"):
        cpu_decoder.paged_attention(*args, 0.2, 0, torch.zeros(3))


def test_the_backend_passes_sinks_on(monkeypatch):
    """AttentionBackend (what DenseAttention calls): stores the new K/V and attends with the sinks, on the compiled
    kernel and on the torch path."""
    from nanochat.models.layers.attention import AttentionBackend, AttnMetadata

    q, kc, vc, cu, lens, tables = batch([3, 1], [10, 6], seed=5)
    k_new, v_new = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    bs = kc.shape[1]
    slots = [int(tables[b, p // bs]) * bs + p % bs for b, (n, rows) in enumerate(((10, 3), (6, 1)))
             for p in range(n - rows, n)]
    meta = AttnMetadata(slot_mapping=torch.tensor(slots), cu_seqlens_q=cu, context_lens=lens, block_tables=tables,
                        max_q_len=3, max_context_len=10)
    sinks = sinks_for(4)
    backend = AttentionBackend(torch.device("cpu"), bs)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2.flatten(0, 1)[slots], vc2.flatten(0, 1)[slots] = k_new, v_new
    want = reference(q, kc2, vc2, cu, lens, tables, 0.2, 4, sinks)
    outs = [backend(q, k_new, v_new, kc.clone(), vc.clone(), meta, 0.2, window=4, sinks=sinks)]
    monkeypatch.setattr(cpu_decoder, "attention_usable", lambda *a: False)
    outs.append(backend(q, k_new, v_new, kc.clone(), vc.clone(), meta, 0.2, window=4, sinks=sinks))
    for got in outs:
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)


@needs_kernels
def test_fused_step_with_sinks_equals_the_module_forward(tiny_models, monkeypatch):
    """A tiny Llama with sinks set on its layers (as a family with sinks does: DenseAttention.sinks): the fused
    whole-stack step, the module forward on the compiled attention and the module forward on torch's attention
    give the same logits over a prompt and forced decode steps, and the sinks change them."""
    from tests.test_families import engine_for, step_logits

    prompt, forced = list(range(5, 40)), [7, 100, 3, 250, 12, 9]

    def logits(sinks: bool, fused: bool, torch_attention: bool = False):
        engine = engine_for(tiny_models["llama"], fused=fused)
        model = engine.runner.model
        if sinks:
            for i, attn in enumerate(model.attention_layers()):
                attn.sinks = sinks_for(attn.num_heads, seed=20 + i)
        assert (model.fused.why_not is None) == fused
        with monkeypatch.context() as m:
            if torch_attention:
                m.setattr(cpu_decoder, "attention_usable", lambda *a: False)
            return step_logits(engine, prompt, forced)

    fused = logits(True, True)
    for other in (logits(True, False), logits(True, False, torch_attention=True)):
        assert (fused - other).abs().max().item() <= 1e-4 * other.abs().max().item()
    assert (fused - logits(False, True)).abs().max().item() > 1e-2 * fused.abs().max().item()
