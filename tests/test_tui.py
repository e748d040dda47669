"""The Textual app driven by Pilot against the REAL engine on a tiny random model (CPU, fp32).

Random tiny models write gibberish: these tests check plumbing (streaming, stats, cancel, commands,
persistence, model switching), not the text.
"""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

from nanochat.app.paths import get_paths
from nanochat.app.settings import Settings
from nanochat.app.store import ChatStore
from nanochat.app.tui.app import NanochatApp
from nanochat.app.tui.conversation import REPLAY_NOTE, code_blocks, format_stats
from nanochat.app.tui.screens import BenchScreen, HistoryScreen, ModelPicker
from nanochat.app.tui.widgets import ChatInput, CommandHints, MessageView
from nanochat.engine.engine_thread import EngineThread

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
def shared_engine(tiny_models):
    et = EngineThread(str(tiny_models["qwen3"]), **ENGINE)
    yield et
    et.shutdown()


@pytest.fixture
def slow_steps(shared_engine, monkeypatch):
    """At most ~20 engine steps a second, so a long reply is surely still running when the test acts
    (the tiny model can otherwise fill its 256-token context in a second or two)."""
    engine = shared_engine.engine
    step = engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def make_app(engine_thread, paths, max_tokens=6, **kw) -> NanochatApp:
    kw.setdefault("sampling", {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    return NanochatApp(engine_thread=engine_thread, paths=paths, settings=Settings.load(paths.settings_file),
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
    return conv.messages[-1]


def footers(app) -> list[str]:
    return [str(v.query_one(".footer").render()) for v in app.query(MessageView) if v.message.role == "assistant"]


def notifications(app) -> list[str]:
    return [n.message for n in app._notifications]


# ---------------------------------------------------------------------------------- chat
@sync
async def test_streamed_reply_and_second_turn_reuses_the_cache(shared_engine, home, monkeypatch):
    from textual.widgets._markdown import MarkdownStream

    writes = []
    original = MarkdownStream.write

    async def spy(self, fragment):
        view = self.markdown_widget.parent
        writes.append((fragment, view.message.streaming, view.has_class("streaming")))
        await original(self, fragment)

    monkeypatch.setattr(MarkdownStream, "write", spy)
    app = make_app(shared_engine, home, max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.current
        box = app.query_one(ChatInput)
        await pilot.press(*"hi")           # typed keys reach the TextArea
        assert box.text == "hi"
        box.load_text(LONG_USER)
        await pilot.press("enter")
        assert box.text == ""
        reply = await reply_done(pilot, conv)
        # the text went into the live Markdown stream while the message was marked streaming (the app
        # batches the tokens that arrive while it is busy drawing, so there may be fewer writes than tokens)
        assert 1 <= len(writes) <= 12 and all(live and css for _, live, css in writes)
        assert "".join(w[0] for w in writes) == reply.content
        assert reply.role == "assistant" and not reply.streaming and reply.content
        assert reply.stats["completion_tokens"] == 12 and reply.stats["cached_tokens"] == 0
        assert "12 tok" in footers(app)[-1] and "cached 0/" in footers(app)[-1]
        assert conv.title.startswith("hello there")          # titled after the first message

        await send(pilot, "and a second question about the fox and the dog please")
        second = await reply_done(pilot, conv)
        cached = second.stats["cached_tokens"]
        assert cached > 0 and second.stats["prefilled_tokens"] < second.stats["prompt_tokens"]
        assert f"cached {cached}/" in footers(app)[-1]
        assert app.query_one("#gauges").last_ttft == pytest.approx(second.stats["ttft"])
        # every completed message is in the store, with its stats
        stored = ChatStore(home.chat_db).load_conversation(conv.id)
        assert [m.role for m in stored.messages] == ["user", "assistant", "user", "assistant"]
        assert stored.messages[-1].stats["cached_tokens"] == cached


@sync
async def test_two_conversations_generate_at_once(shared_engine, home, slow_steps):
    app = make_app(shared_engine, home, max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        first = app.current
        await send(pilot, LONG_USER)
        await app.run_command("/new")
        second = app.current
        assert second is not first
        await send(pilot, "a different question in another conversation")
        assert first.generating and second.generating, notifications(app)   # both in flight together
        a, b = first.messages[-1], second.messages[-1]
        running = []

        def both_streaming():
            if app.engine_stats is not None:
                running.append(app.engine_stats.running)
            return a.generated_tokens >= 3 and b.generated_tokens >= 3 and max(running, default=0) == 2

        await wait_for(pilot, both_streaming, what="both replies streaming, batched")
        assert "running 2" in str(app.query_one("#g-seqs").render())     # the gauges show the batch
        await pilot.press("escape")                                       # cancels the current one only
        await reply_done(pilot, second)
        assert b.stats["finish_reason"] == "abort" and b.stats["completion_tokens"] >= 3
        if first.generating:
            first.handle.cancel()
        await reply_done(pilot, first)
        # (the first one may have filled the 256-token context before its cancel)
        assert a.stats["finish_reason"] in ("abort", "length") and a.stats["completion_tokens"] >= 3
        # the first conversation streamed while hidden; its view shows the whole reply when shown again
        await app.show_conversation(first.id)
        await pilot.pause()
        views = list(app.chat_view(first).query(MessageView))
        assert views[-1].message is a and f"{a.stats['completion_tokens']} tok" in str(views[-1].query_one(".footer").render())


@sync
async def test_escape_cancels_the_reply(shared_engine, home, slow_steps):
    app = make_app(shared_engine, home, max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.current
        await send(pilot, LONG_USER)
        reply = conv.messages[-1]
        await wait_for(pilot, lambda: reply.generated_tokens >= 2, what="the first tokens")
        await pilot.press("escape")
        await reply_done(pilot, conv)
        assert reply.stats["finish_reason"] == "abort" and reply.stats["completion_tokens"] < 400
        assert "cancelled" in footers(app)[-1]
        # the partial reply is kept (and stored); the next turn continues after it
        assert [m.role for m in ChatStore(home.chat_db).messages(conv.id)] == ["user", "assistant"]
        app.sampling["max_tokens"] = 4
        await send(pilot, "go on")
        nxt = await reply_done(pilot, conv)
        assert nxt.stats["finish_reason"] == "length" and nxt.stats["cached_tokens"] > 0


@sync
async def test_a_refused_request_gives_the_text_back(shared_engine, home):
    app = make_app(shared_engine, home)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.current
        too_long = "fox " * 400                          # more than the 256-token context
        await send(pilot, too_long)
        await wait_for(pilot, lambda: not conv.generating, 10, "the refusal")
        await pilot.pause()
        assert conv.messages == [] and ChatStore(home.chat_db).messages(conv.id) == []
        assert any("reply failed" in m and "max_model_len" in m for m in notifications(app))
        assert app.query_one(ChatInput).text == too_long    # nothing typed is lost


@sync
async def test_input_history_newline_and_completion(shared_engine, home):
    app = make_app(shared_engine, home, max_tokens=2)
    async with app.run_test(size=SIZE) as pilot:
        box = app.query_one(ChatInput)
        await send(pilot, "first message")
        await reply_done(pilot, app.current)
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
@sync
async def test_slash_commands(shared_engine, home):
    app = make_app(shared_engine, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.current
        await send(pilot, "Show me code")
        reply = await reply_done(pilot, conv)

        await send(pilot, "/history")
        assert isinstance(app.screen, HistoryScreen)
        table = app.screen.query_one("#history-table")
        assert table.row_count == 2
        await pilot.press("escape")
        assert not isinstance(app.screen, HistoryScreen)

        await send(pilot, "/export")
        assert app.last_export is not None and app.last_export.parent == home.exports_dir
        text = app.last_export.read_text()
        assert "Show me code" in text and "## Assistant" in text and "cached 0/" in text

        await send(pilot, "/copy")
        assert app.clipboard == reply.content

        await send(pilot, "/theme nanochat-light")
        assert app.theme == "nanochat-light"
        assert Settings.load(home.settings_file).theme == "nanochat-light"

        await send(pilot, "/rename Renamed chat")
        assert conv.title == "Renamed chat"

        await send(pilot, "/hstory")
        assert any("Unknown command /hstory" in m and "/history" in m for m in notifications(app))

        def pinned():
            return app.engine_thread.call(lambda e: e.block_manager.stats().pinned_sessions).result(10)

        await send(pilot, "/system Be terse.")
        assert conv.system_prompt == "Be terse." and conv.session is None   # next turn replays with it
        assert pinned() == 0
        await send(pilot, "again")
        await reply_done(pilot, conv)
        assert conv.messages[-1].note == REPLAY_NOTE and pinned() == 1
        await send(pilot, "/clear")
        assert conv.messages == [] and ChatStore(home.chat_db).messages(conv.id) == []
        assert not list(app.chat_view(conv).query(MessageView))
        assert conv.system_prompt == "Be terse." and pinned() == 0

        await send(pilot, "/new Second")
        assert app.current.title == "Second" and len(app.conversations) == 2
        await send(pilot, "/rename")                   # without a title: a prompt
        box = app.screen.query_one("Input")
        box.value = "Third"
        await pilot.press("enter")
        assert app.current.title == "Third"
        await send(pilot, "/delete")                   # asks first
        await pilot.press("n")
        assert len(app.conversations) == 2
        await send(pilot, "/delete")
        await pilot.press("y")
        await pilot.pause()
        assert len(app.conversations) == 1 and app.current is conv
        assert [c.title for c in ChatStore(home.chat_db).list_conversations()] == ["Renamed chat"]

        await send(pilot, "/help")
        assert app.screen.id == "help"
        await pilot.press("escape")


@sync
async def test_command_palette_runs_the_same_actions(shared_engine, home):
    app = make_app(shared_engine, home)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"New conversation")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.conversations) == 2, 5, "a new conversation")


@sync
async def test_bench_fast_runs_in_the_app(shared_engine, home):
    app = make_app(shared_engine, home)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "/bench fast seqs=2 input=16 output=8")
        screen = app.screen
        assert isinstance(screen, BenchScreen)
        await wait_for(pilot, lambda: screen.report is not None, 60, "the bench")
        table = screen.query_one("#bench-results")
        assert table.row_count > 5
        assert screen.report["iterations"][0]["generated_tokens"] > 0
        await pilot.press("escape")
        assert not isinstance(app.screen, BenchScreen)


@sync
async def test_bench_cancel_with_escape(shared_engine, home, slow_steps):
    app = make_app(shared_engine, home)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "/bench fast seqs=2 input=16 output=200 max_model_len=256")
        screen = app.screen
        await wait_for(pilot, lambda: "tokens" in str(screen.query_one("#bench-status").render()), 30,
                       "bench progress")
        await pilot.press("escape")
        await wait_for(pilot, lambda: screen.report is not None or not screen.running, 30, "the cancel")
        assert screen.cancelled
        await pilot.press("escape")
        assert not isinstance(app.screen, BenchScreen)
        assert not app.engine_thread.call(lambda e: e.has_unfinished()).result(10)


# ---------------------------------------------------------------------------------- models
@sync
async def test_model_picker_switches_and_survives_a_broken_model(tiny_models, home):
    import shutil

    from nanochat.models.catalog import discover_models

    other = home.models_dir / "tiny-llama"
    shutil.copytree(tiny_models["llama"], other)
    broken = home.models_dir / "x.gguf"
    broken.write_bytes(b"\x00garbage bytes, not a model\xff" * 64)
    et = EngineThread(str(tiny_models["qwen3"]), **ENGINE)
    try:
        app = make_app(et, home, max_tokens=4,
                       discover=lambda: discover_models([home.models_dir], include_hub=False))
        async with app.run_test(size=SIZE) as pilot:
            conv = app.current
            await send(pilot, LONG_USER)
            await reply_done(pilot, conv)
            await send(pilot, "/model")
            picker = app.screen
            assert isinstance(picker, ModelPicker)
            table = picker.query_one("#picker-table")
            await wait_for(pilot, lambda: table.row_count >= 1, 10, "the model list")
            assert str(other) in [k.value for k in table.rows]

            picker.query_one("#picker-path").value = str(broken)
            picker.query_one("#picker-path").focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: not app.model_loading and not picker._loading, 30, "the failed load")
            await pilot.pause()
            assert app.screen is picker                                  # still open
            assert any("could not load" in m and "x.gguf" in m for m in notifications(app))
            assert et.model_name == str(tiny_models["qwen3"])             # previous model kept

            table.focus()
            table.move_cursor(row=table.get_row_index(str(other)))
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.screen is not picker, 30, "the model load")
            assert et.model_name == str(other) and app.generation == 1
            assert "tiny-llama" in str(app.query_one("#g-model").render())
            assert str(other) in Settings.load(home.settings_file).recent_models

            # the conversation goes on with the new model: its transcript is re-prefilled once
            await send(pilot, "continue with the new model")
            reply = await reply_done(pilot, conv)
            assert reply.note == REPLAY_NOTE and REPLAY_NOTE in footers(app)[-1]
            assert reply.stats["prompt_tokens"] > 40
    finally:
        et.shutdown()


