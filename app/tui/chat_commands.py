"""The slash commands of the chat screen: `await ChatCommands(screen, ...).run("/clear")`.

Typed in the input, chosen in the command palette or bound to keys, every command runs here. The
handlers act on the chat screen's current conversation through the controller, push screens and post
requests upward (LoadModel); parsing, completion and help text live in commands.py. What they need of
the screen is `ChatHost` (the chat screen is one), so this module does not import the screen's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from textual.app import App
from textual.message import Message as TextualMessage

from nanochat.app.controller import Chat, ChatController, describe_settings, setting_value
from nanochat.app.conversation import ChatError, Message
from nanochat.app.export import model_name
from nanochat.app.options import on_off
from nanochat.app.tui import commands as slash
from nanochat.app.tui.messages import LoadModel
from nanochat.app.tui.screens import (BenchScreen, ConfirmScreen, HelpScreen, HistoryScreen, ModelPicker, TextPrompt,
                                      ThemePicker)
from nanochat.app.tui.widgets import code_blocks
from nanochat.themes import THEME_NAMES


class ChatHost(Protocol):
    """The screen the commands act on (ChatScreen): its controller and current conversation, and the
    changes to its views that a command makes."""

    controller: ChatController

    @property
    def app(self) -> App: ...

    @property
    def current(self) -> Chat: ...

    def notify(self, message: str, *, title: str = "", severity: str = "information",
               timeout: float | None = None, markup: bool = True) -> None: ...

    def post_message(self, message: TextualMessage) -> bool: ...

    async def new_conversation(self, title: str = "") -> Chat: ...

    def rename_conversation(self, conv: Chat, title: str) -> None: ...

    async def delete_conversation(self, conv: Chat) -> None: ...

    async def clear_conversation(self, conv: Chat) -> None: ...

    async def retry(self, conv: Chat) -> None: ...

    def start_edit(self, message: Message) -> None: ...

    async def fork(self, conv: Chat, message: Message) -> None: ...

    def refresh_chat_status(self) -> None: ...


def parse_value(raw: str):
    """A `key=value` bench override's value: int, float, else the text."""
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


