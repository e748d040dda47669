"""An in-process engine thread: owns the LLMEngine, takes commands from an inbox, streams events.

Any thread (a Textual worker, asyncio via `async for`, a plain thread) submits requests and reads
their events; only the engine thread touches torch. Commands: submit, cancel, load model, release
session, call (run a function on the engine, e.g. a bench), shutdown.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from nanochat.engine.output import EngineStats, TokenEvent
from nanochat.engine.sampling_params import SamplingParams

STATS_INTERVAL = 0.25   # seconds between periodic engine-stats reports


class RequestHandle:
    """The event stream of one request. Iterate (blocking) or `async for` over its TokenEvents."""

    def __init__(self, request_id: str, owner: "EngineThread",
                 on_event: Callable[[TokenEvent], None] | None = None):
        self.request_id = request_id
        self._owner = owner
        self._queue: queue.Queue[TokenEvent] = queue.Queue()
        self._on_event = on_event
        self.done = threading.Event()
        self.final: TokenEvent | None = None

    def _deliver(self, event: TokenEvent) -> None:
        if event.finished:
            self.final = event
        self._queue.put(event)
        if self._on_event is not None:
            self._on_event(event)
        if event.finished:
            self.done.set()

    def cancel(self) -> None:
        self._owner.cancel(self.request_id)

    def __iter__(self):
        while True:
            event = self._queue.get()
            yield event
            if event.finished:
                return

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        while True:
            event = await loop.run_in_executor(None, self._queue.get)
            yield event
            if event.finished:
                return

    def result(self, timeout: float | None = None) -> tuple[str, list[int], TokenEvent]:
        """Block until finished: (text, token ids, final event)."""
        text, ids = [], []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            event = self._queue.get(timeout=remaining)
            text.append(event.text)
            if event.token_id is not None:
                ids.append(event.token_id)
            if event.finished:
                return "".join(text), ids, event


@dataclass
class _Command:
    kind: str
    args: tuple = ()
    future: Future = field(default_factory=Future)


class EngineThread:
    """Owns an LLMEngine on a background thread. `engine_factory(model, **config)` builds engines."""

    def __init__(self, model: str | None = None, engine_factory=None, **config):
        from nanochat.engine.llm_engine import LLMEngine

        self._factory = engine_factory or LLMEngine
        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._stats_listeners: list[Callable[[EngineStats], None]] = []
        self._stats = EngineStats()
        self._lock = threading.Lock()
        self.engine = None
        self.model_name: str | None = None
        self._thread = threading.Thread(target=self._loop, name="nanochat-engine", daemon=True)
        self._thread.start()
        if model is not None:
            self.load_model(model, **config).result()

    # ------------------------------------------------------------------ public API (any thread)
    def load_model(self, model: str, **config) -> Future:
        """Load (or switch to) a model; in-flight requests are cancelled. The future raises on failure
        and the previous model stays loaded."""
        return self._send("load", model, config)

    def submit(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               session_id: str | None = None,
               on_event: Callable[[TokenEvent], None] | None = None) -> RequestHandle:
        request_id = f"r{next(self._ids)}"
        handle = RequestHandle(request_id, self, on_event)
        with self._lock:
            self._handles[request_id] = handle
        self._send("submit", request_id, prompt, sampling_params or SamplingParams(), session_id)
        return handle

    def cancel(self, request_id: str) -> None:
        self._send("cancel", request_id)

    def release_session(self, session_id: str) -> Future:
        return self._send("release_session", session_id)

    def call(self, fn: Callable, *args) -> Future:
        """Run fn(engine, *args) on the engine thread (between steps); the future holds its result."""
        return self._send("call", fn, args)

    def add_stats_listener(self, fn: Callable[[EngineStats], None]) -> None:
        self._stats_listeners.append(fn)

    def stats(self) -> EngineStats:
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._send("shutdown")
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _send(self, kind: str, *args) -> Future:
        cmd = _Command(kind, args)
        self._inbox.put(cmd)
        return cmd.future

    def _loop(self) -> None:
        last_stats = 0.0
        while True:
            busy = self.engine is not None and self.engine.has_unfinished()
            try:
                cmd = self._inbox.get(block=not busy, timeout=None if busy else STATS_INTERVAL)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd.kind == "shutdown":
                    self._cancel_all("abort")
                    cmd.future.set_result(None)
                    return
                self._handle(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine is not None and self.engine.has_unfinished():
                try:
                    for event in self.engine.step():
                        self._dispatch(event)
                except Exception as e:   # a failed step must not leave requests hanging
                    self._cancel_all("error", str(e))
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL:
                last_stats = now
                self._publish_stats()

    def _handle(self, cmd: _Command) -> None:
        try:
            result = getattr(self, f"_cmd_{cmd.kind}")(*cmd.args)
        except Exception as e:
            cmd.future.set_exception(e)
        else:
            cmd.future.set_result(result)

    def _cmd_load(self, model: str, config: dict):
        new = self._factory(model, **config)      # raises on failure: the old engine stays
        self._cancel_all("abort")
        self.engine, self.model_name = new, model
        self._publish_stats()
        return new

    def _cmd_submit(self, request_id, prompt, sp, session_id):
        handle = self._handles.get(request_id)
        if self.engine is None:
            self._finish(request_id, "error", "no model is loaded")
            return
        try:
            self.engine.add_request(prompt, sp, request_id=request_id, session_id=session_id)
        except ValueError as e:
            self._finish(request_id, "error", str(e))
        return handle

    def _cmd_cancel(self, request_id):
        if self.engine is not None:
            event = self.engine.abort(request_id)
            if event is not None:
                self._dispatch(event)

    def _cmd_release_session(self, session_id):
        if self.engine is not None:
            self.engine.release_session(session_id)

    def _cmd_call(self, fn, args):
        return fn(self.engine, *args)

    def _dispatch(self, event: TokenEvent) -> None:
        with self._lock:
            handle = self._handles.get(event.request_id)
            if event.finished:
                self._handles.pop(event.request_id, None)
        if handle is not None:
            handle._deliver(event)

    def _finish(self, request_id: str, reason: str, message: str = "") -> None:
        event = TokenEvent(request_id, None, "", True, reason, error=message)
        self._dispatch(event)

    def _cancel_all(self, reason: str, message: str = "") -> None:
        if self.engine is not None:
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
        with self._lock:
            pending = list(self._handles)
        for request_id in pending:
            self._finish(request_id, reason, message)

    def _publish_stats(self) -> None:
        if self.engine is None:
            return
        self._stats = self.engine.stats()
        for fn in list(self._stats_listeners):
            try:
                fn(self._stats)
            except Exception:
                pass   # a listener's bug must not stop the engine
