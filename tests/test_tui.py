"""The Textual app driven by Pilot against the REAL engine on a tiny random model (CPU, fp32).

Most tests run the engine core on a thread of this process (EngineClient(in_process=True): faster,
and its steps can be slowed down by monkeypatching LLMEngine.step); the engine-death and exit tests
run a real engine process.

Random tiny models write gibberish: these tests check plumbing (streaming, stats, cancel, commands,
persistence, model switching, engine death), not the text.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import re
import sys
import threading
import time

import pytest
from textual.widgets._markdown import MarkdownParagraph
from textual.widgets import Label, Static

from nanochat.app.controller import EngineState
from nanochat.app.conversation import DEFAULT_TITLE, INTERRUPTED_NOTE, REPLAY_NOTE, Message
from nanochat.app.export import format_stats
from nanochat.app.paths import get_paths
from nanochat.app.settings import Settings
from nanochat.app.store import ChatStore
from nanochat.app.terminal_text import sanitize
from nanochat.app.tui.app import MAX_TICK, STREAM_HZ, UI_NICE, UI_SHARE, NanochatApp, next_tick, yield_to_engine
from nanochat.app.tui.chat_screen import ChatScreen
from nanochat.app.tui.commands import SLASH_COMMANDS
from nanochat.app.tui.screens import BenchScreen, ContextFullScreen, HistoryScreen, ModelPicker
from nanochat.app.tui.widgets import (ChatInput, CommandHints, ConversationList, MessageView, Readout, chat_markdown,
                                     code_blocks)
from nanochat.engine.llm_engine import LLMEngine
from nanochat.engine.output import RequestStats
from nanochat.engine.serve.client import EngineClient
from test_controller import install_step_delay_hook, process_gone

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, num_kvcache_blocks=96)
SIZE = (120, 40)
LONG_USER = "hello there, how are you today? tell me about the quick brown fox and the lazy dog"


def sync(fn):
    """Run an async test with asyncio.run (no pytest async plugin needed)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return wrapper


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    return get_paths().ensure()


@pytest.fixture(scope="module")
def shared_client(tiny_models):
    client = EngineClient(in_process=True)
    client.load_model(str(tiny_models["qwen3"]), **ENGINE)
    yield client
    client.shutdown()


@pytest.fixture
def slow_steps(monkeypatch):
    """At most ~20 engine steps a second (in-process engines), so a long reply is surely still running
    when the test acts (the tiny model can otherwise fill its 256-token context in a second or two)."""
    step = LLMEngine.step

    def slow_step(self):
        time.sleep(0.05)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", slow_step)


