"""Fetching a hub GGUF wherever a model is named `REPO:QUANT` (--model, settings, the picker), with a
progress bar on a terminal (models/formats/hub_gguf.py does the fetch)."""

from __future__ import annotations

import sys

from nanochat.app.terminal_text import for_stream, is_terminal, sanitize


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
