"""The CPU fast path (models/layers/fused_forward.py) on whole models: tiny GGUFs with the type mixes real files
have (every kernel type in every projection position, q/k/v and gate/up of different types, quantized
heads, tied and untied embeddings, a vocab that is not a multiple of the kernels' 16-row tiles), against
the module-by-module forward of the same model, and the 16-bit KV cache against the fp32 one.
The engines decode without speculation: the tests compare every step's logits rows, which proposals would add
(tests/test_speculative.py checks that they change no token)."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch

from nanochat.kernels import cpu_qgemv

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")

# Every type the kernels read; positions of a layer's linears and the head (GGUF names).
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32]
POSITIONS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
# K-quant blocks are 256 wide: every input dimension (hidden, heads * head_dim, intermediate) is a multiple.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=2)
VOCAB = 1003   # not a multiple of 16


def _rotation(r: int, layer: int) -> dict[str, T]:
    return {f"blk.{layer}.{p}.weight": TYPES[(r + i) % len(TYPES)] for i, p in enumerate(POSITIONS)}


def _mixed_model(root, index: int, arch: str, tie: bool):
    """Model `index`: layer l uses rotation 2 * index + l of TYPES over POSITIONS, so the models together
    put every type in every position; the head takes the rotation's next type."""
    from conftest import make_hf_model
    from gguf_writer import write_gguf_from_hf

    src = make_hf_model(arch, root / f"hf-{index}", seed=40 + index, tie=tie, vocab_size=VOCAB, **SHAPE)
    qtypes = {**_rotation(2 * index, 0), **_rotation(2 * index + 1, 1)}
    head = TYPES[(2 * index + len(POSITIONS)) % len(TYPES)]
    path = root / f"m{index}" / "model.gguf"
    path.parent.mkdir()
    shutil.copy(src / "tokenizer.json", path.parent / "tokenizer.json")
    write_gguf_from_hf(src, path, arch, T.Q8_0, tensor_qtypes=qtypes,
                       embed_qtype=head if tie else TYPES[(2 * index + 3) % len(TYPES)],
                       output_qtype=None if tie else head)
    return path


MODELS = [(i, ("llama", "qwen2", "qwen3")[i % 3], i % 2 == 0) for i in range((len(TYPES) + 1) // 2)]


@pytest.fixture(scope="module")
def mixed_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    return {i: _mixed_model(root, i, arch, tie) for i, arch, tie in MODELS}


def _greedy(llm, prompts, tokens):
    """Greedy token ids per prompt and the logits of every step."""
    from nanochat.engine import SamplingParams
    model = llm.engine.runner.model
    logits, orig = [], model.compute_logits
    model.compute_logits = lambda h: logits.append(orig(h)) or logits[-1]
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    finally:
        del model.compute_logits
    return [r.token_ids for r in out], logits


PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 51)), list(range(900, 918))]   # ragged, crossing blocks


@pytest.mark.parametrize("index,arch,tie", MODELS, ids=[f"m{i}-{a}-{'tied' if t else 'untied'}" for i, a, t in MODELS])
def test_fused_forward_on_mixed_types(index, arch, tie, mixed_models):
    from nanochat.engine import LLM
    llm = LLM(str(mixed_models[index]), dtype="float32", speculative="off", max_model_len=128, enable_prefix_caching=False,
              max_num_batched_tokens=24)   # prompts prefilled in chunks, mixed with decode rows
    model = llm.engine.runner.model
    assert model.fused.why_not is None
    report = llm.describe()
    assert report.fused and "dense" not in " ".join(report.projections.values())
    assert model.lm_head.quant is not None and model.lm_head.quant.backend == "q8"
    if tie:
        assert model.embed_tokens.packed is not None    # one copy serves the embedding and the head
    ids_fused, logits_fused = _greedy(llm, PROMPTS, 12)
    model.fused.why_not = "disabled for the comparison"
    ids_ref, logits_ref = _greedy(llm, PROMPTS, 12)
    assert ids_fused == ids_ref
    for a, b in zip(logits_fused, logits_ref, strict=True):
        assert a.shape[-1] == VOCAB
        assert (a - b).abs().max().item() <= 1e-3 * b.abs().max().item()


