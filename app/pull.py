"""`nanochat pull REPO[:QUANT]`, and the same fetch wherever a model is named `REPO:QUANT` (--model, settings):
a GGUF from a Hugging Face repo into the hub cache, with a progress bar on a terminal (models/formats/hub_gguf.py).

    nanochat pull bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M    -> prints the file's local path
    nanochat --model bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q8_0    -> fetches it (once), then chats
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

from nanochat.app.errors import EXIT_OK, UsageError, one_line, run_guarded
from nanochat.app.options import name_arg
from nanochat.app.terminal_text import for_stream, is_terminal, sanitize

PROG = "nanochat pull"


def add_pull_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("pull", help="download a GGUF from a Hugging Face repo (REPO[:QUANT])",
                              description="Download a GGUF model file from a Hugging Face repo into the hub cache, "
                                          "resuming an interrupted download. QUANT picks the file by the tag in its "
                                          "name (default Q4_K_M, else Q8_0, else the first); prints its path.")
    p.add_argument("ref", type=name_arg, metavar="REPO[:QUANT]", help="e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run_pull_cli)
    return p


def run_pull_cli(args) -> int:
    return run_guarded(lambda: _pull(args), PROG, describe=partial(one_line, oom_advice=None))


def _pull(args) -> int:
    from nanochat.models.formats.hub_gguf import parse_ref

    ref = parse_ref(args.ref, any_repo=True)
    if ref is None:
        raise UsageError(f"{args.ref!r} is not REPO[:QUANT] (for example owner/Model-GGUF:Q4_K_M)")
    path = fetch_with_progress(ref, quiet=bool(args.quiet))
    print(for_stream(str(path), sys.stdout))
    return EXIT_OK


def materialize(model: str | None, quiet: bool = False) -> str | None:
    """`model` as the loader takes it: a hub GGUF reference becomes its local file (fetched when needed);
    anything else unchanged."""
    if not model:
        return model
    from nanochat.models.formats.hub_gguf import parse_ref

    ref = parse_ref(model)
    return model if ref is None else str(fetch_with_progress(ref, quiet))


def fetch_with_progress(ref, quiet: bool = False):
    """hub_gguf.fetch with a rich progress bar on a terminal's stderr (a start and an end line elsewhere)."""
    from nanochat.models.formats.hub_gguf import fetch

    if quiet:
        return fetch(ref)
    if not is_terminal(sys.stderr):
        return fetch(ref, _LineProgress())
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        tasks: dict[str, int] = {}

        def update(done: int, total: int, filename: str) -> None:
            if filename not in tasks:
                tasks[filename] = bar.add_task(sanitize(filename), total=total, completed=done)
            bar.update(tasks[filename], completed=done, total=total)

        return fetch(ref, update)


class _LineProgress:
    """Without a terminal: say what is fetched and when it is done, one line each."""

    def __init__(self) -> None:
        self.started: set[str] = set()

    def __call__(self, done: int, total: int, filename: str) -> None:
        if filename not in self.started:
            self.started.add(filename)
            if done == total:
                return self._say(f"{filename}: already here")
            start = f" (resuming at {done / 2**20:.1f} MiB)" if 0 < done < total else ""
            self._say(f"fetching {filename}: {total / 2**20:.1f} MiB{start}")
        elif done == total:
            self._say(f"fetched {filename}")

    @staticmethod
    def _say(line: str) -> None:
        print(for_stream(f"nanochat: {line}", sys.stderr), file=sys.stderr, flush=True)
