"""The chat controller: conversations' turns, their engine sessions and the engine's life.

No Textual here (nor torch): a front end builds a ChatController over an EngineClient and a ChatStore,
calls its methods from one thread (the UI thread; "the owner"), and calls `drain()` now and then (the
TUI: on its stream tick). Token events arrive on the client's reader thread, which only puts them in
an inbox; `drain()` folds them into the conversations on the owner thread and tells the ChatObserver
what changed, so the front end redraws at most once per drain however fast tokens come.

Blocking engine work (load a model, restart a dead engine) is in `load_model` / `restart_engine`,
for the front end to run in a worker thread; they touch nothing but the client.

A conversation is a tree (app/conversation.py): `regenerate` and `edit` add versions beside the
messages they replace, `switch` shows another version, `fork` copies a branch into a new conversation.
Each branch recently shown keeps an engine session; a new branch is cut from the session it shares the
longest prefix with, so its shared KV is found in the prefix cache. Which session holds which branch is
the sessions' to say (BranchSessions, engine/serve/session.py, where their state machine is written).

A reply is saved while it streams (SAVE_INTERVAL), so when the app itself is killed a restart shows
the reply up to its last save, marked STOPPED_NOTE; `regenerate` writes a new version of it.
A write the storage refuses (a full disk, an I/O error) changes nothing here: the store keeps it and
saves it when it can (drain() gives it the chance now and then), messages keep the ids the store gave
them, and the observer hears `storage_changed` when saving stops and starts working.

Engine death (kill -9, the OOM killer, a crash in a kernel): the reply in flight ends with an error
event that keeps its partial text; the controller saves that partial reply marked INTERRUPTED_NOTE,
the observer hears `engine_stopped(reason)` once, and the next message restarts the engine
(`restart_engine`), after which the client re-opens the session from its history.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from nanochat.app.conversation import (DEFAULT_TITLE, INTERRUPTED_NOTE, REPLAY_NOTE, ChatError, Conversation, Message,
                                       as_history, exchange_sizes, exchanges, exchanges_to_drop, join_notes,
                                       latest_leaf, reply_room)
from nanochat.app.export import model_name, write_export
from nanochat.app.options import (REPLY_FORMATS, REQUEST_RULES, SAMPLING_RULES, TEMPLATE_RULES, TEMPLATE_SWITCHES,
                                  effective_sampling, held_reply_value, model_config, speculative_refusal,
                                  template_variables)
from nanochat.app.reasoning import ThinkingSplitter, reply_splitter, reply_thought, split_reply
from nanochat.app.store import ChatStore, warn_on_stderr
from nanochat.engine.output import EngineStats, Reply, TokenEvent
from nanochat.engine.sampling_params import ANY_OBJECT, SamplingParams
from nanochat.engine.serve.client import BranchSessions, EngineClient, RequestStream, Session
from nanochat.engine.serve.protocol import EngineError, ModelInfo, one_line

SAVE_INTERVAL = 0.5    # seconds between saves of a streaming reply: what a kill -9 of the app can lose
MAX_BRANCH_SESSIONS = 4   # engine sessions kept per conversation (the branch shown and recent others)
# What /set may change: sampling, the request's other settings (speculative), what holds the replies (a JSON
# schema or a grammar), and template variables.
CHAT_SETTINGS = (*SAMPLING_RULES, *REQUEST_RULES, *REPLY_FORMATS, *TEMPLATE_RULES)
TURN_SETTINGS = (*SAMPLING_RULES, *REQUEST_RULES, *REPLY_FORMATS)   # the chat settings that are SamplingParams fields


# ---------------------------------------------------------------------------------- chats
@dataclass(eq=False)
class Chat(Conversation):
    """A conversation as the controller runs it: the tree, its turn in flight and the engine sessions
    of its branches."""

    # The engine sessions of recently shown branches (set by the controller), each known by the
    # exchanges it holds (turn_keys). Branches share their common prefix's KV through the prefix cache.
    sessions: BranchSessions | None = None
    turn: "Turn | None" = None      # the turn in flight

    @property
    def generating(self) -> bool:
        return self.turn is not None

    @property
    def session(self) -> Session | None:
        """The engine session used last (the branch shown, unless a move to another branch came since)."""
        return self.sessions.recent if self.sessions is not None else None


@dataclass(eq=False)
class Turn:
    """One user message and the reply streaming into it."""

    conversation: Chat
    user: Message
    reply: Message
    stream: RequestStream | None = None
    new_user: bool = True           # the user message was written for this turn (not a regenerate)
    edit_of: Message | None = None  # the message this turn's user message is a new version of
    shown_before: Message | None = None   # the leaf shown before the turn (where a forgotten turn goes back)
    fold: Reply = field(default_factory=Reply)   # the events drained so far (the owner thread's copy)
    interrupted: bool = False       # the engine died during it
    saved_at: float = 0.0           # monotonic time of the reply's last save while streaming
    finished: bool = False          # the controller has finished it (saved or dropped)
    splitter: ThinkingSplitter = field(default_factory=ThinkingSplitter)   # the reply's thinking | answer
    started: float = field(default_factory=time.monotonic)   # when it was sent (thinking time counts from it)

    @property
    def kept(self) -> bool:
        """Whether the reply produced tokens (and was saved); a turn without any is forgotten."""
        return bool(self.fold.token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.fold.final.finish_reason if self.fold.final is not None else None

    @property
    def error(self) -> str:
        return self.fold.final.error if self.fold.final is not None else ""

    @property
    def context_exceeded(self) -> bool:
        """The engine refused the prompt: the chat with this message is longer than the context."""
        final = self.fold.final
        return final is not None and final.finish_reason == "error" and final.stats is not None \
            and final.stats.context_full


def setting_value(name: str, raw: str):
    """A /set value typed as text, as the setting's type (ValueError with one line when it is not; the
    value itself is checked by set_setting, with the others)."""
    if name in TEMPLATE_RULES or name in REQUEST_RULES:   # a word: set_setting checks it
        return raw.lower()
    if name in REPLY_FORMATS:   # `object`, @FILE or the text, as --json-schema and --grammar take it
        return held_reply_value(name, raw)
    if name not in SAMPLING_RULES:
        raise ValueError(f"unknown setting {name!r}; one of: {', '.join(CHAT_SETTINGS)}")
    cast = SAMPLING_RULES[name].cast
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not {'a whole number' if cast is int else 'a number'}") from None


NEUTRAL_SETTINGS = {"top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "seed": None}


def describe_settings(sampling: dict, own: dict | None = None) -> str:
    """'temperature 0.7* · top_p 0.95 · max_tokens 512': the sampling a turn uses, settings that change
    nothing left out unless the chat set them; * marks the chat's own (/set) settings."""
    own = own or {}
    parts = []
    for name in CHAT_SETTINGS:
        value = sampling.get(name)
        if name not in own and (value is None or value == NEUTRAL_SETTINGS.get(name, object())
                                or (name == "top_k" and value == 0)):
            continue
        if name in TEMPLATE_RULES and value is None:
            value = own.get(name)
            if value is None:
                continue
        text = f"{value:g}" if isinstance(value, float) else held_text(value) if name in REPLY_FORMATS else str(value)
        parts.append(f"{name} {text}{'*' if name in own else ''}")
    parts += [f"{name} {'on' if own[name] else 'off'}*" for name in TEMPLATE_SWITCHES if isinstance(own.get(name), bool)]
    return " · ".join(parts)


