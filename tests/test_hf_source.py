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
