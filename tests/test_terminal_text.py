"""Model output and stored text are untrusted: the one sanitizer (app/terminal_text.py) shows their
control and escape bytes as visible symbols wherever they reach a terminal.

Checked here: the sanitizer over the C0/C1/OSC/CSI/DCS families and split across stream chunks; the
one-shot on a pseudo-terminal (exact bytes on a pipe); the REPL through pexpect; the TUI through Pilot
(prose, code blocks, titles, dialogs, notifications, a streamed reply) and in tmux (no title change);
a bracketed paste holding ESC bytes; and a structural check that the front ends show text no other way.
(tests/fuzz/test_fuzz_terminal_text.py runs the generative cases.)
"""

from __future__ import annotations

import ast
import asyncio
import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from textual import events
from textual._xterm_parser import XTermParser

from nanochat.app.oneshot import OneShotOptions, ReplyPrinter, _print_in_order, _report
from nanochat.app.paths import get_paths
from nanochat.app.repl import _Terminal
from nanochat.app.store import ChatStore
from nanochat.app.terminal_text import SHOWN, dim, for_terminal, sanitize
from nanochat.app.tui.paste import PasteSafeParser
from nanochat.app.tui.screens import ConfirmScreen, HistoryScreen, TextPrompt
from nanochat.app.tui.widgets import ChatInput, MessageView
from test_tui_snapshots import make_app

ROOT = Path(__file__).resolve().parents[1]
TITLE_ATTACK = "\x1b]2;PWNED\x07"
HOSTILE = f"{TITLE_ATTACK} \x1b[41mRED"                       # the reply
SHOWN_HOSTILE = "␛]2;PWNED␇ ␛[41mRED"
FAMILIES = {
    "OSC title, BEL": "\x1b]2;PWNED\x07",
    "OSC title, ST": "\x1b]0;PWNED\x1b\\",
    "OSC 52 clipboard": "\x1b]52;c;cm0gLXJmIH4=\x07",
    "OSC 8 hyperlink": "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\",
    "CSI colours": "\x1b[41mRED\x1b[0m",
    "CSI cursor and erase": "\x1b[2J\x1b[H\x1b[1A\x1b[2K",
    "CSI private modes": "\x1b[?1049h\x1b[?25l\x1b[?2004l",
    "DCS": "\x1bP1$r0m\x1b\\",
    "APC, PM, SOS": "\x1b_x\x1b\\\x1b^x\x1b\\\x1bXx\x1b\\",
    "8-bit CSI": "\x9b31m",
    "8-bit OSC": "\x9d2;PWNED\x9c",
    "8-bit DCS": "\x90q\x9c",
    "C0": "".join(chr(c) for c in range(32) if chr(c) not in "\t\n"),
    "DEL": "\x7f",
    "bidi overrides and isolates": "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069",
    "a lone CR overwrites": "safe\rEVIL",
    "backspaces overwrite": "rm -rf ~\x08\x08\x08\x08\x08\x08\x08\x08ls",
}


def clean(text: str) -> bool:
    return not set(text) & SHOWN


# ---------------------------------------------------------------------------------- the sanitizer
@pytest.mark.parametrize("family", FAMILIES)
def test_every_escape_family_is_shown_not_obeyed(family):
    text = f"before {FAMILIES[family]} after"
    shown = sanitize(text)
    assert clean(shown) and shown.startswith("before ") and shown.endswith(" after")
    assert shown == "".join(sanitize(c) for c in text)        # character by character


