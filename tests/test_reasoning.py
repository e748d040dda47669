"""A reasoning model's thinking shown as thinking: the splitter, the store (schema v5 and its migration),
the controller (thinking tokens and time, /think's enable_thinking, exports, the history the model sees
again) and the TUI's collapsed "Thinking" block, on a scripted client whose replies are fixed pieces
of text streamed from a thread (a random tiny model never writes <think>)."""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3
import threading
import time

import pytest

from nanochat.app.controller import ChatController, describe_settings
from nanochat.app.conversation import ChatError
from nanochat.app.export import export_markdown, tree_json
from nanochat.app.paths import get_paths
from nanochat.app.reasoning import Thought, ThinkingSplitter, describe_thought, split_reasoning
from nanochat.app.store import SCHEMA_VERSION, ChatStore, migrate
from nanochat.app.tui.widgets import MessageView, ThinkingBlock
from nanochat.engine.output import RequestStats, TokenEvent
from nanochat.engine.serve.client import RequestStream
from nanochat.engine.serve.protocol import ModelInfo
from test_tui_snapshots import FrozenClient

THINKING_REPLY = ["<think>", "\n", "The user", " greets me", ".", "\n", "</think>", "\n\n", "Hello", "!"]


class ScriptedClient(FrozenClient):
    """A loaded model whose every reply is `pieces`, one token each, `delay` seconds apart, waiting for
    `resume` after the first `hold` of them; it records the template variables each turn was sent
    with. A cancel ends the reply at once."""

    def __init__(self, pieces=THINKING_REPLY, delay=0.0, switch=True, opened=frozenset(), hold=None):
        super().__init__()
        self.model = ModelInfo(model="scripted", arch="qwen3", device="cpu", dtype="float32", max_model_len=4096,
                               load_seconds=0.0, thinking_switch=switch, thinking_opened=opened)
        self.pieces, self.delay = list(pieces), delay
        self.variables: list[dict | None] = []
        self._cancelled: set[str] = set()
        self.hold, self.resume = hold, threading.Event()

    def submit_turn(self, session, user, sampling=None, on_event=None, template_kwargs=None):
        self.variables.append(template_kwargs)
        request_id = f"r{next(self._ids)}"
        stream = RequestStream(self, request_id, on_event, session)
        session.request_id, session.pending = request_id, [{"role": "user", "content": user}]

        def run():
            for i, piece in enumerate(self.pieces):
                if i == self.hold:
                    self.resume.wait()
                if request_id in self._cancelled:
                    break
                time.sleep(self.delay)
                stream._deliver(TokenEvent(request_id, i, piece))
            reason = "abort" if request_id in self._cancelled else "stop"
            n = len(stream.reply.token_ids)
            stream._deliver(TokenEvent(request_id, None, "", True, reason,
                                       RequestStats(prompt_tokens=10, completion_tokens=n, finish_reason=reason)))

        threading.Thread(target=run, daemon=True).start()
        return stream

    def cancel(self, request_id: str) -> None:
        self._cancelled.add(request_id)


