"""The chat controller: conversations, their engine sessions, streamed turns and the engine's life.

No Textual here (nor torch): a front end builds a ChatController over an EngineClient and a ChatStore,
calls its methods from one thread (the UI thread; "the owner"), and calls `drain()` now and then (the
TUI: STREAM_HZ times a second). Token events arrive on the client's reader thread, which only puts
them in an inbox; `drain()` folds them into the conversations on the owner thread and tells the
ChatObserver what changed, so the front end redraws at most once per drain however fast tokens come.

Blocking engine work (load a model, restart a dead engine) is in `load_model` / `restart_engine`,
for the front end to run in a worker thread; they touch nothing but the client.

A reply is saved while it streams (SAVE_INTERVAL), so when the app itself is killed a restart shows
the reply up to its last save, marked STOPPED_NOTE; `rewind` takes back the last exchange, for the
front end to send its message again (regenerate).

Engine death (kill -9, the OOM killer, a crash in a kernel): the reply in flight ends with an error
event that keeps its partial text; the controller saves that partial reply marked INTERRUPTED_NOTE,
the observer hears `engine_stopped(reason)` once, and the next message restarts the engine
(`restart_engine`), after which the client re-opens the session from its history.
"""

from __future__ import annotations

import enum
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from nanochat.app.store import ChatStore, StoredConversation
from nanochat.engine.output import EngineStats, Reply, RequestStats, TokenEvent
from nanochat.engine.sampling_params import SamplingParams
from nanochat.engine.serve.client import EngineClient, RequestStream, Session
from nanochat.engine.serve.protocol import EngineError, ModelInfo, one_line

DEFAULT_TITLE = "New chat"
REPLAY_NOTE = "history re-prefilled"
INTERRUPTED_NOTE = "interrupted: engine stopped"
STOPPED_NOTE = "interrupted: nanochat stopped"   # saved mid-reply and never finished (/retry regenerates it)
UNANSWERED_NOTE = "not answered: nanochat stopped · /retry sends it again"
SAVE_INTERVAL = 0.5    # seconds between saves of a streaming reply: what a kill -9 of the app can lose


# ---------------------------------------------------------------------------------- conversations
@dataclass(eq=False)   # identity: two messages with the same text are still two messages
class Message:
    role: str                       # "user" | "assistant"
    content: str
    stats: RequestStats | None = None   # an assistant reply's numbers
    created: float = field(default_factory=time.time)
    note: str = ""                  # REPLAY_NOTE, INTERRUPTED_NOTE, STOPPED_NOTE
    id: int | None = None           # row id in the store (None until saved)
    streaming: bool = False
    generated_tokens: int = 0       # tokens received so far while streaming


@dataclass(eq=False)
class Conversation:
    id: int
    title: str
    system_prompt: str | None = None
    model: str | None = None
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    messages: list[Message] = field(default_factory=list)
    session: Session | None = None  # the client's session, opened on the first turn
    turn: "Turn | None" = None      # the turn in flight

    @property
    def generating(self) -> bool:
        return self.turn is not None

    @classmethod
    def from_stored(cls, stored: StoredConversation) -> "Conversation":
        messages = [Message(m.role, m.content, m.stats, m.created,
                            join_notes(m.note, STOPPED_NOTE) if m.partial else m.note, m.id)
                    for m in stored.messages]
        for m, nxt in zip(messages, messages[1:] + [None]):
            if m.role == "user" and (nxt is None or nxt.role != "assistant"):
                m.note = UNANSWERED_NOTE   # the app stopped before the reply's first token
        return cls(stored.id, stored.title, stored.system_prompt, stored.model, stored.created, stored.updated,
                   messages)


@dataclass(eq=False)
class Turn:
    """One user message and the reply streaming into it."""

    conversation: Conversation
    user: Message
    reply: Message
    stream: RequestStream | None = None
    fold: Reply = field(default_factory=Reply)   # the events drained so far (the owner thread's copy)
    interrupted: bool = False       # the engine died during it
    saved_at: float = 0.0           # monotonic time of the reply's last save while streaming
    finished: bool = False          # the controller has finished it (saved or dropped)

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