def held_text(value: str) -> str:
    """A schema or grammar in a settings line: `object` (any JSON object), else its size."""
    if value == ANY_OBJECT:
        return "object"
    lines = value.count("\n") + 1
    return f"({lines} lines)" if lines > 1 else f"({len(value):,} characters)"


SUMMARY_REQUEST = ("Summarize our conversation so far in a few sentences: the topics, what was decided or "
                   "answered, and anything I asked you to remember. Write only the summary.")
SUMMARY_OVERHEAD = 96   # tokens for the summary request itself and the template around it


def turn_keys(held: list[Message]) -> list[tuple[Message, Message]]:
    """The names of a path's exchanges in its engine sessions (BranchSessions): (user message, reply)."""
    return list(zip(held[::2], held[1::2]))


# ---------------------------------------------------------------------------------- observer
class ChatObserver:
    """What a front end hears from the controller. Every call comes from `drain()`, on its thread.
    Changes the front end asked for (send, clear, rename, ...) are not echoed: the caller knows."""

    def reply_streamed(self, turn: Turn) -> None:
        """The reply gained text since the last drain (turn.reply.content, .generated_tokens)."""

    def turn_finished(self, turn: Turn) -> None:
        """The turn ended: saved (turn.kept) or forgotten with its user message (failed or cancelled
        before any token); turn.finish_reason, turn.error and turn.interrupted say how."""

    def engine_stats(self, stats: EngineStats) -> None:
        """The engine's numbers changed (pushed about 4 times a second while it works)."""

    def engine_changed(self) -> None:
        """ChatController.engine_state or the loaded model changed (a load or restart began or ended)."""

    def engine_stopped(self, reason: str) -> None:
        """The engine process died (told after engine_changed, and after the turns it cut short have
        finished); the next message restarts it."""

    def storage_changed(self, warning: str | None) -> None:
        """Saving chats failed (a full disk, an I/O error; `warning` says so: what is not saved stays in
        memory and is saved when writing works again), or works again (None). Without a front end that
        shows it: on stderr."""
        warn_on_stderr(warning)


