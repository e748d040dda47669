"""Headless one-shot generation: `nanochat --prompt "..."` and `nanochat run --prompt A --prompt B`.

stdout carries only the reply (streamed as tokens arrive, then one newline), or JSON with --json;
progress and stats go to stderr. A reasoning model's thinking (<think>...</think>) is left out unless
--show-thinking asks for it (then it comes first, between its tags, dim on a terminal); --json carries
it apart ("reasoning"). On a terminal the reply passes the sanitizer (app/terminal_text.py); a
pipe or a file gets its exact text. Several prompts run batched; their replies are printed in order,
the earliest unfinished one streaming live while the others are buffered.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import stat
import sys
import threading
import time
from dataclasses import dataclass, field

from nanochat.app.export import format_stats, model_name
from nanochat.app.options import effective_sampling
from nanochat.app.reasoning import CLOSE, OPEN, reply_splitter, split_reply
from nanochat.app.terminal_text import dim, for_terminal, is_terminal, sanitize
from nanochat.models.errors import one_line

LOAD_INDICATOR_DELAY = 0.4   # seconds before a loading spinner appears
LOG_NOTE_DELAY = 2.0         # seconds of slow load work before a log (stderr not a terminal) says what it is
STDIN_WAIT = 1.0             # seconds to wait for a pipe on stdin to say something


@dataclass
class OneShotOptions:
    model: str
    prompts: list[str]
    engine_config: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)     # SamplingParams keyword arguments
    system: str | None = None
    chat_template: bool = True
    json: bool = False
    quiet: bool = False
    show_thinking: bool = False
    template_kwargs: dict | None = None   # chat template variables (reasoning_effort)


# ---------------------------------------------------------------------------------- shared helpers
def read_piped_stdin(stream=None, wait: float = STDIN_WAIT) -> str:
    """Text piped on stdin, or "" when stdin is a terminal, closed, or a pipe that stays silent.

    A pipe that says nothing within `wait` seconds is left alone, so a caller whose stdin is an
    idle pipe (an editor, a CI runner) does not hang."""
    stream = sys.stdin if stream is None else stream
    try:
        if stream is None or stream.isatty():
            return ""
        fd = stream.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                return ""
        data = stream.buffer.read() if hasattr(stream, "buffer") else stream.read()
    except (OSError, ValueError):
        return ""
    return data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data


def combine_prompt(piped: str, prompt: str | None) -> str:
    """Piped text first, then the prompt, separated by a blank line."""
    piped = piped.rstrip()
    if not piped:
        return prompt or ""
    return f"{piped}\n\n{prompt}" if prompt else piped


@contextlib.contextmanager
def loading_indicator(label: str, enabled: bool = True, delay: float = LOAD_INDICATOR_DELAY,
                      log_delay: float = LOG_NOTE_DELAY):
    """A rich progress bar on stderr, shown only if the block takes longer than `delay` (or says it will
    be slow) and stderr is a terminal (so logs and pipes stay clean). Yields (update(done, total), for the
    bar (a spinner until the first call); status(text), slow one-time work the load does now (a kernel
    compile), shown beside the label at once; where stderr is a log or a pipe, as one plain line once that
    work has taken `log_delay` seconds, so that a load that takes a minute says why there too)."""
    state = {"started": False, "done": False, "task": None, "at": (0, 0), "label": label}

    def update(done: int, total: int) -> None:
        state["at"] = (done, total)
        if state["task"] is not None:
            progress.update(state["task"], completed=done, total=total)

    if not enabled:
        yield update, lambda text: None
        return
    if not sys.stderr.isatty():
        timers: list[threading.Timer] = []

        def write(text: str) -> None:
            print(sanitize(f"nanochat: {label} · {text}"), file=sys.stderr, flush=True)

        def note(text: str) -> None:   # only if the work is still going on a while later: a tiny file's repack is quiet
            timers.append(threading.Timer(log_delay, write, (text,)))
            timers[-1].daemon = True
            timers[-1].start()

        try:
            yield update, note
        finally:
            for timer in timers:
                timer.cancel()
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True, redirect_stdout=False,
                        redirect_stderr=False)
    lock = threading.Lock()

    def start():
        with lock:
            if not state["done"] and not state["started"]:
                progress.start()
                done, total = state["at"]
                state["task"] = progress.add_task(shown(), total=total or None, completed=done)
                state["started"] = True

    def shown() -> str:   # a file's path and the engine's words: their escape sequences and [markup] as text
        return escape(sanitize(state["label"]))

    def status(text: str) -> None:
        state["label"] = f"{label} · {text}"
        start()
        with lock:
            if state["task"] is not None:
                progress.update(state["task"], description=shown())

    timer = threading.Timer(delay, start)
    timer.daemon = True
    timer.start()
    try:
        yield update, status
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["started"]:
                progress.stop()


# ---------------------------------------------------------------------------------- one-shot
class ReplyPrinter:
    """Writes a streamed reply as it comes: its answer, and with `show_thinking` its thinking first,
    between <think> and </think>, dim on a terminal (an empty block is left out). On a terminal the text
    passes the sanitizer. `prompted`: the prompt opened the thinking block; `model`: the ModelInfo, whose
