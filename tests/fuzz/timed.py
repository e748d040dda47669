"""Run one fuzz case on a worker thread with a time limit: a case that hangs is reported, not waited for."""

from __future__ import annotations

import threading


def call_with_timeout(fn, seconds: float) -> tuple[str, object]:
    """("done", fn's value) | ("error", the exception) | ("hang", None)."""
    box: dict = {}

    def target():
        try:
            box["result"] = ("done", fn())
        except BaseException as e:   # noqa: BLE001 -- the caller classifies every exception
            box["result"] = ("error", e)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    return ("hang", None) if worker.is_alive() else box["result"]
