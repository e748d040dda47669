"""The fused CPU forward (kernels/cpu_decoder.py, csrc/decoder.cpp, models/layers/fused_forward.py).

Kernel level: one call over a small random stack vs a torch reference written out op by op (RMSNorm,
the same int8 matmul kernel, q/k norms, RoPE, paged KV store, softmax attention, SwiGLU), paged
caches with scattered blocks, decode rows and prefill chunks in one ragged step, fp32 and fp16 KV
caches, qkv and gate/up as row segments of different weight types, in the native, AVX2 and scalar
builds. Model level: logits and greedy tokens of tiny GGUF models with the fused path vs the
module-by-module forward it replaces (whole prompts, and chunked prefill mixed with decode).
"""

from __future__ import annotations

import dataclasses

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

def _random_weight(t: int, rows: int, cols: int, rng) -> QuantWeight:
    return QuantWeight(t, (rows, cols), torch.from_numpy(random_rows(t, rows, cols, rng)))


def _packed(t: int, rows: int, cols: int, rng) -> cpu_qgemv.PackedWeight:
    return cpu_qgemv.pack(_random_weight(t, rows, cols, rng))


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    half = rot // 2
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _linear_ref(x: torch.Tensor, segments, bias: torch.Tensor | None, levels: int) -> torch.Tensor:
    """x @ [W_0; W_1; ...]^T (+ bias): one kernel call per row segment with its slice of the bias."""
    out, at = [], 0
    for w in segments:
        out.append(cpu_qgemv.matmul(x, w, None if bias is None else bias[at:at + w.out_features], levels=levels))
        at += w.out_features
    return torch.cat(out, dim=-1)


def _reference_step(dims, layers, cos, sin, final_norm, x, positions, slots, cu, tables, lens, levels=2):
    """The step as plain torch ops on copies of the caches; returns (hidden, caches). Row i of
    sequence b sits at positions[i] and sees that sequence's keys 0..positions[i]. K/V are stored in
    the caches' dtype (fp16: rounded to nearest even) and read back as fp32."""
    h, kvh, d, bs = dims.heads, dims.kv_heads, dims.head_dim, dims.block_size
    caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in layers]
    x = x.clone()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for layer, (kc, vc) in zip(layers, caches):
        xn = F.rms_norm(x, (dims.hidden,), layer.input_norm, dims.eps)
        qkv = _linear_ref(xn, layer.qkv, layer.qkv_bias, levels)
        q = qkv[:, :h * d].view(-1, h, d)
        k = qkv[:, h * d:(h + kvh) * d].view(-1, kvh, d)
        v = qkv[:, (h + kvh) * d:].view(-1, kvh, d)
        if layer.q_norm is not None:
            q = F.rms_norm(q, (d,), layer.q_norm, dims.eps)
            k = F.rms_norm(k, (d,), layer.k_norm, dims.eps)
        q, k = _rope_ref(q, c, s, dims.rotary_dim), _rope_ref(k, c, s, dims.rotary_dim)
        kc.view(-1, kvh, d)[slots] = k.to(kc.dtype)
        vc.view(-1, kvh, d)[slots] = v.to(vc.dtype)
        out = torch.empty(x.shape[0], h, d)
        for b in range(len(lens)):
            for i in range(int(cu[b]), int(cu[b + 1])):
                n = int(positions[i]) + 1
                rows = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(n)])
                kb = kc.view(-1, kvh, d)[rows].float().repeat_interleave(h // kvh, dim=1)   # [n, h, d]
                vb = vc.view(-1, kvh, d)[rows].float().repeat_interleave(h // kvh, dim=1)
                p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], kb) / d ** 0.5, dim=-1)
                out[i] = torch.einsum("hn,nhd->hd", p, vb)
        x = x + _linear_ref(out.reshape(-1, h * d), [layer.o], None, levels)
        xn = F.rms_norm(x, (dims.hidden,), layer.post_norm, dims.eps)
        gate, up = _linear_ref(xn, layer.gate_up, None, levels).chunk(2, -1)
        x = x + _linear_ref(F.silu(gate) * up, [layer.down], None, levels)
    return F.rms_norm(x, (dims.hidden,), final_norm, dims.eps), caches