reply format picks the splitter (see app/reasoning.py)."""

    def __init__(self, out, prompted: bool = False, show_thinking: bool = False, before: str = "", model=None):
        self.out, self.terminal = out, is_terminal(out)
        self.splitter = reply_splitter(model, prompted)
        self.show_thinking = show_thinking
        self.before = before            # written before the reply's first text (a blank line between replies)
        self.printed = False
        self._reasoning = self._answer = 0   # characters of each part written so far
        self._closed = False                 # the closing tag is written

    def add(self, text: str) -> None:
        self.splitter.feed(text)
        self._write()

    def finish(self) -> None:
        self.splitter.finish()
        self._write()

    def _write(self) -> None:
        s = self.splitter
        if self.show_thinking and s.reasoning and not self._closed:
            if not self._reasoning:
                self._start()
                self.out.write(dim(f"{OPEN}\n", self.terminal))
            if len(s.reasoning) > self._reasoning:
                self.out.write(dim(s.reasoning[self._reasoning:], self.terminal))
                self._reasoning = len(s.reasoning)
            if s.closed:
                self.out.write(dim(f"\n{CLOSE}", self.terminal) + "\n\n")
                self._closed = True
        if len(s.answer) > self._answer:
            self._start()
            self.out.write(for_terminal(s.answer[self._answer:], self.terminal))
            self._answer = len(s.answer)
        self.out.flush()

    def _start(self) -> None:
        if not self.printed:
            self.out.write(for_terminal(self.before, self.terminal))
            self.printed = True


def load_client(model: str, engine_config: dict, quiet: bool, lean_sampling: dict | None = None):
    """An EngineClient with `model` loaded (a progress bar on stderr); (client, load seconds). `lean_sampling`:
    the sampling of a single request to come, which the lean engine may serve (engine/lean.py; None: the engine
    process always)."""
    from nanochat.engine.serve.client import EngineClient

    t0 = time.perf_counter()
    client = EngineClient(lean=lean_sampling is not None, lean_sampling=lean_sampling)
    try:
        with loading_indicator(f"Loading {model_name(model)}", enabled=not quiet) as (progress, status):
            client.load_model(model, progress=progress, status=status, **engine_config)
    except BaseException:
        client.shutdown()
        raise
    return client, time.perf_counter() - t0


def run_oneshot(opts: OneShotOptions, out=None, err=None) -> int:
    from nanochat.engine import SamplingParams

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    stated = effective_sampling(opts.sampling)
    SamplingParams(**stated)   # invalid values raise ValueError before loading
    # One prompt: the lean engine may answer it in this process (no torch); several run batched in the engine.
    client, load_s = load_client(opts.model, opts.engine_config, opts.quiet,
                                 lean_sampling=stated if len(opts.prompts) == 1 else None)
    sp = SamplingParams(**effective_sampling(opts.sampling, client.model.sampling_defaults))
    # a template that opens the thinking block itself: the replies start inside it (raw prompts never do)
    prompted = opts.chat_template and None in client.model.thinking_opened
    model = client.model if opts.chat_template else None   # raw prompts: no reply format to split
    streams = []
    try:
        for text in opts.prompts:
            if opts.chat_template:
                variables = {"template_kwargs": opts.template_kwargs} if opts.template_kwargs else {}
                streams.append(client.submit_turn(client.open_session(opts.system), text, sp, **variables))
            else:
                streams.append(client.submit(text, sp))
        _print_in_order(streams, None if opts.json else out, prompted, opts.show_thinking, model)
        for stream in streams:
            stream.done.wait()
    except KeyboardInterrupt:
        if not opts.json and any(s.reply.token_ids for s in streams):
            out.write("\n")
            out.flush()
        raise
    finally:
        client.shutdown()
    return _report(opts, [s.reply for s in streams], load_s, out, err, prompted, model)


def _print_in_order(streams: list, out, prompted: bool = False, show_thinking: bool = False, model=None) -> None:
    """Print the replies in prompt order as they arrive: the earliest unfinished one streams live,
    the later ones (generated in the same batch) come out of their buffers when their turn comes."""
    if out is None:
        return
    for n, stream in enumerate(streams):
        # a blank line between the replies of several prompts
        printer = ReplyPrinter(out, prompted, show_thinking, before="\n" if n > 0 else "", model=model)
        for event in stream:
            printer.add(event.text)
        printer.finish()
        if printer.printed or stream.reply.final.finish_reason != "error":
            out.write("\n")
            out.flush()


def _report(opts: OneShotOptions, replies: list, load_s: float, out, err, prompted: bool = False, model=None) -> int:
    errors = [r.final.error or "generation failed" for r in replies if r.final.finish_reason == "error"]
    if opts.json:
        # JSON escapes C0 controls; on a terminal ensure_ascii escapes C1 and bidi too (the same text)
        ascii_only = is_terminal(out)
        for reply in replies:
            out.write(json.dumps(_as_json(reply, opts.model, prompted, model), ensure_ascii=ascii_only) + "\n")
        out.flush()
    terminal = is_terminal(err)
    if not opts.quiet:
        for n, reply in enumerate(replies):
            st = reply.final.stats
            if st is None or (reply.final.finish_reason == "error" and not reply.token_ids):
                continue   # refused: the error line says why
            prefix = f"#{n + 1} " if len(replies) > 1 else ""
            line = format_stats(st, f"load {load_s:.1f}s" if n == 0 else "")
            print(dim(f"{prefix}[{line}]", terminal), file=err, flush=True)
    if errors:
        print(for_terminal(f"nanochat: error: {one_line(errors[0])}", terminal), file=err, flush=True)
        return 1
    return 0


def _as_json(reply, model: str, prompted: bool = False, info=None) -> dict:
    """One reply: "text" is its answer, "reasoning" its thinking (null: none; the tags and the whitespace
    around them dropped), "token_ids" all it generated."""
    final = reply.final
    st = final.stats
    split = split_reply(reply.text, info, prompted)
    return {
        "text": split.answer,
        "reasoning": split.reasoning,
        "token_ids": reply.token_ids,
        "prompt_tokens": st.prompt_tokens if st else 0,
        "cached_tokens": st.cached_tokens if st else 0,
        "generated_tokens": st.completion_tokens if st else len(reply.token_ids),
        "ttft_s": st.ttft if st else None,
        "decode_tok_s": st.decode_tok_s if st else None,
        "finish_reason": final.finish_reason,
        "model": model,
    }
