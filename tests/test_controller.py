"""The chat controller without Textual, on a REAL engine process running a tiny random model (CPU, fp32).

Random tiny models write gibberish: these tests check the plumbing (turns, stats, cancel, sessions,
model switch, engine death and recovery), not the text.

The engine process cannot be monkeypatched from here, so `step_delay` slows its steps from outside: a
sitecustomize module on the engine's PYTHONPATH wraps LLMEngine.step to sleep for the number of
seconds written in a file, read at every step (0 or no file: full speed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from nanochat.app.controller import SAVE_INTERVAL, ChatController, ChatObserver, EngineState, describe_settings
from nanochat.app.conversation import (INTERRUPTED_NOTE, REPLAY_NOTE, STOPPED_NOTE, UNANSWERED_NOTE, ChatError,
                                       Message, as_history, exchange_sizes, exchanges, exchanges_to_drop)
from nanochat.app.export import format_stats
from nanochat.app.store import ChatStore
from nanochat.engine.output import RequestStats
from nanochat.engine.serve.client import EngineClient
from nanochat.models.errors import ModelLoadError

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, num_kvcache_blocks=96)
SAMPLING = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
LONG_USER = "hello there, how are you today? tell me about the quick brown fox and the lazy dog"

SITECUSTOMIZE = textwrap.dedent('''\
    """Test hook (tests/test_controller.py): slow the engine's steps down by the seconds in a file."""
    import os as _os

    _FLAG = _os.environ.get("NANOCHAT_TEST_STEP_DELAY_FILE")
    if _FLAG:
        import time as _time

        import nanochat.engine.llm_engine as _llm_engine

        _step = _llm_engine.LLMEngine.step

        def _slow_step(self):
            try:
                with open(_FLAG) as f:
                    delay = float(f.read() or 0)
            except (OSError, ValueError):
                delay = 0.0
            if delay:
                _time.sleep(delay)
            return _step(self)

        _llm_engine.LLMEngine.step = _slow_step