@sync
async def test_conversations_persist_across_restart(shared_engine, home):
    app = make_app(shared_engine, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "remember this conversation")
        await reply_done(pilot, app.current)
        first_id = app.current.id
        await send(pilot, "/new")
        await send(pilot, "/rename Empty one")
    again = make_app(shared_engine, home, max_tokens=4)
    async with again.run_test(size=SIZE) as pilot:
        titles = {c.title for c in again.conversations.values()}
        assert titles == {"remember this conversation", "Empty one"}
        restored = again.conversations[first_id]
        assert [m.role for m in restored.messages] == ["user", "assistant"]
        assert restored.messages[1].stats["completion_tokens"] == 4
        await again.show_conversation(first_id)
        await pilot.pause()
        assert len(again.chat_view(restored).query(MessageView)) == 2
        await send(pilot, "and now continue")
        reply = await reply_done(pilot, restored)
        assert reply.note == REPLAY_NOTE and reply.stats["completion_tokens"] == 4


# ---------------------------------------------------------------------------------- helpers
def test_footer_format_and_code_blocks():
    stats = {"completion_tokens": 5, "ttft": 0.0123, "decode_tok_s": 42.04, "cached_tokens": 16,
             "prompt_tokens": 30, "finish_reason": "abort"}
    assert format_stats(stats, REPLAY_NOTE) == ("5 tok · TTFT 12 ms · 42.0 tok/s · cached 16/30 · cancelled · "
                                                + REPLAY_NOTE)
    text = "a\n```python\nprint(1)\n```\nb\n```\nunfinished"
    assert code_blocks(text) == ["print(1)", "unfinished"]
    assert asyncio.iscoroutinefunction(NanochatApp.send_message)
