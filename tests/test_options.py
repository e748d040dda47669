"""app/options.py: the value checks, engine flags and option merging every command line shares, and the
dtype names and device check it shares with the settings file and the engine's Config."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from nanochat.app import cli, options
from nanochat.app.settings import Settings
from nanochat.engine import config as engine_config_module
from nanochat.engine.config import ENV_OVERRIDES, Config


def test_quant_backend_names_are_the_kernels():
    """Config names them so that checking a config needs no torch; the kernels own them."""
    from nanochat.kernels.quant_matmul import BACKENDS

    assert engine_config_module.QUANT_BACKENDS == BACKENDS


def test_dtype_names_are_the_engines():
    assert options.DTYPE_NAMES == ("auto", *engine_config_module.DTYPES)
    parser = cli.build_parser([])
    dtype = next(a for a in parser._actions if a.dest == "dtype")
    assert tuple(dtype.choices) == options.DTYPE_NAMES
    import torch

    for name in engine_config_module.DTYPES:
        assert isinstance(Config(dtype=name).resolved_dtype(torch.device("cpu")), torch.dtype)


@pytest.mark.parametrize("device, ok", [
    ("cpu", True), ("cuda", True), ("cuda:0", True), ("cuda:12", True), ("auto", True),
    ("cuda:abc", False), ("cuda:", False), ("cuda:-1", False), ("tpu", False), ("CPU", False), ("", False),
    (7, False), (None, False),
])
def test_one_device_check_everywhere(device, ok, tmp_path):
    assert options.valid_device(device) is ok
    # the settings file
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"device": device}))
    loaded = Settings.load(path)
    assert loaded.device == (device if ok else "cpu") and bool(loaded.warnings) is (not ok)
    # Config
    if ok:
        assert Config.create("m", device=device).device == device
    elif device is not None:      # None means "not given" to Config.create
        with pytest.raises(ValueError, match="device must be cpu, cuda, cuda:N or auto"):
            Config.create("m", device=device)
    # the command line
    if isinstance(device, str):
        if ok:
            assert options.device_name(device) == device
        else:
            with pytest.raises(argparse.ArgumentTypeError, match="must be cpu, cuda, cuda:N or auto"):
                options.device_name(device)


def test_cuda_abc_is_a_usage_error_on_the_command_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path))
    assert cli.main(["--prompt", "hi", "--device", "cuda:abc"]) == 2
    err = capsys.readouterr().err
    assert "--device" in err and "cuda:abc" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("parser, raw, value", [
    (options.positive_int, "3", 3), (options.non_negative_int, "0", 0), (options.top_k_int, "-1", -1),
    (options.temperature_float, "0", 0.0), (options.top_p_float, "1", 1.0), (options.kv_cache_gib_float, "0.5", 0.5),
    (options.repetition_penalty_float, "1.3", 1.3), (options.penalty_float, "-2", -2.0),
])
def test_value_parsers_accept(parser, raw, value):
    assert parser(raw) == value


@pytest.mark.parametrize("parser, raw, message", [
    (options.positive_int, "0", "must be a positive integer, got '0'"),
    (options.positive_int, "x", "expected an integer, got 'x'"),
    (options.non_negative_int, "-1", "must be a non-negative integer"),
    (options.top_k_int, "-2", "-1 or 0 (off) or a positive integer"),
    (options.temperature_float, "inf", "0 (greedy) or from 0.01 up"), (options.temperature_float, "nan", "0 (greedy)"),
    (options.temperature_float, "1e-300", "0 (greedy) or from 0.01 up"),   # overflowed the sampler's softmax
    (options.top_p_float, "0", "in (0, 1]"), (options.kv_cache_gib_float, "0", "> 0"),
    (options.kv_cache_gib_float, "1e300", "at most 1048576"),   # "cannot convert float NaN to integer" at load
    (options.kv_cache_gib_float, "two", "expected a number"),
    (options.repetition_penalty_float, "0", "a number > 0 (1 is off)"),
    (options.repetition_penalty_float, "nan", "a number > 0"), (options.penalty_float, "2.5", "from -2 to 2"),
    (options.penalty_float, "inf", "from -2 to 2"),
])
def test_value_parsers_refuse(parser, raw, message):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parser(raw)
    assert message in str(info.value)


def test_settings_file_uses_the_same_rules(tmp_path):
    path = tmp_path / "settings.json"
    good = {"dtype": "bf16", "temperature": 0, "top_p": 1, "top_k": -1, "max_tokens": 5, "kv_cache_gib": 2,
            "max_model_len": 128, "repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 2}
    path.write_text(json.dumps({"version": 2, **good}))   # a current file: -1 for top_k was chosen
    loaded = Settings.load(path)
    assert not loaded.warnings and {k: getattr(loaded, k) for k in good} == good
    bad = {"dtype": "int3", "temperature": -0.1, "top_p": 0, "top_k": -2, "max_tokens": 1.5, "kv_cache_gib": 0,
           "max_model_len": True, "repetition_penalty": 0, "presence_penalty": 3, "frequency_penalty": "1"}
    path.write_text(json.dumps(bad))
    loaded = Settings.load(path)
    assert len(loaded.warnings) == len(bad) and loaded == Settings()


# Values at and around each sampling rule's edges, as a user could type or write them.
EDGE_VALUES = [-3, -2, -1, 0, 0.001, 0.01, 0.5, 1, 1.5, 2, 2.5, 7, 2 ** 64 - 1, 2 ** 64, float("inf"), float("nan")]


@pytest.mark.parametrize("name", sorted(options.SAMPLING_RULES))
def test_one_rule_table_for_flags_settings_set_and_sampling_params(name, tmp_path):
    """argparse, settings.json, a chat's /set (SamplingParams' check) and SamplingParams itself accept
    exactly the same values of every sampling setting, and refuse with the same words."""
    from nanochat.engine.rules import SAMPLING_RULES, accepts
    from nanochat.engine.sampling_params import SamplingParams

    rule = SAMPLING_RULES[name]
    parser = options.arg_type(rule)
    path = tmp_path / "settings.json"
    for value in EDGE_VALUES:
        if rule.cast is int and isinstance(value, float):
            continue   # not an integer: every reader refuses it by type
        try:
            SamplingParams(**{name: value})
            by_params = True
        except ValueError as e:
            by_params = False
            assert str(e).startswith(f"{name} must be {rule.text}, got "), e
        try:
            parser(repr(value) if isinstance(value, float) else str(value))
            by_flag = True
        except argparse.ArgumentTypeError as e:
            by_flag = False
            assert f"must be {rule.text}" in str(e)
        assert by_flag == by_params == accepts(rule, value), (name, value)
        if name != "seed":   # settings.json states no seed
            path.write_text(json.dumps({"version": 2, name: value}))
            assert (not Settings.load(path).warnings) == by_params, (name, value)


def test_one_engine_config_for_every_command():
    from nanochat.app import bench_cli, convert_cli

    assert cli.engine_config is options.engine_config is bench_cli.engine_config
    assert cli.sampling_options is options.sampling_options
    assert cli.resolve_model is options.resolve_model is bench_cli.resolve_model is convert_cli.resolve_model
    settings = Settings(device="auto", dtype="bf16", max_model_len=1024, kv_cache_gib=None)
    args = SimpleNamespace(device=None, dtype="float32")
    # a flag over its settings value over the engine's default; the extra (bench) keys ride along
    assert options.engine_config(args, settings, cpu_threads=2, other=None) == \
        {"device": "auto", "dtype": "float32", "max_model_len": 1024, "cpu_threads": 2}
    assert options.engine_config(SimpleNamespace(), Settings())["device"] == "cpu"   # the default, once
    flags = cli.build_parser([]).parse_args(["--device", "cuda:1", "--kv-cache-gib", "0.5", "--dequantize"])
    assert options.engine_config(flags, settings) == {"device": "cuda:1", "dtype": "bf16", "max_model_len": 1024,
                                                      "kv_cache_gib": 0.5, "dequantize": True}


def test_sampling_options_and_model_resolution(tmp_path):
    settings = Settings(temperature=0.2, max_tokens=9, default_model=str(tmp_path / "s.gguf"), presence_penalty=0.5)
    args = SimpleNamespace(temperature=0.0, top_k=None, seed=3, ignore_eos=True, repetition_penalty=1.3)
    # only what the user states: a flag over its settings value; the rest is left to the model file
    stated = options.sampling_options(args, settings)
    assert stated == {"temperature": 0.0, "max_tokens": 9, "seed": 3, "repetition_penalty": 1.3,
                      "presence_penalty": 0.5, "ignore_eos": True}
    flags = cli.build_parser([]).parse_args(["--frequency-penalty", "0.25", "--presence-penalty", "-1"])
    assert options.sampling_options(flags, Settings()) == {"frequency_penalty": 0.25, "presence_penalty": -1.0}
    # ... then what the model file recommends, then the chat defaults
    recommended = {"temperature": 0.6, "top_p": 0.8, "top_k": 20}
    assert options.effective_sampling(stated, recommended) == {**stated, "top_p": 0.8, "top_k": 20}
    assert options.effective_sampling({}, {}) == options.CHAT_DEFAULTS
    assert options.effective_sampling({"max_tokens": 5}, recommended) == {"temperature": 0.6, "top_p": 0.8,
                                                                          "top_k": 20, "max_tokens": 5}
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert options.resolve_model(SimpleNamespace(model=str(model)), settings) == str(model)


def test_every_environment_knob_is_documented_once():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    for env, (field, _) in ENV_OVERRIDES.items():
        assert section.count(f"`{env}`") == 1, env
        assert f"`{field}`" in section, field
        assert env.startswith(("NANO_VLLM_", "NANOCHAT_"))


def test_imports_read_no_knobs_and_load_no_torch_for_the_command_line():
    """Importing the package reads no engine knob (a bad value fails at Config.create, not at import) and
    the command line's modules load no torch."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update({name: "bogus" for name in ENV_OVERRIDES})
    code = ("import sys, os\n"
            "before = dict(os.environ)\n"
            "import nanochat.app.cli, nanochat.app.options, nanochat.app.settings, nanochat.app.convert_cli\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import nanochat.kernels.cpu_qgemv, nanochat.kernels.moe_cpu, nanochat.kernels.quant_matmul\n"
            "import nanochat.models.layers.fused_forward, nanochat.models.formats.pack_cache, nanochat.models.formats.loader\n"
            "import nanochat.engine.llm_engine\n"
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_reasoning_effort_is_a_template_variable_with_one_rule():
    import argparse

    from nanochat.app.controller import setting_value
    from nanochat.app.options import reasoning_effort_word, template_variables

    assert template_variables({"reasoning_effort": "high", "temperature": 0.5}) == {"reasoning_effort": "high"}
    assert template_variables({"reasoning_effort": "extreme"}) == {}   # a damaged stored value is ignored
    assert reasoning_effort_word("low") == "low"
    with pytest.raises(argparse.ArgumentTypeError, match="must be low, medium or high, got 'max'"):
        reasoning_effort_word("max")
    assert setting_value("reasoning_effort", "HIGH") == "high"


@pytest.mark.parametrize("smt, expected", [(1, 4), (2, 2)], ids=["no SMT", "SMT 2"])
def test_expert_threads_default_to_the_physical_cores(smt, expected, tmp_path, monkeypatch):
    """The host experts are memory-bound: one thread per physical core of the CPUs the process may use, read
    from sysfs's topology (4 logical CPUs: 4 cores without SMT, 2 with two threads a core)."""
    from nanochat.kernels.options import KernelOptions, physical_cores

    for cpu in range(4):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{cpu // smt}\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert physical_cores(str(tmp_path)) == expected
    assert physical_cores(str(tmp_path / "absent")) == 2            # unreadable: half the logical CPUs
    assert KernelOptions(expert_threads=3).expert_thread_count() == 3


def test_a_chat_template_file_stays_with_the_model_it_was_given_with():
    """The app and the server load other models without --chat-template's file, and the first one with it again."""
    from nanochat.app.options import model_config

    config = {"threads": 2, "chat_template": "/t.jinja"}
    assert model_config(config, "a.gguf", "a.gguf") == config
    assert model_config(config, "b.gguf", "a.gguf") == {"threads": 2}
    assert model_config({"threads": 2}, "b.gguf", "a.gguf") == {"threads": 2}
