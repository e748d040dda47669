"""The fused CPU forward (kernels/cpu_decoder.py, csrc/decoder.cpp, models/fused_forward.py).

Kernel level: one call over a small random stack vs a torch reference written out op by op (RMSNorm,
the same int8 matmul kernel, q/k norms, RoPE, paged KV store, softmax attention, SwiGLU), paged
caches with scattered blocks, decode rows and prefill chunks in one ragged step. Model level: logits
and greedy tokens of tiny GGUF models with the fused path vs the module-by-module forward it replaces
(whole prompts, and chunked prefill mixed with decode).
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.qweight import QuantWeight
from tests.kquant_pack import random_rows

pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")

T = gguf.GGMLQuantizationType


# ---------------------------------------------------------------- kernel vs torch reference

def _packed(t: int, rows: int, cols: int, rng) -> cpu_qgemv.PackedWeight:
    data = torch.from_numpy(random_rows(t, rows, cols, rng))
    return cpu_qgemv.pack(QuantWeight(t, (rows, cols), data))


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    half = rot // 2
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _reference_step(dims, layers, cos, sin, final_norm, x, positions, slots, cu, tables, lens, levels=2):
    """The step as plain torch ops on copies of the caches; returns (hidden, caches). Row i of
    sequence b sits at positions[i] and sees that sequence's keys 0..positions[i]."""
    h, kvh, d, bs = dims.heads, dims.kv_heads, dims.head_dim, dims.block_size
    caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in layers]
    x = x.clone()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for layer, (kc, vc) in zip(layers, caches):
        xn = F.rms_norm(x, (dims.hidden,), layer.input_norm, dims.eps)
        qkv = cpu_qgemv.linear(xn, layer.qkv[0], layer.qkv[1], (h + 2 * kvh) * d, layer.qkv_bias, levels=levels)
        q = qkv[:, :h * d].view(-1, h, d)
        k = qkv[:, h * d:(h + kvh) * d].view(-1, kvh, d)
        v = qkv[:, (h + kvh) * d:].view(-1, kvh, d)
        if layer.q_norm is not None:
            q = F.rms_norm(q, (d,), layer.q_norm, dims.eps)
            k = F.rms_norm(k, (d,), layer.k_norm, dims.eps)
        q, k = _rope_ref(q, c, s, dims.rotary_dim), _rope_ref(k, c, s, dims.rotary_dim)
        kc.view(-1, kvh, d)[slots] = k
        vc.view(-1, kvh, d)[slots] = v
        out = torch.empty(x.shape[0], h, d)
        for b in range(len(lens)):
            for i in range(int(cu[b]), int(cu[b + 1])):
                n = int(positions[i]) + 1
                rows = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(n)])
                kb = kc.view(-1, kvh, d)[rows].repeat_interleave(h // kvh, dim=1)   # [n, h, d]
                vb = vc.view(-1, kvh, d)[rows].repeat_interleave(h // kvh, dim=1)
                p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], kb) / d ** 0.5, dim=-1)
                out[i] = torch.einsum("hn,nhd->hd", p, vb)
        x = x + cpu_qgemv.linear(out.reshape(-1, h * d), layer.o[0], layer.o[1], dims.hidden, levels=levels)
        xn = F.rms_norm(x, (dims.hidden,), layer.post_norm, dims.eps)
        gate, up = cpu_qgemv.linear(xn, layer.gate_up[0], layer.gate_up[1], 2 * dims.intermediate,
                                    levels=levels).chunk(2, -1)
        x = x + cpu_qgemv.linear(F.silu(gate) * up, layer.down[0], layer.down[1], dims.hidden, levels=levels)
    return F.rms_norm(x, (dims.hidden,), final_norm, dims.eps), caches