''')


class StepDelay:
    """The delay file the engine process reads before every step."""

    def __init__(self, path):
        self.path = path
        self.set(0)

    def set(self, seconds: float) -> None:
        self.path.write_text(str(seconds))


def step_delay_hook(folder) -> tuple[StepDelay, dict[str, str]]:
    """The hook's files in `folder`, and the environment under which engine processes read the delay file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    delay = StepDelay(folder / "step_delay")
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return delay, {"PYTHONPATH": path, "NANOCHAT_TEST_STEP_DELAY_FILE": str(delay.path)}


def install_step_delay_hook(folder, monkeypatch) -> StepDelay:
    """Engine processes started from now on (the environment is inherited) read the delay file."""
    delay, env = step_delay_hook(folder)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return delay


def process_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(condition, timeout: float = 30.0, what: str = "condition", controller: ChatController | None = None):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
        if controller is not None:
            controller.drain()


class Recorder(ChatObserver):
    def __init__(self):
        self.calls: list[tuple] = []

    def reply_streamed(self, turn):
        self.calls.append(("streamed", turn))

    def turn_finished(self, turn):
        self.calls.append(("finished", turn))

    def engine_stats(self, stats):
        self.calls.append(("stats", stats))

    def engine_changed(self):
        self.calls.append(("changed",))

    def engine_stopped(self, reason):
        self.calls.append(("stopped", reason))

    def storage_changed(self, warning):
        self.calls.append(("storage", warning))

    def named(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


# ---------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def step_delay(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        yield install_step_delay_hook(tmp_path_factory.mktemp("engine-hook"), mp)


@pytest.fixture(scope="module")
def client(tiny_models, step_delay):
    """One engine process for the module (a test that kills it leaves a restarted one behind)."""
    c = EngineClient()
    c.load_model(str(tiny_models["qwen3"]), **ENGINE)
    yield c
    c.shutdown()


@pytest.fixture
def delay(step_delay):
    yield step_delay
    step_delay.set(0)


@pytest.fixture
def make(client, tmp_path):
    made: list[ChatController] = []

    def build(db="chats.db", observer=None, **sampling) -> ChatController:
        controller = ChatController(client, ChatStore(tmp_path / db), {**SAMPLING, **sampling},
                                    engine_config=ENGINE, observer=observer)
        made.append(controller)
        return controller

    yield build
    for controller in made:
        controller.close()
        controller.store.close()


def first(controller: ChatController):
    return next(iter(controller.conversations.values()))


# ---------------------------------------------------------------------------------- turns

def test_exchange_sizes_and_what_a_refused_prompt_drops():
    def exchange(end_prompt: int | None, completion: int, text: str = "x" * 30) -> list[Message]:
        stats = None if end_prompt is None else RequestStats(prompt_tokens=end_prompt, completion_tokens=completion)
        return [Message("user", text), Message("assistant", text, stats)]

    held = exchange(40, 20) + exchange(90, 30) + exchange(150, 10)     # ends at 60, 120, 160
    assert exchange_sizes(held) == [60, 60, 40]
    # a reply without stats, and one counted in a later session (after a trim: its end is below the one
    # before): both are estimated from their text, (30 + 30) // 3 + 8
    assert exchange_sizes(exchange(40, 20) + exchange(None, 0) + exchange(30, 10)) == [60, 28, 28]
    # 200 tokens refused in a 160-token context with 64-token replies (at most a quarter: 40 kept free):
    # 80 must go, the two oldest exchanges
    assert exchanges_to_drop(held, 200, 160, 64) == 2
    assert exchanges_to_drop(held, 160, 160, 1) == 1                  # refused: at least one goes
    with pytest.raises(ChatError, match="the message alone does not fit in the context"):
        exchanges_to_drop(held, 400, 160, 64)

def test_turns_stream_save_and_reuse_the_cache(make, client):
    recorder = Recorder()
    chat = make(observer=recorder, max_tokens=8)
    conv = first(chat)
    assert conv.title == "New chat" and conv.path == []
    turn = chat.send(conv, LONG_USER)
    assert conv.generating and turn.reply.streaming and conv.title.startswith("hello there")
    chat.wait(turn)
    reply = turn.reply
    assert not conv.generating and turn.kept and not reply.streaming and reply.content
    assert isinstance(reply.stats, RequestStats)
    assert (reply.stats.completion_tokens, reply.stats.cached_tokens, reply.stats.finish_reason) == (8, 0, "length")
    assert reply.generated_tokens == 8 and reply.note == ""
    assert recorder.named("streamed") and recorder.named("finished") == [("finished", turn)]
    assert conv.model == client.model.model

    second = chat.wait(chat.send(conv, "and a second question about the fox and the dog please"))
    stats = second.reply.stats
    assert stats.cached_tokens > 0 and stats.prefilled_tokens < stats.prompt_tokens
    assert chat.last_ttft() == pytest.approx(stats.ttft)
    stored = chat.store.load_conversation(conv.id)
    assert [m.role for m in stored.messages] == ["user", "assistant", "user", "assistant"]
    assert stored.messages[-1].stats == stats and stored.model == client.model.model
    assert f"cached {stats.cached_tokens}/{stats.prompt_tokens}" in format_stats(stats)


def test_two_conversations_share_the_engine(make, delay):
    delay.set(0.02)
    chat = make(max_tokens=40)
    a = first(chat)
    b = chat.new_conversation("second")
    assert list(chat.conversations) == [b.id, a.id]                   # newest first
    ta, tb = chat.send(a, LONG_USER), chat.send(b, "another question in another chat")
    peak = []

    def both_finished():
        peak.append(chat.client.stats().running)
        return ta.finished and tb.finished

    wait_until(both_finished, what="both replies", controller=chat)
    assert ta.reply.stats.completion_tokens == tb.reply.stats.completion_tokens == 40
    assert max(peak) == 2                                                # batched together


def test_cancel_keeps_the_partial_reply_and_frees_the_session(make, delay):
    delay.set(0.03)
    chat = make(max_tokens=200)
    conv = first(chat)
    turn = chat.send(conv, LONG_USER)
    wait_until(lambda: turn.reply.generated_tokens >= 2, what="the first tokens", controller=chat)
    assert chat.cancel(conv)
    chat.wait(turn)
    assert turn.finish_reason == "abort" and turn.kept and 2 <= turn.reply.stats.completion_tokens < 200
    assert not conv.session.busy and not chat.cancel(conv)              # the session is free again
    assert "cancelled" in format_stats(turn.reply.stats)
    delay.set(0)
    chat.sampling["max_tokens"] = 4
    nxt = chat.wait(chat.send(conv, "go on"))                            # continues after the partial reply
    assert nxt.reply.stats.finish_reason == "length" and nxt.reply.stats.cached_tokens > 0
    assert [m.role for m in chat.store.messages(conv.id)] == ["user", "assistant", "user", "assistant"]


def test_a_refused_request_forgets_the_turn(make):
    recorder = Recorder()
    chat = make(observer=recorder)
    conv = first(chat)
    turn = chat.wait(chat.send(conv, "fox " * 400))                   # more than the 256-token context
    assert not turn.kept and turn.finish_reason == "error" and "max_model_len" in turn.error
    assert not turn.interrupted and conv.path == [] and chat.store.messages(conv.id) == []
    assert recorder.named("finished") == [("finished", turn)]
    with pytest.raises(ChatError, match="bad sampling"):
        chat.sampling["top_p"] = 7
        chat.send(conv, "hi")


def test_system_prompt_and_clear_free_the_session(make, client):
    chat = make(max_tokens=4)
    conv = first(chat)
    chat.wait(chat.send(conv, LONG_USER))
    wait_until(lambda: client.stats().pinned_sessions == 1, what="the session's KV pinned")
    chat.set_system_prompt(conv, "Be terse.")
    assert conv.system_prompt == "Be terse." and conv.session is None
    assert chat.store.load_conversation(conv.id).system_prompt == "Be terse."
    wait_until(lambda: client.stats().pinned_sessions == 0, what="the session's KV freed")
    turn = chat.wait(chat.send(conv, "again"))
    assert turn.reply.note == REPLAY_NOTE                                # re-prefilled with the new prompt
    assert conv.session.system_prompt == "Be terse."
    with pytest.raises(ChatError, match="system prompt"):
        busy = chat.send(conv, "one more")
        chat.set_system_prompt(conv, "no")
    chat.wait(busy)
    chat.clear(conv)
    assert conv.path == [] and chat.store.messages(conv.id) == [] and conv.session is None
    assert conv.system_prompt == "Be terse."
    wait_until(lambda: client.stats().pinned_sessions == 0, what="the KV freed by /clear")


def test_rename_delete_export(make, tmp_path):
    chat = make(max_tokens=3)
    conv = first(chat)
    chat.wait(chat.send(conv, "Show me code"))
    assert chat.rename(conv, "  Renamed   chat ") and conv.title == "Renamed chat"
    assert not chat.rename(conv, "   ")
    path = chat.export(conv, tmp_path / "exports")
    text = path.read_text()
    assert "# Renamed chat" in text and "Show me code" in text and re.search(r"cached \d+/\d+", text)
    other = chat.new_conversation()
    chat.delete(conv)
    assert list(chat.conversations) == [other.id]
    chat.delete(other)                                                   # the last one: a new empty one
    [fresh] = chat.conversations.values()
    assert fresh.title == "New chat" and [c.id for c in chat.store.list_conversations()] == [fresh.id]


def test_close_saves_the_partial_reply_as_cancelled(make, delay, tmp_path):
    delay.set(0.03)
    chat = make(db="close.db", max_tokens=200)
    conv = first(chat)
    turn = chat.send(conv, LONG_USER)
    wait_until(lambda: turn.reply.generated_tokens >= 2, what="the first tokens", controller=chat)
    chat.close()
    [user, reply] = chat.store.messages(conv.id)
    assert reply.role == "assistant" and reply.content.startswith(turn.reply.content)
    assert reply.stats.finish_reason == "abort" and reply.stats.completion_tokens >= 2
    assert conv.session is None


def test_a_streaming_reply_is_saved_before_it_ends(make, delay, tmp_path):
    delay.set(0.03)
    chat = make(db="stream.db", max_tokens=200)
    conv = first(chat)
    turn = chat.send(conv, LONG_USER)
    outside = ChatStore(tmp_path / "stream.db")      # what a restart after a kill -9 would read
    saved_text = lambda: outside.messages(conv.id)[1].content if len(outside.messages(conv.id)) == 2 else ""  # noqa: E731
    wait_until(saved_text, 10 + SAVE_INTERVAL, "the first save with text", chat)
    [_, saved] = outside.messages(conv.id)
    assert saved.partial and saved.content and turn.reply.content.startswith(saved.content)
    first_save = saved.content
    wait_until(lambda: outside.messages(conv.id)[1].content != first_save, 10 + SAVE_INTERVAL, "a later save", chat)
    assert outside.messages(conv.id)[1].content.startswith(first_save)
    chat.cancel(conv)
    chat.wait(turn)
    [_, final] = outside.messages(conv.id)
    assert not final.partial and final.content == turn.reply.content and final.stats.finish_reason == "abort"
    outside.close()


def test_the_app_killed_mid_reply_keeps_the_reply_and_retry_regenerates_it(tiny_models, make, delay, tmp_path):
    """kill -9 of the front end mid-reply: a restart shows the reply up to its last save, marked, and
    regenerating gives it a new version beside it."""
    delay.set(0.03)
    db = tmp_path / "killed.db"
    script = textwrap.dedent(f"""
        import time
        from nanochat.app.controller import ChatController
        from nanochat.app.store import ChatStore
        from nanochat.engine.serve.client import EngineClient
        client = EngineClient()
        client.load_model({str(tiny_models["qwen3"])!r}, **{ENGINE!r})
        chat = ChatController(client, ChatStore({str(db)!r}), {{**{SAMPLING!r}, "max_tokens": 400}})
        conv = next(iter(chat.conversations.values()))
        turn = chat.send(conv, {LONG_USER!r})
        while True:
            chat.drain()
            saved = chat.store.messages(conv.id)
            if len(saved) == 2 and saved[1].content:
                print("saved", flush=True)
            time.sleep(0.05)
    """)
    app = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert app.stdout.readline().strip() == "saved", app.stderr.read()
    finally:
        app.kill()
        app.wait(10)
    chat = make(db="killed.db")
    conv = first(chat)
    user, reply = conv.path
    assert (user.content, user.note) == (LONG_USER, "")
    assert reply.content and reply.note == STOPPED_NOTE
    assert as_history(exchanges(conv.path)) == [{"role": "user", "content": LONG_USER},
                                                    {"role": "assistant", "content": reply.content}]
    turn = chat.wait(chat.regenerate(conv))
    assert turn.kept and turn.user is user and conv.path == [user, turn.reply]
    assert conv.siblings(turn.reply) == [reply, turn.reply]               # the old version stays
    stored = chat.store.messages(conv.id)
    assert [(m.role, m.partial, m.parent_id) for m in stored] == [("user", False, None), ("assistant", True, user.id),
                                                                  ("assistant", False, user.id)]
    assert stored[2].content == turn.reply.content


def test_an_unanswered_message_is_marked_and_can_be_sent_again(make, tmp_path):
    store = ChatStore(tmp_path / "unanswered.db")
    cid = store.create_conversation("c")
    one = store.add_message(cid, "user", "one")
    reply = store.add_message(cid, "assistant", "reply one", parent_id=one)
    store.add_message(cid, "user", "two", parent_id=reply)   # the app stopped before the first token
    store.close()
    chat = make(db="unanswered.db")
    conv = first(chat)
    assert [m.note for m in conv.path] == ["", "", UNANSWERED_NOTE]
    with pytest.raises(ChatError):
        chat.regenerate(chat.new_conversation())   # nothing to answer
    turn = chat.wait(chat.regenerate(conv))
    assert turn.kept and turn.fold.stats.cached_tokens < 16   # a new session: the history is replayed
    assert turn.reply.note == REPLAY_NOTE and turn.user.note == ""
    assert [m.content for m in chat.store.messages(conv.id)] == ["one", "reply one", "two", turn.reply.content]


def test_retry_reuses_the_cached_prefix(make):
    chat = make(db="retry.db")
    conv = first(chat)
    chat.wait(chat.send(conv, LONG_USER))
    second = chat.wait(chat.send(conv, "and then?"))
    again = chat.wait(chat.regenerate(conv))
    # The branch's session is the first exchange's exact ids, so the retry's prompt is the second turn's,
    # every full block of which the prefix cache holds.
    assert again.fold.stats.prompt_tokens == second.fold.stats.prompt_tokens
    assert again.fold.stats.cached_tokens > second.fold.stats.cached_tokens
    assert again.fold.stats.prompt_tokens - again.fold.stats.cached_tokens < 16
    assert not again.stream.replayed
    assert again.reply.content == second.reply.content   # greedy: the same reply
    assert [m.content for m in chat.store.messages(conv.id)][2:] == ["and then?", second.reply.content,
                                                                     again.reply.content]
    assert conv.path[-1] is again.reply and conv.siblings(again.reply) == [second.reply, again.reply]


# ---------------------------------------------------------------------------------- models
def test_model_switch_replays_the_history(tiny_models, tmp_path):
    """A model switch on an in-process engine: the next turn re-prefills the transcript once."""
    client = EngineClient(in_process=True)
    recorder = Recorder()
    chat = ChatController(client, ChatStore(tmp_path / "switch.db"), SAMPLING, engine_config=ENGINE,
                          observer=recorder)
    try:
        assert chat.engine_state is EngineState.NO_MODEL
        with pytest.raises(ChatError, match="no model"):
            chat.send(first(chat), "hi")
        chat.load_model(str(tiny_models["qwen3"]))
        chat.drain()
        assert chat.engine_state is EngineState.READY and len(recorder.named("changed")) == 1
        conv = first(chat)
        chat.wait(chat.send(conv, LONG_USER))
        with pytest.raises(ModelLoadError, match="no such file"):
            chat.load_model(str(tmp_path / "missing.gguf"))
        assert chat.model.model == str(tiny_models["qwen3"])              # the previous model stays
        chat.load_model(str(tiny_models["llama"]))
        assert chat.model.arch == "llama"
        turn = chat.wait(chat.send(conv, "continue with the new model"))
        assert turn.reply.note == REPLAY_NOTE and turn.reply.stats.prompt_tokens > 30
        assert turn.reply.stats.cached_tokens == 0 and conv.model == str(tiny_models["llama"])
        again = chat.wait(chat.send(conv, "and once more"))
        assert again.reply.note == "" and again.reply.stats.cached_tokens > 0
    finally:
        chat.close()
        chat.store.close()
        client.shutdown()


def test_a_chat_template_file_stays_with_the_model_it_was_given_for(tiny_models, tmp_path):
    """--chat-template (the controller's engine_config) renders the first model's prompts; a model switched to
    renders with its own template, and the first one, loaded again, with the file's."""
    from nanochat.models.formats.loader import load

    template = tmp_path / "marks.jinja"
    template.write_text("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    qwen3, llama = str(tiny_models["qwen3"]), str(tiny_models["llama"])
    marked = len(load(qwen3).tokenizer.encode("<<user>>hello there<<assistant>>", add_special_tokens=False))
    client = EngineClient(in_process=True)
    chat = ChatController(client, ChatStore(tmp_path / "template.db"), SAMPLING,
                          engine_config={**ENGINE, "chat_template": str(template)})
    try:
        prompts = []
        for model in (qwen3, llama, qwen3):
            chat.load_model(model)
            chat.drain()
            prompts.append(chat.wait(chat.send(chat.new_conversation(), "hello there")).reply.stats.prompt_tokens)
        assert prompts[0] == prompts[2] == marked and prompts[1] != marked
    finally:
        chat.close()
        chat.store.close()
        client.shutdown()


# ---------------------------------------------------------------------------------- engine death
def test_engine_death_mid_reply_keeps_the_partial_reply_and_recovers(make, client, delay, tmp_path):
    recorder = Recorder()
    chat = make(db="death.db", observer=recorder, max_tokens=5)
    conv = first(chat)
    chat.wait(chat.send(conv, LONG_USER))                               # one complete exchange first
    chat.sampling["max_tokens"] = 150
    delay.set(0.03)
    turn = chat.send(conv, "tell me a long story")
    wait_until(lambda: turn.reply.generated_tokens >= 3, what="the first tokens", controller=chat)
    pid = client.pid
    client.kill()
    chat.wait(turn)
    assert turn.interrupted and turn.kept and turn.finish_reason == "error"
    assert "SIGKILL" in turn.error
    assert turn.reply.note == INTERRUPTED_NOTE
    assert format_stats(turn.reply.stats, turn.reply.note).endswith("tok · interrupted: engine stopped")
    [(_, reason)] = recorder.named("stopped")
    assert reason == "the engine process was killed by SIGKILL (out of memory?)"
    assert chat.engine_state is EngineState.STOPPED
    wait_until(lambda: process_gone(pid), 10, "the killed engine process")

    # every message is kept: the partial reply with its note, after the user message
    stored = chat.store.messages(conv.id)
    assert [(m.role, m.note) for m in stored] == [("user", ""), ("assistant", ""), ("user", ""),
                                                 ("assistant", INTERRUPTED_NOTE)]
    assert stored[-1].content == turn.reply.content and stored[-1].stats.completion_tokens >= 3

    # the next message restarts the engine, and the conversation re-prefills from its history
    delay.set(0)
    chat.restart_engine()
    chat.drain()
    assert chat.engine_state is EngineState.READY and client.pid != pid
    chat.sampling["max_tokens"] = 5
    nxt = chat.wait(chat.send(conv, "are you back?"))
    assert nxt.kept and nxt.reply.note == REPLAY_NOTE and nxt.reply.stats.finish_reason == "length"
    assert nxt.reply.stats.cached_tokens == 0 and nxt.reply.stats.prompt_tokens > 40
    assert conv.session.history[-2:] == [{"role": "user", "content": "are you back?"},
                                         {"role": "assistant", "content": nxt.reply.content}]

    # after an app restart the interrupted reply is there, between its user messages
    reopened = ChatController(client, ChatStore(tmp_path / "death.db"), SAMPLING)
    try:
        messages = reopened.conversations[conv.id].path
        assert [m.role for m in messages] == ["user", "assistant"] * 3
        assert messages[3].note == INTERRUPTED_NOTE and messages[3].content == turn.reply.content
        assert as_history(exchanges(messages))[3] == {"role": "assistant", "content": turn.reply.content}
    finally:
        reopened.close()
        reopened.store.close()


def test_engine_death_before_the_first_token_gives_the_turn_back(make, client, delay):
    recorder = Recorder()
    chat = make(db="early.db", observer=recorder)
    conv = first(chat)
    delay.set(2.0)                                                      # the first step sleeps: no token yet
    turn = chat.send(conv, LONG_USER)
    time.sleep(0.2)
    client.kill()
    chat.wait(turn)
    delay.set(0)
    assert turn.interrupted and not turn.kept
    assert conv.path == [] and chat.store.messages(conv.id) == []   # the text goes back to the user
    assert len(recorder.named("stopped")) == 1
    chat.restart_engine()
    assert chat.wait(chat.send(conv, LONG_USER)).kept


def test_the_engine_exits_when_its_front_end_vanishes(tiny_models):
    """A front end that dies without a shutdown (kill -9 of the app) leaves no engine process behind."""
    script = textwrap.dedent(f"""
        import os, sys
        from nanochat.engine.serve.client import EngineClient
        client = EngineClient()
        client.load_model({str(tiny_models["qwen3"])!r}, **{ENGINE!r})
        print(client.pid, flush=True)
        os._exit(0)    # no shutdown: the engine only sees its end of the connection close
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.strip())
    wait_until(lambda: process_gone(pid), 15, "the orphaned engine process to exit")


# ---------------------------------------------------------------------------------- the tree
BLOCK = 16   # the engine's default KV block size


def four_turns(chat, conv):
    return [chat.wait(chat.send(conv, text)) for text in (LONG_USER, "and then?", "why so?", "tell me more")]


def test_edit_makes_a_branch_and_moving_between_branches_reuses_their_kv(make, tmp_path):
    """Edit the first message of a 4-turn chat, move back and forth between the two branches: each move
    finds the branch's KV (the shared prefix, or the whole branch) cached, and the tree survives a restart."""
    chat = make(db="tree.db")
    conv = first(chat)
    turns = four_turns(chat, conv)
    old_path = list(conv.path)
    first_user = conv.path[0]
    with pytest.raises(ChatError, match="own messages"):
        chat.edit(conv, conv.path[1], "not mine")
    edited = chat.wait(chat.edit(conv, first_user, LONG_USER + " (edited)"))
    assert conv.path == [edited.user, edited.reply] and conv.siblings(edited.user) == [first_user, edited.user]
    # only the system/template head before the first message is shared: its whole blocks are cached
    assert edited.reply.stats.cached_tokens < turns[0].reply.stats.prompt_tokens
    # back to the first branch: the newest leaf under it is shown, its session is still resident
    assert chat.switch(conv, edited.user, -1) is first_user and conv.path == old_path
    assert chat.switch(conv, first_user, -1) is None                      # no version before the first
    nxt = chat.wait(chat.send(conv, "back on the first branch"))
    held = turns[-1].reply.stats.prompt_tokens + turns[-1].reply.stats.completion_tokens
    assert nxt.reply.stats.cached_tokens >= held - BLOCK and not nxt.stream.replayed
    # and to the second: its session too
    assert chat.switch(conv, first_user, 1) is edited.user and conv.path == [edited.user, edited.reply]
    again = chat.wait(chat.send(conv, "on the edited branch"))
    held = edited.reply.stats.prompt_tokens + edited.reply.stats.completion_tokens
    assert again.reply.stats.cached_tokens >= held - BLOCK
    # the store keeps the tree: a restart shows the same path, the same versions
    shown = [m.content for m in conv.path]
    reopened = ChatController(chat.client, ChatStore(tmp_path / "tree.db"), SAMPLING)
    try:
        conv2 = reopened.conversations[conv.id]
        assert [m.content for m in conv2.path] == shown
        assert [m.content for m in conv2.roots] == [first_user.content, edited.user.content]
        assert len(conv2.roots[0].children[0].children) == 1
        assert reopened.switch(conv2, conv2.roots[1], -1) is conv2.roots[0]
        assert [m.content for m in conv2.path] == [m.content for m in old_path] + [
            "back on the first branch", nxt.reply.content]
    finally:
        reopened.close()
        reopened.store.close()


def test_a_branch_from_an_evicted_session_still_finds_the_shared_prefix(make):
    """More branches than sessions kept: an old branch's session is closed, yet moving back to it and
    sending prefills only what the prefix cache no longer holds."""
    chat = make(db="many.db")
    conv = first(chat)
    base = chat.wait(chat.send(conv, LONG_USER))
    second = chat.wait(chat.send(conv, "and then?"))
    for k in range(5):   # five more versions of the second message: more than MAX_BRANCH_SESSIONS
        chat.wait(chat.edit(conv, conv.path[2], f"variant {k}"))
    assert len(conv.sessions) <= 4
    first_version = conv.siblings(conv.path[2])[0]
    while conv.path[2] is not first_version:
        chat.switch(conv, conv.path[2], -1)
    turn = chat.wait(chat.send(conv, "continue"))
    # its own session was closed, but the first exchange's blocks are shared by every branch
    assert turn.reply.stats.cached_tokens >= base.reply.stats.prompt_tokens - BLOCK
    assert not turn.stream.replayed or turn.reply.stats.cached_tokens > 0
    assert second.reply in conv.path


def test_fork_copies_the_branch_and_shares_its_kv(make):
    chat = make(db="fork.db")
    conv = first(chat)
    turns = [chat.wait(chat.send(conv, t)) for t in (LONG_USER, "and then?")]
    other = chat.fork(conv, conv.path[1])                            # after the first reply
    assert other.title.endswith("(fork)") and [m.content for m in other.path] == [
        LONG_USER, turns[0].reply.content]
    assert chat.store.load_conversation(other.id).leaf_id == other.path[-1].id
    turn = chat.wait(chat.send(other, "a different second question"))
    held = turns[0].reply.stats.prompt_tokens + turns[0].reply.stats.completion_tokens
    assert turn.reply.stats.cached_tokens >= held - BLOCK and not turn.stream.replayed
    assert len(conv.path) == 4                                       # the original is untouched


def test_per_chat_settings_are_validated_saved_and_win(make, tmp_path, monkeypatch):
    chat = make(db="settings.db")
    conv = first(chat)
    monkeypatch.setattr(chat.client.model, "sampling_defaults", {"temperature": 0.6, "top_k": 20})   # the file's
    assert chat.sampling_for(conv)["top_k"] == 20 and chat.sampling_for(conv)["temperature"] == 0
    chat.set_setting(conv, "top_k", 5)
    chat.set_setting(conv, "max_tokens", 3)
    assert chat.sampling_for(conv)["top_k"] == 5
    assert describe_settings(chat.sampling_for(conv), conv.settings) == \
        "temperature 0 · top_p 0.95 · top_k 5* · max_tokens 3*"
    for name, value, why in [("top_p", 7.0, "top_p"), ("temperature", -1.0, "temperature"),
                             ("max_tokens", 0, "max_tokens"), ("colour", 1, "unknown setting")]:
        with pytest.raises(ChatError, match=why):
            chat.set_setting(conv, name, value)
    turn = chat.wait(chat.send(conv, "hello"))
    assert turn.reply.stats.completion_tokens == 3
    chat.set_setting(conv, "top_k", None)
    assert conv.settings == {"max_tokens": 3}
    reopened = ChatController(chat.client, ChatStore(tmp_path / "settings.db"), SAMPLING)
    try:
        assert reopened.conversations[conv.id].settings == {"max_tokens": 3}
    finally:
        reopened.close()
        reopened.store.close()


def test_a_chat_may_hold_its_replies_to_a_schema_or_a_grammar(make, tmp_path, monkeypatch):
    """/set json_schema and /set grammar (object, @FILE or the text, as --json-schema and --grammar take them):
    the chat's next replies follow it, it is saved with the chat, and a summary (prose) is not held to it."""
    import json

    from nanochat.app.controller import setting_value

    chat = make(db="held.db", ignore_eos=False, max_tokens=40)
    conv = first(chat)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    chat.set_setting(conv, "json_schema", setting_value("json_schema", f"@{schema}"))
    assert "json_schema (" in describe_settings(chat.sampling_for(conv), conv.settings)
    turn = chat.wait(chat.send(conv, "is it ok?"))
    assert json.loads(turn.reply.content) in ({"ok": True}, {"ok": False})
    with pytest.raises(ChatError, match="json_schema and grammar cannot both hold a reply"):
        chat.set_setting(conv, "grammar", setting_value("grammar", 'root ::= "yes" | "no"'))
    chat.set_setting(conv, "json_schema", setting_value("json_schema", "object"))
    assert "json_schema object*" in describe_settings(chat.sampling_for(conv), conv.settings)
    chat.set_setting(conv, "json_schema", None)
    grammar = tmp_path / "yes.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    chat.set_setting(conv, "grammar", setting_value("grammar", f"@{grammar}"))
    assert "grammar (2 lines)*" in describe_settings(chat.sampling_for(conv), conv.settings)
    assert chat.wait(chat.send(conv, "yes or no?")).reply.content in ("yes", "no")
    with pytest.raises(ChatError, match="grammar cannot be followed: .*undefined_rule"):   # the engine's check
        chat.set_setting(conv, "grammar", setting_value("grammar", "root ::= undefined_rule"))
    assert conv.settings["grammar"] == grammar.read_text()   # the one set before stays
    for name, raw, why in [("json_schema", "{not json", "json_schema is not valid JSON"),
                           ("json_schema", "@/no/such.json", "cannot read"), ("grammar", " ", "grammar must be")]:
        with pytest.raises(ValueError, match=why):
            setting_value(name, raw)
    sent = []
    real = chat.client.submit_turn
    monkeypatch.setattr(chat.client, "submit_turn", lambda session, text, sp, **kw: (sent.append(sp),
                                                                                      real(session, text, sp, **kw))[1])
    try:
        chat.summarize(conv)
    except ChatError:   # a random model may write no summary; what it was asked with is the point
        pass
    assert sent[-1].grammar is None and sent[-1].json_schema is None
    reopened = ChatController(chat.client, ChatStore(tmp_path / "held.db"), SAMPLING)
    try:
        assert reopened.sampling_for(reopened.conversations[conv.id])["grammar"] == grammar.read_text()
    finally:
        reopened.close()
        reopened.store.close()


def test_export_json_keeps_every_branch(make, tmp_path):
    import json

    chat = make(db="export.db")
    conv = first(chat)
    chat.wait(chat.send(conv, "one"))
    chat.wait(chat.regenerate(conv))
    data = json.loads(chat.export(conv, tmp_path / "out", tree=True).read_text())
    [root] = data["messages"]
    assert root["content"] == "one" and [c["shown"] for c in root["children"]] == [False, True]
    markdown = chat.export(conv, tmp_path / "out").read_text()
    assert markdown.count("## Assistant") == 1 and conv.path[-1].content in markdown


# ---------------------------------------------------------------------------------- storage faults
def test_a_storage_fault_mid_reply_keeps_the_turn_and_saves_it_later(make, delay, monkeypatch):
    """A full disk mid-reply (injected: the store's writes raise what SQLite raises then): the reply
    streams on and ends, the observer hears it once, a next message still goes (its id given before its
    row exists), and once writing works again drain() saves both turns, the tree intact."""
    import sqlite3

    import nanochat.app.store as store_module
    from test_store import Faults

    delay.set(0.03)
    recorder = Recorder()
    chat = make(db="full.db", observer=recorder, max_tokens=30)
    faults = Faults(chat.store, monkeypatch)
    conv = first(chat)
    turn = chat.send(conv, LONG_USER)
    wait_until(lambda: len(chat.store.messages(conv.id)) == 2, 10, "the reply's first save", chat)
    faults.error = sqlite3.OperationalError("database or disk is full")
    chat.wait(turn)
    assert turn.kept and turn.reply.stats.completion_tokens == 30 and conv.path == [turn.user, turn.reply]
    [(_, warning)] = recorder.named("storage")
    assert warning.startswith(f"cannot save chats to {chat.store.path} (database or disk is full)")
    [_, saved] = chat.store.messages(conv.id)
    assert saved.partial and turn.reply.content.startswith(saved.content)
    delay.set(0)
    nxt = chat.wait(chat.send(conv, "and a second question"))       # sent while nothing can be written
    assert nxt.kept and nxt.user.parent is turn.reply and len(chat.store.messages(conv.id)) == 2
    chat.drain()
    assert len(recorder.named("storage")) == 1                       # said once, not at every try
    faults.error = None
    monkeypatch.setattr(store_module, "RETRY_SECONDS", 0.0)
    chat.drain()                                                     # drain gives the store its chance
    assert recorder.named("storage")[-1] == ("storage", None)
    stored = chat.store.load_conversation(conv.id)
    assert [(m.id, m.parent_id, m.content, m.partial) for m in stored.messages] == [
        (m.id, m.parent.id if m.parent else None, m.content, False) for m in conv.path]
    assert stored.leaf_id == nxt.reply.id and stored.messages[1].stats == turn.reply.stats


def test_closing_while_nothing_can_be_saved_names_what_is_lost(client, tmp_path, monkeypatch, capsys):
    """Without a front end to show it, the warning goes to stderr; at close, what is still not saved is
    named (the front end says it), and nothing raises."""
    from test_store import Faults

    store = ChatStore(tmp_path / "lost.db")
    chat = ChatController(client, store, SAMPLING, engine_config=ENGINE)
    Faults(store, monkeypatch).error = OSError(5, "Input/output error")
    conv = first(chat)
    turn = chat.wait(chat.send(conv, "a question that is never saved"))
    assert turn.kept
    assert capsys.readouterr().err.startswith(f"nanochat: warning: cannot save chats to {store.path} "
                                              "(input/output error)")
    chat.close()
    lost = store.close()
    assert lost.startswith(f"could not save to {store.path} (input/output error); not saved: your message “a "
                           "question that is never saved”, the reply “")
    assert capsys.readouterr().err == ""                               # close() leaves the telling to its owner


# ---------------------------------------------------------------------------------- export
def test_export_to_a_path_and_its_one_line_errors(tmp_path, monkeypatch):
    """write_export's targets: the exports folder, a file (~ expanded, relative to the working folder), a
    folder for the default name; and what cannot be written, in one line that names the path."""
    import json

    from nanochat.app.conversation import Conversation, Message
    from nanochat.app.export import write_export

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    conv = Conversation(7, "Capital question")
    question = Message("user", "What is the capital of France?")
    conv.attach(question, None)
    conv.attach(Message("assistant", "Paris."), question)
    conv.show(question.children[0])

    default = write_export(conv, tmp_path / "exports")
    assert default.parent == tmp_path / "exports" and default.name.startswith("capital-question-7-")
    assert default.suffix == ".md" and "Paris." in default.read_text()
    assert write_export(conv, tmp_path / "exports", target="~/notes.md") == home / "notes.md"
    data = json.loads(write_export(conv, tmp_path / "exports", tree=True, target="tree.json").read_text())
    assert (cwd / "tree.json").exists() and data["messages"][0]["children"][0]["content"] == "Paris."
    in_home = write_export(conv, tmp_path / "exports", target="~")
    assert in_home.parent == home and in_home.name.startswith("capital-question-7-")
    made = write_export(conv, tmp_path / "exports", tree=True, target="new/folder/")
    assert made.parent == cwd / "new" / "folder" and made.suffix == ".json"

    (tmp_path / "file").write_text("")
    errors = {
        "": f"exports folder {tmp_path / 'file'} is a file",
        "~/notes.md": f"{home / 'notes.md'} already exists; /export does not overwrite a file",
        "~/notes.md/x.md": f"folder {home / 'notes.md'} is a file",
        "~/notes.md/sub/x.md": f"{home / 'notes.md'} is a file, not a folder",
        "a\x00b": "cannot write 'a\\x00b': embedded null byte",
        "x" * 300: f"cannot write {cwd / ('x' * 300)}: file name too long",
    }
    for target, message in errors.items():
        with pytest.raises(ChatError) as e:
            write_export(conv, tmp_path / "file", target=target)
        assert str(e.value) == message
    assert (home / "notes.md").read_text().startswith("# Capital question")   # not overwritten
    if os.path.isdir("/sys/kernel"):   # sysfs: no new files, even for root
        with pytest.raises(ChatError, match="^cannot write /sys/x.md: (permission denied|read-only file system)$"):
            write_export(conv, tmp_path / "exports", target="/sys/x.md")


def test_set_speculative_reaches_the_next_turn_is_saved_per_chat_and_checked(tiny_models, tmp_path, monkeypatch):
    """/set speculative: a SamplingParams field of the chat's next turns, saved with the chat; the engine speculates
    (ngram, as started) unless the chat turns it off; a draft without a draft model is refused at /set. A fresh
    engine: one whose step costs were measured under other tests' slowed steps may judge speculation not to pay."""
    client = EngineClient()
    client.load_model(str(tiny_models["qwen3"]), **ENGINE, speculative="ngram")
    chat = ChatController(client, ChatStore(tmp_path / "spec.db"), {**SAMPLING, "max_tokens": 24})
    try:
        _set_speculative(chat, tmp_path, monkeypatch)
    finally:
        chat.close()
        chat.store.close()
        client.shutdown()


def _set_speculative(chat, tmp_path, monkeypatch):
    conv = first(chat)
    assert chat.client.model.speculative == "ngram"
    sent = []
    real = chat.client.submit_turn
    monkeypatch.setattr(chat.client, "submit_turn", lambda session, text, sp, **kw: (sent.append(sp),
                                                                                      real(session, text, sp, **kw))[1])
    repeat = "Repeat exactly: 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9"
    default = chat.wait(chat.send(conv, repeat))
    assert sent[-1].speculative is None and default.reply.stats.spec_proposed > 0
    assert default.reply.stats.spec_accepted <= default.reply.stats.spec_proposed
    chat.set_setting(conv, "speculative", "off")
    assert "speculative off*" in describe_settings(chat.sampling_for(conv), conv.settings)
    off = chat.wait(chat.send(conv, repeat))
    assert sent[-1].speculative == "off" and off.reply.stats.spec_proposed == 0
    with pytest.raises(ChatError, match="draft model"):
        chat.set_setting(conv, "speculative", "draft")
    with pytest.raises(ChatError, match="speculative must be off, ngram or draft"):
        chat.set_setting(conv, "speculative", "fast")
    assert conv.settings == {"speculative": "off"}
    reopened = ChatController(chat.client, ChatStore(tmp_path / "spec.db"), SAMPLING)
    try:
        assert reopened.conversations[conv.id].settings == {"speculative": "off"}
        assert reopened.sampling_for(reopened.conversations[conv.id])["speculative"] == "off"
    finally:
        reopened.close()
        reopened.store.close()
    monkeypatch.setattr(chat.client.model, "speculative_modes", ("off",))   # a hybrid model: no speculation
    with pytest.raises(ChatError, match="cannot speculate"):
        chat.set_setting(conv, "speculative", "ngram")
    chat.set_setting(conv, "speculative", None)
    assert conv.settings == {}
