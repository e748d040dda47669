"""--quantize q8_0: a dense checkpoint's linears quantized at load.

Oracles: the blocks equal gguf.quants.quantize's (bit for bit), and the model equals the same
checkpoint written as a Q8_0 GGUF by the gguf package and loaded from that file."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch

from gguf_writer import write_gguf_from_hf
from nanochat.engine import LLM, SamplingParams
from nanochat.kernels import cpu_qgemv
from nanochat.kernels.gguf_quants import quantize_q8_0

T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_q8_0_blocks_match_gguf(dtype):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(48, 320, generator=g) * torch.logspace(-3, 1, 48).unsqueeze(1)).to(dtype)
    w[0, :64] = 0                                  # an all-zero block: d = 0, codes 0
    w[1, 5] = 127 * 0.0125                         # codes exactly at .5 boundaries round away from zero
    ours = quantize_q8_0(w).numpy()
    ref = gguf.quants.quantize(w.float().numpy(), T.Q8_0).reshape(ours.shape)
    assert np.array_equal(ours, ref)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.zeros(2, 40))


def _greedy_logits(llm, prompts, n=6):
    model = llm.engine.runner.model
    logits, orig = [], model.compute_logits
    model.compute_logits = lambda h: logits.append(orig(h)) or logits[-1]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [r.token_ids for r in out], logits


@pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_quantized_checkpoint_equals_its_q8_0_gguf(name, tiny_models, tmp_path):
    src = tiny_models[name]
    path = tmp_path / "model.gguf"
    write_gguf_from_hf(src, path, name, T.Q8_0, embed_qtype=T.F32)   # embeddings stay dense in both
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    quantized = LLM(str(src), dtype="float32", speculative="off", max_model_len=128, quantize="q8_0")
    from_gguf = LLM(str(path), dtype="float32", speculative="off", max_model_len=128)
    model = quantized.engine.runner.model
    assert model.fused.why_not is None                    # every linear on the q8 kernels
    assert model.layers[0].self_attn.qkv_proj.quant.ggml_type == T.Q8_0
    prompts = [[5, 17, 42, 99, 3], list(range(20, 45))]
    ids_a, logits_a = _greedy_logits(quantized, prompts)
    ids_b, logits_b = _greedy_logits(from_gguf, prompts)
    assert ids_a == ids_b
    for a, b in zip(logits_a, logits_b):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_quantize_option_is_checked():
    from nanochat.engine.config import Config
    with pytest.raises(ValueError, match="q8_0"):
        Config.create("m", quantize="q4_0")
    with pytest.raises(ValueError, match="exclude"):
        Config.create("m", quantize="q8_0", dequantize=True)
