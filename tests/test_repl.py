"""`nanochat repl` driven in a pseudo-terminal (pexpect) with a tiny random model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")

# prompt_toolkit draws "> " as ">" plus a cursor move on a real terminal.
PROMPT = r">(?: |\x08\x1b\[2C)"
STATS = r"\[(\d+) tok · [^\]]*?cached (\d+)/(\d+)[^\]]*\]"   # tokens, cached / prompt (app/export.format_stats)
READING_DONE = r"\x1b\[\?2004l"     # prompt_toolkit leaves bracketed paste: the line was accepted


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ, NANOCHAT_HOME=str(tmp_path / "home"), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm",
             PYTHONUNBUFFERED="1")
    e.pop("NANOCHAT_DEBUG", None)
    return e


@pytest.fixture
def slow_env(env, tmp_path):
    """env whose engine steps take 20 ms at least (tests/test_controller.py's hook): a reply lasts long enough for a
    Ctrl-C or a kill to land mid-reply however fast the machine (a tiny model speculating could finish its 450
    tokens first)."""
    from test_controller import step_delay_hook

    delay, hook_env = step_delay_hook(tmp_path / "engine-hook")
    delay.set(0.02)
    return dict(env, **hook_env)


def spawn(env, model, *extra, preexec_fn=None):
    child = pexpect.spawn(sys.executable, ["-m", "nanochat.app.cli", "repl", "--model", str(model),
                                           "--temperature", "0", *extra],
                          env=env, encoding="utf-8", timeout=30, dimensions=(40, 200), preexec_fn=preexec_fn)
    child.expect("Ctrl-D to exit")
    child.expect(PROMPT)
    return child


def say(child, line):
    child.sendline(line)
    child.expect(STATS)
    tokens, cached, prompt = (int(x) for x in child.match.groups())
    child.expect(PROMPT)
    return tokens, cached, prompt - cached


def test_two_turns_history_clear_help(env, tiny_models):
    child = spawn(env, tiny_models["qwen3"], "--max-tokens", "6")
    try:
        first = say(child, "hello there, how are you today?")
        assert first[0] >= 1 and first[1] == 0 and first[2] > 0
        second = say(child, "what is the capital of France?")
        assert second[1] > 0            # turn 2 reuses turn 1's KV: only the new message is prefilled

        child.sendline("/history")
        child.expect("user: hello there, how are you today\\?")
        child.expect(r"prompt \d+ · cached 0 · prefilled \d+")
        child.expect("user: what is the capital of France\\?")
        child.expect(r"prompt (\d+) · cached (\d+) · prefilled (\d+)")
        prompt, cached, prefilled = (int(x) for x in child.match.groups())
        assert cached == second[1] and prompt == cached + prefilled
        child.expect(PROMPT)

        child.sendline("/help")
        child.expect("/clear")
        child.expect(PROMPT)
        child.sendline("/frobnicate")
        child.expect("unknown command /frobnicate")
        child.expect(PROMPT)

        child.sendline("/clear")
        child.expect("conversation cleared")
        child.expect(PROMPT)
        child.sendline("/history")
        child.expect(re.escape("(no messages yet)"))
        child.expect(PROMPT)

        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_cancels_a_reply_and_ctrl_d_exits(slow_env, tiny_models):
    child = spawn(slow_env, tiny_models["qwen3"], "--max-tokens", "450", "--ignore-eos")
    try:
        child.send("abc")
        time.sleep(0.3)
        child.sendintr()                 # Ctrl-C at the prompt clears the line
        child.expect(PROMPT)
        cancel_a_reply(child, "hello there")
        child.sendline("/history")
        child.expect("user: hello there")   # not "abc hello there": the cleared line is gone
        child.expect("assistant: ")         # the partial reply is kept
        child.expect("abort")
        child.expect(PROMPT)
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    history = (slow_env["NANOCHAT_HOME"] + "/state/repl_history")
    assert "hello there" in open(history).read()     # prompt_toolkit FileHistory persisted it


def _ignore_and_block_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def test_ctrl_c_cancels_a_reply_whatever_sigint_state_the_repl_inherited(slow_env, tiny_models):
    """A parent that ignores and blocks SIGINT (nohup, some launchers) passes both on through exec; a
    Python started so would never see a Ctrl-C during a reply (at the prompt prompt_toolkit reads it
    as a key)."""
    child = spawn(slow_env, tiny_models["qwen3"], "--max-tokens", "450", "--ignore-eos",
                  preexec_fn=_ignore_and_block_sigint)
    try:
        cancel_a_reply(child, "hello there")
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def cancel_a_reply(child, line: str) -> None:
    """Send `line`, Ctrl-C while its reply (450 tokens at most) streams: the reply ends cancelled."""
    child.sendline(line)
    child.expect(READING_DONE)
    time.sleep(0.15)
    child.sendintr()
    child.expect(STATS)
    assert "cancelled" in child.after, f"{child.after} ({ctrl_c_state(child)})"
    assert 0 < int(child.match.group(1)) < 450
    child.expect(PROMPT)


def ctrl_c_state(child) -> str:
    """Why a Ctrl-C might not have reached the REPL: its signal masks, the terminal's ISIG and foreground
    process group."""
    import termios

    status = open(f"/proc/{child.pid}/status").read().splitlines()
    masks = [line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
    isig = bool(termios.tcgetattr(child.child_fd)[3] & termios.ISIG)
    return f"{', '.join(masks)}, ISIG {isig}, foreground {os.tcgetpgrp(child.child_fd)} vs pid {child.pid}"


def test_repl_without_a_terminal(env, tiny_models):
    lines = "hello there\nwhat next?\n/history\n/nope\n/clear\n/exit\nnever read\n"
    r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "repl", "--model", str(tiny_models["qwen3"]),
                        "--temperature", "0", "--max-tokens", "4", "--ignore-eos"],
                       input=lines, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    stats = re.findall(STATS, r.stderr)                 # stats lines go to stderr without a terminal
    assert len(stats) == 2 and int(stats[1][1]) > 0
    assert "user: hello there" in r.stdout and "unknown command /nope" in r.stdout
    assert "Traceback" not in r.stderr


def test_a_chat_longer_than_the_context_goes_on_without_its_oldest_exchanges(env, tiny_models):
    # 40-token replies in a 128-token context: from the third message on, the oldest exchanges no longer fit
    messages = [f"message number {i}: tell me about the weather" for i in range(5)]
    too_long = "word " * 200                    # more than the whole context by itself
    lines = "\n".join([*messages[:3], too_long, *messages[3:], "/history", "/exit"]) + "\n"
    r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "repl", "--model", str(tiny_models["qwen3"]),
                        "--temperature", "0", "--max-tokens", "40", "--ignore-eos", "--max-model-len", "128"],
                       input=lines, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(re.findall(STATS, r.stderr)) == len(messages)      # every message that fits is answered
    assert "no longer sees the oldest exchange" in r.stderr
    assert "the message alone does not fit in the context (128 tokens)" in r.stderr   # the long one, in one line
    history = r.stdout[r.stdout.index("user: message number 0"):]
    assert all(f"user: message number {i}" in history for i in range(5))             # /history keeps them all
    divider = history.index("the model no longer sees the messages above")
    assert history.index("user: message number 0") < divider < history.index("user: message number 4")
    assert "Traceback" not in r.stderr


def child_pids(pid: int) -> list[int]:
    out = []
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(stat))
    return out


def test_engine_killed_mid_reply_gives_one_line_and_the_next_message_restarts_it(slow_env, tiny_models):
    child = spawn(slow_env, tiny_models["qwen3"], "--max-tokens", "450", "--ignore-eos")
    try:
        engines = child_pids(child.pid)
        assert len(engines) == 1                   # the engine runs in its own process
        child.sendline("hello there")
        child.expect(READING_DONE)
        child.expect(r"\S")                        # the reply has started (450 tokens take 1 s at least)
        os.kill(engines[0], 9)
        child.expect(r"nanochat: error: the engine process was killed by SIGKILL[^\r\n]*\r?\n")
        child.expect(PROMPT)
        child.sendline("/history")
        child.expect("assistant: ")                # the partial reply is kept
        child.expect(PROMPT)
        child.sendline("go on")
        child.expect("restarting the engine")
        child.expect(STATS)
        assert int(child.match.group(2)) == 0      # a new engine: the whole history is prefilled again
        child.expect(PROMPT)
        assert len(child_pids(child.pid)) == 1 and child_pids(child.pid) != engines
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_a_ctrl_c_that_escapes_a_turn_keeps_the_repl_going():
    """A Ctrl-C that lands after a reply ended (while its stats line prints) escapes the turn: the REPL
    goes on reading lines instead of exiting with the conversation lost."""
    from types import SimpleNamespace

    from nanochat.app.repl import Repl, ReplOptions

    client = SimpleNamespace(model=SimpleNamespace(sampling_defaults={}), open_session=lambda system: object())
    repl = Repl(ReplOptions(model="m"), client, interactive=False)
    turns = []

    def turn(text):
        turns.append(text)
        if len(turns) == 1:
            raise KeyboardInterrupt

    repl.turn = turn
    lines = iter(["first", "second"])

    def read_line():
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    try:
        rc = repl.run(read_line)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped the REPL's loop")
    assert rc == 0 and turns == ["first", "second"]


from test_cli import thinking_model  # noqa: E402,F401  (the fixture)


def test_the_thinking_is_shown_only_when_asked_for(env, thinking_model):
    child = spawn(env, thinking_model, "--max-tokens", "4", "--ignore-eos", "--show-thinking")
    try:
        child.sendline("hello there")
        child.expect(r"<think>\r?\n")        # --show-thinking: the thinking first, marked
        child.expect(STATS)
        child.expect(PROMPT)
        child.sendline("/think off")
        child.expect("no thinking switch")   # this template has none
        child.expect(PROMPT)
        child.sendline("/thinking")          # the last reply's thinking, again
        child.expect(r"\S")
        assert "has no thinking" not in child.before
        child.expect(PROMPT)
    finally:
        child.close(force=True)
    plain = spawn(env, thinking_model, "--max-tokens", "4", "--ignore-eos")
    try:
        plain.sendline("hello there")
        plain.expect(STATS)
        assert "<think>" not in plain.before     # the answer only (none: it never closed its thinking)
    finally:
        plain.close(force=True)


SPEC = r"spec (\d+)/(\d+) accepted"


def test_set_speculative_applies_to_the_next_reply_and_its_stats_line_says_so(env, tiny_models):
    """/set speculative off|ngram in the REPL reaches the next turn's request: the stats line counts proposals
    while the engine speculates (ngram, its default) and says nothing once the chat turns it off."""
    repeat = "Repeat exactly: 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9"
    lines = "\n".join([repeat, "/set speculative off", "/set", repeat, "/set speculative draft", "/set speculative x",
                       "/set speculative -", repeat, "/exit"]) + "\n"
    r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "repl", "--model", str(tiny_models["qwen3"]),
                        "--temperature", "0", "--max-tokens", "24", "--ignore-eos", "--speculative", "ngram"],
                       input=lines, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    stats = re.findall(r"\[[^\]]*\]", r.stderr)
    assert len(stats) == 3, r.stderr
    first, off, again = (re.search(SPEC, s) for s in stats)
    assert first and int(first[1]) <= int(first[2]) and int(first[2]) > 0
    assert off is None and again is not None
    assert "speculative off*" in r.stdout   # /set shows the chat's settings, its own starred
    assert "/set speculative: speculative draft needs a draft model" in r.stdout
    assert "/set speculative: speculative must be off, ngram or draft, got 'x'" in r.stdout
    assert "Traceback" not in r.stderr


def test_set_speculative_ngram_speculates_on_an_engine_started_with_it_off(env, tiny_models):
    """The engine's proposer is the default; a chat may still ask for prompt lookup."""
    repeat = "Repeat exactly: 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9"
    r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "repl", "--model", str(tiny_models["qwen3"]),
                        "--temperature", "0", "--max-tokens", "24", "--ignore-eos", "--speculative", "off"],
                       input=f"{repeat}\n/set speculative ngram\n{repeat}\n/exit\n", capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    first, second = (re.search(SPEC, s) for s in re.findall(r"\[[^\]]*\]", r.stderr))
    assert first is None and second is not None and int(second[2]) > 0, r.stderr


def test_set_a_grammar_holds_the_next_replies(env, tiny_models, tmp_path):
    """/set grammar @FILE (and json_schema) in the REPL: the next replies follow it until /set grammar -."""
    grammar = tmp_path / "yes.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    lines = "\n".join([f"/set grammar @{grammar}", "/set", "yes or no?", "/set json_schema object", "/set grammar -",
                       "/set json_schema {bad", "/set grammar root ::= undefined_rule", "/exit"]) + "\n"
    r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "repl", "--model", str(tiny_models["llama"]),
                        "--temperature", "0", "--max-tokens", "24"],
                       input=lines, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "grammar (2 lines)*" in r.stdout and re.search(r"^(yes|no)$", r.stdout, re.M), r.stdout
    assert "/set json_schema: json_schema and grammar cannot both hold a reply" in r.stdout
    assert "/set json_schema: json_schema is not valid JSON" in r.stdout and "Traceback" not in r.stderr
    assert re.search(r"/set grammar: grammar cannot be followed: .*undefined_rule", r.stdout), r.stdout