def _random_stack(rng, qk_norm: bool, bias: bool, head_dim: int, rotary_dim: int, types, num_blocks=48,
                  block_size=4, heads=4):
    from nanochat.kernels.cpu_decoder import DecoderDims, DecoderLayer
    dims = DecoderDims(layers=2, hidden=64, heads=heads, kv_heads=2, head_dim=head_dim, intermediate=96,
                       rotary_dim=rotary_dim, block_size=block_size, eps=1e-6)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))

    def vec(n, base=1.0, scale=0.2):
        return base + scale * torch.randn(n, generator=g)

    layers = []
    for i in range(dims.layers):
        qkv_rows = (dims.heads + 2 * dims.kv_heads) * dims.head_dim
        w = {name: _packed(types[(i + j) % len(types)], r, c, rng)
             for j, (name, r, c) in enumerate([("qkv", qkv_rows, 64), ("o", 64, heads * head_dim), ("gate_up", 192, 64),
                                               ("down", 64, 96)])}
        cache = (num_blocks, block_size, dims.kv_heads, dims.head_dim)
        layers.append(DecoderLayer(
            input_norm=vec(64), post_norm=vec(64),
            qkv=(w["qkv"].ggml_type, w["qkv"].data), o=(w["o"].ggml_type, w["o"].data),
            gate_up=(w["gate_up"].ggml_type, w["gate_up"].data), down=(w["down"].ggml_type, w["down"].data),
            k_cache=torch.randn(cache, generator=g), v_cache=torch.randn(cache, generator=g),
            qkv_bias=vec(qkv_rows, 0.0, 0.5) if bias else None,
            q_norm=vec(head_dim) if qk_norm else None, k_norm=vec(head_dim) if qk_norm else None))
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), 1.0 / 100.0 ** (torch.arange(rotary_dim // 2) / 8))
    return dims, layers, freqs.cos(), freqs.sin(), vec(64)


def _batch(block_size: int, seqs: list[tuple[int, int]], rng, num_blocks: int = 48):
    """A ragged step: per sequence (context length after the step, rows in the step), scattered
    block tables (distinct blocks across sequences), each row's position and slot."""
    need = [(n + block_size - 1) // block_size for n, _ in seqs]
    blocks = rng.permutation(num_blocks)[:sum(need)].tolist()
    width = max(need)
    tables, positions, slots, cu, at = [], [], [], [0], 0
    for (n, rows), k in zip(seqs, need):
        row = blocks[at:at + k]
        at += k
        tables.append(row + [0] * (width - k))
        for p in range(n - rows, n):
            positions.append(p)
            slots.append(row[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + rows)
    return (torch.tensor(positions), torch.tensor(slots), torch.tensor(cu, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32), torch.tensor([n for n, _ in seqs], dtype=torch.int32))


DECODE = [(1, 1), (7, 1), (13, 1), (30, 1)]
# a whole prompt, a chunk after cached keys, decode rows, a prompt of one token
MIXED = [(21, 21), (40, 17), (9, 1), (33, 1), (1, 1)]


# Tolerance relative to the largest |output|. The fused step and the reference feed the same int8
# kernels with inputs equal to fp32 rounding, which can still land on opposite sides of a rounding
# boundary of the activation grid: with two-level activations (the default) such a flip is worth
# amax / 32512, ~1e-4 after two layers (one level: amax / 254, too coarse to compare this way).
TOL = 3e-4


# head_dim 64 and 128 run the kernel's fixed-size instantiations, 32 its generic one; 2, 3 and 4
# query heads per KV head its value passes over 2, 3 and 4 heads at once.
@pytest.mark.parametrize("qk_norm,bias,head_dim,rotary_dim,heads,types", [
    (False, False, 64, 64, 4, [T.Q8_0]),                   # Llama
    (False, False, 64, 64, 6, [T.Q4_1]),                   # 3 heads per KV head (SmolLM2)
    (False, False, 64, 64, 8, [T.Q8_0]),                   # 4 heads per KV head
    (False, True, 32, 32, 4, [T.Q4_1, T.Q5_0]),            # Qwen2 (bias on q/k/v)
    (True, False, 128, 128, 4, [T.Q4_0, T.Q8_0, T.Q5_1]),  # Qwen3 (q/k head norms)
    (False, False, 32, 16, 4, [T.Q8_0]),                   # partial rotary
], ids=["llama", "group3", "group4", "qwen2", "qwen3", "partial-rope"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_fused_step_matches_torch_reference(qk_norm, bias, head_dim, rotary_dim, heads, types, threads, seqs):
    from nanochat.kernels.cpu_decoder import FusedDecoder
    rng = np.random.default_rng(7)
    dims, layers, cos, sin, final_norm = _random_stack(rng, qk_norm, bias, head_dim, rotary_dim,
                                                       [int(t) for t in types], heads=heads)
    positions, slots, cu, tables, lens = _batch(dims.block_size, seqs, rng)
    x = torch.randn(len(positions), 64, generator=torch.Generator().manual_seed(3))
    want, caches = _reference_step(dims, layers, cos, sin, final_norm, x, positions, slots, cu, tables, lens,
                                   levels=2)

    dec = FusedDecoder(dims, layers, cos, sin, final_norm)
    got = dec.forward(x.clone(), positions, slots, cu, tables, lens, levels=2, threads=threads)
    assert (got - want).abs().max().item() <= TOL * want.abs().max().item()
    for layer, (kc, vc) in zip(layers, caches):   # K/V written in place, into the right slots only
        torch.testing.assert_close(layer.k_cache, kc, atol=TOL * kc.abs().max().item(), rtol=0)
        torch.testing.assert_close(layer.v_cache, vc, atol=TOL * vc.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def other_builds():
    """The library built without AVX-512 (the AVX2 paths) and for no x86 extension (the scalar paths)."""
    return {name: cpu_qgemv.build_variant(name, flags)
            for name, flags in (("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("scalar", []))}


@pytest.mark.parametrize("build", ["avx2", "scalar"])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_fused_step_without_avx512(build, head_dim, other_builds):
    from nanochat.kernels.cpu_decoder import FusedDecoder
    rng = np.random.default_rng(11)
    dims, layers, cos, sin, final_norm = _random_stack(rng, True, True, head_dim, head_dim, [int(T.Q4_1)])
    positions, slots, cu, tables, lens = _batch(dims.block_size, MIXED, rng)
    x = torch.randn(len(positions), 64, generator=torch.Generator().manual_seed(4))
    want, _ = _reference_step(dims, layers, cos, sin, final_norm, x, positions, slots, cu, tables, lens, levels=2)
    dec = FusedDecoder(dims, layers, cos, sin, final_norm, lib=other_builds[build])
    got = dec.forward(x.clone(), positions, slots, cu, tables, lens, levels=2, threads=2)
    assert (got - want).abs().max().item() <= TOL * want.abs().max().item()


def test_fused_step_rejects_bad_input():
    from nanochat.kernels.cpu_decoder import FusedDecoder
    rng = np.random.default_rng(1)
    dims, layers, cos, sin, final_norm = _random_stack(rng, False, False, 32, 32, [int(T.Q8_0)])
    dec = FusedDecoder(dims, layers, cos, sin, final_norm)
    positions, slots, cu, tables, lens = _batch(dims.block_size, [(5, 1)], rng)
    with pytest.raises(RuntimeError, match="RoPE table"):
        dec.forward(torch.zeros(1, 64), torch.tensor([64]), slots, cu, tables, lens)
    with pytest.raises(RuntimeError, match="context length"):
        dec.forward(torch.zeros(1, 64), positions, slots, cu, tables, lens + 1)
    with pytest.raises(ValueError, match="float32"):
        dec.forward(torch.zeros(1, 64, dtype=torch.bfloat16), positions, slots, cu, tables, lens)
    bad = layers[0]
    bad.down = (bad.down[0], bad.down[1][:-1])
    with pytest.raises(ValueError, match="down is not a packed"):
        FusedDecoder(dims, layers, cos, sin, final_norm)


# ---------------------------------------------------------------- model level

@pytest.fixture(scope="module")
def q8_models(tmp_path_factory):
    """Tiny GGUF models with Q8_0 / Q4_1 linears (every linear on the q8 backend)."""
    from conftest import make_hf_model
    from gguf_writer import write_gguf_from_hf
    root = tmp_path_factory.mktemp("fused")
    out = {}
    for arch, qtype in (("llama", T.Q8_0), ("qwen2", T.Q4_1), ("qwen3", T.Q8_0)):
        src = make_hf_model(arch, root / f"{arch}-hf", seed=21)
        path = root / arch / "model.gguf"
        path.parent.mkdir()
        write_gguf_from_hf(src, path, arch, qtype)
        shutil.copy(src / "tokenizer.json", path.parent / "tokenizer.json")
        out[arch] = path
    return out


def _decode_logits(llm, prompts, tokens):
    """Greedy token ids per prompt and the logits of every step (rows in the batch's order)."""
    from nanochat.engine import SamplingParams
    model = llm.engine.runner.model
    logits, orig = [], model.compute_logits
    model.compute_logits = lambda h: logits.append(orig(h)) or logits[-1]
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    finally:
        del model.compute_logits
    return [r.token_ids for r in out], logits


@pytest.mark.parametrize("arch,budget", [("llama", 512), ("qwen2", 512), ("qwen3", 512), ("qwen3", 12)],
                         ids=["llama", "qwen2", "qwen3", "qwen3-chunked"])
def test_fused_forward_matches_module_forward(arch, budget, q8_models):
    """budget 12: prompts are prefilled in chunks of up to 12 tokens, mixed with other rows' decode."""
    from nanochat.engine import LLM
    # no prefix caching: the second run must compute every token itself, with the first run's schedule
    llm = LLM(str(q8_models[arch]), dtype="float32", max_model_len=256, kvcache_block_size=16,
              max_num_batched_tokens=budget, enable_prefix_caching=False)
    fused = llm.engine.runner.model.fused
    assert fused.why_not is None
    prompts = [[5, 17, 42, 99, 3], list(range(20, 51)), list(range(100, 118))]   # ragged, crossing blocks
    calls = []
    real_run = fused.run
    fused.run = lambda *a: calls.append(1) or real_run(*a)
    ids_fused, logits_fused = _decode_logits(llm, prompts, 24)
    assert len(calls) >= len(logits_fused)    # every step went through the fused call
    fused.why_not = "disabled for the comparison"
    ids_ref, logits_ref = _decode_logits(llm, prompts, 24)
    assert ids_fused == ids_ref
    assert len(logits_fused) == len(logits_ref)
    for a, b in zip(logits_fused, logits_ref):
        assert (a - b).abs().max().item() <= 1e-3 * b.abs().max().item()


def test_fused_forward_rebuilds_plan_for_a_new_cache(q8_models):
    from nanochat.engine import LLM
    llm = LLM(str(q8_models["llama"]), dtype="float32", max_model_len=128)
    model = llm.engine.runner.model
    first, _ = _decode_logits(llm, [[1, 2, 3, 4]], 6)
    old = model.fused._decoder
    assert old is not None and old.uses(model.layers[0].self_attn.k_cache)
    llm.engine.runner._allocate_kv_cache()          # new cache tensors: the old plan's pointers are stale
    again, _ = _decode_logits(llm, [[1, 2, 3, 4]], 6)
    assert model.fused._decoder is not old and model.fused._decoder.uses(model.layers[0].self_attn.k_cache)
    assert again == first


def test_fused_forward_only_where_it_applies(q8_models, monkeypatch):
    from nanochat.engine import LLM
    dense = LLM(str(q8_models["qwen3"]), dtype="float32", max_model_len=128, dequantize=True)
    assert "q8" in dense.engine.runner.model.fused.why_not
    bf16 = LLM(str(q8_models["qwen3"]), dtype="bfloat16", max_model_len=128)
    assert "float32" in bf16.engine.runner.model.fused.why_not
    monkeypatch.setenv("NANOCHAT_FUSED_FORWARD", "0")
    off = LLM(str(q8_models["qwen3"]), dtype="float32", max_model_len=128)
    assert off.engine.runner.model.fused.why_not == "NANOCHAT_FUSED_FORWARD=0"
