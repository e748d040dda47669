"""Adding a family takes one description and a line in models/families/registry.py: a Llama clone under its own
config.json model_type and GGUF architecture, described here and registered for the test, loads from a checkpoint
folder and from a GGUF file and gives exactly Llama's logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from nanochat.models.errors import ModelLoadError
from nanochat.models.families import registry
from nanochat.models.families.dense import DenseForCausalLM
from nanochat.models.families.spec import FamilySpec
from nanochat.models.formats.loader import open_source
from tests.gguf_writer import T, write_gguf_from_hf
from tests.test_families import FORCED, PROMPT, engine_for, step_logits, tokenizer_metadata

# All a new Llama variant needs (as models/families/llama.py has it, under other names).
LLAMA_CLONE = FamilySpec("llama_clone", DenseForCausalLM, gguf_arch="llamaclone", permute_qk=True,
                         sliding_window="none")


def test_a_registered_family_loads_from_both_sources(tiny_models, tmp_path, monkeypatch):
    llama = tiny_models["llama"]
    clone = tmp_path / "clone"
    shutil.copytree(llama, clone)
    cfg = json.loads((clone / "config.json").read_text())
    (clone / "config.json").write_text(json.dumps({**cfg, "model_type": "llama_clone"}))
    vocab = tokenizer_metadata(llama)
    llama_gguf = write_gguf_from_hf(llama, tmp_path / "llama.gguf", "llama", T.F32, tokenizer=vocab)
    clone_gguf = write_gguf_from_hf(llama, tmp_path / "clone.gguf", "llama", T.F32, tokenizer=vocab,
                                    gguf_arch="llamaclone")
    for path, what in ((clone, "architecture 'llama_clone'"), (clone_gguf, "GGUF architecture 'llamaclone'")):
        with pytest.raises(ModelLoadError, match=f"unsupported {what}"):
            open_source(str(path))

    monkeypatch.setattr(registry, "FAMILIES", [*registry.FAMILIES, LLAMA_CLONE])
    for path, twin in ((clone, llama), (clone_gguf, llama_gguf)):
        engine = engine_for(path, False)
        assert engine.loaded.source.family is LLAMA_CLONE and engine.loaded.config.arch == "llama_clone"
        assert isinstance(engine.runner.model, DenseForCausalLM)
        assert torch.equal(step_logits(engine, PROMPT, FORCED[:8]), step_logits(engine_for(twin, False), PROMPT,
                                                                                  FORCED[:8]))
