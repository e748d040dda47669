"""The nanochat Textual app: builds the chat controller and the chat screen, and runs the engine's life.

Threads: the UI thread never waits on the engine. The engine runs in its own process behind an
EngineClient; token events and stats arrive on the client's reader thread, which only drops them in
the controller's inbox, and the stream tick drains that and draws what it brought in one batch (one
frame, plus the one Textual adds when a growing paragraph changes height).

Those frames are what the TUI costs the engine, since both share the CPU. So the tick keeps the UI
thread to a budget: it comes every 1/STREAM_HZ s while drawing is cheap, and less often when the
last interval cost more than UI_SHARE of a core (a long chat, a big terminal, a slow machine), but
at least every MAX_TICK s; a reply's first token shows at once. On a 2-core machine streaming
300 tok/s through a long chat that is about one tick a second, a few hundred tokens each: faster than
anyone reads. Each frame also evicts the engine's data from the caches they share: at 2 ticks a
second the engine lost 5-13% in later replies on AVX-512 (benchmarks/tui_vs_headless.py). The gauges
take new engine stats at most every STATS_EVERY s, and Python's garbage collector waits for the
replies to end. The UI thread itself runs at a low priority (yield_to_engine), so that it draws in
the gaps the engine leaves.
Model loads and engine restarts are blocking client calls, run in worker threads. What a load does
that makes it slow (compiling the kernels for this machine, repacking a new file's weights) comes from
the client's reader thread as a LoadNote, and shows beside "loading" until the load ends.

Data flows down (the controller and settings into screens, `engine_status` into the gauges); news
flows up as messages (the controller's through TuiObserver, LoadModel from the picker and /model).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import App
from textual.reactive import var
from textual.timer import Timer

from nanochat.app.controller import ChatController, EngineState
from nanochat.app.export import model_name
from nanochat.app.options import sampling_options
from nanochat.app.paths import Paths, get_paths
from nanochat.app.settings import Settings
from nanochat.app.store import open_store
from nanochat.app.terminal_text import sanitize
from nanochat.app.tui.chat_screen import ChatScreen
from nanochat.app.tui.messages import (EngineChanged, EngineStopped, LoadModel, LoadNote, StorageChanged,
                                       TuiObserver, TurnFinished, TurnStarted)
from nanochat.app.tui.recovery import offer_recovery
from nanochat.app.tui.widgets import EngineStatus, InputHistory
from nanochat.engine.output import EngineStats
from nanochat.engine.serve.client import EngineClient
from nanochat.engine.serve.protocol import one_line
from nanochat.themes import DEFAULT_THEME, register_themes

STREAM_HZ = 10       # the most stream ticks a second
UI_SHARE = 0.02      # of one core: the UI thread's budget while replies stream
MAX_TICK = 1.0       # seconds: the longest wait between ticks, however slow drawing is
STATS_EVERY = 1.0    # seconds between gauge updates while the engine is busy
GC_DEFER_MAX = 30.0  # seconds: the longest streaming holds off Python's cyclic garbage collector
UI_NICE = 19         # the drawing thread's nice value: it yields to the engine (see yield_to_engine)


def yield_to_engine() -> None:
    """Lower the calling (drawing) thread's priority to nice UI_NICE, on Linux, where a thread has its
    own. The app's drawing then runs in the gaps the engine leaves (its Python between kernel calls)
    instead of preempting a kernel thread, which stalls the whole step (on 2 cores, AVX2 build: the
    engine at 85-96% of its headless tok/s per reply without it, 95-100% with it; medians of 8 rounds
    of benchmarks/tui_vs_headless.py). Typing still echoes in 20-100 ms while a reply streams.
    Irreversible without privileges, so the engine is started from a thread of its own (EngineClient)
    and keeps its priority."""
    if sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(UI_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
        except OSError:
            pass   # not allowed here (a sandbox): drawing keeps the default priority


def next_tick(spent: float, awaiting_first_token: bool) -> float:
    """Seconds to the next stream tick, after an interval whose UI-thread CPU time was `spent`: soon
    while a reply waits for its first token, then as often as UI_SHARE allows."""
    if awaiting_first_token:
        return 1 / STREAM_HZ
    return min(MAX_TICK, max(1 / STREAM_HZ, spent / UI_SHARE))


def engine_labels(controller: ChatController, note: str | None = None) -> tuple[str, str, bool]:
    """(model, detail, busy) for the gauges, from what the engine is doing; `note`: the slow work of the
    load or restart running (a kernel compile)."""
    state, info = controller.engine_state, controller.model
    name = model_name(info.model if info is not None else None)
    if state is EngineState.LOADING:
        loading = f"loading {model_name(controller.job_model)}"
        return name, f"{loading}: {note}" if note else f"{loading}…", True
    if state is EngineState.RESTARTING:
        return name, f"restarting the engine: {note}" if note else "restarting the engine…", True
    if state is EngineState.STOPPED:
        return name, "engine stopped", False
    if info is None:
        return name, "", False
    device = info.device if info.tensor_parallel_size == 1 else f"{info.device} × {info.tensor_parallel_size} ranks"
    only = "" if info.writes_text else "embeddings only"   # before a message is sent and refused
    return name, " · ".join(x for x in (info.arch, device, info.dtype, only) if x), False


class NanochatApp(App):
    TITLE = "nanochat"
    CSS_PATH = ["app.tcss", "screens.tcss"]

    engine_status: var[EngineStatus] = var(EngineStatus())

    def __init__(self, client: EngineClient | None = None, paths: Paths | None = None,
                 settings: Settings | None = None, model: str | None = None, engine_config: dict | None = None,
                 sampling: dict | None = None, system_prompt: str | None = None,
                 discover: Callable[[], list] | None = None, bench_overrides: dict | None = None):
        super().__init__()
        self.paths = paths or get_paths()   # main() made the folders (where the home is writable)
        self.settings = settings if settings is not None else Settings.load(self.paths.settings_file)
        self.owns_client = client is None          # a client we start is one we stop
        self.client = client if client is not None else EngineClient()
        self.startup_model = model
        store, self._store_warning = open_store(self.paths.chat_db)
        if sampling is None:
            sampling = sampling_options(None, self.settings)
        self.controller = ChatController(
            self.client, store, sampling, system_prompt if system_prompt is not None else self.settings.system_prompt,
            engine_config)
        self.chat_screen = ChatScreen(self.controller, InputHistory(self.paths.input_history), self.paths.exports_dir,
                                      discover or self.discover_models, bench_overrides)
        self.observer = TuiObserver(self.chat_screen)
        self.controller.observer = self.observer
        self._tick_cpu = 0.0                        # the UI thread's CPU time at the last stream tick
        self._tick_timer: Timer | None = None       # the next stream tick; None while one runs
        self._hurry = False                         # a turn began during the running tick
        self._stats: EngineStats | None = None      # engine stats the gauges have not shown yet
        self._stats_at = 0.0                        # when the gauges last took stats
        self._gc_deferred_at: float | None = None   # when streaming turned the garbage collector off
        register_themes(self)
        self.theme = self.settings.theme if self.settings.theme in self.available_themes else DEFAULT_THEME

    def get_default_screen(self) -> ChatScreen:
        return self.chat_screen

    def notify(self, message: str, *, title: str = "", severity: str = "information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Every notification (a screen's or a widget's notify comes here too) is shown through the
        sanitizer, and as plain text whatever `markup` says: it may quote a title, a model's name or an
        error, where "[/]" is not markup."""
        super().notify(sanitize(message), title=sanitize(title), severity=severity, timeout=timeout, markup=False)

    def on_mount(self) -> None:
        self.engine_status = EngineStatus(*engine_labels(self.controller), stats=self.client.stats(),
                                          last_ttft=self.controller.last_ttft())
        self._tick_cpu = time.thread_time()
        self._tick_timer = self.set_timer(1 / STREAM_HZ, self.stream_tick)
        if self.controller.store.damaged is not None:   # the user decides what becomes of the file
            offer_recovery(self, self.controller.store, self._store_warning)
        elif self._store_warning:   # keep working, but say loudly that nothing will be saved
            self.notify(self._store_warning, severity="error", timeout=30)
        for warning in self.settings.warnings:
            self.notify(warning, severity="warning")
        if self.controller.model is None and self.startup_model:
            self.chat_screen.load_pending = True
            self.startup_load(self.startup_model)
        elif self.controller.model is None:
            self.notify("No model loaded: pick one (Ctrl+L or /model)", severity="warning")
            self.call_later(self.chat_screen.commands.run, "/model")

    def on_unmount(self) -> None:
        if self._gc_deferred_at is not None:
            gc.enable()
        # Quitting mid-reply keeps the partial replies (marked cancelled); no engine process outlives us.
        self.controller.close()
        lost = self.controller.store.close()
        if lost:   # Textual prints it on stderr once the terminal is the shell's again
            self.exit(self.return_value, self.return_code or 1, message=Text(sanitize(f"nanochat: {lost}")))
        if self.owns_client:
            self.client.shutdown()

    # ------------------------------------------------------------------ engine status
    def refresh_engine_status(self) -> None:
        model, detail, busy = engine_labels(self.controller, self.chat_screen.load_note)
        self.engine_status = replace(self.engine_status, model=model, detail=detail, busy=busy)

    def post_load_note(self, text: str) -> None:
        """A load's `status` callback (any thread)."""
        self.post_message(LoadNote(text))

    @on(LoadNote)
    def _load_note(self, message: LoadNote) -> None:
        screen = self.chat_screen
        if screen.load_pending or self.controller.engine_state in (EngineState.LOADING, EngineState.RESTARTING):
            screen.load_note = message.text   # (a note that comes after its load ended is dropped)
            self.refresh_engine_status()
            screen.show_load_note(message.text)

    async def stream_tick(self) -> None:
        """Drain the controller and draw what it brought (reply text, gauges) as one batch; then wait
        for the next tick as long as the UI thread's budget asks."""
        self._tick_timer = None   # this tick schedules the next
        try:
            self.controller.drain()
            news = self.observer.take()
            self._stats = news.stats or self._stats
            # at most every STATS_EVERY s while the engine works; an idle engine's final numbers at once
            show = self._stats is not None and (not self._stats.running
                                                or time.monotonic() - self._stats_at >= STATS_EVERY)
            with self.batch_update():
                if show:
                    self._stats_at = time.monotonic()
                    self.engine_status = replace(self.engine_status, stats=self._stats)
                    self._stats = None
                await self.chat_screen.show_replies(news.replies)
            self._pace_gc(self.controller.generating)
        finally:
            now = time.thread_time()
            spent, self._tick_cpu = now - self._tick_cpu, now   # since the last tick: its frames, typing
            delay = 1 / STREAM_HZ if self._hurry else next_tick(spent, self.controller.awaiting_first_token)
            self._hurry = False
            self._tick_timer = self.set_timer(delay, self.stream_tick)

    @on(TurnStarted)
    def _turn_started(self) -> None:
        """Its first token shows at once: the tick already scheduled may be up to MAX_TICK away."""
        if self._tick_timer is None:
            self._hurry = True
        else:
            self._tick_timer.stop()
            self._tick_timer = self.set_timer(1 / STREAM_HZ, self.stream_tick)

    def _pace_gc(self, streaming: bool) -> None:
        """Python's cyclic garbage collector waits while replies stream: a full collection of the app's
        objects takes 50-70 ms of the UI thread, about one a turn, and the engine loses that time. It
        runs when the replies end (the engine idle), or every GC_DEFER_MAX s of streaming."""
        now = time.monotonic()
        if streaming and self._gc_deferred_at is None and gc.isenabled():
            gc.disable()
            self._gc_deferred_at = now
        elif self._gc_deferred_at is not None and (not streaming or now - self._gc_deferred_at > GC_DEFER_MAX):
            gc.collect()
            if streaming:
                self._gc_deferred_at = now
            else:
                gc.enable()
                self._gc_deferred_at = None

    @on(EngineChanged)
    def _engine_changed(self) -> None:
        if self.controller.engine_state not in (EngineState.LOADING, EngineState.RESTARTING):
            self.chat_screen.load_note = None   # the job it was about has ended
        self.refresh_engine_status()

    @on(EngineStopped)
    def _engine_stopped(self, message: EngineStopped) -> None:
        self._stats = None    # its last reports are void (one not shown yet included)
        self.engine_status = replace(self.engine_status, stats=EngineStats())
        self.notify(f"engine stopped: {message.reason}; your next message restarts it", severity="error",
                    timeout=30)

    @on(StorageChanged)
    def _storage_changed(self, message: StorageChanged) -> None:
        if message.warning is not None:
            self.notify(message.warning, severity="error", timeout=30)
        else:
            self.notify(f"Chats are saved again to {self.controller.store.path}")

    @on(TurnFinished)
    def _turn_finished(self, message: TurnFinished) -> None:
        stats = message.turn.reply.stats
        if message.turn.kept and stats is not None and stats.ttft is not None:
            self.engine_status = replace(self.engine_status, last_ttft=stats.ttft)

    # ------------------------------------------------------------------ models
    def discover_models(self) -> list:
        """Entries for the model picker (runs in a worker thread)."""
        from nanochat.models.formats.catalog import ModelEntry, discover_models

        recent = list(self.settings.recent_models)
        entries = discover_models([self.paths.models_dir, Path.cwd() / "models"], recent=recent)
        known = {e.path for e in entries}
        for model in recent:   # hub ids and paths the catalog could not describe
            if model not in known and not Path(model).exists():
                entries.append(ModelEntry(model, model, "hub", origin="recent"))
        return entries

    async def load_model(self, model: str) -> str | None:
        """Load `model` in a worker thread; None on success, else why not (the previous model stays).
        Then the message that waited for it goes out, or back to the input."""
        self.chat_screen.load_pending = True
        error = None
        try:
            await asyncio.to_thread(self.controller.load_model, model, status=self.post_load_note)
        except Exception as e:   # a bad file, a bad id, out of memory, a load already running: one line
            error = one_line(e)
            self.notify(f"could not load {model}: {error}", severity="error", timeout=10)
        finally:
            self.chat_screen.load_pending, self.chat_screen.load_note = False, None
            self.refresh_engine_status()
        if error is None:
            self.settings.remember_model(model)
            self._save_settings()
            self.notify(f"Loaded {model_name(model)}")
        await self.chat_screen.engine_ready(None if error is None else "the model did not load")
        return error

    @on(LoadModel)
    def _load_requested(self, message: LoadModel) -> None:
        self.run_worker(self._load_for(message), group="load")

    async def _load_for(self, request: LoadModel) -> None:
        error = await self.load_model(request.model)
        if request.done is not None:
            request.done(request.model, error)

    @work(group="load")
    async def startup_load(self, model: str) -> None:
        if await self.load_model(model) is not None:
            await self.chat_screen.commands.run("/model")

    # ------------------------------------------------------------------ settings
    def watch_theme(self, name: str) -> None:
        if self.settings.theme != name and name in self.available_themes:
            self.settings.theme = name
            self._save_settings()

    def _save_settings(self) -> None:
        try:
            self.settings.save(self.paths.settings_file)
        except OSError as e:
            self.notify(f"could not save settings: {one_line(e)}", severity="warning")
