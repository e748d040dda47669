"""On a CUDA GPU, for real: the Triton kernels compiled (not interpreted) against the torch references
(every GGUF block type; windows and sinks), CUDA graphs against eager and the CPU, windowed models against
the CPU, flash-attn when installed, the expert offload's CUDA side, and tensor parallelism over NCCL when
there are two GPUs. Skipped without CUDA (CI); benchmarks/gpu_check.sh runs
this file on a GPU machine and puts the outcome in its report."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":   # another test module of this session asked for the interpreter
    pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests run in their own session", allow_module_level=True)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from nanochat.engine import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], list(range(20, 120))]
CUDA = torch.device("cuda")


def _share_equal(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of a's tokens that b has at the same place (a near tie may break either way on another device)."""
    return sum(x == y for r, s in zip(a, b) for x, y in zip(r, s)) / sum(len(r) for r in a)


def _paged_case(seqs, q_lens, heads=8, kv_heads=2, head_dim=128, block=16, dtype=torch.bfloat16, seed=0):
    """A ragged batch over a shuffled paged cache: (q, k_cache, v_cache, cu_q, context_lens, tables)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [(n + block - 1) // block for n in seqs]
    total = sum(blocks_per) + 4
    order = torch.randperm(total, generator=g).tolist()
    tables, at = [], 0
    for n in blocks_per:
        tables.append(order[at:at + n] + [0] * (max(blocks_per) - n))
        at += n
    k_cache = torch.randn(total, block, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(total, block, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    t = lambda x, dt: torch.tensor(x, dtype=dt)  # noqa: E731
    return q, k_cache, v_cache, t(cu, torch.int32), t(seqs, torch.int32), t(tables, torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [37, 1, 200]], ids=["decode", "mixed"])
@pytest.mark.parametrize("window,sinks", [(0, False), (64, True)], ids=["full", "window-sinks"])
def test_triton_paged_attention_compiled_matches_torch(dtype, q_lens, window, sinks):
    from nanochat.kernels.attention import paged_attention
    from nanochat.kernels.triton_attention import paged_attention_triton, store_kvcache_triton

    seqs = [300, 17, 1000]
    q, kc, vc, cu, lens, tables = _paged_case(seqs, q_lens, dtype=dtype)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(5)) if sinks else None
    ref = paged_attention(q.float(), kc.float(), vc.float(), cu, lens, tables, 128 ** -0.5, window=window, sinks=sink)
    ours = paged_attention_triton(q.to(CUDA), kc.to(CUDA), vc.to(CUDA), cu.to(CUDA), lens.to(CUDA),
                                  tables.to(CUDA), 128 ** -0.5, window=window,
                                  sinks=sink.to(CUDA) if sinks else None)
    tol = 2e-2 if dtype != torch.float32 else 2e-3
    assert (ours.float().cpu() - ref).abs().max().item() < tol
    # the store: every written slot holds its row, the others are untouched
    key = torch.randn(5, 2, 128, dtype=dtype, device=CUDA)
    slots = torch.tensor([3, 40, -1, 17, 100], device=CUDA)
    kcd, vcd = kc.to(CUDA), vc.to(CUDA)
    before = kcd.clone()
    store_kvcache_triton(key, key, kcd, vcd, slots)
    flat = kcd.view(-1, 2, 128)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], key[i])
    assert torch.equal(flat[5], before.view(-1, 2, 128)[5])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                   "MXFP4"])
@pytest.mark.parametrize("m", [1, 300])
def test_triton_gguf_matmul_compiled_matches_torch(qtype, m):
    import numpy as np

    from nanochat.kernels import gguf_quants as gq
    from nanochat.kernels.triton_gguf import gguf_dequantize, gguf_linear
    from tests.kquant_pack import random_rows

    t = int(getattr(gq, qtype))
    raw = torch.from_numpy(random_rows(t, 384, 512, np.random.default_rng(m)))
    dense = gq.dequantize_raw(t, raw, (384, 512), torch.float32)
    assert torch.equal(gguf_dequantize(raw.to(CUDA), t, 384, 512).cpu(), dense)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    ref = x @ dense.T
    fp32 = gguf_linear(x.to(CUDA), raw.to(CUDA), t, 384, 512).cpu()
    assert (fp32 - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
    bf16 = gguf_linear(x.to(CUDA, torch.bfloat16), raw.to(CUDA), t, 384, 512).float().cpu()
    assert (bf16 - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


@pytest.mark.parametrize("lens", [[1, 1, 1], [64, 5, 130]], ids=["recurrent", "chunked"])
def test_triton_gated_delta_compiled_matches_torch(lens):
    from nanochat.kernels import gated_delta as gd
    from nanochat.kernels import triton_gated_delta as tgd

    g = torch.Generator().manual_seed(1)
    n, nk, nv, dk, dv = sum(lens), 2, 4, 64, 64
    q, k = torch.randn(n, nk, dk, generator=g), torch.randn(n, nk, dk, generator=g)
    v = torch.randn(n, nv, dv, generator=g)
    gate = -torch.rand(n, nv, generator=g)
    beta = torch.rand(n, nv, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    slots = torch.tensor([2, 0, 1])
    state = torch.randn(4, nv, dk, dv, generator=g)
    fresh = torch.tensor([False, True, False])
    ref_state = state.clone()
    # torch's forms: gated_delta_rule would take the C++ CPU kernel, whose first build outlasts a test's limit
    recurrent = max(lens) == 1
    ref = (gd.recurrent_gated_delta_rule if recurrent else gd.chunk_gated_delta_rule)(
        q, k, v, gate, beta, cu, ref_state, slots, fresh)
    fn = tgd.recurrent_gated_delta_rule_triton if recurrent else tgd.chunk_gated_delta_rule_triton
    dev_state = state.to(CUDA)
    ours = fn(*(x.to(CUDA) for x in (q, k, v, gate, beta, cu)), dev_state, slots.to(CUDA), fresh.to(CUDA))
    assert (ours.float().cpu() - ref).abs().max().item() < 2e-3
    assert (dev_state.cpu() - ref_state).abs().max().item() < 2e-3


def test_sampling_on_the_gpu_is_batched_seeded_and_keeps_the_filters():
    """Sampled rows are drawn on the device in one batch (engine/sampler.py sample_rows): greedy rows and
    top-k 1 take the argmax, top-k 5 stays in the row's five best, a seed gives the same tokens again."""
    from nanochat.engine.sampler import Sampler

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 151_936, generator=g) * 3).to(CUDA)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=1),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.6),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0)]

    def draw(seed):
        return Sampler()(logits, params, [torch.Generator().manual_seed(seed + i) for i in range(6)])

    out, best = draw(1), logits.argmax(-1).tolist()
    assert out == draw(1)
    assert [out[i] for i in (0, 1, 5)] == [best[i] for i in (0, 1, 5)]
    top5 = set(logits[2].topk(5).indices.tolist())
    assert all(draw(s)[2] in top5 for s in range(20))


