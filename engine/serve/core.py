"""The engine process: one LLMEngine, the working copies of the client's chat sessions (built from
their records: engine/serve/session.py) and the step loop, driven over a connection.

    python -m nanochat.engine.serve.core FD      (started by EngineClient; FD is its end of a socketpair)

A reader thread takes calls off the connection into an inbox (and sets a running bench's cancel
flag at once); the main thread alternates between the inbox and engine steps, sending the token
events of the steps of the last EVENTS_INTERVAL seconds in one message (a request's end at once).
When the client goes away (its end closes) the process exits at once: it holds nothing that is not
also held by the client.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time

from nanochat.engine.output import ContextExceeded, Reply, RequestStats, TokenEvent
from nanochat.engine.serve.protocol import EVENTS_INTERVAL, STATS_INTERVAL, Call, ModelInfo, error_kind, one_line


# What a call may raise and still be answered: every Exception, and the BaseExceptions that are not
# a request to stop, such as the panic of a Rust extension (tokenizers' regex out of memory).
def _answerable(e: BaseException) -> bool:
    return not isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit))


class EngineCore:
    def __init__(self, conn, exit_on_eof: bool = False):
        self.conn = conn
        self.exit_on_eof = exit_on_eof            # the engine process: nothing to save, go at once
        self.inbox: queue.Queue[Call | None] = queue.Queue()
        self.engine = None
        self.model: str | None = None
        self.sessions: dict = {}                  # session id -> ChatSession
        self.session_errors: dict[str, str] = {}  # session id -> why it could not be opened
        self.turns: dict[str, tuple] = {}         # request id -> (ChatSession, Reply) of a turn in flight
        self.bench_cancel: threading.Event | None = None
        self._send_lock = threading.Lock()
        self._last_stats = 0.0
        self._events: list[TokenEvent] = []      # published, not sent yet (_publish)
        self._events_sent = 0.0

    # ------------------------------------------------------------------ transport
    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def _read(self) -> None:
        """Reader thread: calls into the inbox; a bench cancel acts at once (the bench blocks the loop)."""
        while True:
            try:
                call = self.conn.recv()
            except (EOFError, OSError):
                if self.exit_on_eof:
                    os._exit(0)
                self.inbox.put(None)
                return
            if call.op == "cancel_bench":
                if self.bench_cancel is not None:
                    self.bench_cancel.set()
                continue
            self.inbox.put(call)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        threading.Thread(target=self._read, name="nanochat-core-reader", daemon=True).start()
        while True:
            busy = self.engine is not None and self.engine.has_unfinished()
            try:
                call = self.inbox.get(block=not busy, timeout=None if busy else STATS_INTERVAL)
            except queue.Empty:
                call = False
            while call is not False:
                if call is None or call.op == "shutdown":
                    self._abort_all()
                    if self.engine is not None:
                        self.engine.close()
                    if call is not None:
                        self.send(("done", call.call_id, None))
                    return
                self._handle(call)
                try:
                    call = self.inbox.get_nowait()
                except queue.Empty:
                    call = False
            if self.engine is not None and self.engine.has_unfinished():
                self._step()
            self._maybe_send_stats()

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except BaseException as e:   # a failed step must not leave requests hanging
            if not _answerable(e):
                raise
            from nanochat.engine.tensor_parallel import WorkerLost
            if isinstance(e, WorkerLost):   # the engine cannot go on: say why and stop; the client's next
                print(one_line(e), file=sys.stderr, flush=True)   # message starts a new one
                self.engine.close()
                os._exit(1)
            events = self._abort_all("error", f"the engine step failed: {one_line(e)}")
        self._publish(events)

    def _publish(self, events: list[TokenEvent]) -> None:
        """Queue one step's events, and send the queue when it is EVENTS_INTERVAL old, a request ended
        or the engine has nothing left to run (chat turns that end record their reply first)."""
        for event in events:
            turn = self.turns.get(event.request_id)
            if turn is not None:
                self._fold_turn(event, *turn)
        self._events += events
        now = time.monotonic()
        if self._events and (now - self._events_sent >= EVENTS_INTERVAL or any(e.finished for e in events)
                             or self.engine is None or not self.engine.has_unfinished()):
            self.send(("events", self._events))
            self._events, self._events_sent = [], now

    def _fold_turn(self, event: TokenEvent, session, reply: Reply) -> None:
        if reply.add(event).done:
            del self.turns[event.request_id]
            session.finish_turn(reply)
            self.send(("session", session.session_id, list(session.token_ids), list(session.turn_starts)))

    def _maybe_send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.engine is not None and (force or now - self._last_stats >= STATS_INTERVAL):
            self._last_stats = now
            self.send(("stats", self.engine.stats()))

    def _handle(self, call: Call) -> None:
        """Run a call; answer it unless it was posted (call id 0: nobody waits for the answer)."""
        try:
            value = getattr(self, f"op_{call.op}")(call, **call.args)
        except BaseException as e:   # every failure goes back as one line
            if not _answerable(e):
                raise
            if call.call_id:
                self.send(("failed", call.call_id, error_kind(e), one_line(e)))
        else:
            if call.call_id:
                self.send(("done", call.call_id, value))

    def _abort_all(self, reason: str = "abort", message: str = "") -> list[TokenEvent]:
        """End every request now; the final events are returned (and folded into their turns)."""
        events = []
        if self.engine is not None:
            for request_id in list(self.engine.requests):
                event = self.engine.abort(request_id)
                if event is not None:
                    event.finish_reason, event.error = reason, message
                    if event.stats is not None:
                        event.stats.finish_reason = reason
                    events.append(event)
        return events

    # ------------------------------------------------------------------ operations
    def op_load(self, call: Call, model: str, config: dict) -> ModelInfo:
        from nanochat.kernels import notices

        def progress(done: int, total: int) -> None:
            self.send(("progress", call.call_id, (done, total)))

        def status(text: str) -> None:
            self.send(("status", call.call_id, text))

        if self.engine is not None and (self.engine.workers is not None or config.get("tensor_parallel_size", 1) > 1):
            # one tensor-parallel group per process: the old engine goes first (a failed load leaves none)
            self._publish(self._abort_all())
            self.engine.close()
            self.engine = None
        with notices.listening(status):   # a kernel compile, a first repack: the front end says why it is slow
            engine = self.create_engine(model, config, progress)   # raises: the old engine stays
        self._publish(self._abort_all())
        self.engine, self.model = engine, model
        self.sessions.clear()                     # sessions belong to a tokenizer and a KV cache
        self.session_errors.clear()
        self._maybe_send_stats(force=True)
        thinking_switch, thinking_opened = engine.loaded.chat_template.thinking_modes()
        return ModelInfo(model=model, arch=engine.model_config.arch, device=str(engine.device),
                         dtype=str(engine.dtype).removeprefix("torch."), max_model_len=engine.config.max_model_len,
                         load_seconds=engine.load_seconds, sampling_defaults=engine.sampling_defaults,
                         tensor_parallel_size=engine.config.tensor_parallel_size,
                         thinking_switch=thinking_switch, thinking_opened=thinking_opened,
                         tools=engine.loaded.chat_template.takes_tools(),
                         harmony=engine.loaded.chat_template.harmony,
                         reasoning_efforts=engine.loaded.chat_template.reasoning_efforts(),
                         speculative=engine.speculative, speculative_modes=engine.speculative_modes,
                         pooling=engine.pooling, embedding_model=engine.embedding_model,
                         embedding_length=engine.embedding_length, writes_text=not engine.encoder)

    def create_engine(self, model: str, config: dict, progress):
        """The engine for op_load (engine/lean.py's core makes its own)."""
        from nanochat.engine.llm_engine import LLMEngine
        return LLMEngine(model, load_progress=progress, **config)

    def _engine(self):
        if self.engine is None:
            raise ValueError("no model is loaded")
        return self.engine

    def op_open_session(self, call: Call, session_id: str, system_prompt: str | None = None,
                        history: list[dict] | None = None, token_ids: list[int] | None = None,
                        turn_starts: list[int] | None = None, template_kwargs: dict | None = None) -> int:
        """A session from a transcript: canonical ids for its first len(turn_starts) turns (kept as they
        were), the rest rendered turn by turn. Returns its length in ids."""
        from nanochat.engine.serve.session import ChatSession

        engine = self._engine()
        self.session_errors.pop(session_id, None)
        try:
            session = ChatSession.from_history(engine.tokenizer, engine.loaded.chat_template, system_prompt,
                                               history or [], session_id, token_ids, turn_starts, template_kwargs)
        except BaseException as e:   # e.g. the chat template fails on this history: the turn says why
            if not _answerable(e):
                raise
            self.session_errors[session_id] = f"cannot build the chat prompt: {one_line(e)}"
            raise
        self.sessions[session_id] = session
        return len(session.token_ids)

    def op_tokenize(self, call: Call, text: str | None = None, add_special: bool = True,
                    system_prompt: str | None = None, messages: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """Text's ids (`add_special`: with the BOS the model's prompts start with), or a chat prompt's: the
        transcript's turns, then the new turn's input, as a session renders them (nothing is kept)."""
        from nanochat.engine.serve.session import ChatSession

        engine = self._engine()
        if messages is None:
            return engine.tokenizer.encode(text, add_special_tokens=add_special)
        start = max((at + 1 for at, m in enumerate(messages) if m["role"] == "assistant"), default=0)
        session = ChatSession.from_history(engine.tokenizer, engine.loaded.chat_template, system_prompt,
                                           messages[:start], template_kwargs=template_kwargs)
        return session.prepare_turn(messages[start:], template_kwargs)

    def op_check_hold(self, call: Call, json_schema: str | None = None, grammar: str | None = None) -> None:
        """Whether this model can follow a JSON schema or a grammar (a chat's /set): ValueError with the one line a
        turn held to it would fail with."""
        from nanochat.engine.sampling_params import SamplingParams

        self._engine().grammars.constraint(SamplingParams(json_schema=json_schema, grammar=grammar), [])

    def op_infill(self, call: Call, prefix: str, suffix: str, budget: int) -> dict:
        """A fill-in-the-middle prompt's ids (at most `budget`) and the tokens that end its middle
        (models/text/fim.py); ValueError for a model without FIM tokens."""
        from nanochat.models.text.fim import infill_ids

        tokenizer = self._engine().tokenizer
        return {"ids": infill_ids(tokenizer, prefix, suffix, budget), "stop_token_ids": list(tokenizer.fim.ends)}

    def op_detokenize(self, call: Call, ids: list[int]) -> str:
        from nanochat.engine.reply_text import check_ids

        engine = self._engine()
        check_ids(ids, engine.loaded.config.vocab_size)
        return engine.tokenizer.decode(ids, skip_special_tokens=False)

    def op_touch_session(self, call: Call, session_id: str) -> None:
        """The session is the one shown: its resident KV is the last to be evicted."""
        if self.engine is not None:
            self.engine.touch_session(session_id)

    def op_close_session(self, call: Call, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        if self.engine is not None:
            self.engine.release_session(session_id)

    def op_submit(self, call: Call, request_id: str, sampling, prompt=None, session_id: str | None = None,
                  messages: list[dict] | None = None, template_kwargs: dict | None = None, pooling=None,
                  truncate: bool = False) -> None:
        """A raw prompt (text or ids), or a chat turn (its input `messages` in session `session_id`, its
        prompt rendered with the template variables `template_kwargs`), or with `pooling` (PoolingParams) an
        embedding of the prompt (`truncate`: cut to the context). A refused request ends at once with an error
        event (submits are posted: nobody waits for an answer)."""
        try:
            if pooling is not None:
                self._engine().add_embedding(prompt, pooling, request_id=request_id, truncate=truncate)
                return
            self._add(request_id, sampling, prompt, session_id, messages, template_kwargs)
        except BaseException as e:
            if not _answerable(e):
                raise
            # A prompt longer than the context says so in its stats, for a front end to offer a way out.
            stats = RequestStats(prompt_tokens=e.prompt_tokens, context_full=True) \
                if isinstance(e, ContextExceeded) else None
            self.send(("events", [TokenEvent(request_id, None, "", True, "error", stats, error=one_line(e))]))

    def _add(self, request_id, sampling, prompt, session_id, messages, template_kwargs) -> None:
        engine = self._engine()
        if messages is None:
            engine.add_request(prompt, sampling, request_id=request_id)
            return
        session = self.sessions.get(session_id)
        if session is None:
            raise ValueError(self.session_errors.get(session_id, f"unknown chat session {session_id!r}"))
        ids = session.prepare_turn(messages, template_kwargs)
        try:
            engine.add_request(ids, sampling, request_id=request_id, session_id=session_id)
        except BaseException:
            session.abandon_turn()
            raise
        self.turns[request_id] = (session, Reply())

    def op_cancel(self, call: Call, request_id: str) -> None:
        if self.engine is None:
            return
        event = self.engine.abort(request_id)
        if event is not None:
            self._publish([event])

    def op_stats(self, call: Call):
        return self._engine().stats()

    def op_describe(self, call: Call) -> list[tuple[str, str]]:
        return self._engine().describe().lines()

    def op_bench(self, call: Call, spec, multi_turn: dict | None = None):
        """Run a bench workload on the loaded engine (chats wait until it ends); progress streams back."""
        from nanochat.engine.serve import bench

        engine = self._engine()
        self.bench_cancel = threading.Event()
        last = [0.0]

        def progress(p) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or p.finished_requests == p.total_requests:
                last[0] = now
                self.send(("progress", call.call_id, (p, engine.stats())))

        try:
            if multi_turn is not None:
                return bench.run_multi_turn(engine, progress=progress, cancel=self.bench_cancel, **multi_turn)
            return bench.run_bench(engine, spec, progress=progress, cancel=self.bench_cancel)
        finally:
            self.bench_cancel = None
            self._maybe_send_stats(force=True)


def main(argv: list[str] | None = None) -> int:
    from multiprocessing.connection import Connection

    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C belongs to the front end, which cancels
    conn = Connection(int(argv[0]))
    try:
        EngineCore(conn, exit_on_eof=True).run()
    finally:
        conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # skip interpreter teardown: torch's thread pools can take seconds to wind down


if __name__ == "__main__":
    sys.exit(main())