def make_app(client, paths, max_tokens=6, **kw) -> NanochatApp:
    kw.setdefault("sampling", {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    return NanochatApp(client=client, paths=paths, settings=Settings.load(paths.settings_file),
                       engine_config=dict(ENGINE), **kw)


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def send(pilot, text: str) -> None:
    box = pilot.app.query_one(ChatInput)
    box.load_text(text)
    await pilot.press("enter")
    await pilot.pause()


async def reply_done(pilot, conv, timeout: float = 30.0):
    await wait_for(pilot, lambda: not conv.generating, timeout, "the reply")
    await pilot.pause()
    return conv.path[-1]


def footers(app) -> list[str]:
    return [str(v.query_one(".footer").render()) for v in app.chat_screen.query(MessageView)
            if v.message.role == "assistant"]


def notifications(app) -> list[str]:
    return [n.message for n in app._notifications]


# ---------------------------------------------------------------------------------- chat
@sync
async def test_streamed_reply_and_second_turn_reuses_the_cache(shared_client, home, monkeypatch, slow_steps):
    from textual.widgets import Markdown

    writes = []
    original = Markdown.append

    def spy(self, fragment):
        writes.append((fragment, self.parent.has_class("streaming")))
        return original(self, fragment)

    monkeypatch.setattr(Markdown, "append", spy)
    app = make_app(shared_client, home, max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        conv = screen.current
        box = app.query_one(ChatInput)
        await pilot.press(*"hi")           # typed keys reach the TextArea
        assert box.text == "hi"
        box.load_text(LONG_USER)
        await pilot.press("enter")
        assert box.text == ""
        reply = await reply_done(pilot, conv)
        # the text went into the Markdown of the view marked streaming, a few tokens at a time (the
        # stream tick draws the tokens that arrived since the last tick, so there may be fewer writes
        # than tokens; the steps are slowed down so that the reply surely outlasts the mounting of its view)
        assert 1 <= len(writes) <= 12 and all(live for _, live in writes)
        assert "".join(w[0] for w in writes) == sanitize(reply.content)   # (a random model writes controls too)
        assert reply.role == "assistant" and not reply.streaming and reply.content
        assert reply.stats.completion_tokens == 12 and reply.stats.cached_tokens == 0
        assert "12 tok" in footers(app)[-1] and "cached 0/" in footers(app)[-1]
        assert conv.title.startswith("hello there") and screen.sub_title == conv.title   # titled after it

        await send(pilot, "and a second question about the fox and the dog please")
        second = await reply_done(pilot, conv)
        cached = second.stats.cached_tokens
        assert cached > 0 and second.stats.prefilled_tokens < second.stats.prompt_tokens
        assert f"cached {cached}/" in footers(app)[-1]
        assert app.query_one("#gauges").status.last_ttft == pytest.approx(second.stats.ttft)
        assert f"{second.stats.ttft * 1000:.0f} ms" in str(app.query_one("#g-ttft").render())
        # every completed message is in the store, with its stats
        stored = ChatStore(home.chat_db).load_conversation(conv.id)
        assert [m.role for m in stored.messages] == ["user", "assistant", "user", "assistant"]
        assert stored.messages[-1].stats == second.stats


@sync
async def test_a_reply_streams_into_room_below_its_question_and_nothing_jumps_when_it_ends(shared_client, home,
                                                                                       slow_steps):
    app = make_app(shared_client, home, max_tokens=30)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        conv = screen.current
        await send(pilot, "first question")
        await reply_done(pilot, conv)
        await send(pilot, "a second question that wraps, " * 6)   # its height is only known once laid out
        chat = screen.chat_view(conv)
        question, reply = list(chat.query(MessageView))[-2:]
        await wait_for(pilot, lambda: reply.room > 0 and len(reply.message.content) > 0, what="the room")
        await pilot.pause(0.3)
        assert conv.generating and not gc.isenabled()     # the garbage collector waits for the reply
        # the question at the top of the view, the reply's room down to its bottom (a full view)
        top = question.virtual_region.y - question.styles.margin.top
        assert chat.scroll_y == chat.max_scroll_y == top
        assert reply.virtual_region.bottom == top + chat.scrollable_content_region.height
        height = chat.virtual_size.height
        await reply_done(pilot, conv)
        await pilot.pause(0.3)
        assert gc.isenabled()
        # the room is now below the reply: the stats line follows the text, and the view did not move
        assert reply.room == 0 and reply.styles.margin.bottom > 0
        assert chat.virtual_size.height == height and chat.scroll_y == top
        blocks = [b for b in reply.body.children if b.display]
        assert reply.body.size.height == max(b.virtual_region.bottom + b.styles.margin.bottom for b in blocks)
        # the next turn takes the room over
        await send(pilot, "third")
        assert reply.styles.margin.bottom == 0
        await reply_done(pilot, conv)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have their own nice value on Linux")
def test_the_drawing_thread_yields_to_the_engine():
    seen = []
    def draw():   # on a thread of its own: the test process keeps its priority
        yield_to_engine()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    thread = threading.Thread(target=draw)
    thread.start()
    thread.join()
    assert seen == [max(UI_NICE, os.getpriority(os.PRIO_PROCESS, 0))]


@sync
async def test_a_turn_shows_its_first_token_at_once_whatever_the_tick_budget(shared_client, home, monkeypatch):
    """A slow machine's budget may put the next stream tick MAX_TICK away (here 30 s): a new turn's
    first token must not wait for it. (Waiting up to 15 s still tells the two apart, and leaves room for
    a busy 2-core machine's first forward: 5 s was once too short.)"""
    import nanochat.app.tui.app as tui_app
    monkeypatch.setattr(tui_app, "next_tick", lambda spent, awaiting: 1 / STREAM_HZ if awaiting else 30.0)
    app = make_app(shared_client, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.chat_screen.current
        await pilot.pause(0.5)    # the tick after start-up has scheduled the next one 30 s away
        await send(pilot, "hello")
        await wait_for(pilot, lambda: conv.path[-1].role == "assistant" and conv.path[-1].content,
                       15.0, "the first token")


def test_the_stream_tick_keeps_to_its_budget():
    assert next_tick(0.0, False) == pytest.approx(1 / STREAM_HZ)        # cheap drawing: full rate
    assert next_tick(UI_SHARE * 0.3, False) == pytest.approx(0.3)        # the UI thread's share kept
    assert next_tick(10.0, False) == MAX_TICK                            # but the text never stalls
    assert next_tick(10.0, True) == pytest.approx(1 / STREAM_HZ)         # a first token shows at once


@sync
async def test_two_conversations_generate_at_once(shared_client, home, slow_steps):
    app = make_app(shared_client, home, max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        first = screen.current
        await send(pilot, LONG_USER)
        await screen.commands.run("/new")
        second = screen.current
        assert second is not first
        await send(pilot, "a different question in another conversation")
        assert first.generating and second.generating, notifications(app)   # both in flight together
        a, b = first.path[-1], second.path[-1]
        running = []

        def both_streaming():
            if app.engine_status.stats is not None:
                running.append(app.engine_status.stats.running)
            return a.generated_tokens >= 3 and b.generated_tokens >= 3 and max(running, default=0) == 2

        await wait_for(pilot, both_streaming, what="both replies streaming, batched")
        assert "running 2" in str(app.query_one("#g-seqs").render())     # the gauges show the batch
        await pilot.press("escape")                                       # cancels the current one only
        await reply_done(pilot, second)
        assert b.stats.finish_reason == "abort" and b.stats.completion_tokens >= 3
        app.controller.cancel(first)
        await reply_done(pilot, first)
        # (the first one may have filled the 256-token context before its cancel)
        assert a.stats.finish_reason in ("abort", "length") and a.stats.completion_tokens >= 3
        # the first conversation streamed while hidden; its view shows the whole reply when shown again
        await screen.show_conversation(first.id)
        await pilot.pause()
        views = list(screen.chat_view(first).query(MessageView))
        assert views[-1].message is a
        assert f"{a.stats.completion_tokens} tok" in str(views[-1].query_one(".footer").render())


@sync
async def test_escape_cancels_the_reply(shared_client, home, slow_steps):
    app = make_app(shared_client, home, max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.chat_screen.current
        await send(pilot, LONG_USER)
        reply = conv.path[-1]
        await wait_for(pilot, lambda: reply.generated_tokens >= 2, what="the first tokens")
        await pilot.press("escape")
        await reply_done(pilot, conv)
        assert reply.stats.finish_reason == "abort" and reply.stats.completion_tokens < 400
        assert "cancelled" in footers(app)[-1]
        assert not conv.session.busy                                      # the session is free again
        # the partial reply is kept (and stored); the next turn continues after it
        assert [m.role for m in ChatStore(home.chat_db).messages(conv.id)] == ["user", "assistant"]
        app.controller.sampling["max_tokens"] = 4
        await send(pilot, "go on")
        nxt = await reply_done(pilot, conv)
        assert nxt.stats.finish_reason == "length" and nxt.stats.cached_tokens > 0


@sync
async def test_quitting_mid_reply_keeps_the_partial_reply(shared_client, home, slow_steps):
    app = make_app(shared_client, home, max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.chat_screen.current
        await send(pilot, LONG_USER)
        reply = conv.path[-1]
        await wait_for(pilot, lambda: reply.generated_tokens >= 2, what="the first tokens")
    stored = ChatStore(home.chat_db).messages(conv.id)
    assert [m.role for m in stored] == ["user", "assistant"]
    assert stored[1].stats.finish_reason == "abort" and stored[1].stats.completion_tokens >= 2
    assert stored[1].content.startswith(reply.content)
    assert conv.session is None                                          # its KV was freed


async def fill_until_refused(pilot, app, conv, text: str, most: int = 12) -> int:
    """Send `text` until the chat no longer fits and the context dialog opens; returns the sends."""
    for sent in range(1, most + 1):
        await send(pilot, text)
        await wait_for(pilot, lambda: not conv.generating, 10, "the reply")
        await pilot.pause()
        if isinstance(app.screen, ContextFullScreen):
            return sent
    raise AssertionError("the context never filled")


@sync
async def test_a_message_longer_than_the_context_offers_a_choice_and_loses_nothing(shared_client, home):
    app = make_app(shared_client, home)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.chat_screen.current
        too_long = "fox " * 400                          # more than the 256-token context
        await fill_until_refused(pilot, app, conv, too_long, most=1)
        assert conv.path == [] and ChatStore(home.chat_db).messages(conv.id) == []
        title = app.screen.query_one(".title", Label)      # the question wraps in its box, all of it shown
        assert "context holds 256" in str(title.render()) and title.size.height >= 2
        assert title.region.right <= title.parent.content_region.right
        await pilot.press("escape")                      # cancel
        await pilot.pause()
        assert app.query_one(ChatInput).text == too_long    # nothing typed is lost
        untitled(app, home, conv)                        # and no empty chat is named after it
        app.query_one(ChatInput).set_text("")
        await fill_until_refused(pilot, app, conv, too_long, most=1)
        await pilot.press("enter")                       # drop the oldest turns: there are none to drop
        await pilot.pause()
        assert any("does not fit" in m for m in notifications(app))
        assert app.query_one(ChatInput).text == too_long
        untitled(app, home, conv)


@sync
async def test_a_reply_view_taken_apart_lets_the_stream_tick_pass():
    """Textual takes a removed view's children away before the view. A stream tick in between (a refused
    turn's view goes while the app shows what its reply gained) once crashed the app in CI."""
    from textual.app import App

    reply = Message("assistant", "", streaming=True)

    class Host(App):
        def compose(self):
            yield MessageView(reply)

    async with Host().run_test() as pilot:
        view = pilot.app.query_one(MessageView)
        await view.remove_children()
        reply.content, reply.generated_tokens, reply.streaming = "late words", 2, False
        await view.sync()
        await view.finish()
        view.refresh_footer()
        await pilot.pause()
        assert pilot.app.is_running and view.is_attached and not view.intact


def untitled(app, home, conv) -> None:
    """The chat a refused first message was sent in is as it was: empty, and titled "New chat"."""
    store = ChatStore(home.chat_db)
    assert conv.title == DEFAULT_TITLE == store.load_conversation(conv.id).title and not conv.roots
    store.close()
    assert str(app.chat_screen.query_one(ConversationList).get_option(str(conv.id)).prompt).strip() == DEFAULT_TITLE


@sync
async def test_a_chat_outgrowing_the_context_drops_its_oldest_turns_or_goes_on_from_a_summary(shared_client, home):
    app = make_app(shared_client, home, max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        conv = screen.current
        text = "tell me about the fox " * 6
        sends = await fill_until_refused(pilot, app, conv, text)
        assert sends > 2 and len(conv.path) == 2 * (sends - 1)
        gauge = str(screen.query_one("#g-context-label", Readout).render())
        assert gauge.startswith("context  ") and gauge.endswith("/256 tokens")
        await pilot.press("enter")                       # the first choice: drop the oldest turns
        await wait_for(pilot, lambda: len(conv.path) == 2 * sends and not conv.generating, 10, "the resend")
        assert conv.context_after in conv.path and conv.context_after.role == "assistant"
        assert conv.path[-2].content == text and conv.path[-1].stats.finish_reason == "length"
        assert conv.path[0].role == "user"           # the transcript is untouched
        await wait_for(pilot, lambda: screen.chat_status.context_used > 0, 10, "the context gauge")
        assert screen.chat_status.context_used < 256 and conv.path[-1].stats.prompt_tokens < 256
        # again until it is full, then go on in a new chat from a summary
        await fill_until_refused(pilot, app, conv, text)
        await pilot.press("down", "enter")               # the second choice
        await wait_for(pilot, lambda: screen.current is not conv and screen.current.path
                       and not screen.current.generating, 30, "the new chat")
        other = screen.current
        assert other.title.endswith("(continued)") and "summary of the conversation" in other.system_prompt
        assert [m.content for m in other.path][:1] == [text]


@sync
async def test_input_history_newline_and_completion(shared_client, home):
    app = make_app(shared_client, home, max_tokens=2)
    async with app.run_test(size=SIZE) as pilot:
        box = app.query_one(ChatInput)
        await send(pilot, "first message")
        await reply_done(pilot, app.chat_screen.current)
        await pilot.press("up")
        assert box.text == "first message"
        await pilot.press("down")
        assert box.text == ""
        await pilot.press("a", "ctrl+j", "b")
        assert box.text == "a\nb"
        box.load_text("")
        await pilot.press("/", "h", "e")
        hints = app.query_one(CommandHints)
        assert hints.display and hints.chosen() == "/help"
        await pilot.press("tab")
        assert box.text == "/help "
        await pilot.press("escape")                    # Esc first hides the hints
        assert not hints.display
    assert "first message" in home.input_history.read_text()


# ---------------------------------------------------------------------------------- commands
def test_help_shows_every_command_usage_whole():
    """The help's table: one row per command, its usage and help whole (a "|" in them once split the cells:
    `/set [NAME VALUE|NAME -]` showed as `/set [NAME` and `NAME -]`)."""
    from markdown_it import MarkdownIt

    from nanochat.app.tui.commands import help_markdown

    tokens = MarkdownIt("gfm-like").parse(help_markdown(("dark",)))   # Textual's Markdown widget's parser
    rows, row = [], None
    for t in tokens:
        if t.type == "tr_open":
            row = []
        elif t.type == "inline" and row is not None:
            row.append("".join(c.content for c in t.children))
        elif t.type == "tr_close":
            rows.append(row)
            row = None
    assert all(len(cells) == 2 for cells in rows)
    commands = dict(cells for cells in rows if cells[0].startswith("/"))
    assert {c.usage: c.help for c in SLASH_COMMANDS} == commands
    assert "/set [NAME VALUE|NAME -]" in commands


@sync
async def test_slash_commands(shared_client, home):
    app = make_app(shared_client, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        assert set(screen.commands.handlers) == {c.name for c in SLASH_COMMANDS}
        conv = screen.current
        await send(pilot, "Show me code")
        reply = await reply_done(pilot, conv)

        await send(pilot, "/history")
        assert isinstance(app.screen, HistoryScreen)
        table = app.screen.query_one("#history-table")
        assert table.row_count == 2
        await pilot.press("escape")
        assert not isinstance(app.screen, HistoryScreen)

        await send(pilot, "/export")
        export = screen.commands.last_export
        assert export is not None and export.parent == home.exports_dir
        text = export.read_text()
        assert "Show me code" in text and "## Assistant" in text and re.search(r"cached \d+/\d+", text)

        await send(pilot, "/copy")
        assert app.clipboard == reply.content

        await send(pilot, "/theme nanochat-light")
        assert app.theme == "nanochat-light"
        assert Settings.load(home.settings_file).theme == "nanochat-light"

        await send(pilot, "/rename Renamed chat")
        assert conv.title == "Renamed chat" and screen.sub_title == "Renamed chat"

        await send(pilot, "/hstory")
        assert any("Unknown command /hstory" in m and "/history" in m for m in notifications(app))

        def pinned(n):
            return lambda: shared_client.stats().pinned_sessions == n

        await wait_for(pilot, pinned(1), 20, "the session's KV pinned")
        await send(pilot, "/system Be terse.")
        assert conv.system_prompt == "Be terse." and conv.session is None   # next turn replays with it
        await wait_for(pilot, pinned(0), 20, "the session's KV freed")
        await send(pilot, "again")
        await reply_done(pilot, conv)
        assert conv.path[-1].note == REPLAY_NOTE
        await wait_for(pilot, pinned(1), 20, "the new session's KV pinned")
        await send(pilot, "/clear")
        assert conv.path == [] and ChatStore(home.chat_db).messages(conv.id) == []
        assert not list(screen.chat_view(conv).query(MessageView))
        assert conv.system_prompt == "Be terse."
        await wait_for(pilot, pinned(0), 20, "the KV freed by /clear")

        await send(pilot, "/new Second")
        conversations = app.controller.conversations
        assert screen.current.title == "Second" and len(conversations) == 2
        await send(pilot, "/rename")                   # without a title: a prompt
        box = app.screen.query_one("Input")
        box.value = "Third"
        await pilot.press("enter")
        assert screen.current.title == "Third"
        await send(pilot, "/delete")                   # asks first
        await pilot.press("n")
        assert len(conversations) == 2
        await send(pilot, "/delete")
        await pilot.press("y")
        await pilot.pause()
        assert len(app.controller.conversations) == 1 and screen.current is conv
        assert [c.title for c in ChatStore(home.chat_db).list_conversations()] == ["Renamed chat"]

        await send(pilot, "/help")
        assert app.screen.id == "help"
        await pilot.press("escape")


@sync
async def test_a_room_callback_landing_while_its_reply_is_removed_is_ignored(shared_client, home):
    """Textual removes a view's children before the view itself: a /clear (or a regenerate) right after a
    reply ended could run the reply's pending room callback in between, which looked for the gone body
    and took the app down. Neither the callback nor a room change may need the body then."""
    app = make_app(shared_client, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.chat_screen.current
        await send(pilot, "hello")
        reply = await reply_done(pilot, conv)
        view = app.chat_screen.chat_view(conv)
        mview = view.view_for(reply)
        await pilot.pause(0.3)                       # the reply's own room callback has run
        mview.room = 3                               # as if it had not
        await mview.body.remove()                    # the first half of a removal
        assert mview.is_attached
        view.room_below(mview)
        mview.room = 0
        await pilot.pause()
        await send(pilot, "/clear")
        assert conv.path == [] and not list(view.query(MessageView))
        await send(pilot, "still here")
        assert (await reply_done(pilot, conv)).content


@sync
async def test_command_palette_runs_the_same_actions(shared_client, home):
    app = make_app(shared_client, home)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"New conversation")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.controller.conversations) == 2, 20, "a new conversation")


@sync
async def test_bench_fast_runs_in_the_app(shared_client, home):
    app = make_app(shared_client, home)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "/bench fast seqs=2 input=16 output=8")
        screen = app.screen
        assert isinstance(screen, BenchScreen)
        await wait_for(pilot, lambda: screen.report is not None, 60, "the bench")
        table = screen.query_one("#bench-results")
        assert table.row_count > 5
        assert screen.report["iterations"][0]["generated_tokens"] > 0
        assert "running" in str(screen.query_one("#g-seqs").render())     # its own gauges
        await pilot.press("escape")
        assert not isinstance(app.screen, BenchScreen)


@sync
async def test_bench_cancel_with_escape(shared_client, home, slow_steps):
    app = make_app(shared_client, home, max_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "/bench fast seqs=2 input=16 output=200 max_model_len=256")
        screen = app.screen
        await wait_for(pilot, lambda: "tokens" in str(screen.query_one("#bench-status").render()), 30,
                       "bench progress")
        assert screen.engine_status.stats is not None                     # live gauges from the bench
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.running, 30, "the cancel")
        assert screen.cancelled and screen.report is None
        assert "cancelled" in str(screen.query_one("#bench-status").render())
        await pilot.press("escape")
        assert not isinstance(app.screen, BenchScreen)
        await wait_for(pilot, lambda: (shared_client.stats().running, shared_client.stats().waiting) == (0, 0), 20,
                       "an idle engine")
        await send(pilot, "the engine is free again")                   # chats go on after the bench
        assert (await reply_done(pilot, app.chat_screen.current)).stats.completion_tokens == 3


# ---------------------------------------------------------------------------------- models
@sync
async def test_model_picker_switches_and_survives_a_broken_model(tiny_models, home):
    import shutil

    from nanochat.models.formats.catalog import discover_models

    other = home.models_dir / "tiny-llama"
    shutil.copytree(tiny_models["llama"], other)
    broken = home.models_dir / "x.gguf"
    broken.write_bytes(b"\x00garbage bytes, not a model\xff" * 64)
    client = EngineClient(in_process=True)
    client.load_model(str(tiny_models["qwen3"]), **ENGINE)
    try:
        app = make_app(client, home, max_tokens=4,
                       discover=lambda: discover_models([home.models_dir], include_hub=False))
        async with app.run_test(size=SIZE) as pilot:
            conv = app.chat_screen.current
            await send(pilot, LONG_USER)
            await reply_done(pilot, conv)
            await send(pilot, "/model")
            picker = app.screen
            assert isinstance(picker, ModelPicker)
            table = picker.query_one("#picker-table")
            await wait_for(pilot, lambda: table.row_count >= 1, 10, "the model list")
            assert str(other) in [k.value for k in table.rows]

            assert picker.focused is table
            await pilot.press(*str(broken))                              # typed with the list focused: to the field
            assert picker.query_one("#picker-path").value == str(broken)
            await pilot.press("enter")
            await wait_for(pilot, lambda: not picker._loading, 30, "the failed load")
            await pilot.pause()
            assert app.screen is picker                                  # still open
            assert any("could not load" in m and "x.gguf" in m for m in notifications(app))
            assert client.model.model == str(tiny_models["qwen3"])       # previous model kept
            assert app.controller.engine_state is EngineState.READY

            table.focus()
            table.move_cursor(row=table.get_row_index(str(other)))
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.screen is not picker, 30, "the model load")
            assert client.model.model == str(other)
            assert "tiny-llama" in str(app.query_one("#g-model").render())
            assert "llama" in str(app.query_one("#g-device").render())
            assert str(other) in Settings.load(home.settings_file).recent_models

            # the conversation goes on with the new model: its transcript is re-prefilled once
            await send(pilot, "continue with the new model")
            reply = await reply_done(pilot, conv)
            assert reply.note == REPLAY_NOTE and REPLAY_NOTE in footers(app)[-1]
            assert reply.stats.prompt_tokens > 40
    finally:
        client.shutdown()


@sync
async def test_conversations_persist_across_restart(shared_client, home):
    app = make_app(shared_client, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "remember this conversation")
        await reply_done(pilot, app.chat_screen.current)
        first_id = app.chat_screen.current.id
        await send(pilot, "/new")
        await send(pilot, "/rename Empty one")
    again = make_app(shared_client, home, max_tokens=4)
    async with again.run_test(size=SIZE) as pilot:
        screen = again.chat_screen
        titles = {c.title for c in again.controller.conversations.values()}
        assert titles == {"remember this conversation", "Empty one"}
        restored = again.controller.conversations[first_id]
        assert [m.role for m in restored.path] == ["user", "assistant"]
        assert restored.path[1].stats.completion_tokens == 4
        await screen.show_conversation(first_id)
        await pilot.pause()
        assert len(screen.chat_view(restored).query(MessageView)) == 2
        await send(pilot, "and now continue")
        reply = await reply_done(pilot, restored)
        assert reply.note == REPLAY_NOTE and reply.stats.completion_tokens == 4


def role_labels(app, conv) -> list[str]:
    view = app.chat_screen.chat_view(conv)
    return [str(v.query_one(".role", Label).render()) for v in view.query(MessageView)]


@sync
async def test_ctrl_r_regenerates_the_last_reply_as_a_new_version(shared_client, home):
    app = make_app(shared_client, home, max_tokens=20)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.chat_screen.current
        await send(pilot, "first question")
        await reply_done(pilot, conv)
        await send(pilot, "second question")
        old = await reply_done(pilot, conv)
        app.chat_screen.query_one(ChatInput).focus()
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: conv.path[-1] is not old and not conv.generating, what="the new reply")
        await pilot.pause()
        new = conv.path[-1]
        assert [m.content for m in conv.path[:3]] == [conv.path[0].content, conv.path[1].content,
                                                          "second question"]
        assert len(conv.path) == 4 and new.content == old.content          # greedy: the same text again
        # the whole prompt is found cached (its last block copied up to the last token, computed again for
        # its logits); nothing is replayed
        assert new.stats.cached_tokens == new.stats.prompt_tokens - 1 and new.note == ""
        assert role_labels(app, conv) == ["You", "Assistant", "You", "Assistant  ‹2/2›"]
        assert [m.content for m in app.controller.store.messages(conv.id)] == [
            m.content for m in conv.path] + [old.content]
        # Alt+Left and Alt+Right move between the versions
        await pilot.press("alt+left")
        await pilot.pause()
        assert conv.path[-1] is old and role_labels(app, conv)[-1] == "Assistant  ‹1/2›"
        await pilot.press("alt+right")
        await pilot.pause()
        assert conv.path[-1] is new and len(app.chat_screen.chat_view(conv).query(MessageView)) == 4
        await send(pilot, "/new")
        await send(pilot, "/retry")
        assert any("cannot retry" in n for n in notifications(app)), notifications(app)


@sync
async def test_set_changes_this_chat_only_and_shows_in_the_gauges(shared_client, home):
    app = make_app(shared_client, home, max_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        conv = screen.current
        await send(pilot, "/set temperature 0.3")
        await send(pilot, "/set top_p 7")
        await send(pilot, "/set max_tokens lots")
        await pilot.pause()
        assert conv.settings == {"temperature": 0.3}
        errors = [n for n in notifications(app) if n.startswith("/set")]
        assert any("top_p" in n for n in errors) and any("not a whole number" in n for n in errors)
        sampling = str(screen.query_one("#g-sampling", Static).render())
        assert "temperature 0.3*" in sampling and "max_tokens 3" in sampling
        await send(pilot, "/new")
        await pilot.pause()
        assert "temperature 0.3" not in str(screen.query_one("#g-sampling", Static).render())
        assert ChatStore(home.chat_db).load_conversation(conv.id).settings == {"temperature": 0.3}


@sync
async def test_edit_an_earlier_message_then_move_between_branches_and_fork(shared_client, home):
    app = make_app(shared_client, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        conv = screen.current
        for text in ("one", "two", "three"):
            await send(pilot, text)
            await reply_done(pilot, conv)
        original = list(conv.path)
        # focus the first message and press e: its text goes to the input, Enter sends the new version
        view = screen.chat_view(conv)
        view.view_for(conv.path[0]).focus()
        await pilot.press("e")
        await pilot.pause()
        assert screen.query_one(ChatInput).text == "one" and screen.query_one("#editing").display
        screen.query_one(ChatInput).set_text("one, edited")
        screen.query_one(ChatInput).focus()
        await pilot.press("enter")
        reply = await reply_done(pilot, conv)
        assert [m.content for m in conv.path] == ["one, edited", reply.content]
        assert role_labels(app, conv) == ["You  ‹2/2›", "Assistant"] and not screen.query_one("#editing").display
        # Left on the focused first message: back to the original branch, all three exchanges
        view.view_for(conv.path[0]).focus()
        await pilot.press("left")
        await pilot.pause()
        assert conv.path == original and len(view.query(MessageView)) == 6
        assert role_labels(app, conv)[0] == "You  ‹1/2›"
        screen.query_one(ChatInput).focus()
        await send(pilot, "four")
        back = await reply_done(pilot, conv)
        held = original[-1].stats.prompt_tokens + original[-1].stats.completion_tokens
        assert back.stats.cached_tokens >= held - 16                         # the branch's KV was resident
        # fork at the second message (the first reply): a new conversation with that much
        view.view_for(conv.path[1]).focus()
        await pilot.press("f")
        await pilot.pause()
        fork = screen.current
        assert fork is not conv and [m.content for m in fork.path] == ["one", original[1].content]
        await send(pilot, "/edit")
        assert screen.query_one(ChatInput).text == "one"
        await pilot.press("escape")
        assert screen.query_one(ChatInput).text == "" and not screen.query_one("#editing").display


@pytest.fixture
def step_delay(tmp_path, monkeypatch):
    """Engine processes started in this test read a step delay from a file (see test_controller.py)."""
    return install_step_delay_hook(tmp_path / "engine-hook", monkeypatch)


@sync
async def test_engine_killed_mid_reply_is_survived(tiny_models, home, step_delay):
    client = EngineClient()                       # a real engine process, for a real kill -9
    client.load_model(str(tiny_models["qwen3"]), **ENGINE)
    try:
        app = make_app(client, home, max_tokens=150)
        async with app.run_test(size=SIZE) as pilot:
            screen = app.chat_screen
            conv = screen.current
            step_delay.set(0.03)
            await send(pilot, LONG_USER)
            reply = conv.path[-1]
            await wait_for(pilot, lambda: reply.generated_tokens >= 3, what="the first tokens")
            pid = client.pid
            client.kill()
            await reply_done(pilot, conv)
            await wait_for(pilot, lambda: "engine stopped" in str(app.query_one("#g-device").render()), 20,
                           "the gauges to show the stopped engine")
            assert str(app.query_one("#g-seqs").render()) == "running 0 · waiting 0"   # not its last report
            # one clear line, and nothing else about it
            assert notifications(app) == ["engine stopped: the engine process was killed by SIGKILL (out of "
                                          "memory?); your next message restarts it"]
            assert process_gone(pid)
            # the partial reply is saved, marked interrupted (footer, store, /history)
            assert reply.note == INTERRUPTED_NOTE and reply.stats.completion_tokens >= 3
            assert footers(app)[-1].endswith(f"{reply.stats.completion_tokens} tok · {INTERRUPTED_NOTE}")
            stored = ChatStore(home.chat_db).messages(conv.id)
            assert [(m.role, m.note) for m in stored] == [("user", ""), ("assistant", INTERRUPTED_NOTE)]
            assert stored[1].content == reply.content
            await send(pilot, "/history")
            history = app.screen.query_one("#history-table")
            assert str(history.get_row_at(1)[-1]) == INTERRUPTED_NOTE
            await pilot.press("escape")

            # the next message restarts the engine, then goes out; the history is re-prefilled
            step_delay.set(0)
            app.controller.sampling["max_tokens"] = 5
            await send(pilot, "are you back?")
            await wait_for(pilot, lambda: len(conv.path) == 4 and not conv.generating, 60,
                           "the restart and the reply")
            await pilot.pause()
            nxt = conv.path[-1]
            assert nxt.role == "assistant" and nxt.note == REPLAY_NOTE
            assert nxt.stats.finish_reason == "length" and nxt.stats.prompt_tokens > 40
            assert client.alive and client.pid != pid
            assert str(app.query_one("#g-device").render()) == "qwen3 · cpu · float32"
            assert len(notifications(app)) == 1

        # after an app restart the interrupted reply shows where it was, between its user messages
        again = make_app(client, home)
        async with again.run_test(size=SIZE) as pilot:
            await pilot.pause()
            views = list(again.chat_screen.query(MessageView))
            assert [v.message.role for v in views] == ["user", "assistant", "user", "assistant"]
            assert views[1].message.content == reply.content
            assert INTERRUPTED_NOTE in str(views[1].query_one(".footer").render())
    finally:
        client.shutdown()


@sync
async def test_no_engine_process_outlives_the_app(tiny_models, home, step_delay):
    """The app starts its own engine (no client given), loads the startup model; quitting mid-reply
    keeps the partial reply and stops the engine process."""
    app = make_app(None, home, max_tokens=150, model=str(tiny_models["qwen3"]))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.controller.engine_state is EngineState.READY, 60, "the startup load")
        pid = app.client.pid
        assert pid is not None and not process_gone(pid)
        step_delay.set(0.03)
        conv = app.chat_screen.current
        await send(pilot, LONG_USER)
        await wait_for(pilot, lambda: conv.path[-1].generated_tokens >= 2, what="the first tokens")
    assert process_gone(pid) and not app.client.alive
    [_, reply] = ChatStore(home.chat_db).messages(conv.id)
    assert reply.stats.finish_reason == "abort" and "cancelled" in format_stats(reply.stats)


# ---------------------------------------------------------------------------------- helpers
def test_footer_format_and_code_blocks():
    stats = RequestStats(completion_tokens=5, ttft=0.0123, decode_tok_s=42.04, cached_tokens=16, prompt_tokens=30,
                         finish_reason="abort")
    assert format_stats(stats, REPLAY_NOTE) == ("5 tok · TTFT 12 ms · 42.0 tok/s · cached 16/30 · cancelled · "
                                                + REPLAY_NOTE)
    text = "a\n```python\nprint(1)\n```\nb\n```\nunfinished"
    assert code_blocks(text) == ["print(1)", "unfinished"]
    assert asyncio.iscoroutinefunction(ChatScreen.send_message)


POEM = "Roses are red,\nviolets are blue.\n\nA new stanza\nends here."


def test_single_newlines_break_lines_in_messages():
    inline = [t for t in chat_markdown().parse(POEM) if t.type == "inline"]
    assert [[c.type for c in t.children] for t in inline] == [["text", "hardbreak", "text"]] * 2
    fence = chat_markdown().parse("```\na\nb\n```")        # code is untouched
    assert [t.type for t in fence] == ["fence"] and fence[0].content == "a\nb\n"


def stored_chat(home, reply: str) -> int:
    """A conversation of one question and `reply`, written to the store before the app starts: its id."""
    store = ChatStore(home.chat_db)
    cid = store.create_conversation("stored")
    store.add_message(cid, "user", "a question")
    store.add_message(cid, "assistant", reply)
    store.close()
    return cid


async def shown_reply(pilot, app, cid: int) -> MessageView:
    await app.chat_screen.show_conversation(cid)
    await pilot.pause()
    return list(app.chat_screen.chat_view(app.controller.conversations[cid]).query(MessageView))[-1]


@sync
async def test_a_poem_keeps_its_lines_on_screen(shared_client, home):
    cid = stored_chat(home, POEM)
    app = make_app(shared_client, home)
    async with app.run_test(size=SIZE) as pilot:
        reply = await shown_reply(pilot, app, cid)
        [first, second] = reply.query(MarkdownParagraph)
        assert first.content.plain.split("\n") == ["Roses are red,", "violets are blue."]
        # Two lines on screen, though both would fit on one line of this width.
        assert first.outer_size.height == 2 and len("Roses are red, violets are blue.") < first.outer_size.width
        assert second.content.plain == "A new stanza\nends here."


@sync
async def test_a_message_body_has_no_outer_blank_lines_as_it_grows(shared_client, home):
    cid = stored_chat(home, "```\nprint(1)\n```\n\nThat prints 1.")
    app = make_app(shared_client, home)
    async with app.run_test(size=SIZE) as pilot:
        reply = await shown_reply(pilot, app, cid)
        fence, para = reply.body.children
        assert fence.styles.margin.top == 0 and fence.styles.margin.bottom > 0   # no blank line above the code
        assert para.styles.margin.bottom == 0                                    # nor below the last block
        reply.message.content += "\n\nA second paragraph."                      # as a streamed reply grows
        await reply.sync()
        await pilot.pause()
        assert reply.body.children[-1] is not para and reply.body.children[-1].styles.margin.bottom == 0
        assert para.styles.margin.bottom > 0 and fence.styles.margin.top == 0    # no longer last: its margin back


@sync
async def test_speculation_shows_in_the_gauges_the_footer_and_the_completions(tiny_models, home):
    """A copy-heavy turn on the engine's default proposer (ngram): the gauge panel shows the acceptance and the
    tokens per step, the reply's footer its accepted proposals; /set speculative completes to what the engine
    runs, and /set speculative off reaches the chat's next turn. A fresh engine, whose step costs no slowed step
    of another test measured (they decide whether speculation pays)."""
    client = EngineClient(in_process=True)
    client.load_model(str(tiny_models["qwen3"]), **ENGINE, speculative="ngram")
    try:
        await _speculation_in_the_app(client, home)
    finally:
        client.shutdown()


async def _speculation_in_the_app(client, home):
    from nanochat.app.tui.commands import matching, speculative_choices
    from nanochat.app.tui.widgets import speculation_text
    from nanochat.engine.output import EngineStats

    app = make_app(client, home, max_tokens=24)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        spec = screen.query_one("#g-spec", Readout)
        assert not spec.display                             # nothing proposed yet
        await send(pilot, "Repeat this list exactly: 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9")
        reply = await reply_done(pilot, screen.current)
        assert reply.stats.spec_proposed > 0
        assert f"spec {reply.stats.spec_accepted}/{reply.stats.spec_proposed} accepted" in footers(app)[-1]
        await wait_for(pilot, lambda: spec.display, 10, "the speculation gauge")
        assert re.fullmatch(r"spec  (\d+% · \d+\.\d tok/step|none accepted · 1\.0 tok/step|\d+% accepted in all)",
                            spec.text), spec.text
        box = app.query_one(ChatInput)
        assert box.speculative == ("off", "ngram")            # no draft model: draft is not offered
        assert [t for t, _ in matching("/set speculative ", speculative=box.speculative)] == \
            ["/set speculative off", "/set speculative ngram"]
        await send(pilot, "/set speculative off")
        assert screen.current.settings == {"speculative": "off"}
        assert "speculative off*" in str(screen.query_one("#g-sampling", Static).render())
        await send(pilot, "Repeat this list exactly: 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9")
        off = await reply_done(pilot, screen.current)
        assert off.stats.spec_proposed == 0 and " spec " not in footers(app)[-1]
    assert speculative_choices(("off",)) == () and speculative_choices(("off", "ngram", "draft")) == ("off", "ngram", "draft")
    assert speculation_text(EngineStats()) == ""
    assert speculation_text(EngineStats(spec_acceptance=0.72, spec_tokens_per_step=2.31, total_spec_proposed=50,
                                        total_spec_accepted=36)) == "spec  72% · 2.3 tok/step"
    assert speculation_text(EngineStats(total_spec_proposed=80, total_spec_accepted=45)) == "spec  56% accepted in all"
    assert speculation_text(EngineStats(spec_tokens_per_step=1.0, total_spec_proposed=80)) == \
        "spec  none accepted · 1.0 tok/step"


def test_the_bench_table_shows_speculation_only_when_it_proposed():
    from nanochat.app.tui.screens import report_table

    plain = {"iterations": [{"iteration": 0, "num_requests": 2}], "mean": {"generated_tokens": 24, "spec_proposed": 0}}
    assert not any(row[0] == "tokens per step" for row in report_table(plain)[1])
    spec = {"iterations": [{"iteration": 0, "num_requests": 2}],
            "mean": {"spec_proposed": 40, "spec_accepted": 30, "spec_tokens_per_step": 2.5}}
    rows = {row[0]: row[1] for row in report_table(spec)[1]}
    assert (rows["proposed tokens"], rows["accepted tokens"], rows["tokens per step"]) == ("40", "30", "2.50")