def test_cuda_graphs_match_eager_and_the_cpu(tiny_models):
    path = str(tiny_models["qwen3"])
    cpu = [r.token_ids for r in LLM(path, dtype="float32", max_model_len=256).generate(PROMPTS, GREEDY)]
    graphs = LLM(path, device="cuda", dtype="float32", max_model_len=256)
    assert graphs.engine.runner.graphs is not None
    eager = LLM(path, device="cuda", dtype="float32", max_model_len=256, enforce_eager=True)
    assert [r.token_ids for r in graphs.generate(PROMPTS, GREEDY)] == cpu
    assert [r.token_ids for r in eager.generate(PROMPTS, GREEDY)] == cpu
    bf16 = LLM(path, device="cuda", max_model_len=256).generate(PROMPTS, GREEDY)   # the default dtype runs
    assert all(len(r.token_ids) == GREEDY.max_tokens for r in bf16)


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_windowed_models_on_cuda_match_the_cpu(family, tmp_path):
    """Windowed layers (and gpt-oss's sinks and experts) on the GPU: the prompts outrun the window. (Two KV
    groups, windowed and global, run eagerly: the captured graphs hold one block table.)"""
    if family == "gemma3":
        from test_gemma3 import make_gemma3 as make
    else:
        from test_gpt_oss import make_gpt_oss as make
    path = str(make(tmp_path / family))
    cpu = [r.token_ids for r in LLM(path, dtype="float32", max_model_len=256).generate(PROMPTS, GREEDY)]
    cuda = LLM(path, device="cuda", dtype="float32", max_model_len=256)
    got = [r.token_ids for r in cuda.generate(PROMPTS, GREEDY)]
    assert _share_equal(cpu, got) >= 0.9, (got, cpu)   # fp32 on both: a wrong window breaks most tokens


def test_flash_attn_matches_triton(tiny_models):
    pytest.importorskip("flash_attn")
    path = str(tiny_models["qwen3"])
    flash = LLM(path, device="cuda", max_model_len=1024, kvcache_block_size=256)
    assert flash.engine.runner.model.backend.kind == "flash"
    triton = LLM(path, device="cuda", max_model_len=1024, kvcache_block_size=16)
    assert triton.engine.runner.model.backend.kind == "triton"
    a = [r.token_ids for r in flash.generate(PROMPTS, GREEDY)]
    b = [r.token_ids for r in triton.generate(PROMPTS, GREEDY)]
    assert _share_equal(a, b) >= 0.9   # bf16: an argmax tie may break either way


def test_expert_offload_cuda_side_matches_on_device_experts(tmp_path):
    from test_moe_gguf import Models

    path, _ = Models(tmp_path).quant("qwen3moe-q8_0-attn-q8_0")
    on_host = LLM(str(path), device="cuda", dtype="float32", max_model_len=256, moe_offload="cpu")
    from nanochat.models.layers.moe import has_host_experts
    assert has_host_experts(on_host.engine.runner.model) and on_host.engine.runner.graphs is None
    on_device = LLM(str(path), device="cuda", dtype="float32", max_model_len=256, moe_offload="none")
    a = [r.token_ids for r in on_host.generate(PROMPTS, GREEDY)]
    b = [r.token_ids for r in on_device.generate(PROMPTS, GREEDY)]
    assert _share_equal(a, b) >= 0.9   # the host kernels quantize activations (one level)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_over_nccl_matches_one_gpu(tiny_models):
    path = str(tiny_models["qwen3"])
    one = [r.token_ids for r in LLM(path, device="cuda", dtype="float32", max_model_len=256).generate(PROMPTS, GREEDY)]
    two = LLM(path, device="cuda", dtype="float32", max_model_len=256, tensor_parallel_size=2)
    try:
        assert two.engine.runner.graphs is not None      # CUDA graphs per rank
        assert [r.token_ids for r in two.generate(PROMPTS, GREEDY)] == one
    finally:
        two.engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_dead_nccl_worker_stops_rank_0_with_one_line(tiny_models, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "kill.py"
    script.write_text(
        "import os, signal\n"
        "from nanochat.engine import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_models['qwen3'])!r}, device='cuda', max_model_len=256, tensor_parallel_size=2)\n"
        "worker = llm.engine.workers.procs[0]\n"
        "for event in llm.stream([list(range(5, 40))], SamplingParams(max_tokens=5000, ignore_eos=True)):\n"
        "    if worker.poll() is None:\n"
        "        os.kill(worker.pid, signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == "tensor-parallel rank 1 stopped (killed by signal 9)"
