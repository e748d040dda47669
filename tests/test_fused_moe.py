"""The compiled CPU step (models/layers/fused_forward.py) on sparse MoE models: its router, top-k routing and routed
experts (csrc/decoder.cpp's MoE MLP over moe.cpp) against the module-by-module forward of the same model. Tiny GGUFs:
Qwen3-MoE with Q8_0 attention and experts and a dense layer between the MoE layers (softmax then top-k, with and
without renormalization), and gpt-oss with Q8_0 linears and MXFP4 experts (top-k then softmax, router and expert
biases, the output projection's bias, sinks, windows past their width). Every step's logits, batched, preempted
and chunked, and the greedy tokens."""

from __future__ import annotations

import pytest

from nanochat.engine import LLM
from nanochat.kernels import cpu_qgemv
from tests.gguf_writer import T, write_gguf_from_hf
from tests.test_fused_models import _greedy, assert_fused_matches_module

pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")

PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 51)), list(range(100, 118))]   # ragged, crossing blocks and windows


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from tests.test_families import tokenizer_metadata
    from tests.test_gpt_oss import make_gpt_oss
    from tests.test_moe_gguf import Models

    root = tmp_path_factory.mktemp("fused_moe")
    qwen, _ = Models(root).quant("qwen3moe-q8_0-attn-q8_0")
    folder = make_gpt_oss(root / "gpt-oss-hf", seed=3)
    gpt_oss = write_gguf_from_hf(folder, root / "gpt-oss.gguf", "gpt-oss", T.Q8_0, expert_qtype=T.MXFP4,
                                 tokenizer=tokenizer_metadata(folder))
    return {"qwen3moe": qwen, "gpt-oss": gpt_oss}


@pytest.mark.parametrize("arch,budget,renormalize,blocks", [
    ("qwen3moe", 512, False, None), ("qwen3moe", 12, True, None), ("gpt-oss", 512, False, None),
    ("gpt-oss", 12, False, None), ("gpt-oss", 512, False, 6)],
    ids=["qwen3moe", "qwen3moe-renormalized-chunked", "gpt-oss", "gpt-oss-chunked", "gpt-oss-preempted"])
def test_fused_moe_step_matches_the_module_forward(arch, budget, renormalize, blocks, moe_models):
    """budget 12: prompts prefilled in chunks of up to 12 tokens beside other rows' decode; blocks 6: too few KV
    blocks for all three sequences, so some are preempted and recomputed."""
    kw = {} if blocks is None else {"num_kvcache_blocks": blocks}
    llm = LLM(str(moe_models[arch]), dtype="float32", speculative="off", max_model_len=256, kvcache_block_size=16,
              max_num_batched_tokens=budget, enable_prefix_caching=False, **kw)
    model = llm.engine.runner.model
    moe_layers = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")]
    assert moe_layers and len(moe_layers) < len(model.layers) if arch == "qwen3moe" else len(moe_layers) == 4
    for mlp in moe_layers:
        mlp.renormalize = renormalize
    assert_fused_matches_module(llm, PROMPTS)
    assert (llm.engine.scheduler.num_preemptions > 0) == (blocks is not None)


def test_the_comparison_can_fail(moe_models):
    """The module path with other routing gives other logits: the comparison above sees the router."""
    llm = LLM(str(moe_models["gpt-oss"]), dtype="float32", speculative="off", max_model_len=128)
    model = llm.engine.runner.model
    _, fused = _greedy(llm, PROMPTS[:1], 4)
    model.fused.why_not = "disabled for the comparison"
    for layer in model.layers:
        layer.mlp.top_k = 1
    _, other = _greedy(llm, PROMPTS[:1], 4)
    assert max((a - b).abs().max().item() for a, b in zip(fused, other)) > 1e-2


def test_moe_models_off_the_host_kernels_say_why(moe_models):
    llm = LLM(str(moe_models["qwen3moe"]), dtype="float32", speculative="off", max_model_len=128, moe_offload="none")
    assert "host kernels" in llm.engine.runner.model.fused.why_not
