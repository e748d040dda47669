"""Textual messages of the app: the controller's news (through TuiObserver) and requests that screens
and widgets post upward (load a model, run a slash command)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from textual.message import Message
from textual.message_pump import MessagePump

from nanochat.app.controller import ChatObserver, Turn
from nanochat.engine.output import EngineStats


# ---------------------------------------------------------------------------------- controller -> UI
class TurnFinished(Message):
    """A turn ended, saved or forgotten (the chat screen updates its views; the app its last TTFT)."""

    def __init__(self, turn: Turn):
        super().__init__()
        self.turn = turn


class EngineChanged(Message):
    """A model load or an engine restart began or ended."""


class EngineStopped(Message):
    """The engine process died; the next message restarts it."""

    def __init__(self, reason: str):
        super().__init__()
        self.reason = reason


class StorageChanged(Message):
    """Saving chats failed (`warning` says why; nothing is lost yet) or works again (None)."""

    def __init__(self, warning: str | None):
        super().__init__()
        self.warning = warning


@dataclass
class StreamNews:
    """What one drain brought for the screen to draw: the replies that gained text and the engine's
    latest stats (None: unchanged)."""

    replies: list[Turn] = field(default_factory=list)
    stats: EngineStats | None = None


class TuiObserver(ChatObserver):
    """The controller's callbacks, which it makes from drain() on the UI thread. Streaming news (reply
    text, engine stats) is kept for the app's stream tick to draw all at once, in one frame; the rest
    becomes messages posted to the chat screen, and what the screen does not handle bubbles up to the
    app."""

    def __init__(self, target: MessagePump):
        self.target = target
        self.news = StreamNews()

    def take(self) -> StreamNews:
        news, self.news = self.news, StreamNews()
        return news

    def reply_streamed(self, turn: Turn) -> None:
        if turn not in self.news.replies:
            self.news.replies.append(turn)

    def engine_stats(self, stats: EngineStats) -> None:
        self.news.stats = stats

    def turn_finished(self, turn: Turn) -> None:
        self.target.post_message(TurnFinished(turn))

    def engine_changed(self) -> None:
        self.target.post_message(EngineChanged())

    def engine_stopped(self, reason: str) -> None:
        self.target.post_message(EngineStopped(reason))

    def storage_changed(self, warning: str | None) -> None:
        self.target.post_message(StorageChanged(warning))


# ---------------------------------------------------------------------------------- requests upward
class TurnStarted(Message):
    """A turn began: the app's next stream tick comes at once, whatever the drawing before it cost."""


class LoadModel(Message):
    """Load `model` (the app does it in a worker); `done(model, error)`, when given, hears how it went
    (error: None when the model is loaded)."""

    def __init__(self, model: str, done: Callable[[str, str | None], None] | None = None):
        super().__init__()
        self.model = model
        self.done = done


class LoadNote(Message):
    """What the load (or restart) in progress is doing that takes long; posted from the client's reader
    thread."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text


class RunCommand(Message):
    """Run a slash command (from the command palette)."""

    def __init__(self, command: str):
        super().__init__()
        self.command = command


class MessageAction(Message):
    """Act on one message of the chat shown: "edit" it, "fork" the chat there, or move to its previous
    ("prev") or next ("next") version."""

    def __init__(self, message, action: str):
        super().__init__()
        self.message = message
        self.action = action
