"""EngineClient: the one way front ends reach the engine, which runs in its own process.

    client = EngineClient()
    info = client.load_model("model.gguf", progress=lambda done, total: ..., status=lambda text: ...)
    chat = client.open_session(system_prompt="Be brief.")
    for event in client.submit_turn(chat, "Hello!", SamplingParams(max_tokens=64)):
        print(event.text, end="")

The engine process (engine/serve/core.py) holds the model, the KV cache, the scheduler and a working
copy of each chat session. The sessions themselves are this side's `Session` records (their state
machine: engine/serve/session.py): transcript, canonical token ids, the engine that holds them. So when
the process dies (kill -9, the OOM killer, a crash in a kernel) nothing is lost: open streams end with
one clear error, and the next request starts a new process, reloads the model and re-opens each
session from its record, whose ids are then prefilled once.

Nothing here imports torch. Calls may come from any thread; event callbacks run on the client's
reader thread and must not block.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from nanochat.engine.config import engine_process_env
from nanochat.engine.output import EngineStats, Reply, TokenEvent
from nanochat.engine.pooling import PoolingParams
from nanochat.engine.sampling_params import SamplingParams
from nanochat.engine.serve.protocol import (Call, EngineDied, EngineError, EngineRestarting, ModelInfo, one_line,
                                            remote_error)
from nanochat.engine.serve.session import (BranchSessions, Incarnation, Session, SessionState, SessionStateError,
                                           check)

# Front ends reach sessions through this module too (the one door).
__all__ = ["AsyncEngineClient", "AsyncRequestStream", "BranchSessions", "EngineClient", "RequestStream", "Session",
           "SessionState", "SessionStateError"]

STDERR_TAIL = 40   # lines of the engine process's stderr kept for the message when it dies


# What an allocation failure leaves on stderr: C++ (torch, the kernels) aborts with std::bad_alloc, the
# allocator and Python name ENOMEM.
MEMORY_SIGNS = ("bad_alloc", "Cannot allocate memory", "can't allocate memory", "MemoryError", "out of memory")


def _memory_hint(signal_name: str, stderr_tail: list[str]) -> str:
    """Why a killed engine probably died: SIGKILL is how the kernel's OOM killer ends a process; an abort
    after an allocation failure (a `ulimit -v`, a container limit) says so in its last words."""
    if any(sign in line for line in stderr_tail[-4:] for sign in MEMORY_SIGNS):
        return " (out of memory: an allocation failed)"
    return " (out of memory?)" if signal_name == "SIGKILL" else ""


class RequestStream:
    """The events of one request: iterate (blocking), or wait with `result()` (asyncio code: AsyncEngineClient)."""

    def __init__(self, client: "EngineClient", request_id: str, on_event: Callable[[TokenEvent], None] | None,
                 session: Session | None = None, replayed: bool = False):
        self.request_id = request_id
        self.session = session
        self.replayed = replayed            # a chat turn whose history is prefilled again (new model or process)
        self.reply = Reply()
        self.done = threading.Event()
        self.lost = False                   # it ended because the engine process died under it
        self._client = client
        self._on_event = on_event
        self._queue: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()

    def _deliver(self, event: TokenEvent) -> None:
        self.reply.add(event)
        if event.finished and self.session is not None and self.session.request_id == self.request_id:
            self.session.end_turn(self.reply)
        self._queue.put(event)
        if self._on_event is not None:
            self._on_event(event)
        if event.finished:
            self.done.set()

    def cancel(self) -> None:
        self._client.cancel(self.request_id)

    def __iter__(self):
        while True:
            event = self._queue.get()
            yield event
            if event.finished:
                return

    def result(self, timeout: float | None = None) -> Reply:
        """Wait for the end; the folded reply (text, ids, final event)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        return self.reply


def _end_connection(conn) -> None:
    """End `conn` in both directions without closing its descriptor: its reader thread wakes (end of file) and
    closes it. (A second socket object on a duplicate of the descriptor shuts the socket down for both.)"""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as dup:
            dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass   # already closed, or the other end is gone: the reader finds out either way


