"""The nanochat Textual app: conversations, streamed chat, live gauges, model picker, slash commands.

Threads: the UI thread never touches torch. Requests go to the EngineThread, whose callbacks run on
the engine thread and never wait for the UI: token events go into a locked buffer that a UI timer
drains (STREAM_HZ batches a second), engine stats arrive through `post_message` (thread-safe, and
unlike `call_from_thread` it does not block the engine thread until the UI has run the callback) and
are shown on the same tick, so a streaming reply costs at most STREAM_HZ frames a second: a Textual
frame of this layout takes ~13 ms of the GIL the engine thread also needs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message as TextualMessage
from textual.reactive import reactive
from textual.widgets import ContentSwitcher, Footer, Header, Label, OptionList

from nanochat.app.tui import commands as slash
from nanochat.app.tui.commands import NanochatCommands
from nanochat.app.tui.conversation import (REPLAY_NOTE, Conversation, Message, code_blocks, completed_exchanges,
                                           new_session, write_export)
from nanochat.app.tui.screens import (BenchScreen, ConfirmScreen, HelpScreen, HistoryScreen, ModelPicker,
                                      TextPrompt, ThemePicker)
from nanochat.app.tui.widgets import ChatInput, ChatView, CommandHints, ConversationList, GaugePanel, InputHistory
from nanochat.themes import DEFAULT_THEME, THEME_NAMES, register_themes

DEFAULT_TITLE = "New chat"
STREAM_HZ = 10


class StatsArrived(TextualMessage):
    def __init__(self, stats):
        super().__init__()
        self.stats = stats


def model_display_name(model: str | None) -> str:
    if not model:
        return "no model"
    from nanochat.models.catalog import EMBEDDED_FILE, EMBEDDED_NAME

    p = Path(model)
    if p.name == EMBEDDED_FILE:
        return EMBEDDED_NAME
    return p.name if (p.suffix or p.exists()) else model


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or e.__class__.__name__


class NanochatApp(App):
    TITLE = "nanochat"
    CSS_PATH = ["app.tcss", "screens.tcss"]
    COMMANDS = App.COMMANDS | {NanochatCommands}
    BINDINGS = [
        Binding("escape", "cancel_reply", "Cancel reply"),
        Binding("ctrl+n", "new_conversation", "New chat"),
        Binding("ctrl+l", "pick_model", "Model"),
        Binding("f2", "focus_conversations", "Chats"),
        Binding("f1", "help", "Help"),
    ]

    engine_stats = reactive(None, always_update=True)
    last_ttft: reactive[float | None] = reactive(None)     # seconds, the last finished turn
    current_id: reactive[int | None] = reactive(None)
    model_loading = reactive(False)

    def __init__(self, engine_thread=None, paths=None, settings=None, model: str | None = None,
                 engine_config: dict | None = None, sampling: dict | None = None, system_prompt: str | None = None,
                 discover: Callable[[], list] | None = None, bench_overrides: dict | None = None):
        super().__init__()
        from nanochat.app.paths import get_paths

        self.paths = (paths or get_paths()).ensure()
        if settings is None:
            from nanochat.app.settings import Settings
            settings = Settings.load(self.paths.settings_file)
        self.settings = settings
        self._owns_engine = engine_thread is None
        if engine_thread is None:
            from nanochat.engine.engine_thread import EngineThread
            engine_thread = EngineThread()
        self.engine_thread = engine_thread
        self.startup_model = model
        self.engine_config = dict(engine_config or {})
        self.sampling = dict(sampling) if sampling is not None else {
            "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
            "max_tokens": settings.max_tokens}
        self.default_system_prompt = system_prompt if system_prompt is not None else settings.system_prompt
        self._discover = discover
        self.bench_overrides = dict(bench_overrides or {})
        self.conversations: dict[int, Conversation] = {}
        self.generation = 0               # bumps on every model load: sessions of older loads are stale
        self.last_export: Path | None = None
        self.store = None
        self._listening = False
        self.input_history = InputHistory(self.paths.input_history)
        # Token events wait here (engine thread -> UI) and the UI takes them in batches at most
        # STREAM_HZ times a second: redrawing per token would eat the CPU the engine needs.
        self._token_lock = threading.Lock()
        self._token_events: dict[int, list] = {}
        self._pending_stats = None        # the latest engine stats, shown on the next tick
        register_themes(self)
        self.theme = settings.theme if settings.theme in self.available_themes else DEFAULT_THEME

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="sidebar"):
                yield Label("Conversations", classes="section")
                yield ConversationList(id="conversations")
                yield Label("n/r/d: new/rename/delete", classes="hint")
            with Vertical(id="main"):
                yield ContentSwitcher(id="chats")
                yield CommandHints(id="hints")
                yield ChatInput(self.input_history, self.theme_names(), id="input")
            yield GaugePanel(id="gauges", classes="gauges")
        yield Footer()

    async def on_mount(self) -> None:
        from nanochat.app.store import ChatStore, StoreError

        try:
            self.store = ChatStore(self.paths.chat_db)
        except StoreError as e:   # keep working, but say loudly that nothing will be saved
            self.store = ChatStore(":memory:")
            self.notify(f"{e}; conversations will NOT be saved this session", severity="error", timeout=30)
        for stored in self.store.load_all():
            self.conversations[stored.id] = Conversation.from_stored(stored)
        if not self.conversations:
            self._create_conversation(DEFAULT_TITLE)
        self._refresh_list()
        await self.show_conversation(next(iter(self.conversations)))
        self._listening = True
        self.engine_thread.add_stats_listener(self._stats_listener)
        self.set_interval(1 / STREAM_HZ, self._drain_tokens)
        self.prime_gauges(self.query_one("#gauges", GaugePanel))
        replies = [m for c in self.conversations.values() for m in c.messages if m.stats and m.stats.get("ttft")]
        if replies:   # until this session's first turn: the last one on record
            self.last_ttft = max(replies, key=lambda m: m.created).stats["ttft"]
        if self.engine_thread.engine is None and self.startup_model:
            self.run_worker(self._startup_load(self.startup_model), group="load")
        elif self.engine_thread.engine is None:
            self.notify("No model loaded: pick one (Ctrl+L or /model)", severity="warning")
            self.call_later(self.cmd_model, "")
        for warning in getattr(self.settings, "warnings", []) or []:
            self.notify(warning, severity="warning")
        self.query_one(ChatInput).focus()

    async def on_unmount(self) -> None:
        self._listening = False
        for conv in self.conversations.values():
            reply = conv.pending
            if reply is not None and reply.generated_tokens and self.store is not None:
                # quitting mid-reply: keep what was generated, marked as cancelled
                stats = {"completion_tokens": reply.generated_tokens, "finish_reason": "abort"}
                self.store.add_message(conv.id, "assistant", reply.content, stats, note=reply.note)
            self._drop_session(conv)   # the engine thread may outlive the app (tests, embedding)
        if self.store is not None:
            self.store.close()
        if self._owns_engine:
            self.engine_thread.shutdown()

    # ------------------------------------------------------------------ helpers
    @property
    def current(self) -> Conversation:
        return self.conversations[self.current_id]

    def theme_names(self) -> tuple[str, ...]:
        return THEME_NAMES

    def model_label(self) -> tuple[str, str]:
        engine = self.engine_thread.engine
        if engine is None:
            return "no model", ""
        arch = getattr(getattr(engine, "model_config", None), "arch", None)
        dtype = str(getattr(engine, "dtype", "")).removeprefix("torch.")
        device = str(getattr(engine, "device", ""))
        return model_display_name(self.engine_thread.model_name), " · ".join(x for x in (arch, device, dtype) if x)

    def prime_gauges(self, panel: GaugePanel) -> None:
        panel.model_label, panel.device_label = self.model_label()
        panel.busy = self.model_loading
        panel.last_ttft = self.last_ttft
        stats = self.engine_stats if self.engine_stats is not None else self.engine_thread.stats()
        panel.stats = stats

    def _gauge_panels(self) -> list[GaugePanel]:
        panels: list[GaugePanel] = []
        for screen in self.screen_stack:
            panels.extend(screen.query(GaugePanel))
        return panels

    def chat_view(self, conv: Conversation) -> ChatView | None:
        try:
            return self.query_one(f"#chat-{conv.id}", ChatView)
        except Exception:
            return None

    def _refresh_list(self) -> None:
        self.query_one(ConversationList).set_conversations(list(self.conversations.values()), self.current_id)

    def _refresh_item(self, conv: Conversation) -> None:
        self.query_one(ConversationList).refresh_conversation(conv)

    def _create_conversation(self, title: str) -> Conversation:
        now = time.time()
        cid = self.store.create_conversation(title, self.default_system_prompt, None, created=now)
        conv = Conversation(cid, title, self.default_system_prompt, None, now, now)
        self.conversations = {cid: conv, **self.conversations}   # newest first
        return conv

    # ------------------------------------------------------------------ engine -> UI
    def _stats_listener(self, stats) -> None:          # engine thread
        if self._listening:
            self.post_message(StatsArrived(stats))

    def _token_listener(self, conversation_id: int):
        def on_event(event) -> None:                    # engine thread
            with self._token_lock:
                self._token_events.setdefault(conversation_id, []).append(event)
        return on_event

    async def _drain_tokens(self) -> None:
        """Timer: show the latest stats and hand the token events that arrived since the last tick to
        their conversations (one frame for both)."""
        stats, self._pending_stats = self._pending_stats, None
        if stats is not None and self._listening and stats != self.engine_stats:   # idle engines repeat themselves
            self.engine_stats = stats
        if not self._token_events:
            return
        with self._token_lock:
            batches, self._token_events = self._token_events, {}
        for conversation_id, events in batches.items():
            await self._apply_events(conversation_id, events)

    def on_stats_arrived(self, message: StatsArrived) -> None:
        self._pending_stats = message.stats

    def watch_engine_stats(self, stats) -> None:
        if stats is None:
            return
        for panel in self._gauge_panels():
            panel.stats = stats

    def watch_last_ttft(self, ttft: float | None) -> None:
        for panel in self._gauge_panels():
            panel.last_ttft = ttft

    def watch_model_loading(self, loading: bool) -> None:
        for panel in self._gauge_panels():
            panel.busy = loading

    def watch_theme(self, name: str) -> None:
        if getattr(self.settings, "theme", None) != name and name in self.available_themes:
            self.settings.theme = name
            self._save_settings()

    def _save_settings(self) -> None:
        try:
            self.settings.save(self.paths.settings_file)
        except OSError as e:
            self.notify(f"could not save settings: {_one_line(e)}", severity="warning")

    # ------------------------------------------------------------------ conversations
    async def show_conversation(self, conversation_id: int) -> None:
        conv = self.conversations[conversation_id]
        switcher = self.query_one("#chats", ContentSwitcher)
        if self.chat_view(conv) is None:
            await switcher.add_content(ChatView(conv))
        switcher.current = f"chat-{conv.id}"
        self.current_id = conv.id
        self.sub_title = conv.title
        self.query_one(ConversationList).select_id(conv.id)

    @on(OptionList.OptionSelected, "#conversations")
    async def _conversation_selected(self, event: OptionList.OptionSelected) -> None:
        await self.show_conversation(int(event.option.id))
        self.query_one(ChatInput).focus()

    async def new_conversation(self, title: str = "") -> Conversation:
        conv = self._create_conversation(title or DEFAULT_TITLE)
        self._refresh_list()
        await self.show_conversation(conv.id)
        self.query_one(ChatInput).focus()
        return conv

    def rename_conversation(self, conv: Conversation, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            return
        conv.title = title
        self.store.rename(conv.id, title)
        self._refresh_item(conv)
        if conv.id == self.current_id:
            self.sub_title = title

    def _drop_session(self, conv: Conversation) -> None:
        """Cancel the reply in flight (its events are ignored from now on) and free the KV of the session."""
        if conv.handle is not None:
            conv.handle.cancel()
        conv.handle, conv.pending, conv.pending_user = None, None, None
        if conv.session is not None:
            if conv.session_generation == self.generation:
                self.engine_thread.release_session(conv.session.session_id)
            conv.session = None

    async def delete_conversation(self, conv: Conversation) -> None:
        self._drop_session(conv)
        self.store.delete_conversation(conv.id)
        del self.conversations[conv.id]
        view = self.chat_view(conv)
        if view is not None:
            await view.remove()
        if not self.conversations:
            self._create_conversation(DEFAULT_TITLE)
        self._refresh_list()
        if conv.id == self.current_id or self.current_id not in self.conversations:
            await self.show_conversation(next(iter(self.conversations)))

    async def clear_conversation(self, conv: Conversation) -> None:
        self._drop_session(conv)
        self.store.clear_messages(conv.id)
        conv.messages.clear()
        view = self.chat_view(conv)
        if view is not None:
            await view.clear_messages()
        self._refresh_item(conv)

    # ------------------------------------------------------------------ sending
    @on(ChatInput.Submitted)
    async def _input_submitted(self, event: ChatInput.Submitted) -> None:
        self.query_one(CommandHints).display = False
        text = event.text
        if slash.parse(text) is not None:
            await self.run_command(text)
            return
        if text.lstrip().startswith("//"):
            text = text.lstrip()[1:]
        await self.send_message(text)

    def sampling_params(self):
        from nanochat.engine import SamplingParams

        return SamplingParams(**self.sampling)

    async def send_message(self, text: str, conv: Conversation | None = None) -> bool:
        """Start a turn in `conv` (default: the current one). Returns False when it could not start."""
        from nanochat.engine.chat import send

        conv = conv or self.current
        engine = self.engine_thread.engine
        if engine is None:
            self.notify("No model is loaded: press Ctrl+L or type /model", severity="error")
            return False
        if self.model_loading:
            self.notify("A model is loading; send again when it is ready", severity="warning")
            return False
        if conv.generating:
            self.notify("This conversation is still replying (Esc cancels it)", severity="warning")
            return False
        replay = False
        if conv.session is None or conv.session_generation != self.generation:
            history = completed_exchanges(conv.messages)
            try:
                conv.session = new_session(engine, conv.system_prompt, history)
            except Exception as e:
                self.notify(f"cannot build the chat prompt: {_one_line(e)}", severity="error")
                return False
            conv.session_generation = self.generation
            replay = bool(history)
        try:
            sp = self.sampling_params()
        except ValueError as e:
            self.notify(f"bad sampling settings: {_one_line(e)}", severity="error")
            return False
        user = Message("user", text)
        reply = Message("assistant", "", streaming=True, note=REPLAY_NOTE if replay else "")
        conv.messages += [user, reply]
        view = self.chat_view(conv)
        if view is not None:   # views first: tokens may start arriving as soon as the request is sent
            await view.add_message(user)
            await view.add_message(reply)
        try:
            conv.handle = send(conv.session, self.engine_thread, text, sp, on_event=self._token_listener(conv.id))
        except Exception as e:   # template errors from prepare_turn
            conv.session = None
            conv.messages = conv.messages[:-2]
            if view is not None:
                for m in (user, reply):
                    v = view.view_for(m)
                    if v is not None:
                        await v.remove()
                view.refresh_placeholder()
            self.notify(f"cannot send: {_one_line(e)}", severity="error")
            return False
        conv.pending, conv.pending_user = reply, user
        user.id = self.store.add_message(conv.id, "user", text, created=user.created)
        model = self.engine_thread.model_name
        if conv.model != model:
            conv.model = model
            self.store.set_model(conv.id, model)
        if conv.title == DEFAULT_TITLE:
            self.rename_conversation(conv, text.strip().splitlines()[0][:40])
        self._refresh_item(conv)
        return True

    async def _apply_events(self, conversation_id: int, events: list) -> None:
        conv = self.conversations.get(conversation_id)
        if conv is None or conv.handle is None:
            return
        # Only the reply in flight counts (a dropped one, e.g. after /clear, may still send its abort).
        events = [e for e in events if e.request_id == conv.handle.request_id]
        if not events:
            return
        reply = conv.pending
        reply.generated_tokens += sum(1 for e in events if e.token_id is not None)
        reply.content += "".join(e.text for e in events)
        view = self.chat_view(conv)
        mview = view.view_for(reply) if view is not None else None
        if mview is not None:
            await mview.sync()
        final = next((e for e in events if e.finished), None)
        if final is not None:
            await self._finish_turn(conv, final, view, mview)

    async def _finish_turn(self, conv: Conversation, event, view, mview) -> None:
        from nanochat.engine.chat import turn_stats_from_event

        reply, user = conv.pending, conv.pending_user
        conv.handle, conv.pending, conv.pending_user = None, None, None
        reply.streaming = False
        if reply.generated_tokens == 0:
            # The session forgot the turn (failed or cancelled before any token): so do we.
            for m in (reply, user):
                if m in conv.messages:
                    conv.messages.remove(m)
            if user.id is not None:
                self.store.delete_message(user.id)
            if view is not None:
                for m in (reply, user):
                    v = view.view_for(m)
                    if v is not None:
                        await v.remove()
                view.refresh_placeholder()
            if event.finish_reason == "error":
                self.notify(f"reply failed: {event.error or 'unknown error'}", severity="error", timeout=8)
            else:
                self.notify("Reply cancelled before the first token")
            chat_input = self.query_one(ChatInput)
            if conv.id == self.current_id and not chat_input.text:
                chat_input.set_text(user.content)
        else:
            reply.stats = turn_stats_from_event(event).to_dict()
            reply.id = self.store.add_message(conv.id, "assistant", reply.content, reply.stats,
                                              note=reply.note)
            if event.finish_reason == "error":
                self.notify(f"reply stopped by an error: {event.error}", severity="error", timeout=8)
            if reply.stats.get("ttft") is not None:
                self.last_ttft = reply.stats["ttft"]
            if mview is not None:
                await mview.finish()
        self._refresh_item(conv)

    def action_cancel_reply(self) -> None:
        hints = self.query_one(CommandHints)
        if hints.display:
            hints.display = False
            return
        conv = self.current
        if conv.handle is not None:
            conv.handle.cancel()

    # ------------------------------------------------------------------ models
    def discover_models(self) -> list:
        """Entries for the picker (runs in a worker thread)."""
        if self._discover is not None:
            return self._discover()
        from nanochat.models.catalog import ModelEntry, discover_models

        recent = list(getattr(self.settings, "recent_models", []) or [])
        entries = discover_models([self.paths.models_dir, Path.cwd() / "models"], recent=recent)
        known = {e.path for e in entries}
        for model in recent:   # hub ids and paths the catalog could not describe
            if model not in known and not Path(model).exists():
                entries.append(ModelEntry(model, model, "hub", origin="recent"))
        return entries

    async def load_model(self, model: str) -> bool:
        """Load `model` on the engine thread; True on success. On failure the previous model stays."""
        if self.model_loading:
            self.notify("A model is already loading", severity="warning")
            return False
        self.model_loading = True
        for panel in self._gauge_panels():
            panel.device_label = f"loading {model_display_name(model)}…"
        try:
            await asyncio.wrap_future(self.engine_thread.load_model(model, **self.engine_config))
        except Exception as e:
            self.notify(f"could not load {model}: {_one_line(e)}", severity="error", timeout=10)
            return False
        finally:
            self.model_loading = False
            name, device = self.model_label()
            for panel in self._gauge_panels():
                panel.model_label, panel.device_label = name, device
        # In-flight replies were cancelled by the load; every session's KV went with the old engine.
        self.generation += 1
        for conv in self.conversations.values():
            conv.session = None
        if hasattr(self.settings, "remember_model"):
            self.settings.remember_model(model)
            self._save_settings()
        self.notify(f"Loaded {self.model_label()[0]}")
        return True

    async def _startup_load(self, model: str) -> None:
        if not await self.load_model(model):
            await self.cmd_model("")

    def action_pick_model(self) -> None:
        self.call_later(self.cmd_model, "")

    # ------------------------------------------------------------------ slash commands
    def run_slash_command(self, command: str) -> None:
        """Entry point of the command palette (and bindings): run a slash command soon."""
        self.call_later(self.run_command, command)

    async def run_command(self, text: str) -> None:
        parsed = slash.parse(text)
        if parsed is None:
            return
        name, arg = parsed
        handler = getattr(self, f"cmd_{name}", None)
        if name not in slash.COMMANDS_BY_NAME or handler is None:
            self.notify(slash.unknown_message(name), severity="warning")
            return
        await handler(arg)

    async def cmd_help(self, arg: str) -> None:
        await self.push_screen(HelpScreen(slash.help_markdown(self.theme_names())))

    async def cmd_new(self, arg: str) -> None:
        await self.new_conversation(arg)

    async def cmd_rename(self, arg: str) -> None:
        conv = self.current
        if arg:
            self.rename_conversation(conv, arg)
            return

        def done(title: str | None) -> None:
            if title:
                self.rename_conversation(conv, title)

        await self.push_screen(TextPrompt("Rename conversation", conv.title), done)

    async def cmd_delete(self, arg: str) -> None:
        conv = self.current

        async def done(yes: bool | None) -> None:
            if yes:
                await self.delete_conversation(conv)

        await self.push_screen(ConfirmScreen(f"Delete “{conv.title}”?"), done)

    async def cmd_clear(self, arg: str) -> None:
        await self.clear_conversation(self.current)
        self.notify("Conversation cleared")

    async def cmd_history(self, arg: str) -> None:
        await self.push_screen(HistoryScreen(self.current))

    async def cmd_system(self, arg: str) -> None:
        conv = self.current
        if not arg:
            self.notify(f"System prompt: {conv.system_prompt or '(none)'}")
            return
        if conv.generating:
            self.notify("Wait for the reply (or press Esc) before changing the system prompt", severity="warning")
            return
        prompt = None if arg == "-" else arg
        conv.system_prompt = prompt
        self.store.set_system_prompt(conv.id, prompt)
        # The cached history starts with the old system prompt: the next turn replays with the new one.
        self._drop_session(conv)
        self.notify("System prompt removed" if prompt is None else "System prompt set")

    async def cmd_model(self, arg: str) -> None:
        if arg:
            self.run_worker(self.load_model(arg), group="load")
            return
        if isinstance(self.screen, ModelPicker):
            return
        await self.push_screen(ModelPicker(self.discover_models, model_display_name(self.engine_thread.model_name)))

    async def cmd_bench(self, arg: str) -> None:
        words = arg.split()
        tier = "fast"
        overrides = dict(self.bench_overrides)
        for w in words:
            if "=" in w:
                key, _, value = w.partition("=")
                overrides[key] = _parse_value(value)
            elif w in slash.BENCH_TIERS:
                tier = w
            else:
                self.notify(f"/bench: unknown tier {w!r} (use {', '.join(slash.BENCH_TIERS)})", severity="warning")
                return
        if self.engine_thread.engine is None:
            self.notify("Load a model first (/model)", severity="error")
            return
        if any(c.generating for c in self.conversations.values()):
            self.notify("Wait for the replies in progress (or cancel them) before a bench", severity="warning")
            return
        await self.push_screen(BenchScreen(tier, overrides))

    async def cmd_export(self, arg: str) -> None:
        conv = self.current
        try:
            path = write_export(conv, self.paths.exports_dir, model_display_name(self.engine_thread.model_name))
        except OSError as e:
            self.notify(f"export failed: {_one_line(e)}", severity="error")
            return
        self.last_export = path
        self.notify(f"Exported to {path}", timeout=8)

    async def cmd_copy(self, arg: str) -> None:
        replies = [m for m in self.current.messages if m.role == "assistant" and m.content]
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
        self.copy_to_clipboard(text)
        self.notify("Copied to the clipboard")

    async def cmd_theme(self, arg: str) -> None:
        names = list(self.theme_names()) + sorted(n for n in self.available_themes if n not in self.theme_names())
        if arg:
            if arg not in self.available_themes:
                self.notify(f"Unknown theme {arg!r}; try one of: {', '.join(self.theme_names())}",
                            severity="warning")
                return
            self.theme = arg
            return
        await self.push_screen(ThemePicker(names, self.theme))

    async def cmd_exit(self, arg: str) -> None:
        self.exit()

    # ------------------------------------------------------------------ bindings
    def action_new_conversation(self) -> None:
        self.run_slash_command("/new")

    def action_rename_conversation(self) -> None:
        self.run_slash_command("/rename")

    def action_delete_conversation(self) -> None:
        self.run_slash_command("/delete")

    def action_focus_conversations(self) -> None:
        self.query_one(ConversationList).focus()

    def action_help(self) -> None:
        self.run_slash_command("/help")


def _parse_value(raw: str):
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw
