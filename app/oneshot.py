"""Headless one-shot generation: `nanochat --prompt "..."` and `nanochat run --prompt A --prompt B`.

stdout carries only the reply (streamed as tokens arrive, then one newline), or JSON with --json;
progress and stats go to stderr. Several prompts run batched; their replies are printed in order,
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

LOAD_INDICATOR_DELAY = 0.4   # seconds before a loading spinner appears
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
def loading_indicator(label: str, enabled: bool = True, delay: float = LOAD_INDICATOR_DELAY):
    """A rich progress bar on stderr, shown only if the block takes longer than `delay` and stderr is a
    terminal (so logs and pipes stay clean). Yields `update(done, total)` for the bar (a spinner until
    the first call)."""
    state = {"started": False, "done": False, "task": None, "at": (0, 0)}

    def update(done: int, total: int) -> None:
        state["at"] = (done, total)
        if state["task"] is not None:
            progress.update(state["task"], completed=done, total=total)

    if not enabled or not sys.stderr.isatty():
        yield update
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True, redirect_stdout=False,
                        redirect_stderr=False)
    lock = threading.Lock()

    def start():
        with lock:
            if not state["done"]:
                progress.start()
                done, total = state["at"]
                state["task"] = progress.add_task(label, total=total or None, completed=done)
                state["started"] = True

    timer = threading.Timer(delay, start)
    timer.daemon = True
    timer.start()
    try:
        yield update
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["started"]:
                progress.stop()


def format_stats(completion: int, prompt: int, cached: int, ttft: float | None, tok_s: float | None,
                 extra: str = "") -> str:
    """`[12 tokens · 48 cached / 9 new · TTFT 0.05s · 80 tok/s]`"""
    parts = [f"{completion} token{'s' if completion != 1 else ''}", f"{cached} cached / {prompt - cached} new"]
    if ttft is not None:
        parts.append(f"TTFT {ttft:.2f}s")
    if tok_s:
        parts.append(f"{tok_s:.1f} tok/s")
    if extra:
        parts.append(extra)
    return "[" + " · ".join(parts) + "]"


def model_label(model: str) -> str:
    return os.path.basename(model.rstrip("/")) or model


# ---------------------------------------------------------------------------------- one-shot
@dataclass
class _Reply:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    final: object = None          # the finishing TokenEvent
    printed: int = 0              # chars of text already written to stdout


def build_prompt(engine, text: str, system: str | None, chat_template: bool):
    """Token ids of the chat-templated prompt, or the raw text (the engine encodes it)."""
    if not chat_template:
        return text
    from nanochat.engine.chat import ChatSession

    return ChatSession(engine.tokenizer, engine.loaded.chat_template, system_prompt=system).prepare_turn(text)


def load_engine(model: str, engine_config: dict, quiet: bool):
    from nanochat.engine import LLMEngine

    t0 = time.perf_counter()
    with loading_indicator(f"Loading {model_label(model)}", enabled=not quiet) as progress:
        engine = LLMEngine(model, load_progress=progress, **engine_config)
    return engine, time.perf_counter() - t0


def run_oneshot(opts: OneShotOptions, out=None, err=None) -> int:
    from nanochat.engine import SamplingParams

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    sp = SamplingParams(**opts.sampling)          # invalid values raise ValueError before loading
    engine, load_s = load_engine(opts.model, opts.engine_config, opts.quiet)
    ids = [f"p{i}" for i in range(len(opts.prompts))]
    replies = {rid: _Reply() for rid in ids}
    try:
        for rid, text in zip(ids, opts.prompts):
            engine.add_request(build_prompt(engine, text, opts.system, opts.chat_template), sp, request_id=rid)
        _drive(engine, ids, replies, None if opts.json else out)
    except KeyboardInterrupt:
        if not opts.json and any(r.printed for r in replies.values()):
            out.write("\n")
            out.flush()
        raise
    finally:
        for rid in ids:
            engine.abort(rid)   # no-op for finished requests
    return _report(opts, replies, ids, load_s, out, err)


def _drive(engine, ids: list[str], replies: dict[str, _Reply], out) -> None:
    """Step the engine until every request ends, printing replies in order as they become ready."""
    pending, cursor = set(ids), 0
    while pending:
        for event in engine.step():
            reply = replies[event.request_id]
            reply.text.append(event.text)
            if event.token_id is not None:
                reply.token_ids.append(event.token_id)
            if event.finished:
                reply.final = event
                pending.discard(event.request_id)
        if out is not None:
            cursor = _print_ready(ids, replies, cursor, out)
        if pending and not engine.has_unfinished():
            raise RuntimeError("the engine stopped before every request finished")


def _print_ready(ids: list[str], replies: dict[str, _Reply], cursor: int, out) -> int:
    """Write what is new of the earliest unfinished reply (and of any finished ones before it)."""
    while cursor < len(ids):
        reply = replies[ids[cursor]]
        text = "".join(reply.text)
        if len(text) > reply.printed:
            if reply.printed == 0 and cursor > 0:
                out.write("\n")     # a blank line between the replies of several prompts
            out.write(text[reply.printed:])
            reply.printed = len(text)
        if reply.final is None:
            break
        if reply.printed or reply.final.finish_reason != "error":
            out.write("\n")
        cursor += 1
    out.flush()
    return cursor


def _report(opts: OneShotOptions, replies: dict[str, _Reply], ids: list[str], load_s: float, out, err) -> int:
    errors = [replies[r].final.error or "generation failed" for r in ids
              if replies[r].final.finish_reason == "error"]
    if opts.json:
        for rid in ids:
            out.write(json.dumps(_as_json(replies[rid], opts.model), ensure_ascii=False) + "\n")
        out.flush()
    if not opts.quiet:
        for n, rid in enumerate(ids):
            st = replies[rid].final.stats
            if st is None:
                continue
            extra = f"load {load_s:.1f}s" if n == 0 else ""
            if replies[rid].final.finish_reason == "length":
                extra = " · ".join(x for x in ("max tokens reached", extra) if x)
            prefix = f"#{n + 1} " if len(ids) > 1 else ""
            line = prefix + format_stats(st.completion_tokens, st.prompt_tokens, st.cached_tokens, st.ttft,
                                         st.decode_tok_s, extra)
            dim = hasattr(err, "isatty") and err.isatty()
            print(f"\x1b[2m{line}\x1b[0m" if dim else line, file=err, flush=True)
    if errors:
        print(f"nanochat: error: {' '.join(errors[0].split())}", file=err, flush=True)
        return 1
    return 0


def _as_json(reply: _Reply, model: str) -> dict:
    final = reply.final
    st = final.stats
    return {
        "text": "".join(reply.text),
        "token_ids": reply.token_ids,
        "prompt_tokens": st.prompt_tokens if st else 0,
        "cached_tokens": st.cached_tokens if st else 0,
        "generated_tokens": st.completion_tokens if st else len(reply.token_ids),
        "ttft_s": st.ttft if st else None,
        "decode_tok_s": st.decode_tok_s if st else None,
        "finish_reason": final.finish_reason,
        "model": model,
    }