class ChatCommands:
    def __init__(self, screen: ChatHost, exports_dir: Path, discover: Callable[[], list],
                 bench_overrides: dict | None = None):
        self.screen = screen
        self.exports_dir = exports_dir
        self.discover = discover                 # model picker entries (runs in a worker thread)
        self.bench_overrides = dict(bench_overrides or {})
        self.last_export: Path | None = None
        self.handlers: dict[str, Callable[[str], Awaitable[None]]] = {
            "help": self.help, "new": self.new, "rename": self.rename, "delete": self.delete, "retry": self.retry,
            "edit": self.edit, "fork": self.fork, "set": self.set, "think": self.think, "clear": self.clear,
            "history": self.history, "system": self.system, "model": self.model, "bench": self.bench,
            "export": self.export, "copy": self.copy, "theme": self.theme, "exit": self.exit}

    @property
    def controller(self) -> ChatController:
        return self.screen.controller

    def notify(self, message: str, severity: str = "information", timeout: float | None = None) -> None:
        self.screen.notify(message, severity=severity, timeout=timeout)

    async def run(self, text: str) -> None:
        parsed = slash.parse(text)
        if parsed is None:
            return
        name, arg = parsed
        handler = self.handlers.get(name)
        if handler is None:
            self.notify(slash.unknown_message(name), severity="warning")
            return
        await handler(arg)

    # ------------------------------------------------------------------ conversations
    async def help(self, arg: str) -> None:
        await self.screen.app.push_screen(HelpScreen(slash.help_markdown(THEME_NAMES)))

    async def new(self, arg: str) -> None:
        await self.screen.new_conversation(arg)

    async def rename(self, arg: str) -> None:
        conv = self.screen.current
        if arg:
            self.screen.rename_conversation(conv, arg)
            return

        def done(title: str | None) -> None:
            if title:
                self.screen.rename_conversation(conv, title)

        await self.screen.app.push_screen(TextPrompt("Rename conversation", conv.title), done)

    async def delete(self, arg: str) -> None:
        conv = self.screen.current

        async def done(yes: bool | None) -> None:
            if yes:
                await self.screen.delete_conversation(conv)

        await self.screen.app.push_screen(ConfirmScreen(f"Delete “{conv.title}”?"), done)

    async def clear(self, arg: str) -> None:
        await self.screen.clear_conversation(self.screen.current)
        self.notify("Conversation cleared")

    async def retry(self, arg: str) -> None:
        await self.screen.retry(self.screen.current)

    async def edit(self, arg: str) -> None:
        conv = self.screen.current
        mine = [m for m in conv.path if m.role == "user"]
        if not mine:
            self.notify("There is no message of yours to edit", severity="warning")
            return
        self.screen.start_edit(mine[-1])

    async def fork(self, arg: str) -> None:
        conv = self.screen.current
        if not conv.path:
            self.notify("Nothing to fork yet", severity="warning")
            return
        await self.screen.fork(conv, conv.path[-1])

    async def set(self, arg: str) -> None:
        conv = self.screen.current
        if not arg:
            self.notify(f"This chat: {describe_settings(self.controller.sampling_for(conv), conv.settings)}",
                        timeout=8)
            return
        name, _, raw = arg.partition(" ")
        raw = raw.strip()
        if not raw:
            self.notify(f"/set {name}: give a value, or - to use the default again", severity="warning")
            return
        try:
            value = None if raw == "-" else setting_value(name, raw)
            self.controller.set_setting(conv, name, value)
        except (ChatError, ValueError) as e:
            self.notify(f"/set {name}: {e}", severity="error")
            return
        self.screen.refresh_chat_status()
        self.notify(f"{name} = {raw}" if value is not None else f"{name}: back to the default")

    async def think(self, arg: str) -> None:
        conv = self.screen.current
        model = self.controller.model
        if not arg:
            state = {True: "on", False: "off"}.get(conv.settings.get("think"), "the model's default")
            self.notify(f"Thinking in this chat: {state} (/think on, off, or - for the default)")
            return
        try:
            on = None if arg == "-" else on_off(arg)
        except ValueError as e:
            self.notify(f"/think: {e}", severity="error")
            return
        self.controller.set_thinking(conv, on)
        self.screen.refresh_chat_status()
        said = {True: "Thinking on", False: "Thinking off", None: "Thinking: the model's default"}[on]
        if model is not None and not model.thinking_switch:
            self.notify(f"{said} for this chat, but {model_name(model.model)}'s chat template has no thinking "
                        "switch (enable_thinking): nothing changes with this model", severity="warning", timeout=8)
        else:
            self.notify(f"{said} for this chat, from its next reply")

    async def history(self, arg: str) -> None:
        await self.screen.app.push_screen(HistoryScreen(self.screen.current))

    async def system(self, arg: str) -> None:
        conv = self.screen.current
        if not arg:
            self.notify(f"System prompt: {conv.system_prompt or '(none)'}")
            return
        prompt = None if arg == "-" else arg
        try:
            self.controller.set_system_prompt(conv, prompt)
        except ChatError as e:
            self.notify(str(e).capitalize(), severity="warning")
            return
        self.notify("System prompt removed" if prompt is None else "System prompt set")

    async def export(self, arg: str) -> None:
        tree, target = slash.parse_export(arg)
        try:
            path = self.controller.export(self.screen.current, self.exports_dir, tree, target)
        except ChatError as e:
            self.notify(f"/export: {e}", severity="error")
            return
        self.last_export = path
        self.notify(f"Exported to {path}", timeout=8)

    async def copy(self, arg: str) -> None:
        replies = [m for m in self.screen.current.path if m.role == "assistant" and m.content]
        if not replies:
            self.notify("Nothing to copy yet", severity="warning")
            return
        text = replies[-1].content
        if arg.strip() == "code":
            blocks = code_blocks(text)
            if not blocks:
                self.notify("The last reply has no code block", severity="warning")
                return
            text = blocks[-1]
        self.screen.app.copy_to_clipboard(text)
        self.notify("Copied to the clipboard")

    # ------------------------------------------------------------------ engine
    async def model(self, arg: str) -> None:
        if arg:
            self.screen.post_message(LoadModel(arg))    # the app loads it
            return
        app = self.screen.app
        if isinstance(app.screen, ModelPicker):
            return
        current = self.controller.model
        await app.push_screen(ModelPicker(self.discover, model_name(current.model if current else None)))

    async def bench(self, arg: str) -> None:
        tier = "fast"
        overrides = dict(self.bench_overrides)
        for word in arg.split():
            if "=" in word:
                key, _, value = word.partition("=")
                overrides[key] = parse_value(value)
            elif word in slash.BENCH_TIERS:
                tier = word
            else:
                self.notify(f"/bench: unknown tier {word!r} (use {', '.join(slash.BENCH_TIERS)})", severity="warning")
                return
        if self.controller.model is None:
            self.notify("Load a model first (/model)", severity="error")
            return
        if self.controller.generating:
            self.notify("Wait for the replies in progress (or cancel them) before a bench", severity="warning")
            return
        await self.screen.app.push_screen(BenchScreen(self.controller.client, tier, overrides))

    # ------------------------------------------------------------------ app
    async def theme(self, arg: str) -> None:
        app = self.screen.app
        if arg:
            if arg not in app.available_themes:
                self.notify(f"Unknown theme {arg!r}; try one of: {', '.join(THEME_NAMES)}", severity="warning")
                return
            app.theme = arg
            return
        names = list(THEME_NAMES) + sorted(n for n in app.available_themes if n not in THEME_NAMES)
        await app.push_screen(ThemePicker(names, app.theme))

    async def exit(self, arg: str) -> None:
        self.screen.app.exit()