class EngineState(enum.Enum):
    NO_MODEL = "no model"
    LOADING = "loading"
    RESTARTING = "restarting"
    STOPPED = "stopped"             # the engine died; the next message restarts it
    READY = "ready"


# ---------------------------------------------------------------------------------- inbox
@dataclass
class _TurnEvent:
    turn: Turn
    event: TokenEvent
    engine_died: bool               # the final event of a reply the engine's death cut short


@dataclass
class _EngineDied:
    reason: str


@dataclass
class _EngineChanged:
    pass


class _Inbox:
    """What other threads (the client's reader, engine workers) hand to the owner thread, in order;
    of the engine stats only the latest counts."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list = []
        self._stats: EngineStats | None = None

    def put(self, item) -> None:
        with self._lock:
            self._items.append(item)

    def put_stats(self, stats: EngineStats) -> None:
        with self._lock:
            self._stats = stats

    def take(self) -> tuple[EngineStats | None, list]:
        with self._lock:
            stats, items = self._stats, self._items
            self._stats, self._items = None, []
        return stats, items


# ---------------------------------------------------------------------------------- controller
class ChatController:
    """The conversations (newest first) of a chat store, their client sessions and their turns.

    Call its methods and drain() from one thread; load_model and restart_engine block and may run in
    a worker thread. The client is the caller's: close() leaves it running."""

    def __init__(self, client: EngineClient, store: ChatStore, sampling: dict | None = None,
                 system_prompt: str | None = None, engine_config: dict | None = None,
                 observer: ChatObserver | None = None):
        self.client, self.store = client, store
        self.sampling = dict(sampling or {})          # SamplingParams keywords
        self.default_system_prompt = system_prompt
        self.engine_config = dict(engine_config or {})
        self._template_model: str | None = None   # the model --chat-template was given for
        self.observer = observer or ChatObserver()
        self.conversations: dict[int, Chat] = {}   # newest first
        self._inbox = _Inbox()
        self._last_stats: EngineStats | None = None
        self._job: tuple[EngineState, str] | None = None   # (LOADING | RESTARTING, model) while one runs
        self._job_lock = threading.Lock()
        self._closed = False
        client.add_stats_listener(self._inbox.put_stats)
        client.add_death_listener(self._on_death)
        store.on_fault = self._storage_changed
        for stored in store.load_all():
            self.conversations[stored.id] = self._live(Chat.from_stored(stored))
        if not self.conversations:
            self.new_conversation()

    # ------------------------------------------------------------------ conversations
    def new_conversation(self, title: str = "") -> Chat:
        title = " ".join(title.split()) or DEFAULT_TITLE
        now = time.time()
        cid = self.store.create_conversation(title, self.default_system_prompt, None, created=now)
        conv = self._live(Chat(cid, title, self.default_system_prompt, None, now, now))
        self.conversations = {cid: conv, **self.conversations}
        return conv

    def _live(self, conv: Chat) -> Chat:
        """`conv`, given the tree of engine sessions its branches use."""
        conv.sessions = BranchSessions(self.client, MAX_BRANCH_SESSIONS)
        return conv

    def rename(self, conv: Chat, title: str) -> bool:
        """Rename (whitespace squeezed); False when the title is blank."""
        title = " ".join(title.split())
        if not title:
            return False
        conv.title = title
        self.store.rename(conv.id, title)
        return True

    def set_system_prompt(self, conv: Chat, prompt: str | None) -> None:
        if conv.generating:
            raise ChatError("wait for the reply (or cancel it) before changing the system prompt")
        conv.system_prompt = prompt or None
        self.store.set_system_prompt(conv.id, conv.system_prompt)
        # The sessions' histories start with the old prompt: the next turn re-prefills with the new one.
        self._drop_sessions(conv)

    def clear(self, conv: Chat) -> None:
        """Forget the messages, every branch (the system prompt stays), and free the sessions' KV."""
        self._drop_sessions(conv)
        self.store.clear_messages(conv.id)
        conv.path, conv.roots = [], []

    def delete(self, conv: Chat) -> None:
        """Delete a conversation; when it was the last one, a new empty one takes its place."""
        self._drop_sessions(conv)
        self.store.delete_conversation(conv.id)
        del self.conversations[conv.id]
        if not self.conversations:
            self.new_conversation()

    def export(self, conv: Chat, folder: Path, tree: bool = False, target: str = "") -> Path:
        """The path shown as Markdown, or (`tree`) every branch as JSON, written to `target` or the exports
        `folder` (see write_export); ChatError when it cannot be written."""
        label = model_name(self.client.model.model if self.client.model else None)
        return write_export(conv, folder, label, tree, target)

    def last_ttft(self) -> float | None:
        """TTFT of the latest reply on record that has one."""
        replies = [m for c in self.conversations.values() for m in c.path
                   if m.stats is not None and m.stats.ttft is not None]
        return max(replies, key=lambda m: m.created).stats.ttft if replies else None

    def _drop_sessions(self, conv: Chat) -> None:
        """Stop the turn in flight (its events are ignored from now on) and free the sessions' KV."""
        conv.turn = None
        conv.sessions.close()   # also cancels the request in flight

    # ------------------------------------------------------------------ branches
    def _start(self, conv: Chat, user: Message, held: list[Message], new_user: bool,
               edit_of: Message | None = None) -> Turn:
        """Send `user` after the exchanges `held` (the path up to its parent) and show the reply streaming."""
        if self.client.model is None:
            raise ChatError("no model is loaded")
        if self._job is not None:
            raise ChatError(f"the engine is {self._job[0].value}; send again when it is ready")
        if conv.generating:
            raise ChatError("this conversation is still replying")
        try:
            sampling = SamplingParams(**self.sampling_for(conv))
        except (TypeError, ValueError) as e:
            raise ChatError(f"bad sampling settings: {one_line(e)}") from None
        session = conv.sessions.session_for(conv.system_prompt, turn_keys(held), as_history(held))
        variables = template_variables(conv.settings)
        # whether the prompt opens the thinking block itself (the reply then starts inside it)
        prompted = variables.get("enable_thinking") in self.client.model.thinking_opened
        turn = Turn(conv, user, Message("assistant", "", streaming=True), new_user=new_user, edit_of=edit_of,
                    shown_before=conv.leaf, splitter=reply_splitter(self.client.model, prompted))
        try:
            turn.stream = conv.sessions.submit_turn(session, (user, turn.reply), user.content, sampling,
                                                    on_event=partial(self._on_event, turn),
                                                    template_kwargs=variables or None)
        except EngineError as e:
            raise ChatError(one_line(e)) from None
        if turn.stream.replayed:   # a new session, a new model or a new engine process
            turn.reply.note = REPLAY_NOTE
        conv.turn = turn
        if new_user:
            user.id = self.store.add_message(conv.id, "user", user.content, created=user.created,
                                             parent_id=user.parent.id if user.parent is not None else None)
        conv.attach(turn.reply, user)
        conv.show(turn.reply)
        self._note_model(conv)
        return turn

    def send(self, conv: Chat, text: str) -> Turn:
        """Start a turn after the path shown; its events come through drain(). Raises ChatError when it
        cannot start. When the engine has stopped, this restarts it first (blocking): front ends call
        restart_engine in a worker beforehand."""
        user = Message("user", text)
        parent = conv.leaf
        turn = self._attached(conv, user, parent, lambda: self._start(conv, user, conv.held(), True))
        if conv.title == DEFAULT_TITLE:
            self.rename(conv, text.strip().splitlines()[0][:40])
        return turn

    def _attached(self, conv: Chat, user: Message, parent: Message | None,
                  start: Callable[[], Turn]) -> Turn:
        """Run `start` with `user` attached under `parent`; detached again when the turn cannot start."""
        conv.attach(user, parent)
        try:
            return start()
        except BaseException:
            conv.detach(user)
            raise

    def regenerate(self, conv: Chat) -> Turn:
        """A new version of the last reply (or the first one of an unanswered message): a sibling of
        the reply it replaces, generated after the same history, whose KV is found cached."""
        if conv.generating:
            raise ChatError("this conversation is still replying")
        at = max((i for i, m in enumerate(conv.path) if m.role == "user"), default=None)
        if at is None:
            raise ChatError("there is no message to answer again")
        user = conv.path[at]
        user.note = ""
        return self._start(conv, user, conv.held(conv.path[:at]), new_user=False)

    def edit(self, conv: Chat, message: Message, text: str) -> Turn:
        """Send `text` in place of the user message `message` (on the path shown): a new version of it,
        a sibling branch from that point; the KV of everything before it is found cached."""
        if conv.generating:
            raise ChatError("this conversation is still replying")
        if message.role != "user" or message not in conv.path:
            raise ChatError("only your own messages on the branch shown can be edited")
        if not text.strip():
            raise ChatError("the edited message is empty")
        at = conv.path.index(message)
        user = Message("user", text)
        return self._attached(conv, user, message.parent,
                              lambda: self._start(conv, user, conv.held(conv.path[:at]), True, message))

    def switch(self, conv: Chat, message: Message, step: int) -> Message | None:
        """Show another version of `message` (`step` = -1: the previous one, +1: the next one) and the
        newest branch under it; returns the version shown, or None when there is none that way."""
        if conv.generating:
            raise ChatError("wait for the reply (or cancel it) before moving to another version")
        siblings = conv.siblings(message)
        at = siblings.index(message) + step
        if not 0 <= at < len(siblings):
            return None
        conv.show(latest_leaf([siblings[at]]) or siblings[at])
        self._save_leaf(conv)
        conv.sessions.focus(turn_keys(conv.held()))   # its KV, if resident, stays so ahead of the others'
        return siblings[at]

    def fork(self, conv: Chat, message: Message) -> Chat:
        """A new conversation with the path shown up to `message`; it shares the KV of that prefix."""
        if message not in conv.path:
            raise ChatError("only a message on the branch shown can be forked")
        path = conv.path[:conv.path.index(message) + 1]
        if any(m.streaming for m in path):
            raise ChatError("wait for the reply (or cancel it) before forking at it")
        other = self.new_conversation(f"{conv.title} (fork)")
        other.system_prompt, other.settings = conv.system_prompt, dict(conv.settings)
        self.store.set_system_prompt(other.id, other.system_prompt)
        self.store.set_settings(other.id, other.settings)
        parent = None
        for m in path:
            copy = Message(m.role, m.content, m.stats, m.created, m.note, thought=m.thought)
            copy.id = self.store.add_message(other.id, m.role, m.content, m.stats, m.created, m.note,
                                             parent_id=parent.id if parent is not None else None, thought=m.thought)
            other.attach(copy, parent)
            parent = copy
        other.show(parent)
        conv.sessions.fork_into(other.sessions, turn_keys(exchanges(path)), turn_keys(exchanges(other.path)))
        return other

    # ------------------------------------------------------------------ the context window
    def context_used(self, conv: Chat) -> int:
        """Tokens of the context the path shown fills, as of its last reply the model sees (0 before any)."""
        held = conv.held()
        last = next((m for m in reversed(held) if m.role == "assistant" and m.stats is not None), None)
        return last.stats.prompt_tokens + last.stats.completion_tokens if last is not None else 0

    def drop_oldest(self, conv: Chat, turn: Turn) -> int:
        """After `turn` was refused for the context: let the model see only the newest turns that leave
        room for the message and a reply (the system prompt stays; the transcript is untouched). Returns
        how many turns are dropped; ChatError when even the message alone does not fit."""
        held = conv.held()
        dropped = exchanges_to_drop(held, turn.fold.stats.prompt_tokens, self.client.model.max_model_len,
                                    self.sampling_for(conv)["max_tokens"])
        if dropped:
            conv.context_after = held[2 * dropped - 1]
            self.store.set_context_after(conv.id, conv.context_after.id)
        return dropped

    def summarize(self, conv: Chat, timeout: float = 600.0) -> str:
        """A summary of the chat, written by the model from the newest turns that fit (blocking: run it
        in a worker). ChatError when it cannot be written."""
        limit = self.client.model.max_model_len
        room = reply_room(self.sampling_for(conv)["max_tokens"], limit)
        held = conv.held()
        sizes = exchange_sizes(held)
        budget, start = limit - room - SUMMARY_OVERHEAD, len(sizes)
        while start > 0 and budget - sizes[start - 1] > 0:
            start -= 1
            budget -= sizes[start]
        session = self.client.open_session(conv.system_prompt, as_history(held[2 * start:]))
        variables = template_variables(conv.settings)
        try:
            # the summary is prose: the schema or grammar the chat's replies follow does not hold it
            sampling = SamplingParams(**{**self.sampling_for(conv), "max_tokens": room, "ignore_eos": False,
                                         "json_schema": None, "grammar": None})
            reply = self.client.submit_turn(session, SUMMARY_REQUEST, sampling,
                                            template_kwargs=variables or None).result(timeout)
        except (EngineError, TimeoutError) as e:
            raise ChatError(f"no summary: {one_line(e)}") from None
        finally:
            self.client.close_session(session)
        prompted = variables.get("enable_thinking") in self.client.model.thinking_opened
        summary = split_reply(reply.text, self.client.model, prompted).answer.strip()   # the answer, not the thinking
        if reply.final is None or reply.final.finish_reason == "error" or not summary:
            raise ChatError(f"no summary: {reply.final.error if reply.final is not None else 'no reply'}")
        return summary

    def continue_with_summary(self, conv: Chat, summary: str) -> Chat:
        """A new chat that starts from `summary` (in its system prompt), with the same settings."""
        other = self.new_conversation(f"{conv.title} (continued)")
        head = f"{conv.system_prompt}\n\n" if conv.system_prompt else ""
        self.set_system_prompt(other, f"{head}A summary of the conversation so far:\n{summary}")
        other.settings = dict(conv.settings)
        self.store.set_settings(other.id, other.settings)
        return other

    def sampling_for(self, conv: Chat) -> dict:
        """SamplingParams keywords of a turn: the chat's own settings over the front end's (flags and
        settings.json) over what the model file recommends over CHAT_DEFAULTS."""
        recommended = self.client.model.sampling_defaults if self.client.model is not None else {}
        own = {k: v for k, v in conv.settings.items() if k in TURN_SETTINGS}
        return effective_sampling({**self.sampling, **own}, recommended)

    def set_setting(self, conv: Chat, name: str, value) -> None:
        """Set (or with value None, drop) one of the chat's own sampling settings; ChatError when invalid."""
        if name not in CHAT_SETTINGS:
            raise ChatError(f"unknown setting {name!r}; one of: {', '.join(CHAT_SETTINGS)}")
        settings = {k: v for k, v in conv.settings.items() if k != name}
        if value is not None:
            settings[name] = value
        if name in TEMPLATE_RULES:
            self._check_template_setting(name, value)
        try:
            SamplingParams(**{**self.sampling_for(conv), **{k: v for k, v in settings.items() if k in TURN_SETTINGS}})
        except (TypeError, ValueError) as e:
            raise ChatError(one_line(e)) from None
        refusal = speculative_refusal(value, self.client.model.speculative_modes) \
            if name == "speculative" and self.client.model is not None else None
        if refusal:
            raise ChatError(refusal)
        if name in REPLY_FORMATS and value is not None and self.client.model is not None:
            try:   # the engine's check, so that a grammar it cannot follow is refused here, not at the next turn
                self.client.check_hold(**{name: value})
            except (EngineError, ValueError) as e:
                raise ChatError(one_line(e)) from None
        conv.settings = settings
        self.store.set_settings(conv.id, settings)

    def _check_template_setting(self, name: str, value) -> None:
        """A template variable's value (None: the default again) against its rule, and, with a model
        loaded, against the values its chat template reads; ChatError (one line) when it is refused."""
        if value is None:
            return
        rule = TEMPLATE_RULES[name]
        if not (isinstance(value, str) and rule.ok(value)):
            raise ChatError(f"{name} must be {rule.text}, got {value!r}")
        model = self.client.model
        if model is not None and value not in model.reasoning_efforts:
            raise ChatError(f"this model's chat template does not read {name}: it changes nothing")

    def set_thinking(self, conv: Chat, on: bool | None) -> None:
        """Turn the chat's thinking on or off (None: the template's default) from its next turn: the chat
        template's enable_thinking. Whether the model's template reads it: `model.thinking_switch`."""
        settings = {k: v for k, v in conv.settings.items() if k != "think"}
        if on is not None:
            settings["think"] = on
        conv.settings = settings
        self.store.set_settings(conv.id, settings)

    def _save_leaf(self, conv: Chat) -> None:
        self.store.set_leaf(conv.id, conv.leaf.id if conv.leaf is not None else None)

    def _note_model(self, conv: Chat) -> None:
        model = self.client.model.model
        if conv.model != model:
            conv.model = model
            self.store.set_model(conv.id, model)

    def cancel(self, conv: Chat) -> bool:
        """Stop the reply in flight; it ends (through drain) with finish reason "abort", partial text kept."""
        if conv.turn is None or conv.turn.stream is None:
            return False
        conv.turn.stream.cancel()
        return True

    def _on_event(self, turn: Turn, event: TokenEvent) -> None:       # the client's reader thread
        # The client records why the engine died before it ends the streams it cut short, and clears
        # it when a new engine starts, so this is the one moment the two can be told apart reliably.
        died = event.finished and event.finish_reason == "error" and self.client.died is not None
        self._inbox.put(_TurnEvent(turn, event, died))

    def _on_death(self, reason: str) -> None:                        # the client's reader thread
        if not self._closed:
            self._inbox.put(_EngineDied(reason))

    def _storage_changed(self, warning: str | None) -> None:         # the store, on the owner thread
        if not self._closed:   # after close() the front end hears what is lost from store.close()
            self.observer.storage_changed(warning)

    # ------------------------------------------------------------------ drain (owner thread)
    def drain(self) -> None:
        """Apply what arrived since the last call and tell the observer: the latest stats, each reply's
        new text (one call per reply), finished turns, then engine news."""
        stats, items = self._inbox.take()
        if stats is not None and stats != self._last_stats:   # an idle engine repeats itself
            self._last_stats = stats
            self.observer.engine_stats(stats)
        events: dict[Turn, list[TokenEvent]] = {}
        deaths: list[str] = []
        changed = False
        for item in items:
            if isinstance(item, _TurnEvent):
                events.setdefault(item.turn, []).append(item.event)
                item.turn.interrupted |= item.engine_died
            elif isinstance(item, _EngineDied):
                deaths.append(item.reason)
            else:
                changed = True
        for turn, batch in events.items():
            self._apply(turn, batch)
        if changed or deaths:
            self.observer.engine_changed()
        for reason in deaths:
            self.observer.engine_stopped(reason)
        self.store.retry()   # what a storage fault held back, now and then

    def _apply(self, turn: Turn, events: list[TokenEvent]) -> None:
        if turn.conversation.turn is not turn:   # dropped (cleared, deleted): its last events do not count
            return
        for event in events:
            turn.fold.add(event)
            self._split(turn, event)
        turn.reply.content = turn.splitter.answer
        turn.reply.generated_tokens = len(turn.fold.token_ids)
        self.observer.reply_streamed(turn)
        if turn.fold.done:
            self._finish(turn)
            self.observer.turn_finished(turn)
        elif turn.kept and time.monotonic() - turn.saved_at >= SAVE_INTERVAL:
            self._save_reply(turn, partial=True)

    def _split(self, turn: Turn, event: TokenEvent) -> None:
        """Fold an event into the reply's thinking and answer: a token counts as thinking when the
        block is open after it or it closed the block."""
        splitter, now = turn.splitter, time.monotonic()
        was_closed = splitter.closed
        splitter.feed(event.text)
        if event.finished:
            splitter.finish()
        if splitter.reasoning is None:
            return
        reply = turn.reply
        if reply.thought is None:
            reply.thought = reply_thought(splitter)
        thought = reply.thought
        thought.text = splitter.reasoning
        if event.token_id is not None and (splitter.thinking or splitter.closed != was_closed):
            thought.tokens += 1
        if event.finished and not splitter.closed and event.stats is not None:
            thought.seconds = event.stats.elapsed   # cut off while thinking: the whole request was thinking
        elif splitter.thinking or splitter.closed != was_closed:
            thought.seconds = now - turn.started    # (to the drain that saw it: within 1/STREAM_HZ)
        thought.closed = splitter.closed

    def _save_reply(self, turn: Turn, partial: bool) -> None:
        """Insert the reply at its first save, then rewrite it; `partial` until it has ended."""
        conv, reply = turn.conversation, turn.reply
        turn.saved_at = time.monotonic()
        if reply.id is None:
            reply.id = self.store.add_message(conv.id, "assistant", reply.content, reply.stats, reply.created,
                                              reply.note, partial, parent_id=turn.user.id, thought=reply.thought)
        else:
            self.store.update_message(reply.id, reply.content, reply.stats, reply.note, partial, reply.thought)

    def _finish(self, turn: Turn) -> None:
        conv, user, reply = turn.conversation, turn.user, turn.reply
        conv.turn, turn.finished, reply.streaming = None, True, False
        if not turn.kept:
            # The client's session forgot the turn (failed, cancelled or cut short before any token): so
            # do we, and the branch shown before it is shown again.
            conv.detach(reply)
            if turn.new_user:
                conv.detach(user)
                if user.id is not None:
                    self.store.delete_message(user.id)
            conv.show(turn.shown_before)
            self._save_leaf(conv)
            return
        reply.stats = turn.fold.stats
        if turn.interrupted:
            reply.note = join_notes(reply.note, INTERRUPTED_NOTE)
        self._save_reply(turn, partial=False)   # (its session recorded the exchange as the turn ended)

    def wait(self, turn: Turn, timeout: float = 60.0, poll: float = 0.01) -> Turn:
        """Drain until `turn` has finished (for front ends without an event loop, and tests)."""
        deadline = time.monotonic() + timeout
        while not turn.finished:
            if time.monotonic() > deadline:
                raise TimeoutError("the reply did not finish in time")
            time.sleep(poll)
            self.drain()
        return turn

    # ------------------------------------------------------------------ engine
    @property
    def model(self) -> ModelInfo | None:
        return self.client.model

    @property
    def engine_state(self) -> EngineState:
        job = self._job
        if job is not None:
            return job[0]
        if self.client.model is None:
            return EngineState.NO_MODEL
        return EngineState.READY if self.client.alive else EngineState.STOPPED

    @property
    def job_model(self) -> str | None:
        """The model being loaded (or reloaded by a restart), while that runs."""
        job = self._job
        return job[1] if job is not None else None

    @property
    def generating(self) -> bool:
        return any(c.generating for c in self.conversations.values())

    @property
    def awaiting_first_token(self) -> bool:
        """Whether a turn in flight has not had its first token yet."""
        return any(c.turn is not None and not c.turn.kept for c in self.conversations.values())

    def load_model(self, model: str, progress=None, status=None) -> ModelInfo:
        """Load (or switch to) `model`. Blocking: run it in a worker thread. Replies in flight are
        cancelled; on failure the previous model stays and the engine's error is raised. `progress` and
        `status`: as EngineClient.load_model's."""
        self._template_model = self._template_model or model   # --chat-template's: the first one loaded
        config = model_config(self.engine_config, model, self._template_model)
        with self._engine_job(EngineState.LOADING, model):
            return self.client.load_model(model, progress=progress, status=status, **config)

    def restart_engine(self, progress=None, status=None) -> ModelInfo | None:
        """Start a new engine process with the last model (after the old one died). Blocking: run it
        in a worker thread. Sessions re-open (their history re-prefilled) on their next turn."""
        model = self.client.model.model if self.client.model is not None else ""
        with self._engine_job(EngineState.RESTARTING, model):
            return self.client.restart(progress, status)

    @contextmanager
    def _engine_job(self, state: EngineState, model: str):
        """One blocking engine operation at a time; the observer hears when it starts and when it ends."""
        with self._job_lock:
            if self._job is not None:
                raise ChatError(f"the engine is already {self._job[0].value}")
            self._job = (state, model)
        self._inbox.put(_EngineChanged())
        try:
            yield
        finally:
            with self._job_lock:
                self._job = None
            self._inbox.put(_EngineChanged())

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """The front end is going: save the partial replies in flight (marked cancelled) and free every
        session. The client and the store stay open (their owner closes them: store.close() says what
        it could not save)."""
        self.observer = ChatObserver()   # nobody listens any more
        self._closed = True
        self.drain()                     # what already arrived belongs to the replies
        for conv in self.conversations.values():
            if conv.turn is not None:
                self._save_partial(conv.turn)
            self._drop_sessions(conv)
        self.client.remove_stats_listener(self._inbox.put_stats)
        self.client.remove_death_listener(self._on_death)

    def _save_partial(self, turn: Turn) -> None:
        if not turn.kept:
            return
        stats = turn.fold.stats
        stats.finish_reason = "abort"
        turn.reply.stats, turn.reply.streaming = stats, False   # drain() has brought its text up to date
        self._save_reply(turn, partial=False)
