"""Hugging Face folders and hub ids: resolution through the HF cache, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest

from nanochat.engine import LLM, SamplingParams
from nanochat.models.errors import ModelLoadError
from nanochat.models.formats.loader import open_source


def test_hub_id_resolves_through_the_hf_cache(tiny_models, tmp_path, monkeypatch):
    # Lay the tiny model out exactly as huggingface_hub's cache does, then ask for it by hub id.
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen3"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    shutil.copytree(tiny_models["qwen3"], snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = open_source("tiny-org/tiny-qwen3")
    assert source.config.arch == "qwen3" and str(source.root) == str(snap)
    out = LLM("tiny-org/tiny-qwen3", dtype="float32", max_model_len=64).generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_unknown_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model"):
        open_source("no-such-org/no-such-model")


def test_folder_errors_name_the_file(tiny_models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["qwen3"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        open_source(str(bad))
    (bad / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        open_source(str(bad))
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        open_source(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        open_source(str(empty))


def test_tensors_are_read_as_stored_and_rows_of_them(tmp_path):
    """Every dtype the reader handles, a 0-d tensor, an empty one and a row range read back as safetensors
    itself loads them."""
    import torch
    from safetensors.torch import load_file, save_file

    from nanochat.models.formats.hf_source import HFSource

    g = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(5, 7, generator=g).bfloat16(), "f16": torch.randn(3, 4, generator=g).half(),
               "f32": torch.randn(6, generator=g), "i64": torch.arange(-4, 8).reshape(3, 4),
               "u8": torch.arange(9, dtype=torch.uint8), "b": torch.tensor([True, False, True]),
               "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    source = HFSource.__new__(HFSource)   # the reader alone: no folder around the file
    source._handles, source._layouts = {}, {}
    want = load_file(str(path))
    for name, t in want.items():
        got = source._read(path, name)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
    assert torch.equal(source._read(path, "bf16", 1, 3), want["bf16"][1:4])
    assert torch.equal(source._read(path, "i64", 2, 1), want["i64"][2:3])


def test_a_load_leaves_no_file_pages_resident(tiny_models, tmp_path):
    """The weights are read into memory that goes once packed, not viewed through a map of the file whose pages
    would stay resident beside the packed copies (Linux: the map's Rss in /proc/self/smaps)."""
    import os

    import torch

    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("needs /proc/self/smaps")
    folder = tmp_path / "big"
    shutil.copytree(tiny_models["qwen3"], folder)
    from safetensors.torch import load_file, save_file
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"] = torch.randn(4096, 64)   # 1 MiB of pages that a map would keep
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, vocab_size=4096)))
    weights["lm_head.weight"] = torch.randn(4096, 64)
    save_file(weights, str(folder / "model.safetensors"))
    llm = LLM(str(folder), dtype="float32", max_model_len=64)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))[0].token_ids) == 2

    def resident_kib(path: str) -> int:
        total, inside = 0, False
        for line in open("/proc/self/smaps"):
            if "-" in line.split()[0] and ":" not in line.split()[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
        return total

    assert resident_kib(str(folder / "model.safetensors")) <= 64   # the header's pages at most, of 2 MiB


@pytest.mark.parametrize("dtype, ggml", [("bfloat16", "BF16"), ("float16", "F16")])
def test_a_16_bit_folder_runs_on_the_kernels_in_its_own_type(tmp_path, dtype, ggml):
    """A bf16 / fp16 checkpoint's matrices stay 16-bit on the CPU kernels (half the bytes of the fp32 copy torch's
    GEMM reads), take the fused step, speculate by default (exact rows), and give the logits of torch's GEMM on
    the same weights widened to fp32 (quant_backend dense) to float32 rounding."""
    import torch
    from conftest import make_hf_model
    from test_families import step_logits

    from nanochat.engine import LLMEngine
    from nanochat.kernels import cpu_qgemv
    from nanochat.kernels import gguf_quants as gq

    if not cpu_qgemv.available():
        pytest.skip("the CPU kernels cannot be built here")
    folder = make_hf_model("qwen3", tmp_path / dtype, seed=11, dtype=getattr(torch, dtype))
    kernels = LLMEngine(str(folder), dtype="float32", max_model_len=128, kv_cache_dtype="float32")
    model = kernels.runner.model
    linears = [m for m in model.modules() if type(m).__name__ == "Linear"]
    assert linears and all(p.backend == "q8" and gq.type_name(p.ggml_type) == ggml
                           for m in linears for p in m.quant_parts())
    assert model.fused.why_not is None and kernels.speculative == "ngram"
    gemm = LLMEngine(str(folder), dtype="float32", max_model_len=128, kv_cache_dtype="float32",
                     quant_backend="dense")
    assert "dense" in gemm.runner.model.fused.why_not and gemm.speculative == "off"
    prompt, forced = list(range(3, 40)), [7, 100, 3, 250, 12]
    a, b = step_logits(kernels, prompt, forced), step_logits(gemm, prompt, forced)
    assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