def _random_stack(rng, qk_norm: bool, bias: bool, head_dim: int, rotary_dim: int, types, num_blocks=48,
                  block_size=4, heads=4, hidden=64, qkv_types=None, gate_up_types=None, kv_dtype=torch.float32):
    """Two layers of random weights of `types` (cycled over layers and projections). qkv_types: the qkv
    projection as row segments of these types (3: q, k, v; 2: q|k, v), gate_up_types: (gate, up);
    else one fused weight each. Random KV caches of kv_dtype."""
    from nanochat.kernels.cpu_decoder import DecoderDims, DecoderLayer
    dims = DecoderDims(layers=2, hidden=hidden, heads=heads, kv_heads=2, head_dim=head_dim, intermediate=96,
                       rotary_dim=rotary_dim, block_size=block_size, eps=1e-6)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))

    def vec(n, base=1.0, scale=0.2):
        return base + scale * torch.randn(n, generator=g)

    q_rows, kv_rows = heads * head_dim, dims.kv_heads * head_dim
    layers = []
    for i in range(dims.layers):
        def pick(j):
            return types[(i + j) % len(types)]
        if qkv_types:
            rows = [q_rows, kv_rows, kv_rows] if len(qkv_types) == 3 else [q_rows + kv_rows, kv_rows]
            qkv = [_random_weight(t, r, hidden, rng) for t, r in zip(qkv_types, rows)]
        else:
            qkv = [_random_weight(pick(0), q_rows + 2 * kv_rows, hidden, rng)]
        # The input norm is scaled to q and k entries of ~2, attention scores of ~4 (as in real
        # models): at the random weights' own scale (entries ~3 for Q8_0, ~10 for K-quants) scores
        # are in the hundreds, a softmax so peaked that rounding-level differences in q or k move
        # the outputs by percents.
        w_rms = torch.cat([gq.dequantize(w) for w in qkv]).square().mean().sqrt().item()
        qkv = [cpu_qgemv.pack(w) for w in qkv]
        o = _packed(pick(1), hidden, q_rows, rng)
        gate_up = [_packed(t, 96, hidden, rng) for t in gate_up_types] if gate_up_types \
            else [_packed(pick(2), 192, hidden, rng)]
        down = _packed(pick(3), hidden, 96, rng)
        cache = (num_blocks, block_size, dims.kv_heads, dims.head_dim)
        layers.append(DecoderLayer(
            input_norm=vec(hidden) * (2 / (w_rms * hidden ** 0.5)), post_norm=vec(hidden),
            qkv=qkv, o=o, gate_up=gate_up, down=down,
            k_cache=torch.randn(cache, generator=g).to(kv_dtype), v_cache=torch.randn(cache, generator=g).to(kv_dtype),
            qkv_bias=vec(q_rows + 2 * kv_rows, 0.0, 0.5) if bias else None,
            q_norm=vec(head_dim) if qk_norm else None, k_norm=vec(head_dim) if qk_norm else None))
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), 1.0 / 100.0 ** (torch.arange(rotary_dim // 2) / 8))
    return dims, layers, freqs.cos(), freqs.sin(), vec(hidden)


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
# With an fp16 cache such input differences also flip the rounding of some K/V entries to the
# neighbouring fp16 value (one fp16 ulp, up to 2^-10 of the entry; a few % of the entries the second
# layer writes), which moves the outputs by ~1e-4 of their max, at most 7e-4 over 80 stacks tried. A
# few flips together reach more: over 120 random stacks (MIXED, kv32) the median was 8.5e-5 and the
# largest 3.7e-4 (4.4e-4 before attention ran in fixed key parts: the same spread).
TOL = 5e-4
TOL_F16 = 1e-3
TOL_F16_ENTRY = 2 ** -10


def _check_step(dec, dims, layers, cos, sin, final_norm, seqs, rng, threads=2, seed=3):
    """The fused step vs the reference on the same stack: outputs and the caches written in place."""
    positions, slots, cu, tables, lens = _batch(dims.block_size, seqs, rng)
    x = torch.randn(len(positions), dims.hidden, generator=torch.Generator().manual_seed(seed))
    want, caches = _reference_step(dims, layers, cos, sin, final_norm, x, positions, slots, cu, tables, lens,
                                   levels=2)
    got = dec.forward(x.clone(), positions, slots, cu, tables, lens, levels=2, threads=threads)
    tol = TOL_F16 if layers[0].k_cache.dtype == torch.float16 else TOL
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    for layer, (kc, vc) in zip(layers, caches):   # K/V written in place, into the right slots only
        assert layer.k_cache.dtype == kc.dtype
        for have, ref in ((layer.k_cache, kc), (layer.v_cache, vc)):
            scale = ref.abs().max().item()
            tol = TOL * scale + (TOL_F16_ENTRY * scale if ref.dtype == torch.float16 else 0.0)
            torch.testing.assert_close(have.float(), ref.float(), atol=tol, rtol=0)


KV_DTYPES = pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv32", "kv16"])


def _ints(types):
    return None if types is None else [int(t) for t in types]


# head_dim 64, 96, 128 and 256 run the kernel's fixed-size instantiations, 32 its generic one; 2, 3 and 4
# query heads per KV head its value passes over 2, 3 and 4 heads at once.
@pytest.mark.parametrize("qk_norm,bias,head_dim,rotary_dim,heads,types", [
    (False, False, 64, 64, 4, [T.Q8_0]),                   # Llama
    (False, False, 64, 64, 6, [T.Q4_1]),                   # 3 heads per KV head (SmolLM2)
    (False, False, 64, 64, 8, [T.Q8_0]),                   # 4 heads per KV head
    (False, True, 32, 32, 4, [T.Q4_1, T.Q5_0]),            # Qwen2 (bias on q/k/v)
    (True, False, 128, 128, 4, [T.Q4_0, T.Q8_0, T.Q5_1]),  # Qwen3 (q/k head norms)
    (False, False, 32, 16, 4, [T.Q8_0]),                   # partial rotary
    (False, False, 96, 48, 4, [T.Q8_0]),                   # Phi-3's heads (and Phi-4-mini's partial rotary)
    (True, False, 256, 256, 2, [T.Q8_0]),                  # Gemma 3's heads
], ids=["llama", "group3", "group4", "qwen2", "qwen3", "partial-rope", "phi3", "gemma3"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
@KV_DTYPES
def test_fused_step_matches_torch_reference(qk_norm, bias, head_dim, rotary_dim, heads, types, threads, seqs,
                                            kv_dtype):
    from nanochat.kernels.cpu_decoder import FusedDecoder
    rng = np.random.default_rng(7)
    stack = _random_stack(rng, qk_norm, bias, head_dim, rotary_dim, [int(t) for t in types], heads=heads,
                          kv_dtype=kv_dtype)
    _check_step(FusedDecoder(*stack), *stack, seqs, rng, threads=threads)


# qkv and gate/up as row segments of their own types, as GGUF quantizers mix them (Q4_K_M: q, k Q4_K,
# v Q6_K): (hidden, qkv segment types, gate/up segment types). K-quants need rows of 256.
SEGMENTS = pytest.mark.parametrize("hidden,qkv_types,gate_up_types", [
    (256, [T.Q5_0, T.Q8_0, T.Q4_K], [T.Q6_K, T.Q4_1]),   # q, k, v; gate, up
    (256, [T.Q4_K, T.Q6_K], [T.Q5_K, T.Q8_0]),           # q|k, v
    (64, [T.Q4_0, T.Q5_1, T.Q8_0], [T.Q5_0, T.Q4_1]),    # legacy types only
], ids=["q-k-v", "qk-v", "legacy"])


@SEGMENTS
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
@KV_DTYPES
def test_fused_step_mixed_segment_types(hidden, qkv_types, gate_up_types, bias, seqs, kv_dtype):
    from nanochat.kernels.cpu_decoder import FusedDecoder
    rng = np.random.default_rng(5)
    stack = _random_stack(rng, False, bias, 64, 64, _ints([T.Q8_0, T.Q4_1]), hidden=hidden,
                          qkv_types=_ints(qkv_types), gate_up_types=_ints(gate_up_types), kv_dtype=kv_dtype)
    _check_step(FusedDecoder(*stack), *stack, seqs, rng)


# fp16 vs fp32 caches: the step's new K/V rounded to fp16 (2^-11 relative at most) move the outputs
# by 2e-4 to 3.3e-3 of their max over 80 stacks tried (these two: see the test's message).
TOL_F16_VS_F32 = 1e-2


@pytest.mark.parametrize("head_dim,heads,qk_norm", [(64, 6, False), (128, 4, True)], ids=["smollm2", "qwen3"])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_fused_step_fp16_cache_vs_fp32_reference(head_dim, heads, qk_norm, seqs):
    """The fp16 cache's error against the fp32 arithmetic throughout (same initial cache values)."""
    from nanochat.kernels.cpu_decoder import FusedDecoder
    rng = np.random.default_rng(9)
    dims, layers, cos, sin, final_norm = _random_stack(rng, qk_norm, True, head_dim, head_dim, [int(T.Q8_0)],
                                                       heads=heads, kv_dtype=torch.float16)
    wide = [dataclasses.replace(layer, k_cache=layer.k_cache.float(), v_cache=layer.v_cache.float())
            for layer in layers]
    positions, slots, cu, tables, lens = _batch(dims.block_size, seqs, rng)
    x = torch.randn(len(positions), dims.hidden, generator=torch.Generator().manual_seed(3))
    want, _ = _reference_step(dims, wide, cos, sin, final_norm, x, positions, slots, cu, tables, lens)
    got = FusedDecoder(dims, layers, cos, sin, final_norm).forward(x.clone(), positions, slots, cu, tables, lens,
                                                                  levels=2, threads=2)
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= TOL_F16_VS_F32, f"fp16 cache vs fp32 reference: max error {err:.2e} of the max |output|"


@pytest.fixture(scope="module")
def other_builds():
    """The library built without AVX-512 (the AVX2 paths) and for no x86 extension (the scalar paths)."""
    return {name: cpu_qgemv.build_variant(name, flags)
            for name, flags in (("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("scalar", []))}


# (head_dim, qk_norm, hidden, qkv segment types, gate/up segment types, types of the rest)
@pytest.mark.parametrize("head_dim,qk_norm,hidden,qkv_types,gate_up_types,types", [
    (64, True, 64, None, None, [T.Q4_1]),
    (64, False, 256, [T.Q5_0, T.Q8_0, T.Q4_K], [T.Q6_K, T.Q4_1], [T.Q8_0]),
    (32, True, 64, [T.Q4_0, T.Q5_1], [T.Q5_0, T.Q4_1], [T.Q4_1, T.Q8_0]),
    (128, True, 64, None, [T.Q8_0, T.Q4_1], [T.Q5_1]),
    (96, False, 64, [T.Q8_0, T.Q4_1, T.Q8_0], None, [T.Q4_1]),
    (256, True, 64, None, None, [T.Q8_0]),
], ids=["hd64", "hd64-segments", "hd32-segments", "hd128", "hd96", "hd256"])
@pytest.mark.parametrize("build", ["avx2", "scalar"])
@KV_DTYPES
def test_fused_step_without_avx512(build, head_dim, qk_norm, hidden, qkv_types, gate_up_types, types, kv_dtype,
                                   other_builds):
    from nanochat.kernels.cpu_decoder import FusedDecoder
    rng = np.random.default_rng(11)
    stack = _random_stack(rng, qk_norm, True, head_dim, head_dim, _ints(types), hidden=hidden,
                          qkv_types=_ints(qkv_types), gate_up_types=_ints(gate_up_types), kv_dtype=kv_dtype)
    _check_step(FusedDecoder(*stack, lib=other_builds[build]), *stack, MIXED, rng, seed=4)


def test_fused_step_rejects_bad_input():
    from nanochat.kernels.cpu_decoder import FusedDecoder
    rng = np.random.default_rng(1)
    dims, layers, cos, sin, final_norm = _random_stack(rng, False, False, 32, 32, [int(T.Q8_0)],
                                                       qkv_types=[int(T.Q8_0)] * 3)
    dec = FusedDecoder(dims, layers, cos, sin, final_norm)
    positions, slots, cu, tables, lens = _batch(dims.block_size, [(5, 1)], rng)
    with pytest.raises(RuntimeError, match="RoPE table"):
        dec.forward(torch.zeros(1, 64), torch.tensor([64]), slots, cu, tables, lens)
    with pytest.raises(RuntimeError, match="context length"):
        dec.forward(torch.zeros(1, 64), positions, slots, cu, tables, lens + 1)
    with pytest.raises(ValueError, match="float32"):
        dec.forward(torch.zeros(1, 64, dtype=torch.bfloat16), positions, slots, cu, tables, lens)

    def rejected(match: str, **changes):
        good = layers[1]
        layers[1] = dataclasses.replace(good, **changes)
        try:
            with pytest.raises(ValueError, match=match):
                FusedDecoder(dims, layers, cos, sin, final_norm)
        finally:
            layers[1] = good

    q, k, v = layers[1].qkv
    down = layers[1].down
    rejected("down is not a packed", down=cpu_qgemv.PackedWeight(down.ggml_type, down.shape, down.data.view(-1)[:-1]))
    rejected("qkv must be 1 to 3 packed weights whose rows add up to 256", qkv=[q, k])       # v missing
    rejected("qkv must be 1 to 3 packed weights", qkv=[q, k, v, v])
    rejected("gate_up must be 1 to 2 packed weights", gate_up=layers[1].gate_up * 2)
    rejected(r"qkv\[1\] is not a packed \[64, 64\]", qkv=[q, _packed(int(T.Q8_0), 64, 32, rng), v])  # wrong in
    rejected("qkv_bias must have 256 values", qkv_bias=torch.zeros(255))
    rejected("v_cache must be a contiguous torch.float32", v_cache=layers[1].v_cache.half())     # K / V differ
    rejected("k_cache must be a contiguous torch.float32", k_cache=layers[1].k_cache.half(),
             v_cache=layers[1].v_cache.half())                                                  # layers differ
    rejected("v_cache shape", v_cache=layers[1].v_cache[:, :2].contiguous())
    bf16 = [dataclasses.replace(layer, k_cache=layer.k_cache.bfloat16(), v_cache=layer.v_cache.bfloat16())
            for layer in layers]
    with pytest.raises(ValueError, match="is not float16 or float32"):
        FusedDecoder(dims, bf16, cos, sin, final_norm)