def test_mixed_qkv_matches_the_dequantized_model(mixed_models):
    """The segments are the right rows in the right order: the quantized model agrees with the same file
    dequantized to fp32 (module path, F.linear) to the activation-quantization error."""
    from nanochat.engine import LLM
    quant = LLM(str(mixed_models[1]), dtype="float32", speculative="off", max_model_len=128)
    dense = LLM(str(mixed_models[1]), dtype="float32", speculative="off", max_model_len=128, dequantize=True)
    assert quant.engine.runner.model.layers[0].self_attn.qkv_proj.segments is not None
    assert "dense" in dense.engine.runner.model.fused.why_not
    _, a = _greedy(quant, PROMPTS[:1], 4)
    _, b = _greedy(dense, PROMPTS[:1], 4)
    assert (a[0] - b[0]).abs().max().item() <= 2e-2 * b[0].abs().max().item()


def test_kv_cache_16_bit(mixed_models):
    """fp16 K/V (the CPU default) against the fp32 cache: logits within 1e-2 of their range here (fp16
    keeps 11 significant bits; attention widens to fp32), greedy tokens equal."""
    from nanochat.engine import LLM
    llms = {dt: LLM(str(mixed_models[2]), dtype="float32", speculative="off", max_model_len=128, kv_cache_dtype=dt)
            for dt in ("float16", "float32")}
    assert llms["float16"].engine.runner.model.layers[0].self_attn.k_cache.dtype == torch.float16
    assert llms["float32"].engine.runner.model.layers[0].self_attn.k_cache.dtype == torch.float32
    ids16, l16 = _greedy(llms["float16"], PROMPTS, 16)
    ids32, l32 = _greedy(llms["float32"], PROMPTS, 16)
    assert ids16 == ids32
    for a, b in zip(l16, l32, strict=True):
        assert (a - b).abs().max().item() <= 1e-2 * b.abs().max().item()


