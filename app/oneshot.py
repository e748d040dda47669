"""Headless one-shot generation: `nanochat --prompt "..."` and `nanochat run --prompt A --prompt B`.

stdout carries only the reply (streamed as tokens arrive, then one newline), or JSON with --json;
progress and stats go to stderr. On a terminal the reply passes the sanitizer (app/terminal_text.py); a
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

from nanochat.app.options import effective_sampling
from nanochat.app.terminal_text import dim, for_terminal, is_terminal

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


def format_stats(stats, extra: str = "") -> str:
    """A RequestStats as `[12 tokens · 48 cached / 9 new · TTFT 0.05s · 80 tok/s]`."""
    n = stats.completion_tokens
    parts = [f"{n} token{'s' if n != 1 else ''}", f"{stats.cached_tokens} cached / {stats.prefilled_tokens} new"]
    if stats.ttft is not None:
        parts.append(f"TTFT {stats.ttft:.2f}s")
    if stats.decode_tok_s:
        parts.append(f"{stats.decode_tok_s:.1f} tok/s")
    if extra:
        parts.append(extra)
    return "[" + " · ".join(parts) + "]"


def length_note(stats) -> str:
    """Why a reply that ended on length ended: its max_tokens, or the model's context filling up."""
    if stats.context_full:
        return f"context full ({stats.prompt_tokens + stats.completion_tokens} tokens)"
    return "max tokens reached"


def model_label(model: str) -> str:
    return os.path.basename(model.rstrip("/")) or model


# ---------------------------------------------------------------------------------- one-shot
def load_client(model: str, engine_config: dict, quiet: bool):
    """An EngineClient with `model` loaded (a progress bar on stderr); (client, load seconds)."""
    from nanochat.engine.serve.client import EngineClient

    t0 = time.perf_counter()
    client = EngineClient()
    try:
        with loading_indicator(f"Loading {model_label(model)}", enabled=not quiet) as progress:
            client.load_model(model, progress=progress, **engine_config)
    except BaseException:
        client.shutdown()
        raise
    return client, time.perf_counter() - t0


def run_oneshot(opts: OneShotOptions, out=None, err=None) -> int:
    from nanochat.engine import SamplingParams

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    SamplingParams(**effective_sampling(opts.sampling))   # invalid values raise ValueError before loading
    client, load_s = load_client(opts.model, opts.engine_config, opts.quiet)
    sp = SamplingParams(**effective_sampling(opts.sampling, client.model.sampling_defaults))
    streams = []
    try:
        for text in opts.prompts:
            if opts.chat_template:
                streams.append(client.submit_turn(client.open_session(opts.system), text, sp))
            else:
                streams.append(client.submit(text, sp))
        _print_in_order(streams, None if opts.json else out)
        for stream in streams:
            stream.done.wait()
    except KeyboardInterrupt:
        if not opts.json and any(s.reply.token_ids for s in streams):
            out.write("\n")
            out.flush()
        raise
    finally:
        client.shutdown()
    return _report(opts, [s.reply for s in streams], load_s, out, err)


def _print_in_order(streams: list, out) -> None:
    """Print the replies in prompt order as they arrive: the earliest unfinished one streams live,
    the later ones (generated in the same batch) come out of their buffers when their turn comes."""
    if out is None:
        return
    terminal = is_terminal(out)
    for n, stream in enumerate(streams):
        printed = False
        for event in stream:
            if event.text:
                if not printed and n > 0:
                    out.write("\n")     # a blank line between the replies of several prompts
                out.write(for_terminal(event.text, terminal))
                out.flush()
                printed = True
        if printed or stream.reply.final.finish_reason != "error":
            out.write("\n")
            out.flush()


def _report(opts: OneShotOptions, replies: list, load_s: float, out, err) -> int:
    errors = [r.final.error or "generation failed" for r in replies if r.final.finish_reason == "error"]
    if opts.json:
        # JSON escapes C0 controls; on a terminal ensure_ascii escapes C1 and bidi too (the same text)
        ascii_only = is_terminal(out)
        for reply in replies:
            out.write(json.dumps(_as_json(reply, opts.model), ensure_ascii=ascii_only) + "\n")
        out.flush()
    terminal = is_terminal(err)
    if not opts.quiet:
        for n, reply in enumerate(replies):
            st = reply.final.stats
            if st is None or (reply.final.finish_reason == "error" and not reply.token_ids):
                continue   # refused: the error line says why
            extra = f"load {load_s:.1f}s" if n == 0 else ""
            if reply.final.finish_reason == "length":
                extra = " · ".join(x for x in (length_note(st), extra) if x)
            prefix = f"#{n + 1} " if len(replies) > 1 else ""
            print(dim(prefix + format_stats(st, extra), terminal), file=err, flush=True)
    if errors:
        print(for_terminal(f"nanochat: error: {' '.join(errors[0].split())}", terminal), file=err, flush=True)
        return 1
    return 0


def _as_json(reply, model: str) -> dict:
    final = reply.final
    st = final.stats
    return {
        "text": reply.text,
        "token_ids": reply.token_ids,
        "prompt_tokens": st.prompt_tokens if st else 0,
        "cached_tokens": st.cached_tokens if st else 0,
        "generated_tokens": st.completion_tokens if st else len(reply.token_ids),
        "ttft_s": st.ttft if st else None,
        "decode_tok_s": st.decode_tok_s if st else None,
        "finish_reason": final.finish_reason,
        "model": model,
    }