def completed_exchanges(messages: list[Message]) -> list[dict]:
    """The transcript a new session starts from: user messages that got a reply, and the replies."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m.streaming:
            continue
        if m.role == "user":
            nxt = messages[i + 1] if i + 1 < len(messages) else None
            if nxt is None or nxt.role != "assistant" or nxt.streaming:
                continue   # never answered (a crash mid-reply): the model never saw it answered
        out.append({"role": m.role, "content": m.content})
    return out


def join_notes(*notes: str) -> str:
    return " · ".join(n for n in notes if n)


# ---------------------------------------------------------------------------------- text helpers
def model_display_name(model: str | None) -> str:
    if not model:
        return "no model"
    from nanochat.models.catalog import EMBEDDED_FILE, EMBEDDED_NAME

    p = Path(model)
    if p.name == EMBEDDED_FILE:
        return EMBEDDED_NAME
    return p.name if (p.suffix or p.exists()) else model


def format_stats(stats: RequestStats | None, note: str = "") -> str:
    """One footer line: tokens, TTFT, decode speed, cached prompt tokens, how it ended, and any note."""
    parts: list[str] = []
    if stats is not None:
        parts.append(f"{stats.completion_tokens} tok")
        if stats.ttft is not None:
            parts.append(f"TTFT {stats.ttft * 1000:.0f} ms")
        if stats.decode_tok_s:
            parts.append(f"{stats.decode_tok_s:.1f} tok/s")
        if stats.prompt_tokens:
            parts.append(f"cached {stats.cached_tokens}/{stats.prompt_tokens}")
        ending = {"abort": "cancelled", "length": "context full" if stats.context_full else "max tokens",
                  "error": "error"}.get(stats.finish_reason or "")
        if ending and not (ending == "error" and INTERRUPTED_NOTE in note):   # the note says it better
            parts.append(ending)
    if note:
        parts.append(note)
    return " · ".join(parts)


def slugify(text: str) -> str:
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", text).strip("-").lower()
    return slug[:40] or "chat"


def export_markdown(conv: Conversation, model_label: str | None = None) -> str:
    lines = [f"# {conv.title}", ""]
    meta = [f"model: {conv.model or model_label or 'unknown'}",
            f"created: {time.strftime('%Y-%m-%d %H:%M', time.localtime(conv.created))}"]
    lines += ["_" + " · ".join(meta) + "_", ""]
    if conv.system_prompt:
        lines += ["## System", "", conv.system_prompt, ""]
    for m in conv.messages:
        lines += ["## You" if m.role == "user" else "## Assistant", "", m.content, ""]
        footer = format_stats(m.stats, m.note)
        if footer:
            lines += [f"<sub>{footer}</sub>", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_export(conv: Conversation, folder: Path, model_label: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"{slugify(conv.title)}-{conv.id}-{stamp}.md"
    n = 1
    while path.exists():
        n += 1
        path = folder / f"{slugify(conv.title)}-{conv.id}-{stamp}-{n}.md"
    path.write_text(export_markdown(conv, model_label), encoding="utf-8")
    return path


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


class EngineState(enum.Enum):
    NO_MODEL = "no model"
    LOADING = "loading"
    RESTARTING = "restarting"
    STOPPED = "stopped"             # the engine died; the next message restarts it
    READY = "ready"


class ChatError(Exception):
    """The controller cannot do what was asked; the message is one line for the user."""


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
        self.observer = observer or ChatObserver()
        self.conversations: dict[int, Conversation] = {}   # newest first
        self._inbox = _Inbox()
        self._last_stats: EngineStats | None = None
        self._job: tuple[EngineState, str] | None = None   # (LOADING | RESTARTING, model) while one runs
        self._job_lock = threading.Lock()
        self._closed = False
        client.add_stats_listener(self._inbox.put_stats)
        client.add_death_listener(self._on_death)
        for stored in store.load_all():
            self.conversations[stored.id] = Conversation.from_stored(stored)
        if not self.conversations:
            self.new_conversation()

    # ------------------------------------------------------------------ conversations
    def new_conversation(self, title: str = "") -> Conversation:
        title = " ".join(title.split()) or DEFAULT_TITLE
        now = time.time()
        cid = self.store.create_conversation(title, self.default_system_prompt, None, created=now)
        conv = Conversation(cid, title, self.default_system_prompt, None, now, now)
        self.conversations = {cid: conv, **self.conversations}
        return conv

    def rename(self, conv: Conversation, title: str) -> bool:
        """Rename (whitespace squeezed); False when the title is blank."""
        title = " ".join(title.split())
        if not title:
            return False
        conv.title = title
        self.store.rename(conv.id, title)
        return True

    def set_system_prompt(self, conv: Conversation, prompt: str | None) -> None:
        if conv.generating:
            raise ChatError("wait for the reply (or cancel it) before changing the system prompt")
        conv.system_prompt = prompt or None
        self.store.set_system_prompt(conv.id, conv.system_prompt)
        # The session's history starts with the old prompt: the next turn re-prefills with the new one.
        self._drop_session(conv)

    def clear(self, conv: Conversation) -> None:
        """Forget the messages (the system prompt stays) and free the session's KV."""
        self._drop_session(conv)
        self.store.clear_messages(conv.id)
        conv.messages.clear()

    def delete(self, conv: Conversation) -> None:
        """Delete a conversation; when it was the last one, a new empty one takes its place."""
        self._drop_session(conv)
        self.store.delete_conversation(conv.id)
        del self.conversations[conv.id]
        if not self.conversations:
            self.new_conversation()

    def export(self, conv: Conversation, folder: Path) -> Path:
        return write_export(conv, folder, model_display_name(self.client.model.model if self.client.model else None))

    def last_ttft(self) -> float | None:
        """TTFT of the latest reply on record that has one."""
        replies = [m for c in self.conversations.values() for m in c.messages
                   if m.stats is not None and m.stats.ttft is not None]
        return max(replies, key=lambda m: m.created).stats.ttft if replies else None

    def _drop_session(self, conv: Conversation) -> None:
        """Stop the turn in flight (its events are ignored from now on) and free the session's KV."""
        conv.turn = None
        if conv.session is not None:
            self.client.close_session(conv.session)   # also cancels the request in flight
            conv.session = None

    # ------------------------------------------------------------------ turns
    def send(self, conv: Conversation, text: str) -> Turn:
        """Start a turn; its events come through drain(). Raises ChatError when it cannot start. When the
        engine has stopped, this restarts it first (blocking): front ends call restart_engine in a
        worker beforehand."""
        if self.client.model is None:
            raise ChatError("no model is loaded")
        if self._job is not None:
            raise ChatError(f"the engine is {self._job[0].value}; send again when it is ready")
        if conv.generating:
            raise ChatError("this conversation is still replying")
        try:
            sampling = SamplingParams(**self.sampling)
        except (TypeError, ValueError) as e:
            raise ChatError(f"bad sampling settings: {one_line(e)}") from None
        if conv.session is None:
            conv.session = self.client.open_session(conv.system_prompt, completed_exchanges(conv.messages))
        turn = Turn(conv, Message("user", text), Message("assistant", "", streaming=True))
        try:
            turn.stream = self.client.submit_turn(conv.session, text, sampling, on_event=partial(self._on_event, turn))
        except EngineError as e:
            raise ChatError(one_line(e)) from None
        if turn.stream.replayed:   # a new session, a new model or a new engine process
            turn.reply.note = REPLAY_NOTE
        conv.turn = turn
        conv.messages += [turn.user, turn.reply]
        turn.user.id = self.store.add_message(conv.id, "user", text, created=turn.user.created)
        self._note_model(conv)
        if conv.title == DEFAULT_TITLE:
            self.rename(conv, text.strip().splitlines()[0][:40])
        return turn

    def rewind(self, conv: Conversation) -> str:
        """Take back the last user message and whatever answered it (store and session), and return its
        text for the caller to send again: regenerating the last reply, or an unanswered message.
        Raises ChatError when there is nothing to take back or a reply is in flight."""
        if conv.generating:
            raise ChatError("this conversation is still replying")
        last = max((i for i, m in enumerate(conv.messages) if m.role == "user"), default=None)
        if last is None:
            raise ChatError("there is no message to send again")
        removed, conv.messages = conv.messages[last:], conv.messages[:last]
        for m in removed:
            if m.id is not None:
                self.store.delete_message(m.id)
        exchange = completed_exchanges(removed)
        if conv.session is not None and exchange and conv.session.history[-2:] == exchange:
            # Cut the exchange off the session in canonical ids: the next turn finds the rest in the
            # prefix cache exactly. (An unanswered message never reached the session.)
            conv.session = self.client.rewind_session(conv.session, 1)
        elif conv.session is not None and exchange:
            self._drop_session(conv)   # not the session's last turn: re-open from the transcript
        return removed[0].content

    def _note_model(self, conv: Conversation) -> None:
        model = self.client.model.model
        if conv.model != model:
            conv.model = model
            self.store.set_model(conv.id, model)

    def cancel(self, conv: Conversation) -> bool:
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

    def _apply(self, turn: Turn, events: list[TokenEvent]) -> None:
        if turn.conversation.turn is not turn:   # dropped (cleared, deleted): its last events do not count
            return
        for event in events:
            turn.fold.add(event)
        turn.reply.content = turn.fold.text
        turn.reply.generated_tokens = len(turn.fold.token_ids)
        self.observer.reply_streamed(turn)
        if turn.fold.done:
            self._finish(turn)
            self.observer.turn_finished(turn)
        elif turn.kept and time.monotonic() - turn.saved_at >= SAVE_INTERVAL:
            self._save_reply(turn, partial=True)

    def _save_reply(self, turn: Turn, partial: bool) -> None:
        """Insert the reply at its first save, then rewrite it; `partial` until it has ended."""
        conv, reply = turn.conversation, turn.reply
        turn.saved_at = time.monotonic()
        if reply.id is None:
            reply.id = self.store.add_message(conv.id, "assistant", reply.content, reply.stats, reply.created,
                                              reply.note, partial)
        else:
            self.store.update_message(reply.id, reply.content, reply.stats, reply.note, partial)

    def _finish(self, turn: Turn) -> None:
        conv, user, reply = turn.conversation, turn.user, turn.reply
        conv.turn, turn.finished, reply.streaming = None, True, False
        if not turn.kept:
            # The client's session forgot the turn (failed, cancelled or cut short before any token): so do we.
            conv.messages = [m for m in conv.messages if m is not user and m is not reply]
            for m in (user, reply):
                if m.id is not None:
                    self.store.delete_message(m.id)
            return
        reply.stats = turn.fold.stats
        if turn.interrupted:
            reply.note = join_notes(reply.note, INTERRUPTED_NOTE)
        self._save_reply(turn, partial=False)

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

    def load_model(self, model: str, progress=None) -> ModelInfo:
        """Load (or switch to) `model`. Blocking: run it in a worker thread. Replies in flight are
        cancelled; on failure the previous model stays and the engine's error is raised."""
        with self._engine_job(EngineState.LOADING, model):
            return self.client.load_model(model, progress=progress, **self.engine_config)

    def restart_engine(self, progress=None) -> ModelInfo | None:
        """Start a new engine process with the last model (after the old one died). Blocking: run it
        in a worker thread. Sessions re-open (their history re-prefilled) on their next turn."""
        model = self.client.model.model if self.client.model is not None else ""
        with self._engine_job(EngineState.RESTARTING, model):
            return self.client.restart(progress)

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
        session. The client stays up (its owner shuts it down)."""
        self.observer = ChatObserver()   # nobody listens any more
        self.drain()                     # what already arrived belongs to the replies
        self._closed = True
        for conv in self.conversations.values():
            if conv.turn is not None:
                self._save_partial(conv.turn)
            self._drop_session(conv)
        self.client.remove_stats_listener(self._inbox.put_stats)
        self.client.remove_death_listener(self._on_death)

    def _save_partial(self, turn: Turn) -> None:
        if not turn.kept:
            return
        stats = turn.fold.stats
        stats.finish_reason = "abort"
        turn.reply.stats, turn.reply.streaming = stats, False   # drain() has brought its text up to date
        self._save_reply(turn, partial=False)