class _Pending:
    def __init__(self, progress: Callable | None, status: Callable[[str], None] | None = None):
        self.future: Future = Future()
        self.progress = progress
        self.status = status


class _Starter:
    """One long-lived thread that starts the engine process and the client's threads. A new process or
    thread takes the scheduling priority (nice value) of the thread that starts it, and a front end may
    lower its own (the TUI's drawing thread yields to the engine); started from here, the engine keeps
    the priority of the thread that created the client, whichever thread (re)starts it."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="nanochat-engine-starter", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.set_result(fn())
            except BaseException as e:
                done.set_exception(e)

    def run(self, fn: Callable[[], object]) -> object:
        done: Future = Future()
        self._jobs.put((fn, done))
        return done.result()


class EngineClient:
    """Starts and talks to the engine process. `in_process=True` runs the same core on a thread of
    this process instead (over the same connection and messages): for embedding and tests, at the
    price that a crash in the engine takes the host down with it.

    `lean=True` (a one-shot): a load that the lean engine can serve (engine/lean.py: a GGUF the full engine has
    loaded before, CPU, fused step; `lean_sampling`, the SamplingParams keywords the caller will use, within what
    it samples) runs it in this process, on the same core and messages, without importing torch; any other load,
    or a lean load that fails, starts the engine process as usual. `lean_used` says which one answered, and
    `lean_refused` why the lean engine did not (None: it did, or was not asked)."""

    def __init__(self, in_process: bool = False, log_path: str | os.PathLike | None = None, lean: bool = False,
                 lean_sampling: dict | None = None):
        self.in_process = in_process
        self.log_path = log_path
        self.lean = lean
        self.lean_sampling = lean_sampling
        self.lean_used = False
        self.lean_refused: str | None = None
        self._lean_plan = None              # the plan the next start serves in this process
        self.model: ModelInfo | None = None
        self.epoch = 0                      # engine incarnations so far (a start or a model load makes one)
        self._incarnation: Incarnation | None = None
        self._config: dict = {}
        self._conn = None
        self._proc: subprocess.Popen | None = None
        self._stderr_thread: threading.Thread | None = None
        self._core_thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._calls = itertools.count(1)
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._streams: dict[str, RequestStream] = {}
        self._sessions: dict[str, Session] = {}
        self._stats = EngineStats()
        self._stats_listeners: list[Callable[[EngineStats], None]] = []
        self._death_listeners: list[Callable[[str], None]] = []
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self._restart_lock = threading.Lock()   # one restart at a time; the callers behind it find it done
        self._closing = False
        self._gone = threading.Event()      # set once the connection's end has been dealt with
        self.died: str | None = None        # why the last engine process ended, until the next start
        self._starter = _Starter()          # created here: at the priority of the thread creating the client

    # ------------------------------------------------------------------ process
    @property
    def alive(self) -> bool:
        return self._conn is not None

    def start(self) -> None:
        """Start the engine process (idempotent). Loading a model starts it too."""
        with self._lock:
            if self._conn is None:
                self._starter.run(self._start)

    def _start(self) -> None:
        """start(), on the starter thread (see _Starter); the caller holds the lock."""
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        self._closing = False
        self._gone = threading.Event()
        if self.in_process or self._lean_plan is not None:
            core_conn = Connection(theirs.detach())
            if self._lean_plan is not None:
                from nanochat.engine.lean import LeanCore
                core = LeanCore(core_conn, self._lean_plan)
            else:
                from nanochat.engine.serve.core import EngineCore
                core = EngineCore(core_conn)
            self._core_thread = threading.Thread(target=self._run_core, args=(core,), name="nanochat-engine",
                                                 daemon=True)
            self._core_thread.start()
        else:
            self._core_thread = None
            fd = theirs.fileno()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "nanochat.engine.serve.core", str(fd)], pass_fds=(fd,),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                env=engine_process_env(), start_new_session=True)   # terminal signals (Ctrl-C, hang-up) are the front end's to handle
            theirs.close()
            self._stderr_thread = threading.Thread(target=self._drain_stderr, args=(self._proc,),
                                                   name="nanochat-engine-stderr", daemon=True)
            self._stderr_thread.start()
        self._conn = Connection(ours.detach())
        self._new_incarnation()
        self.died = None
        threading.Thread(target=self._read, args=(self._conn,), name="nanochat-client-reader",
                         daemon=True).start()

    @staticmethod
    def _run_core(core) -> None:
        try:
            core.run()
        finally:
            core.conn.close()

    def _drain_stderr(self, proc: subprocess.Popen) -> None:
        log = None
        if self.log_path is not None:
            try:
                log = open(self.log_path, "ab")
            except OSError:
                log = None
        try:
            for line in proc.stderr:
                self._stderr_tail.append(line.decode("utf-8", "replace").rstrip())
                if log is not None:
                    log.write(line)
                    log.flush()
        finally:
            if log is not None:
                log.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (requests in flight are aborted). The client can start it again."""
        with self._lock:
            conn, proc, thread = self._conn, self._proc, self._core_thread
            if conn is None:
                return
            self._closing = True
            try:
                self._call("shutdown", timeout=timeout)
            except (EngineError, TimeoutError, OSError):
                pass
            self._disconnect()
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if thread is not None:
            thread.join(timeout)

    def kill(self) -> None:
        """Kill the engine process now (tests; a user's last resort). Its death is reported as usual."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)

    def restart(self, progress: Callable[[int, int], None] | None = None,
                status: Callable[[str], None] | None = None) -> ModelInfo | None:
        """Start a new engine process and load the model the last one had (after it died); `progress`
        and `status` as for load_model."""
        with self._lock:
            self.start()
            model = self.model
        if model is None:
            return None
        try:
            return self.load_model(model.model, progress=progress, status=status, **self._config)
        except BaseException:
            self.shutdown()   # no engine process without its model: the next request tries again
            raise

    def ensure_running(self) -> None:
        """Start a new engine process with the model the last one had, unless one runs. Callers from
        several threads at once get one restart: the later ones wait for it and find the engine up."""
        if self._conn is not None:
            return
        with self._restart_lock:
            if self._conn is None:
                if self.model is None:
                    raise EngineError("no model is loaded")
                self.restart()

    # ------------------------------------------------------------------ transport
    def _send(self, call: Call) -> None:
        conn = self._conn
        if conn is None:
            raise EngineDied(self.died or "the engine is not running")
        try:
            with self._send_lock:
                conn.send(call)
        except OSError as e:
            self._gone.wait(10)   # the reader thread is finding out why
            raise EngineDied(self.died or f"the engine process is gone ({e.strerror or e})") from None

    def _call(self, op: str, progress: Callable | None = None, timeout: float | None = None,
              status: Callable[[str], None] | None = None, **args):
        """Send a call and wait for its answer (re-raising the engine's error as a typed one)."""
        call_id = next(self._calls)
        pending = _Pending(progress, status)
        self._pending[call_id] = pending
        try:
            self._send(Call(op, call_id, args))
            return pending.future.result(timeout)
        finally:
            self._pending.pop(call_id, None)

    def _post(self, op: str, **args) -> None:
        """Send a call whose answer nobody waits for (its outcome shows in the stream it concerns)."""
        self._send(Call(op, 0, args))

    def _read(self, conn) -> None:
        handlers = {"done": self._on_done, "failed": self._on_failed, "progress": self._on_progress,
                    "status": self._on_status,
                    "events": self._on_events, "session": self._on_session, "stats": self._on_stats}
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            handlers[message[0]](*message[1:])
        self._on_disconnect(conn)
        # The reader closes the connection, once it reads no more: closed from another thread, its descriptor's
        # number could go to the next engine's socket (a client started again at once, as a one-shot's lean
        # engine right after the full one) while this thread was about to read from it.
        with self._send_lock:
            conn.close()

    def _on_done(self, call_id: int, value) -> None:
        pending = self._pending.get(call_id)
        if pending is not None:
            pending.future.set_result(value)

    def _on_failed(self, call_id: int, kind: str, message: str) -> None:
        pending = self._pending.get(call_id)
        if pending is not None:
            pending.future.set_exception(remote_error(kind, message))

    def _on_progress(self, call_id: int, payload) -> None:
        pending = self._pending.get(call_id)
        if pending is not None and pending.progress is not None:
            pending.progress(*payload)

    def _on_status(self, call_id: int, text: str) -> None:
        pending = self._pending.get(call_id)
        if pending is not None and pending.status is not None:
            pending.status(text)

    def _on_events(self, events: list[TokenEvent]) -> None:
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                if event.finished:
                    del self._streams[event.request_id]
                stream._deliver(event)

    def _on_session(self, session_id: str, token_ids: list[int], turn_starts: list[int]) -> None:
        """The engine's copy of a session finished a turn: its canonical ids, for the record."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.token_ids, session.turn_starts = token_ids, turn_starts

    def _on_stats(self, stats: EngineStats) -> None:
        self._stats = stats
        for fn in list(self._stats_listeners):
            try:
                fn(stats)
            except Exception:
                pass   # a listener's bug must not stop the client

    def _new_incarnation(self) -> None:
        """A new engine (a start, a model load): the sessions the last one held restart."""
        self._end_incarnation()
        self.epoch += 1
        self._incarnation = Incarnation(self.epoch)

    def _end_incarnation(self) -> None:
        if self._incarnation is not None:
            self._incarnation.end()

    def _disconnect(self) -> None:
        self._end_incarnation()   # before the connection goes: a start after it makes a new one
        conn, self._conn = self._conn, None
        if conn is not None:
            _end_connection(conn)

    def _on_disconnect(self, conn) -> None:
        """The connection ended: after shutdown() that is expected; otherwise the engine died."""
        closing = self._closing
        reason = "the engine stopped" if closing else self._death_reason()
        if not closing:
            self.died = reason     # before the connection goes: a sender that finds it gone says why
        if self._conn is conn:     # no lock: a caller may hold it while waiting on a call failed below
            self._end_incarnation()
            self._conn = None
        self._gone.set()
        error = EngineDied(reason)
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(error)
        for request_id, stream in list(self._streams.items()):
            del self._streams[request_id]
            stream.lost = True
            stream._deliver(TokenEvent(request_id, None, "", True, "error", error=reason))
        if not closing:
            for fn in list(self._death_listeners):
                try:
                    fn(reason)
                except Exception:
                    pass

    def _death_reason(self) -> str:
        if self.in_process or self._core_thread is not None:
            return "the engine thread stopped"
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._stderr_thread is not None:   # its last words may still be in the pipe
            self._stderr_thread.join(timeout=1.0)
        tail = [line.strip() for line in self._stderr_tail if line.strip()]
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the engine process was killed by {name}{_memory_hint(name, tail)}"
        detail = f": {tail[-1]}" if tail else ""
        return f"the engine process exited (code {code}){detail}"

    # ------------------------------------------------------------------ listeners
    def add_stats_listener(self, fn: Callable[[EngineStats], None]) -> None:
        self._stats_listeners.append(fn)

    def remove_stats_listener(self, fn: Callable[[EngineStats], None]) -> None:
        if fn in self._stats_listeners:
            self._stats_listeners.remove(fn)

    def add_death_listener(self, fn: Callable[[str], None]) -> None:
        """fn(reason) runs (on the reader thread) when the engine process ends unexpectedly."""
        self._death_listeners.append(fn)

    def remove_death_listener(self, fn: Callable[[str], None]) -> None:
        if fn in self._death_listeners:
            self._death_listeners.remove(fn)

    # ------------------------------------------------------------------ operations
    def load_model(self, model: str, progress: Callable[[int, int], None] | None = None,
                   status: Callable[[str], None] | None = None, **config) -> ModelInfo:
        """Load (or switch to) `model`; requests in flight are cancelled. On failure the previous model
        stays loaded and the typed error (ModelLoadError, ValueError, ...) is raised. `progress(done,
        total)` follows the weights; `status(text)` hears slow one-time work, in one line each (compiling
        the kernels for this machine, repacking a new file's weights). Both run on the reader thread."""
        info = self._load_lean(model, progress, status, config) if self.lean and self._conn is None else None
        if info is not None:
            return info
        self.start()
        info = self._call("load", progress=progress, status=status, model=model, config=dict(config))
        with self._lock:
            self.model, self._config = info, dict(config)
            self._new_incarnation()            # every session is re-opened for the new model
        return info

    def _load_lean(self, model: str, progress, status, config: dict) -> ModelInfo | None:
        """Load `model` on the lean engine in this process when it applies (None: it does not, or it failed and
        is gone again: the engine process loads the model instead)."""
        from nanochat.engine.lean import plan_for

        try:
            plan = plan_for(model, dict(config), self.lean_sampling)
            refused = "no lean plan applies (engine/lean.py: plan_for)"
        except Exception as e:   # whatever the check trips over, the full engine loads it and says what is wrong
            plan, refused = None, f"the check failed: {e!r}"
        if plan is None:
            self.lean_refused = refused
            return None
        with self._lock:
            self._lean_plan = plan
            try:
                self.start()
                info = self._call("load", progress=progress, status=status, model=model, config=dict(config))
            except Exception as e:
                self.lean_refused = f"the lean load failed: {e!r}"
                self.shutdown()
                return None
            finally:
                self._lean_plan = None
            self.model, self._config = info, dict(config)
            self._new_incarnation()
            self.lean_used, self.lean_refused = True, None
        return info

    def stats(self, fresh: bool = False) -> EngineStats:
        """The latest engine stats, as the engine pushed them; `fresh` asks for them now (a round trip)."""
        if fresh:
            self.ensure_running()
            self._stats = self._call("stats")
        return self._stats

    def describe(self) -> list[tuple[str, str]]:
        """What the model runs on, as (label, value) rows (weight types, kernels, fast path, KV cache)."""
        self.ensure_running()
        return self._call("describe")

    def tokenize(self, text: str | None = None, add_special: bool = True, system_prompt: str | None = None,
                 messages: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The ids of `text` (`add_special`: with the BOS a prompt starts with), or of a chat turn's prompt after
        a transcript (`messages`: finished turns, each ending with the assistant's, then the new turn's input),
        rendered as a session's next turn would be."""
        self.ensure_running()
        return self._call("tokenize", text=text, add_special=add_special, system_prompt=system_prompt,
                          messages=messages, template_kwargs=template_kwargs)

    def check_hold(self, json_schema: str | None = None, grammar: str | None = None) -> None:
        """ValueError (one line) unless the loaded model can follow this JSON schema or grammar."""
        self.ensure_running()
        self._call("check_hold", json_schema=json_schema, grammar=grammar)

    def infill(self, prefix: str, suffix: str, budget: int) -> tuple[list[int], list[int]]:
        """A fill-in-the-middle prompt for the text between `prefix` and `suffix` (at most `budget` tokens: the
        ends are cut as llama.cpp cuts them), and the tokens that end its middle; ValueError for a model
        without FIM tokens."""
        self.ensure_running()
        got = self._call("infill", prefix=prefix, suffix=suffix, budget=budget)
        return got["ids"], got["stop_token_ids"]

    def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included."""
        self.ensure_running()
        return self._call("detokenize", ids=ids)

    def open_session(self, system_prompt: str | None = None, history: list[dict] | None = None) -> Session:
        """A chat session, optionally seeded with a transcript (the messages of finished turns, each
        ending with the assistant's) that its first turn prefills. Cheap: the engine builds it on its
        first turn."""
        session = Session(f"s{next(self._ids)}", system_prompt or None, list(history or []))
        self._sessions[session.id] = session
        return session

    def fork_session(self, session: Session) -> Session:
        """A new session with the same history; the two share the cached prefix."""
        return self.branch_session(session, session.turns)

    def branch_session(self, session: Session, turns: int, more: list[dict] | None = None) -> Session:
        """A new session holding the first `turns` turns of `session`, then the finished turns `more`
        (messages): a branch of a conversation tree. `session` stays as it is.

        Where the cut is known in canonical ids, the branch starts from exactly those ids, so its next
        turn finds them in the prefix cache (shared with `session`, pinned once); `more` is rendered."""
        check("branch", session.state)
        if not 0 <= turns <= session.turns:
            raise ValueError(f"the session has {session.turns} turns; cannot branch after turn {turns}")
        ids = starts = None
        if session.token_ids is not None and session.turn_starts is not None and turns <= len(session.turn_starts):
            cut = session.turn_starts[turns] if turns < len(session.turn_starts) else len(session.token_ids)
            ids, starts = session.token_ids[:cut], session.turn_starts[:turns]
        other = Session(f"s{next(self._ids)}", session.system_prompt,
                        session.history[:session.turn_end(turns)] + [dict(m) for m in more or []], ids, starts,
                        session.model, template_kwargs=session.template_kwargs, keys=session.keys[:turns])
        self._sessions[other.id] = other
        with self._lock:
            if ids is not None and session.resident:
                # Open it now, in the engine that holds these ids' blocks: its next turn is no replay.
                try:
                    self._open(other)
                except EngineDied:
                    pass   # the next turn opens it in a new engine, replaying the history
        return other

    def rewind_session(self, session: Session, turns: int = 1) -> Session:
        """A new session holding `session`'s history without its last `turns` turns; `session` is closed."""
        check("rewind", session.state)
        if not 0 < turns <= session.turns:
            raise ValueError(f"the session has {session.turns} turns; cannot take back {turns}")
        other = self.branch_session(session, session.turns - turns)
        self.close_session(session)
        return other

    def focus_session(self, session: Session) -> None:
        """`session` is the one the user sees: its resident KV is evicted last."""
        check("focus", session.state)
        if session.resident:
            try:
                self._post("touch_session", session_id=session.id)
            except EngineDied:
                pass

    def _open(self, session: Session) -> None:
        """Open the session in the current engine (its ids kept where they belong to this model)."""
        check("open", session.state)
        same_model = session.model == self.model.model and session.token_ids is not None
        if not same_model:   # the history is rendered again: earlier ids are no longer known
            session.token_ids = session.turn_starts = None
        self._post("open_session", session_id=session.id, system_prompt=session.system_prompt,
                   history=session.history, token_ids=session.token_ids, turn_starts=session.turn_starts,
                   template_kwargs=session.template_kwargs)
        session.engine, session.model = self._incarnation, self.model.model

    def close_session(self, session: Session) -> None:
        """Forget a session and release its resident KV (a turn in flight is cancelled)."""
        check("close", session.state)
        if session.request_id is not None:
            self.cancel(session.request_id)
        self._sessions.pop(session.id, None)
        if session.resident:
            try:
                self._post("close_session", session_id=session.id)
            except EngineDied:
                pass
        session.engine, session.closed = None, True

    def submit_turn(self, session: Session, user: str | list[dict], sampling: SamplingParams | None = None,
                    on_event: Callable[[TokenEvent], None] | None = None,
                    template_kwargs: dict | None = None) -> RequestStream:
        """Send the next user message of `session` (or the turn's input messages: the tool results that
        answer the assistant's calls); the stream yields the reply's events. A request the engine refuses
        (too long for the context, ...) ends its stream with an error event. `template_kwargs`: variables
        for the chat template's render of this turn (enable_thinking, tools)."""
        messages = [{"role": "user", "content": user}] if isinstance(user, str) else [dict(m) for m in user]
        check("turn", session.state)
        self.ensure_running()
        with self._lock:
            session.template_kwargs = template_kwargs
            replayed = False
            if session.state is SessionState.UNOPENED:   # new, or its engine ended: lazily (re-)opened
                replayed = bool(session.history)
                self._open(session)
            request_id = f"r{next(self._ids)}"
            stream = RequestStream(self, request_id, on_event, session, replayed)
            session.request_id, session.pending = request_id, messages
            self._streams[request_id] = stream
            try:
                self._post("submit", request_id=request_id, sampling=sampling or SamplingParams(),
                           session_id=session.id, messages=messages, template_kwargs=template_kwargs)
            except EngineDied:
                self._streams.pop(request_id, None)
                session.request_id = session.pending = session.pending_key = None
                raise
        return stream

    def submit(self, prompt: str | list[int], sampling: SamplingParams | None = None,
               on_event: Callable[[TokenEvent], None] | None = None, pooling: PoolingParams | None = None,
               truncate: bool = False) -> RequestStream:
        """A raw request: text (encoded without a chat template) or token ids. With `pooling`, an embedding of
        them: the stream's one event is the final one, with `embedding` (engine/pooling.py; `truncate`: an input
        longer than the context keeps its first tokens instead of failing)."""
        self.ensure_running()
        with self._lock:
            request_id = f"r{next(self._ids)}"
            stream = RequestStream(self, request_id, on_event)
            self._streams[request_id] = stream
            extra = {} if pooling is None else {"pooling": pooling, "truncate": truncate}
            try:
                self._post("submit", request_id=request_id, sampling=sampling or SamplingParams(),
                           prompt=prompt if isinstance(prompt, str) else list(prompt), **extra)
            except EngineDied:
                self._streams.pop(request_id, None)
                raise
        return stream

    def cancel(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish reason "abort" (the partial reply is kept)."""
        try:
            self._post("cancel", request_id=request_id)
        except EngineDied:
            pass

    def bench(self, spec=None, progress: Callable | None = None, multi_turn: dict | None = None):
        """Run a bench workload (engine/serve/bench.py) on the loaded model; `progress(p, stats)` gets
        BenchProgress and EngineStats as it runs. cancel_bench() stops it (BenchCancelled is raised)."""
        self.ensure_running()
        return self._call("bench", progress=progress, spec=spec, multi_turn=multi_turn)

    def cancel_bench(self) -> None:
        try:
            self._post("cancel_bench")
        except EngineDied:
            pass


class AsyncRequestStream:
    """A request's events on an asyncio loop. The client's reader thread hands each event to the loop
    (call_soon_threadsafe) as it arrives, so no thread waits per token or per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.stream: RequestStream | None = None   # set once submitted

    def _on_event(self, event: TokenEvent) -> None:   # the reader thread
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    @property
    def reply(self) -> Reply:
        return self.stream.reply

    @property
    def lost(self) -> bool:
        return self.stream.lost

    def cancel(self) -> None:
        self.stream.cancel()

    async def next_events(self) -> list[TokenEvent]:
        """The events that arrived since the last call (waiting for at least one); the last is final
        once the request ends. The engine sends steps in batches (EVENTS_INTERVAL): a front end can
        forward each batch as one write."""
        events = [await self._events.get()]
        while not events[-1].finished and not self._events.empty():
            events.append(self._events.get_nowait())
        return events

    async def __aiter__(self):
        while True:
            for event in await self.next_events():
                yield event
                if event.finished:
                    return

    async def result(self) -> Reply:
        """Wait for the end; the folded reply."""
        async for _ in self:
            pass
        return self.reply


class AsyncEngineClient:
    """The client for asyncio code (the OpenAI-compatible server): one EngineClient shared by every
    request, so concurrent requests batch in one engine. Calls that may wait (a load, a submit that
    finds the engine gone) run on a worker thread; streams arrive through AsyncRequestStream.

    When the engine process dies, every open stream ends with an error event (its `lost` set) and a new
    process starts loading the model at once, in the background; a submit meanwhile raises
    EngineRestarting rather than waiting for the load."""

    def __init__(self, client: EngineClient | None = None, **kwargs):
        self.client = client or EngineClient(**kwargs)
        self.restarting = False
        self.restarts = 0                        # engine processes that died under it (each is restarted)
        self.restart_error: str | None = None    # why the last background restart failed
        self.client.add_death_listener(self._on_death)

    @property
    def model(self) -> ModelInfo | None:
        return self.client.model

    def _on_death(self, reason: str) -> None:   # the reader thread: never block it
        self.restarts += 1
        self._restart_in_background()

    def _restart_in_background(self) -> None:
        if self.restarting:
            return
        self.restarting = True
        threading.Thread(target=self._restart, name="nanochat-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        try:
            self.client.ensure_running()
            self.restart_error = None
        except BaseException as e:   # kept for the 503s until the next try (each submit starts one)
            self.restart_error = one_line(e)
        finally:
            self.restarting = False

    def _check_running(self) -> None:
        if self.restarting or not self.client.alive:
            self._restart_in_background()
            why = f" (the last try failed: {self.restart_error})" if self.restart_error else ""
            raise EngineRestarting(f"the engine is restarting after it stopped{why}; try again shortly")

    async def load_model(self, model: str, progress=None, status=None, **config) -> ModelInfo:
        return await asyncio.to_thread(self.client.load_model, model, progress, status, **config)

    async def describe(self) -> list[tuple[str, str]]:
        return await asyncio.to_thread(self.client.describe)

    async def tokenize(self, text: str | None = None, add_special: bool = True, system_prompt: str | None = None,
                       messages: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        return await asyncio.to_thread(self.client.tokenize, text, add_special, system_prompt, messages,
                                       template_kwargs)

    async def detokenize(self, ids: list[int]) -> str:
        return await asyncio.to_thread(self.client.detokenize, ids)

    async def infill(self, prefix: str, suffix: str, budget: int) -> tuple[list[int], list[int]]:
        return await asyncio.to_thread(self.client.infill, prefix, suffix, budget)

    def open_session(self, system_prompt: str | None = None, history: list[dict] | None = None) -> Session:
        return self.client.open_session(system_prompt, history)

    def branch_session(self, session: Session, turns: int, more: list[dict] | None = None) -> Session:
        return self.client.branch_session(session, turns, more)

    def close_session(self, session: Session) -> None:
        self.client.close_session(session)

    async def _submit(self, sends: list[Callable]) -> list[AsyncRequestStream]:
        """Submit requests back to back, from one worker thread, so the engine takes them in one step."""
        self._check_running()
        loop = asyncio.get_running_loop()
        streams = [AsyncRequestStream(loop) for _ in sends]

        def submit_all() -> None:
            for stream, send in zip(streams, sends):
                stream.stream = send(stream._on_event)

        await asyncio.to_thread(submit_all)
        return streams

    async def submit_turn(self, session: Session, user: str | list[dict], sampling: SamplingParams | None = None,
                          template_kwargs: dict | None = None) -> AsyncRequestStream:
        """The next user message (or input messages) of `session` (see EngineClient.submit_turn)."""
        return (await self.submit_turns([session], user, [sampling], template_kwargs))[0]

    async def submit_turns(self, sessions: list[Session], user: str | list[dict],
                           samplings: list[SamplingParams | None],
                           template_kwargs: dict | None = None) -> list[AsyncRequestStream]:
        """The same next user message (or input messages) in each of `sessions` (forks of one
        conversation), one sampling each."""
        return await self._submit([partial(self.client.submit_turn, session, user, sampling,
                                           template_kwargs=template_kwargs)
                                   for session, sampling in zip(sessions, samplings)])

    async def submit(self, prompt: str | list[int], sampling: SamplingParams | None = None) -> AsyncRequestStream:
        """A raw request: text (no chat template) or token ids."""
        return (await self.submit_many(prompt, [sampling]))[0]

    async def submit_many(self, prompt: str | list[int],
                          samplings: list[SamplingParams | None]) -> list[AsyncRequestStream]:
        """The same raw prompt once per sampling."""
        return await self._submit([partial(self.client.submit, prompt, sampling) for sampling in samplings])

    async def embed(self, prompts: list[str | list[int]], pooling: PoolingParams,
                    truncate: bool = False) -> list[AsyncRequestStream]:
        """One embedding request per prompt (EngineClient.submit with `pooling`), taken in one engine step."""
        return await self._submit([partial(self.client.submit, prompt, None, pooling=pooling, truncate=truncate)
                                   for prompt in prompts])

    def stats(self) -> EngineStats:
        return self.client.stats()

    async def fresh_stats(self) -> EngineStats:
        return await asyncio.to_thread(self.client.stats, True)

    async def shutdown(self) -> None:
        self.client.remove_death_listener(self._on_death)
        await asyncio.to_thread(self.client.shutdown)