def test_what_each_character_is_shown_as():
    assert sanitize(HOSTILE) == SHOWN_HOSTILE
    assert [sanitize(c) for c in "\x00\x07\x08\x1b\r\x7f"] == ["␀", "␇", "␈", "␛", "␍", "␡"]
    assert sanitize("\x9b") == "<U+009B>" and sanitize("\u202e") == "<U+202E>" and sanitize("\u2069") == "<U+2069>"
    assert sanitize("a\r\nb") == "a\nb"                        # CRLF is a line break
    plain = "tab\tnewline\n é 日本 🙂 e\u0301 \u200f\u200e\u061c [/] <b>"   # bidi marks reorder no text
    assert sanitize(plain) == plain
    assert for_terminal(HOSTILE, False) == HOSTILE and for_terminal(HOSTILE, True) == SHOWN_HOSTILE
    assert dim(HOSTILE, False) == HOSTILE and dim(HOSTILE, True) == f"\x1b[2m{SHOWN_HOSTILE}\x1b[0m"


def test_a_stream_is_safe_split_anywhere():
    text = "".join(FAMILIES.values()) + "```\n" + HOSTILE + "\n```"
    whole = sanitize(text)
    for cut in range(len(text) + 1):
        left, right = sanitize(text[:cut]), sanitize(text[cut:])
        assert clean(left + right)
        if text[cut - 1:cut + 1] != "\r\n":                    # a CRLF cut in two shows its CR
            assert left + right == whole


# ---------------------------------------------------------------------------------- one-shot
class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeStream:
    """What _print_in_order reads of a client's stream: its events, then its reply."""

    def __init__(self, chunks: list[str]):
        self.chunks = chunks
        self.reply = SimpleNamespace(final=SimpleNamespace(finish_reason="stop", error=None, stats=None),
                                     text="".join(chunks), token_ids=list(range(len(chunks))))

    def __iter__(self):
        return iter(SimpleNamespace(text=c) for c in self.chunks)


CHUNKS = ["Here: \x1b", "]2;PWNED", "\x07 \x1b[", "41mRED\x9b", "31m \u202e!"]   # ESC and its rest apart


def test_one_shot_replies_are_sanitized_on_a_terminal_and_exact_in_a_pipe():
    tty, pipe = Tty(), io.StringIO()
    _print_in_order([FakeStream(CHUNKS), FakeStream(["2nd \x1b[2J"])], tty)
    _print_in_order([FakeStream(CHUNKS), FakeStream(["2nd \x1b[2J"])], pipe)
    assert tty.getvalue() == "Here: ␛]2;PWNED␇ ␛[41mRED<U+009B>31m <U+202E>!\n\n2nd ␛[2J\n"
    assert pipe.getvalue() == "".join(CHUNKS) + "\n\n2nd \x1b[2J\n"


def test_one_shot_json_keeps_the_text_and_on_a_terminal_escapes_it():
    reply = FakeStream(CHUNKS).reply
    opts = OneShotOptions(model="m", prompts=["p"], json=True, quiet=True)
    tty, pipe = Tty(), io.StringIO()
    for out in (tty, pipe):
        assert _report(opts, [reply], 0.0, out, io.StringIO()) == 0
        assert json.loads(out.getvalue())["text"] == "".join(CHUNKS)
    assert clean(tty.getvalue()) and "\x9b" in pipe.getvalue()     # a pipe gets the text as it is


def test_one_shot_errors_on_a_terminal_are_sanitized():
    final = SimpleNamespace(finish_reason="error", error=f"bad {HOSTILE}", stats=None)
    err = Tty()
    opts = OneShotOptions(model="m", prompts=["p"])
    assert _report(opts, [SimpleNamespace(final=final, token_ids=[], text="")], 0.0, io.StringIO(), err) == 1
    assert err.getvalue() == f"nanochat: error: bad {SHOWN_HOSTILE}\n"


ONE_SHOT_ON_A_PTY = """
import threading, sys
from types import SimpleNamespace as NS
from nanochat.app import oneshot

CHUNKS = {chunks!r}

class Stream:
    def __init__(self):
        final = NS(finish_reason="stop", error=None, stats=None)
        self.reply = NS(final=final, text="".join(CHUNKS), token_ids=[1])
        self.done = threading.Event()
        self.done.set()

    def __iter__(self):
        return iter([NS(text=c) for c in CHUNKS])

class Client:
    model = NS(sampling_defaults={{}}, thinking_opened=frozenset())
    def open_session(self, system): return None
    def submit_turn(self, session, text, sp): return Stream()
    def shutdown(self): pass

oneshot.load_client = lambda *args, **kwargs: (Client(), 0.0)   # an engine that writes escape sequences
sys.exit(oneshot.run_oneshot(oneshot.OneShotOptions(model="m", prompts=["hi"])))
"""


