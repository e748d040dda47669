"""The TUI while its model loads: a message sent meanwhile waits, shown in its chat, and goes out once the
model is ready (exactly once), or back to the input when the load fails; what makes the load slow (a
kernel compile) shows in the gauges and on the waiting message.

The load is held deterministically: LLMEngine's construction (in an in-process engine) waits for an event,
after announcing a kernel compile as build_library does."""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager

import pytest
from textual.widgets import Static

from nanochat.app.controller import EngineState
from nanochat.app.conversation import DEFAULT_TITLE
from nanochat.app.store import ChatStore
from nanochat.app.tui.chat_screen import WAITING
from nanochat.app.tui.screens import ModelPicker
from nanochat.app.tui.widgets import ChatInput, MessageView
from nanochat.engine.llm_engine import LLMEngine
from nanochat.engine.serve.client import EngineClient
from nanochat.kernels.cpp_build import COMPILING
from nanochat.kernels.notices import announce
from test_tui import SIZE, home, make_app, notifications, send, sync, wait_for  # noqa: F401 (home: a fixture)


@pytest.fixture
def held_load(monkeypatch):
    """Model loads announce a kernel compile, then wait until the event is set."""
    release = threading.Event()
    construct = LLMEngine.__init__

    def held(self, *args, **kwargs):
        announce(COMPILING)
        assert release.wait(60), "the test never released the load"
        construct(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", held)
    yield release
    release.set()


@asynccontextmanager
async def loading_app(home, model: str):
    """The app on an in-process engine, started on `model` (whose load held_load holds); its pilot."""
    client = EngineClient(in_process=True)
    try:
        app = make_app(client, home, model=model)
        async with app.run_test(size=SIZE) as pilot:
            yield app, pilot
    finally:
        client.shutdown()


def waiting_views(app) -> list[MessageView]:
    return [v for v in app.chat_screen.query(MessageView) if v.has_class("waiting")]


def footer(view: MessageView) -> str:
    return str(view.query_one(".footer", Static).render())


@sync
async def test_a_message_sent_while_the_model_loads_waits_and_goes_out_once(tiny_models, home, held_load):
    async with loading_app(home, str(tiny_models["qwen3"])) as (app, pilot):
        screen = app.chat_screen
        conv = screen.current
        box = screen.query_one(ChatInput)
        await send(pilot, "What is the capital of France?")   # at once: the load's worker may not run yet
        [view] = waiting_views(app)
        assert view.message.content == "What is the capital of France?" and footer(view).startswith(WAITING)
        assert box.text == "" and conv.path == [] and conv.title == DEFAULT_TITLE
        assert not screen.query_one(".placeholder").display

        # why it is slow, in the gauges and on the message
        await wait_for(pilot, lambda: COMPILING in str(app.query_one("#g-device").render()), 30, "the note")
        assert footer(view) == f"{WAITING}: {COMPILING}"

        # one message waits at a time; the second stays in the input, with a hint
        await send(pilot, "and of Italy?")
        assert box.text == "and of Italy?" and len(waiting_views(app)) == 1
        assert any("already waiting" in m for m in notifications(app))
        # slash commands work as they do
        await send(pilot, "/set temperature 0")
        assert conv.settings == {"temperature": 0}
        box.load_text("")

        held_load.set()
        await wait_for(pilot, lambda: len(conv.path) == 2 and not conv.generating, 60, "the reply")
        await pilot.pause()
        assert [m.role for m in conv.path] == ["user", "assistant"]
        assert conv.path[0].content == "What is the capital of France?"
        assert conv.path[1].stats.completion_tokens > 0
        assert waiting_views(app) == [] and conv.title == "What is the capital of France?"
        assert COMPILING not in str(app.query_one("#g-device").render())
        await pilot.pause(0.3)
        assert len(conv.path) == 2   # sent once
    assert [m.role for m in ChatStore(home.chat_db).messages(conv.id)] == ["user", "assistant"]


@sync
async def test_a_message_waiting_for_a_load_that_fails_goes_back_to_the_input(tmp_path, home, held_load):
    broken = tmp_path / "x.gguf"
    broken.write_bytes(b"\x00garbage bytes, not a model\xff" * 64)
    async with loading_app(home, str(broken)) as (app, pilot):
        screen = app.chat_screen
        conv = screen.current
        await send(pilot, "hello")
        assert len(waiting_views(app)) == 1
        held_load.set()
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker), 30, "the failed load")
        assert screen.query_one(ChatInput).text == "hello" and waiting_views(app) == []
        assert conv.path == [] and app.controller.engine_state is EngineState.NO_MODEL
        await pilot.pause()
        [why] = [m for m in notifications(app) if "not sent" in m]
        assert "it is back in the input" in why and "x.gguf" not in why   # the load's own line names it
        assert screen.query_one(".placeholder").display


@sync
async def test_escape_takes_a_waiting_message_back(tiny_models, home, held_load):
    async with loading_app(home, str(tiny_models["qwen3"])) as (app, pilot):
        screen = app.chat_screen
        conv = screen.current
        await send(pilot, "never mind")
        assert len(waiting_views(app)) == 1
        await pilot.press("escape")
        await pilot.pause()
        assert waiting_views(app) == [] and screen.query_one(ChatInput).text == "never mind"
        held_load.set()
        await wait_for(pilot, lambda: app.controller.engine_state is EngineState.READY, 60, "the load")
        await pilot.pause(0.2)
        assert conv.path == []   # nothing went out
