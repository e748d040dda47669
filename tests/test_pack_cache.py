"""The on-disk cache of packed kernel weights (models/formats/pack_cache.py): a second load maps what the first
packed, with identical results; a changed model file or a damaged cache file is never read as valid."""

from __future__ import annotations

import os
import shutil

import gguf
import pytest
import torch

from nanochat.kernels import cpu_qgemv
from nanochat.models.formats import pack_cache

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")


@pytest.fixture
def model_file(tmp_path):
    from conftest import make_hf_model
    from gguf_writer import write_gguf_from_hf
    src = make_hf_model("qwen3", tmp_path / "hf", seed=5)
    (tmp_path / "m").mkdir()
    shutil.copy(src / "tokenizer.json", tmp_path / "m" / "tokenizer.json")
    return write_gguf_from_hf(src, tmp_path / "m" / "model.gguf", "qwen3", T.Q8_0,
                              tensor_qtypes={"blk.0.attn_v.weight": T.Q4_0})


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "packed"
    monkeypatch.setattr(pack_cache, "cache_dir", lambda: root)
    return root


def _load(path):
    from nanochat.engine import LLM
    return LLM(str(path), dtype="float32", max_model_len=64, pack_cache=True)


def _logits(llm):
    from nanochat.engine import SamplingParams
    out = llm.generate([[3, 9, 27, 81]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return out[0].token_ids


def _cache_files(root):
    return sorted(root.glob("*.nc-packed"))


def _packed_weights(llm):
    model = llm.engine.runner.model
    return [seg.weight for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj)
            for seg in lin.quant_parts()]


def test_second_load_maps_the_first_loads_tiles(model_file, cache_root):
    first = _load(model_file)
    (written,) = _cache_files(cache_root)
    second = _load(model_file)
    assert _cache_files(cache_root) == [written]            # nothing rewritten
    for a, b in zip(_packed_weights(first), _packed_weights(second), strict=True):
        assert torch.equal(a, b)
    assert _logits(first) == _logits(second)


def test_a_changed_model_file_gets_a_new_cache(model_file, cache_root):
    _load(model_file)
    stat = os.stat(model_file)
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _load(model_file)
    assert len(_cache_files(cache_root)) == 2


@pytest.mark.parametrize("damage", ["truncate", "magic", "index"])
def test_a_damaged_cache_file_is_rewritten(model_file, cache_root, damage):
    reference = _logits(_load(model_file))
    (path,) = _cache_files(cache_root)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "magic":
        raw[:4] = b"XXXX"
    else:
        raw[20:24] = b"{{{{"
    path.write_bytes(bytes(raw))
    assert _logits(_load(model_file)) == reference
    assert path.read_bytes()[:8] == pack_cache.MAGIC and path.stat().st_size > len(raw) // 2


def test_an_unwritable_cache_only_means_packing_again(model_file, tmp_path, monkeypatch):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setattr(pack_cache, "cache_dir", lambda: blocker / "packed")
    assert _logits(_load(model_file)) == _logits(_load(model_file))


def test_old_cache_files_are_pruned_past_the_budget(model_file, cache_root, monkeypatch):
    _load(model_file)
    (first,) = _cache_files(cache_root)
    monkeypatch.setattr(pack_cache, "KEEP_BYTES", first.stat().st_size)   # room for one file
    os.utime(first, (1, 1))                                               # and it is the oldest
    stat = os.stat(model_file)
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # another file identity
    _load(model_file)
    (second,) = _cache_files(cache_root)
    assert second != first


@pytest.fixture
def hf_folder(tmp_path):
    from conftest import make_hf_model
    return make_hf_model("qwen3", tmp_path / "hf-bf16", seed=7, dtype=torch.bfloat16)


def _matrix_reads(monkeypatch) -> list[str]:
    """The names of the matrices (projections, the head) HF folders read from now on."""
    from nanochat.models.formats.hf_source import HFSource

    reads, read = [], HFSource._read

    def counted(self, f, stored, *args, **kw):
        if stored.endswith(("_proj.weight", "lm_head.weight")):
            reads.append(stored)
        return read(self, f, stored, *args, **kw)

    monkeypatch.setattr(HFSource, "_read", counted)
    return reads


def test_a_folders_second_load_maps_the_tiles_and_reads_no_matrix(hf_folder, cache_root, monkeypatch):
    reads = _matrix_reads(monkeypatch)
    first = _load(hf_folder)
    assert reads and len(_cache_files(cache_root)) == 1
    assert not list(cache_root.glob("*.nc-lean"))           # the lean one-shot runs GGUF files only
    reads.clear()
    second = _load(hf_folder)
    assert reads == []                                      # the header said type and shape; the tiles are mapped
    for a, b in zip(_packed_weights(first), _packed_weights(second), strict=True):
        assert torch.equal(a, b)
    assert _logits(first) == _logits(second)


def test_a_fused_folders_parts_come_from_the_cache(tmp_path, cache_root, monkeypatch):
    from test_families import make_family_model
    folder = make_family_model("phi3", tmp_path / "phi3")   # qkv_proj and gate_up_proj stored fused
    reference = _logits(_load_uncached(folder))
    reads = _matrix_reads(monkeypatch)
    assert _logits(_load(folder)) == reference
    assert any(r.endswith("qkv_proj.weight") for r in reads)
    reads.clear()
    assert _logits(_load(folder)) == reference
    assert reads == []


def _load_uncached(path):
    from nanochat.engine import LLM
    return LLM(str(path), dtype="float32", max_model_len=64, pack_cache=False)


@pytest.mark.parametrize("changed", ["model.safetensors", "config.json"])
def test_a_changed_folder_gets_a_new_cache(hf_folder, cache_root, changed):
    _load(hf_folder)
    stat = os.stat(hf_folder / changed)
    os.utime(hf_folder / changed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _load(hf_folder)
    assert len(_cache_files(cache_root)) == 2


def test_a_folder_quantized_at_load_writes_no_cache(hf_folder, cache_root):
    from nanochat.engine import LLM
    LLM(str(hf_folder), dtype="float32", max_model_len=64, pack_cache=True, quantize="q8_0")
    assert _cache_files(cache_root) == []


def test_tensor_parallel_ranks_keep_a_file_each(hf_folder, tmp_path, monkeypatch):
    """Each rank packs its own slice: one file per rank, and a second TP load maps both without rewriting."""
    from nanochat.engine import LLM

    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))   # the ranks' processes see it too
    root = pack_cache.cache_dir()

    def tp2():
        llm = LLM(str(hf_folder), tensor_parallel_size=2, dtype="float32", max_model_len=64, cpu_threads=1,
                  pack_cache=True)
        try:
            return _logits(llm)
        finally:
            llm.engine.close()

    reference = tp2()
    files = _cache_files(root)
    assert [f.name.split("-", 1)[1] for f in files] == ["tp0of2.nc-packed", "tp1of2.nc-packed"]
    inodes = [f.stat().st_ino for f in files]
    assert tp2() == reference
    assert _cache_files(root) == files and [f.stat().st_ino for f in files] == inodes   # mapped, not rewritten