def test_a_one_shot_on_a_pty_writes_no_escape_sequence_of_the_model():
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-c", ONE_SHOT_ON_A_PTY.format(chunks=CHUNKS)], encoding="utf-8",
                          timeout=30, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = child.read()
    child.close()
    assert child.exitstatus == 0, out
    assert "Here: ␛]2;PWNED␇ ␛[41mRED<U+009B>31m <U+202E>!" in out
    assert "\x1b" not in out and clean(out.replace("\r\n", "\n"))


LOADING_ON_A_PTY = """
import time
from nanochat.app.oneshot import loading_indicator

with loading_indicator({label!r}, delay=0) as (update, status):
    time.sleep(0.3)
    status("[red]compiling\x1b[2J")
    time.sleep(0.3)
print("done")
"""


def test_the_load_progress_shows_a_hostile_file_name_as_text():
    """The one-shot's progress line names the model file: its path's escape sequences and [markup] are shown."""
    pexpect = pytest.importorskip("pexpect")
    label = f"Loading /tmp/{TITLE_ATTACK}[bold]x.gguf"
    child = pexpect.spawn(sys.executable, ["-c", LOADING_ON_A_PTY.format(label=label)], encoding="utf-8",
                          timeout=30, env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200"))
    out = child.read()
    child.close()
    assert child.exitstatus == 0, out
    assert "Loading /tmp/␛]2;PWNED␇[bold]x.gguf" in out and "[red]compiling␛[2J" in out
    assert "PWNED\x07" not in out and "\x1b]" not in out and "\x1b[2J" not in out


LOADING_IN_A_LOG = """
import time
from nanochat.app.oneshot import loading_indicator

with loading_indicator({label!r}, enabled={enabled}, log_delay=0.2) as (update, status):
    status("quick")
    time.sleep(0.05)
with loading_indicator({label!r}, enabled={enabled}, log_delay=0.2) as (update, status):
    status("[red]compiling\x1b[2J")
    time.sleep(1)
print("done")
"""


def test_slow_load_work_is_one_plain_line_in_a_log_and_nothing_when_quiet():
    """Where stderr is a file (a server's log, a script's 2>log), there is no bar, but a kernel compile still
    says why the load takes a minute: one sanitized line for work still going on after log_delay (a quick
    repack says nothing); --quiet keeps stderr empty."""
    label = f"Loading /tmp/{TITLE_ATTACK}x.gguf"
    for enabled, expected in ((True, ["nanochat: Loading /tmp/␛]2;PWNED␇x.gguf · [red]compiling␛[2J"]), (False, [])):
        run = subprocess.run([sys.executable, "-c", LOADING_IN_A_LOG.format(label=label, enabled=enabled)],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and run.stdout == "done\n", run.stderr
        assert run.stderr.splitlines() == expected


# ---------------------------------------------------------------------------------- REPL
def test_repl_writes_through_the_sanitizer_on_a_terminal(capsys):
    term = _Terminal(interactive=False)
    term.info(HOSTILE)
    assert capsys.readouterr().out == HOSTILE + "\n"      # a pipe: exact
    term.tty = term.err_tty = True
    term.info(HOSTILE)
    term.note(HOSTILE)
    term.error(HOSTILE)
    captured = capsys.readouterr()
    assert captured.out == SHOWN_HOSTILE + "\n"
    assert captured.err == f"{SHOWN_HOSTILE}\nnanochat: error: {SHOWN_HOSTILE}\n"


def test_a_reply_and_its_thinking_are_sanitized_on_a_terminal_and_exact_in_a_pipe():
    """The REPL's and the one-shots' printer, thinking shown (dim on a terminal)."""
    tty, pipe = Tty(), io.StringIO()
    for out in (tty, pipe):
        printer = ReplyPrinter(out, show_thinking=True)
        for chunk in ["<thi", "nk>\n", *CHUNKS, "\n</th", "ink>\n\n", *CHUNKS]:
            printer.add(chunk)
        printer.finish()
    assert pipe.getvalue() == f"<think>\n{''.join(CHUNKS)}\n</think>\n\n{''.join(CHUNKS)}"
    shown = "Here: ␛]2;PWNED␇ ␛[41mRED<U+009B>31m <U+202E>!"
    thinking, answer = tty.getvalue().split("</think>")
    assert thinking.startswith("\x1b[2m<think>\n") and answer.startswith("\x1b[0m\n\n")   # the thinking dim
    plain = tty.getvalue().replace("\x1b[2m", "").replace("\x1b[0m", "")
    assert plain == f"<think>\n{shown}\n</think>\n\n{shown}" and "\x1b" not in plain


def test_repl_history_shows_a_pasted_escape_sequence_visibly(tmp_path, tiny_models):
    """A bracketed paste puts ESC bytes in the line (prompt_toolkit keeps them, and draws them as ^[);
    /history, which prints the message back, shows them as symbols."""
    pexpect = pytest.importorskip("pexpect")
    from test_repl import PROMPT, STATS

    env = dict(os.environ, NANOCHAT_HOME=str(tmp_path / "home"), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm",
               PYTHONUNBUFFERED="1")
    child = pexpect.spawn(sys.executable, ["-m", "nanochat.app.cli", "repl", "--model", str(tiny_models["qwen3"]),
                                           "--temperature", "0", "--max-tokens", "2"],
                          env=env, encoding="utf-8", timeout=30, dimensions=(40, 200))
    child.logfile_read = transcript = io.StringIO()
    try:
        child.expect(PROMPT)
        child.send(f"\x1b[200~hi {HOSTILE}\x1b[201~")
        child.sendline("")
        child.expect(STATS)
        child.expect(PROMPT)
        child.sendline("/history")
        child.expect(re.escape(f"user: hi {SHOWN_HOSTILE}"))
        child.expect(PROMPT)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert "\x1b]2;" not in transcript.getvalue()


# ---------------------------------------------------------------------------------- TUI
@pytest.fixture
def hostile_home(tmp_path, monkeypatch):
    """A stored chat whose title, system prompt and messages carry escape sequences, in prose and in a
    fenced code block."""
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    paths = get_paths().ensure()
    store = ChatStore(paths.chat_db)
    cid = store.create_conversation(f"chat {HOSTILE}", system_prompt=f"sys {HOSTILE}")
    store.add_message(cid, "user", f"question {HOSTILE}")
    store.add_message(cid, "assistant", f"prose {HOSTILE}\n\n```\ncode {HOSTILE}\n```\n\nbidi \u202eevil")
    store.close()
    return paths


def screen_text(app) -> list[str]:
    """Every line the app would draw now, as the text of its segments."""
    return ["".join(segment.text for segment in strip) for strip in app.screen._compositor.render_strips()]


def sync(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return wrapper


@sync
async def test_tui_shows_stored_escape_sequences_as_symbols_everywhere(hostile_home):
    app = make_app(hostile_home)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        app.notify(f"note {HOSTILE}", title=HOSTILE)
        app.query_one(ChatInput).notify(f"widget {HOSTILE}")   # a widget's notify goes through the app's
        await pilot.pause()
        lines = screen_text(app)
        assert all(clean(line) for line in lines)
        for shown in (f"question {SHOWN_HOSTILE}", f"prose {SHOWN_HOSTILE}", f"code {SHOWN_HOSTILE}",
                      f"chat {SHOWN_HOSTILE}", "bidi <U+202E>evil"):   # both roles, a code block, the title
            assert any(shown in line for line in lines), shown
        notes = [(n.title, n.message) for n in app._notifications]
        assert (SHOWN_HOSTILE, f"note {SHOWN_HOSTILE}") in notes and ("", f"widget {SHOWN_HOSTILE}") in notes
        conv = app.chat_screen.current
        dialogs = (HistoryScreen(conv), TextPrompt("Rename", conv.title), ConfirmScreen(f"Delete “{conv.title}”?"))
        for screen in dialogs:
            await app.push_screen(screen)
            await pilot.pause()
            assert all(clean(line) for line in screen_text(app))
            assert any(SHOWN_HOSTILE in line for line in screen_text(app))
            app.pop_screen()
            await pilot.pause()


@sync
async def test_tui_markup_in_untrusted_text_is_shown_as_it_is(tmp_path, monkeypatch):
    """A title or a message of "[/]" is text, not markup (Textual would raise MarkupError)."""
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    paths = get_paths().ensure()
    store = ChatStore(paths.chat_db)
    cid = store.create_conversation("[/] [bold]x")
    store.add_message(cid, "user", "[/] [red]y")
    store.close()
    app = make_app(paths)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        conv = app.chat_screen.current
        app.notify("Forked into “[/]”")
        for screen in (HistoryScreen(conv), ConfirmScreen(f"Delete “{conv.title}”?")):
            await app.push_screen(screen)
            await pilot.pause()
            assert any("[/] [bold]x" in line for line in screen_text(app))
            app.pop_screen()
        await pilot.pause()
        assert any("  [/] [bold]x" in line for line in screen_text(app))      # the conversation list


@sync
async def test_a_streamed_reply_split_inside_an_escape_sequence_shows_it_whole(hostile_home):
    app = make_app(hostile_home)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        view = list(app.chat_screen.query(MessageView))[-1]
        view.message.content = ""
        view._shown = 0
        await view.body.update("")
        for chunk in ["title? ", "\x1b", "]2;", "PWNED", "\x07 and\n\n```\ncode \x1b[", "41m\n```"]:
            view.message.content += chunk
            await view.sync()
            await pilot.pause()
            assert all(clean(line) for line in screen_text(app))
        lines = screen_text(app)
        assert any("title? ␛]2;PWNED␇ and" in line for line in lines)   # a paragraph, then a code block
        assert any("code ␛[41m" in line for line in lines)


# ---------------------------------------------------------------------------------- pastes
COLOURED_LOG = "a\r\x1b[31mred\x1b[0m\rc"        # three lines, as a terminal pastes them (CR)
BRACKETED = f"\x1b[200~{COLOURED_LOG}\x1b[201~"


def test_textual_alone_turns_an_escape_in_a_paste_into_keys_and_enter():
    """The cause: the stock parser reads the ESC inside the paste as a key sequence."""
    events_ = list(XTermParser().feed(BRACKETED))
    assert any(isinstance(e, events.Key) and e.key == "enter" for e in events_)
    assert [e.text for e in events_ if isinstance(e, events.Paste)] == ["a\r"]


def test_the_guarded_parser_makes_the_paste_one_event_whatever_the_chunks():
    data = "x" + BRACKETED + "y"
    for cut in range(1, len(data)):
        parser = PasteSafeParser()
        parsed = list(parser.feed(data[:cut])) + list(parser.feed(data[cut:]))
        assert [(type(e).__name__, getattr(e, "text", None) or e.key) for e in parsed] == \
            [("Key", "x"), ("Paste", "a\r␛[31mred␛[0m\rc"), ("Key", "y")], cut


def test_the_app_parses_its_terminal_input_with_the_guard(monkeypatch):
    """paste.install() swaps the parser class the driver's input thread builds, by its module name."""
    from textual.drivers import linux_driver

    from nanochat.app.tui import paste

    monkeypatch.setattr(linux_driver, "XTermParser", linux_driver.XTermParser)   # put back afterwards
    paste.install()
    assert linux_driver.XTermParser is PasteSafeParser
    assert "XTermParser" in linux_driver.LinuxDriver.run_input_thread.__code__.co_names


@sync
async def test_a_paste_holding_escapes_goes_whole_into_the_input_and_is_not_sent(hostile_home):
    app = make_app(hostile_home)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        conv = app.chat_screen.current
        sent = len(conv.path)
        box = app.query_one(ChatInput)
        box.set_text("before ")
        for event in PasteSafeParser().feed(BRACKETED):   # what the driver posts for these bytes
            app.post_message(event)
        await pilot.pause()
        assert box.text == "before a\n␛[31mred␛[0m\nc" and len(conv.path) == sent
        # also with the focus on a message: the paste goes to the input, as typing does
        box.load_text("")
        list(app.chat_screen.query(MessageView))[-1].focus()
        app.post_message(events.Paste("p\x1b[1mq\x07"))
        for _ in range(100):   # the paste hops screen -> input: on a loaded machine one pause may not see it land
            await pilot.pause()
            if box.text:
                break
        assert box.text == "p␛[1mq␇" and app.focused is box


@sync
async def test_refused_text_comes_back_above_what_was_typed_since(hostile_home):
    app = make_app(hostile_home)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen, box = app.chat_screen, app.query_one(ChatInput)
        screen.give_back(screen.current, "first")
        assert box.text == "first"
        box.load_text("typed since")
        screen.give_back(screen.current, "refused")
        assert box.text == "refused\ntyped since"
        screen.give_back(screen.current, "")                       # a refused retry gives back nothing
        assert box.text == "refused\ntyped since"
        box.load_text("")
        screen.give_back(screen.current, f"x {HOSTILE}\r\ny")       # the input holds what it shows
        assert box.text == f"x {SHOWN_HOSTILE}\ny"


# ---------------------------------------------------------------------------------- tmux
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_in_tmux_the_title_stays_and_a_coloured_paste_stays_in_the_input(tmp_path, tiny_models, hostile_home):
    """The real app in a real terminal (tmux, on a server of its own): a stored reply's OSC does not
    retitle the pane, the capture with its colours (-e) holds no sequence of the reply, and a bracketed
    paste of a coloured log (-p; tmux sends line breaks as CR, as terminals do) stays whole in the input."""
    server = f"nanochat-test-{os.getpid()}"
    tmux = functools.partial(run_tmux, server)
    (tmp_path / "paste.txt").write_text("a\n\x1b[31mred\x1b[0m\nc", encoding="utf-8")
    command = (f"env -u COLUMNS -u LINES NANOCHAT_HOME={os.environ['NANOCHAT_HOME']} "   # else they fix the size
               f"{sys.executable} -m nanochat.app.cli --model {tiny_models['qwen3']}")
    tmux("-f", "/dev/null", "new-session", "-d", "-x", "200", "-y", "50", command)
    try:
        tmux("select-pane", "-T", "before")
        screen = wait_for_capture(tmux, f"prose {SHOWN_HOSTILE}")
        assert "\x1b]" not in screen and "\x1b[41m" not in screen and "\x07" not in screen
        tmux("load-buffer", "-b", "log", str(tmp_path / "paste.txt"))
        tmux("paste-buffer", "-p", "-d", "-b", "log")
        screen = plain(wait_for_capture(tmux, "␛[31mred␛[0m"))
        assert tmux("display-message", "-p", "#{pane_title}").strip() == "before"
        tmux("send-keys", "C-q")                                 # quit: the database is then free
        wait_for_exit(tmux)
    finally:
        subprocess.run(["tmux", "-L", server, "kill-server"], capture_output=True)
    rows = [re.findall(r"\S+", row) for row in screen.splitlines()]
    at = next(i for i, row in enumerate(rows) if "␛[31mred␛[0m" in row)
    assert "a" in rows[at - 1] and "c" in rows[at + 1]               # the input holds all three lines
    store = ChatStore(hostile_home.chat_db)
    assert [len(store.messages(c.id)) for c in store.load_all()] == [2]   # and nothing was sent
    store.close()


def run_tmux(server: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", server, *args], check=True, capture_output=True, text=True).stdout


def wait_for_capture(tmux, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        screen = tmux("capture-pane", "-e", "-p")
        if text in plain(screen):
            return screen
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never showed:\n{plain(screen)}")
        time.sleep(0.2)


def wait_for_exit(tmux, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            tmux("has-session")
        except subprocess.CalledProcessError:
            return
        time.sleep(0.2)
    raise AssertionError("the app did not quit")


def plain(screen: str) -> str:
    """A capture-pane -e capture without its colours (tmux writes only SGR sequences)."""
    return re.sub(r"\x1b\[[0-9;:]*m", "", screen)


# ---------------------------------------------------------------------------------- structure
RENDERERS = {"sanitize", "for_terminal", "for_stream", "dim"}   # app/terminal_text.py: what text for a terminal passes
# (bench_cli writes rich tables of numbers; tests/test_bench.py checks the model name it shows)
FRONT_ENDS = ["app/oneshot.py", "app/repl.py", "app/cli.py", "app/errors.py", "app/convert_cli.py"]


def callee(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) or (isinstance(node, ast.JoinedStr)
                                              and all(isinstance(v, ast.Constant) for v in node.values))


def written(node: ast.AST) -> bool:
    """Text a front end may write: a literal, or what passed a renderer (JSON escapes the C0 controls,
    and the one-shot asks it to escape the rest on a terminal)."""
    if literal(node):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return written(node.left) and written(node.right)
    if isinstance(node, ast.IfExp):
        return written(node.body) and written(node.orelse)
    return isinstance(node, ast.Call) and (callee(node) in RENDERERS or ast.unparse(node.func) == "json.dumps")


@pytest.mark.parametrize("path", FRONT_ENDS)
def test_front_ends_write_text_only_through_the_sanitizer(path):
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    bad = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
           and callee(node) in ("print", "write") and not all(written(arg) for arg in node.args)]
    assert bad == [], f"{path}: text written without passing app/terminal_text.py"


# Textual's calls and constructors that take text to show, and which of their positional arguments it
# is (None: all); the keywords that carry text; the attributes that show what is assigned to them.
TEXT_CALLS = {"Static": [0], "Label": [0], "Markdown": [0], "MessageBody": [0], "Option": [0], "Input": [0],
              "update": [0], "add_row": None, "add_rows": None, "add_column": [0], "add_columns": None,
              "replace_option_prompt": [1], "update_cell": [2]}
TEXT_KEYWORDS = {"value", "placeholder", "prompt", "label", "markdown", "content", "renderable"}
TEXT_ATTRIBUTES = {"sub_title", "border_title", "border_subtitle"}
MARKUP_WIDGETS = {"Static", "Label"}    # they read a str as markup unless made with markup=False
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def own_nodes(function: ast.AST):
    """The nodes of a function, not those of the functions defined in it."""
    for child in ast.iter_child_nodes(function):
        yield child
        if not isinstance(child, FUNCTIONS):
            yield from own_nodes(child)


class TuiModule:
    """The check of one module of app/tui. It knows its functions' return values, by name."""

    def __init__(self, path: Path):
        self.tree = ast.parse(path.read_text(encoding="utf-8"))
        self.returns: dict[str, list[ast.AST]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, FUNCTIONS):
                values = [r.value for r in own_nodes(node) if isinstance(r, ast.Return) and r.value is not None]
                self.returns.setdefault(node.name, []).extend(values)

    def shown(self, node: ast.AST, local: dict, seen: frozenset = frozenset()) -> bool:
        """Whether `node` is text a widget may show: a literal, what `sanitize` returned, rich Text of
        such, a widget (checked where it is made), a call of a function of this module that returns
        only such, a local variable only ever set to such; or a list, a sum or a choice of these."""
        parts = {ast.BinOp: lambda n: [n.left, n.right], ast.IfExp: lambda n: [n.body, n.orelse],
                 ast.BoolOp: lambda n: n.values, ast.List: lambda n: n.elts, ast.Tuple: lambda n: n.elts,
                 ast.Starred: lambda n: [n.value], ast.ListComp: lambda n: [n.elt],
                 ast.GeneratorExp: lambda n: [n.elt]}.get(type(node))
        if literal(node):
            return True
        if parts is not None:
            return all(self.shown(part, local, seen) for part in parts(node))
        if isinstance(node, ast.Name):
            return node.id in local and all(self.shown(value, local, seen) for value in local[node.id])
        if not isinstance(node, ast.Call):
            return False
        name = callee(node)
        if name == "sanitize" or (name in TEXT_CALLS and name[0].isupper()):
            return True
        if name == "Text":
            return all(self.shown(arg, local, seen) for arg in node.args)
        return name in self.returns and name not in seen and \
            all(self.shown(value, {}, seen | {name}) for value in self.returns[name])

    def unsafe(self) -> list[str]:
        """The calls and assignments that show text which is not `shown`, and the Labels and Statics
        that read non-literal text as markup."""
        bad = []
        for function in (node for node in ast.walk(self.tree) if isinstance(node, FUNCTIONS)):
            local: dict[str, list[ast.AST]] = {}
            for node in own_nodes(function):
                if isinstance(node, ast.Assign) and [type(t) for t in node.targets] == [ast.Name]:
                    local.setdefault(node.targets[0].id, []).append(node.value)
            for node in own_nodes(function):
                bad += self._unsafe(node, local)
            if function.name == "render":
                bad += [ast.unparse(r) for r in own_nodes(function) if isinstance(r, ast.Return)
                        and r.value is not None and not self.shown(r.value, local)]
        return bad

    def _unsafe(self, node: ast.AST, local: dict) -> list[str]:
        if isinstance(node, ast.Call) and callee(node) in TEXT_CALLS:
            where = TEXT_CALLS[callee(node)]
            texts = [arg for i, arg in enumerate(node.args) if where is None or i in where]
            texts += [k.value for k in node.keywords if k.arg in TEXT_KEYWORDS]
            plain_text = any(k.arg == "markup" and ast.unparse(k.value) == "False" for k in node.keywords)
            markup = [t for t in texts if not literal(t) and not (isinstance(t, ast.Call) and callee(t) == "Text")]
            if not all(self.shown(text, local) for text in texts) or (
                    callee(node) in MARKUP_WIDGETS and markup and not plain_text):
                return [ast.unparse(node)]
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr in TEXT_ATTRIBUTES
                                                for t in node.targets) and not self.shown(node.value, local):
            return [ast.unparse(node)]
        return []


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "app" / "tui").glob("*.py")))
def test_tui_widgets_get_text_only_through_the_sanitizer(path):
    """(Notifications are the app's: NanochatApp.notify sanitizes them all, checked above.)"""
    assert TuiModule(ROOT / "app" / "tui" / path).unsafe() == [], \
        f"app/tui/{path}: text shown without sanitize, or read as markup"


def test_the_check_finds_text_shown_raw(tmp_path):
    module = tmp_path / "widget.py"
    module.write_text('''
def compose(self, title, n):
    yield Label(title)
    yield Label(sanitize(title))
    yield Static(sanitize(title), markup=False)
    text = self.label()
    self.query_one(Static).update(text)
    self.sub_title = f"{n} messages"
    table.add_row(*cells(title))

def label(self):
    return sanitize(self.title)

def cells(*values):
    return [Text(value) for value in values]
''', encoding="utf-8")
    assert TuiModule(module).unsafe() == ["Label(title)", "Label(sanitize(title))", "self.sub_title = f'{n} messages'",
                                          "table.add_row(*cells(title))"]