def sync(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return wrapper


# ---------------------------------------------------------------------------------- the splitter
def test_a_qwen3_reply_splits_into_its_thinking_and_answer_streamed_a_token_at_a_time():
    splitter = ThinkingSplitter()
    seen = []
    for piece in THINKING_REPLY:
        splitter.feed(piece)
        seen.append((splitter.thinking, splitter.reasoning, splitter.answer))
    splitter.finish()
    assert seen[0] == (True, "", "") and seen[4] == (True, "The user greets me.", "")
    assert seen[6] == (False, "The user greets me.", "") and splitter.answer == "Hello!" and splitter.closed


@pytest.mark.parametrize("text, prompted, expected", [
    ("Just an answer <think>no</think>", False, (None, "Just an answer <think>no</think>", False)),
    ("  \n<think>\nplan\n</think>\n\nanswer", False, ("plan", "answer", True)),
    ("<think>\ncut off by the token li", False, ("cut off by the token li", "", False)),
    ("plan</think>\n\nanswer", True, ("plan", "answer", True)),      # the template opened the block
    ("<think>\n\n</think>\n\nanswer", False, ("", "answer", True)),   # an empty block
    ("<thin", False, (None, "<thin", False)),                         # not a tag after all
    ("  ", False, (None, "  ", False)),
])
def test_split_reasoning(text, prompted, expected):
    split = split_reasoning(text, prompted)
    assert (split.reasoning, split.answer, split.closed) == expected


def test_describe_thought():
    assert describe_thought(Thought("x", tokens=120, seconds=3.24)) == "Thought for 3.2 s · 120 tokens"
    assert describe_thought(Thought("x", tokens=1, seconds=0.5, closed=False), live=True) == "Thinking… 1 token · 0.5 s"
    assert describe_thought(Thought("x", tokens=9, seconds=2.0, closed=False)) == \
        "Thinking stopped before the answer · 2.0 s · 9 tokens"
    assert describe_thought(Thought("x")) == "Thought"


# ---------------------------------------------------------------------------------- the store
def v4_database(path) -> None:
    """A chat database as nanochat wrote it before thinking was kept apart (schema v4)."""
    conn = sqlite3.connect(path)
    from nanochat.app.store import MIGRATIONS

    for step in MIGRATIONS[:4]:
        step(conn)
    conn.execute("PRAGMA user_version = 4")
    conn.execute("INSERT INTO conversations (id, title, created, updated) VALUES (1, 'old', 0, 0)")
    rows = [(1, "user", "hi"), (2, "assistant", "<think>\nLet me see.\n</think>\n\nHello!"),
            (3, "assistant", "plan</think>\n\nprompted answer"), (4, "assistant", "<think>\nnever closed"),
            (5, "assistant", "No thinking; <think> later is text.")]
    for mid, role, content in rows:
        conn.execute("INSERT INTO messages (id, conversation_id, role, content, created, parent_id) "
                     "VALUES (?, 1, ?, ?, 0, ?)", (mid, role, content, 1 if mid > 1 else None))
    conn.commit()
    conn.close()


def test_a_v4_database_keeps_every_chat_and_its_replies_thinking_becomes_thinking(tmp_path):
    path = tmp_path / "chats.db"
    v4_database(path)
    store = ChatStore(path)
    messages = {m.id: m for m in store.load_conversation(1).messages}
    assert len(messages) == 5 and messages[1].content == "hi" and messages[1].thought is None
    assert (messages[2].content, messages[2].thought.text, messages[2].thought.closed) == ("Hello!", "Let me see.", True)
    assert (messages[3].content, messages[3].thought.text, messages[3].thought.prompted) == \
        ("prompted answer", "plan", True)
    assert (messages[4].content, messages[4].thought.text, messages[4].thought.closed) == ("", "never closed", False)
    assert messages[5].content == "No thinking; <think> later is text." and messages[5].thought is None
    store.close()
    assert migrate(sqlite3.connect(path)) == SCHEMA_VERSION   # already up to date


def test_a_reply_and_its_thought_round_trip_through_the_store(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    cid = store.create_conversation("c")
    thought = Thought("step 1\nstep 2", tokens=40, seconds=1.5, closed=True, prompted=False)
    mid = store.add_message(cid, "assistant", "answer", thought=thought)
    assert store.messages(cid)[0].thought == thought
    store.update_message(mid, "answer, longer", thought=None)
    assert store.messages(cid)[0].thought is None and store.messages(cid)[0].content == "answer, longer"
    store.close()


# ---------------------------------------------------------------------------------- the controller
@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    return get_paths().ensure()


def test_a_turn_keeps_its_thinking_apart_counts_it_and_the_model_sees_it_again(tmp_path):
    client = ScriptedClient(delay=0.01)
    store = ChatStore(tmp_path / "chats.db")
    controller = ChatController(client, store, sampling={"max_tokens": 50})
    conv = next(iter(controller.conversations.values()))
    turn = controller.wait(controller.send(conv, "hi"))
    reply = turn.reply
    assert reply.content == "Hello!" and reply.thought.text == "The user greets me."
    assert reply.thought.tokens == 7 and reply.thought.closed and 0 < reply.thought.seconds < 5
    assert client.variables == [None]                  # no /think: the template's own default
    # what the model wrote is what a rebuilt session holds (as a live one keeps its ids)
    assert reply.spoken == "<think>\nThe user greets me.\n</think>\n\nHello!"
    controller.set_thinking(conv, False)
    assert describe_settings(controller.sampling_for(conv), conv.settings).endswith("think off*")
    assert "think" not in controller.sampling_for(conv)   # a template variable, not sampling
    controller.wait(controller.send(conv, "again"))
    assert client.variables[-1] == {"enable_thinking": False}
    controller.close()
    store.close()
    # saved with its thinking; the setting too
    store = ChatStore(tmp_path / "chats.db")
    again = ChatController(client, store)
    loaded = again.conversations[conv.id]
    assert loaded.settings == {"think": False}
    assert loaded.path[1].content == "Hello!" and loaded.path[1].thought == reply.thought
    markdown = export_markdown(loaded)
    assert "<details><summary>Thought for" in markdown and "> The user greets me." in markdown
    assert markdown.index("> The user greets me.") < markdown.index("Hello!")
    node = tree_json(loaded)["messages"][0]["children"][0]
    assert node["content"] == "Hello!" and node["reasoning"] == "The user greets me."
    assert node["thought"]["tokens"] == 7 and node["thought"]["closed"] is True
    again.close()
    store.close()


def test_a_template_that_opens_the_block_and_a_reply_cut_off_while_thinking(tmp_path):
    client = ScriptedClient(pieces=["weighing", " options", " still"], opened=frozenset({None}))
    store = ChatStore(":memory:")
    controller = ChatController(client, store)
    conv = next(iter(controller.conversations.values()))
    turn = controller.wait(controller.send(conv, "hi"))
    thought = turn.reply.thought
    assert turn.reply.content == "" and thought.text == "weighing options still"
    assert thought.prompted and not thought.closed and thought.tokens == 3
    assert turn.reply.spoken == "weighing options still"   # the prompt holds its <think>
    controller.close()


# ---------------------------------------------------------------------------------- the TUI
def make_app(client, paths):
    from nanochat.app.settings import Settings
    from nanochat.app.tui.app import NanochatApp

    return NanochatApp(client=client, paths=paths, settings=Settings.load(paths.settings_file),
                       sampling={"max_tokens": 50})


async def wait_for(pilot, condition, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.02)


def title(view: MessageView) -> str:
    return str(view.query_one(".thinking-title").render())


@sync
async def test_the_thinking_streams_collapsed_then_says_how_long_it_took_and_opens_on_demand(home):
    client = ScriptedClient(delay=0.05, hold=5)   # it waits inside the thinking, after "The user greets me."
    app = make_app(client, home)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        await screen.send_message("hi")
        conv = screen.current
        await wait_for(pilot, lambda: conv.path[-1].generated_tokens == 5)
        await pilot.pause(0.2)
        view = screen.chat_view(conv).view_for(conv.path[-1])
        block = view.query_one(ThinkingBlock)
        assert block.display and title(view).startswith("▸ Thinking…")   # live, collapsed
        assert "The user" in str(view.query_one(".thinking-tail").render())
        assert not view.query_one(".thinking-text").display
        client.resume.set()
        await wait_for(pilot, lambda: not conv.generating)
        await pilot.pause()
        assert title(view).startswith("▸ Thought for ") and title(view).endswith("· 7 tokens")
        assert not view.query_one(".thinking-tail").display
        assert "Hello!" in view.body.source and "greets" not in view.body.source   # the answer alone
        view.focus()
        await pilot.press("t")                                           # a key opens it
        assert block.expanded and view.query_one(".thinking-text").display
        assert str(view.query_one(".thinking-text").render()) == "The user greets me."
        await pilot.press("enter")
        assert not block.expanded
        await pilot.click(ThinkingBlock, offset=(2, 0))                  # and a click
        assert block.expanded and title(view).startswith("▾ Thought for ")
        # a reply without thinking looks as it did: no block, and its keys do nothing
        user_view = screen.chat_view(conv).view_for(conv.path[0])
        assert not user_view.query(ThinkingBlock)


@sync
async def test_a_reply_cancelled_while_thinking_still_shows_its_thinking(home):
    client = ScriptedClient(pieces=["<think>", "hmm", " let", " me", " think", " more"] * 20, delay=0.05)
    app = make_app(client, home)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        await screen.send_message("hi")
        conv = screen.current
        await wait_for(pilot, lambda: conv.path[-1].generated_tokens >= 4)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not conv.generating)
        await pilot.pause()
        view = screen.chat_view(conv).view_for(conv.path[-1])
        assert view.query_one(ThinkingBlock).display
        assert title(view).startswith("▸ Thinking stopped before the answer")


@sync
async def test_think_switches_the_chat_and_says_when_the_template_has_no_switch(home):
    client = ScriptedClient(switch=False)
    app = make_app(client, home)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        await screen.commands.run("/think off")
        await pilot.pause()
        assert screen.current.settings == {"think": False}
        assert "no thinking switch" in [n.message for n in app._notifications][-1]
        await screen.commands.run("/think maybe")
        await pilot.pause()
        assert "expected on or off" in [n.message for n in app._notifications][-1]
        await screen.commands.run("/think -")
        assert screen.current.settings == {}
        store = ChatStore(home.chat_db)
        assert json.loads(store._conn.execute("SELECT settings FROM conversations WHERE id = ?",
                                              (screen.current.id,)).fetchone()[0]) == {}
        store.close()


# ---------------------------------------------------------------------------------- harmony (gpt-oss)
HARMONY_REPLY = ["<|channel|>", "analysis", "<|message|>", "The user", " greets me", ".", "<|end|>",
                 "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hello", "!"]


def harmony_client(efforts=("low", "medium", "high")) -> ScriptedClient:
    client = ScriptedClient(HARMONY_REPLY, delay=0.01, switch=False)
    client.model = ModelInfo(model="scripted", arch="gpt-oss", device="cpu", dtype="float32", max_model_len=4096,
                             load_seconds=0.0, harmony=True, reasoning_efforts=efforts)
    return client


def test_a_harmony_turn_shows_its_analysis_as_thinking_and_sets_reasoning_effort(tmp_path):
    client = harmony_client()
    store = ChatStore(tmp_path / "chats.db")
    controller = ChatController(client, store, sampling={"max_tokens": 50})
    conv = next(iter(controller.conversations.values()))
    reply = controller.wait(controller.send(conv, "hi")).reply
    assert reply.content == "Hello!" and reply.thought.text == "The user greets me."
    assert reply.thought.closed and reply.thought.tokens == 5 and reply.thought.harmony   # <|message|> to <|end|>
    assert reply.spoken == "Hello!"   # the template drops an answered turn's analysis
    controller.set_setting(conv, "reasoning_effort", "high")
    assert "reasoning_effort" not in controller.sampling_for(conv)   # a template variable, not sampling
    assert describe_settings(controller.sampling_for(conv), conv.settings).endswith("reasoning_effort high*")
    controller.wait(controller.send(conv, "again"))
    assert client.variables[-1] == {"reasoning_effort": "high"}
    with pytest.raises(ChatError, match="reasoning_effort must be low, medium or high, got 'extreme'"):
        controller.set_setting(conv, "reasoning_effort", "extreme")
    controller.close()
    store.close()
    store = ChatStore(tmp_path / "chats.db")   # saved per chat, with the thought's format
    again = ChatController(client, store)
    loaded = again.conversations[conv.id]
    assert loaded.settings == {"reasoning_effort": "high"} and loaded.path[1].thought == reply.thought
    again.close()
    store.close()


def test_reasoning_effort_is_refused_where_the_template_does_not_read_it(tmp_path):
    client = harmony_client(efforts=())
    store = ChatStore(tmp_path / "chats.db")
    controller = ChatController(client, store)
    conv = next(iter(controller.conversations.values()))
    with pytest.raises(ChatError, match="does not read reasoning_effort"):
        controller.set_setting(conv, "reasoning_effort", "low")
    assert conv.settings == {}
    controller.close()
    store.close()