def test_info_names_the_path(mixed_models, tmp_path, monkeypatch, capsys):
    from nanochat.app.cli import main
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path))
    assert main(["info", "--model", str(mixed_models[0]), "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["file", str(mixed_models[0])]
    assert "fused whole-stack CPU kernel" in out and "KV cache" in out and "float16" in out
    assert main(["info", "--model", str(mixed_models[0]), "--dequantize"]) == 0
    assert "module by module (layer 0 qkv_proj" in capsys.readouterr().out


# ---------------------------------------------------------------- the uniform-type models

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


@pytest.mark.parametrize("arch,budget", [("llama", 512), ("qwen2", 512), ("qwen3", 512), ("qwen3", 12)],
                         ids=["llama", "qwen2", "qwen3", "qwen3-chunked"])
def test_fused_forward_matches_module_forward(arch, budget, q8_models):
    """budget 12: prompts are prefilled in chunks of up to 12 tokens, mixed with other rows' decode."""
    from nanochat.engine import LLM
    # no prefix caching: the second run must compute every token itself, with the first run's schedule
    llm = LLM(str(q8_models[arch]), dtype="float32", speculative="off", max_model_len=256, kvcache_block_size=16,
              max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert_fused_matches_module(llm, [[5, 17, 42, 99, 3], list(range(20, 51)), list(range(100, 118))])


def assert_fused_matches_module(llm, prompts, tokens: int = 24) -> None:
    """Greedy decoding of `prompts` through the fused step (every step through it) and then through the module
    forward: the same tokens, every step's logits within 1e-3 of the largest."""
    fused = llm.engine.runner.model.fused
    assert fused.why_not is None
    calls = []
    real_run = fused.run
    fused.run = lambda *a: calls.append(1) or real_run(*a)
    ids_fused, logits_fused = _greedy(llm, prompts, tokens)
    assert len(calls) >= len(logits_fused)    # every step went through the fused call
    fused.why_not = "disabled for the comparison"
    ids_ref, logits_ref = _greedy(llm, prompts, tokens)
    assert ids_fused == ids_ref
    assert len(logits_fused) == len(logits_ref)
    for a, b in zip(logits_fused, logits_ref):
        assert (a - b).abs().max().item() <= 1e-3 * b.abs().max().item()


def test_fused_forward_rebuilds_plan_for_a_new_cache(q8_models):
    from nanochat.engine import LLM
    llm = LLM(str(q8_models["llama"]), dtype="float32", speculative="off", max_model_len=128)
    model = llm.engine.runner.model
    first, _ = _greedy(llm, [[1, 2, 3, 4]], 6)
    old = model.fused._decoder
    assert old is not None and old.uses(model.layers[0].self_attn.k_cache)
    llm.engine.runner._allocate_kv_cache()          # new cache tensors: the old plan's pointers are stale
    again, _ = _greedy(llm, [[1, 2, 3, 4]], 6)
    assert model.fused._decoder is not old and model.fused._decoder.uses(model.layers[0].self_attn.k_cache)
    assert again == first


def test_fused_forward_only_where_it_applies(q8_models, monkeypatch):
    from nanochat.engine import LLM
    dense = LLM(str(q8_models["qwen3"]), dtype="float32", speculative="off", max_model_len=128, dequantize=True)
    assert "dense" in dense.engine.runner.model.fused.why_not
    bf16 = LLM(str(q8_models["qwen3"]), dtype="bfloat16", speculative="off", max_model_len=128)
    assert "float32" in bf16.engine.runner.model.fused.why_not
    monkeypatch.setenv("NANOCHAT_FUSED_FORWARD", "0")
    off = LLM(str(q8_models["qwen3"]), dtype="float32", speculative="off", max_model_len=128)
    assert "NANOCHAT_FUSED_FORWARD=0" in off.engine.runner.model.fused.why_not
    monkeypatch.delenv("NANOCHAT_FUSED_FORWARD")
    off = LLM(str(q8_models["qwen3"]), dtype="float32", speculative="off", max_model_len=128, fused_forward=False)
    assert "fused_forward=False" in off.engine.runner.model.fused.why_not
    on = LLM(str(q8_models["qwen3"]), dtype="float32", speculative="off", max_model_len=128)   # the next engine's default: on
    assert on.engine.runner.model.fused.why_not is None


def test_preemption_recompute_equals_decode(mixed_models):
    """Preemption recomputes a sequence's generated tokens with the prefill kernels (a GEMM over the
    chunk, attention over a block of queries); their sums for a row run in the same order as decode's
    (issue 29: before, they agreed to rounding only, and a SmolLM2 story on AVX2 took the other branch
    where its top two logits differed by 2.7e-5). A preempted run matches the solo one token for token,
    and a prompt plus 20 generated tokens prefilled at once gives decode step 20's logits bit for bit."""
    from nanochat.engine import LLM
    path = str(mixed_models[0])
    solo = LLM(path, dtype="float32", speculative="off", max_model_len=128)
    prompts = [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(6)]
    tight = LLM(path, dtype="float32", speculative="off", max_model_len=128, num_kvcache_blocks=6, kvcache_block_size=16)
    preempted, _ = _greedy(tight, prompts, 40)
    assert tight.engine.scheduler.num_preemptions > 0
    for prompt, got in zip(prompts, preempted):
        (want,), steps = _greedy(solo, [prompt], 40)
        assert got == want
        _, (prefill, *_) = _greedy(solo, [prompt + want[:20]], 1)
        assert torch.equal(prefill[-1], steps[20][-1])


def test_fused_forward_adds_every_attention_bias(tmp_path):
    """Llama with attention_bias: q, k, v and the output projection carry biases (the output's went missing in
    the fused step once)."""
    from conftest import make_hf_model
    from gguf_writer import write_gguf_from_hf

    from nanochat.engine import LLM
    src = make_hf_model("llama", tmp_path / "hf", seed=5, attention_bias=True)
    path = write_gguf_from_hf(src, tmp_path / "model.gguf", "llama", T.Q8_0)
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    llm = LLM(str(path), dtype="float32", speculative="off", max_model_len=256, kvcache_block_size=16,
              enable_prefix_caching=False)
    assert llm.engine.runner.model.layers[0].self_attn.o_proj.bias is not None
    assert_fused_matches_module(llm, [[5, 17, 42, 99, 3], list(range(20, 51))])
