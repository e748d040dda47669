"""Slow one-time work a model load may do (compiling the C++ kernels, repacking a new file's weights),
announced to whoever listens on the loading thread: the engine process forwards it to the front end,
which shows it where it shows the load (a load that takes 20 s instead of 1 s should say why).

Per thread, so that engines loading side by side in one process (tests, embedding) each hear only
their own load's work."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


@contextmanager
def listening(listener: Callable[[str], None]) -> Iterator[None]:
    """While inside, `listener(text)` hears this thread's announcements (one line each)."""
    previous = getattr(_local, "listener", None)
    _local.listener = listener
    try:
        yield
    finally:
        _local.listener = previous


def announce(text: str) -> None:
    """Tell this thread's listener (if any) what slow work starts now."""
    listener = getattr(_local, "listener", None)
    if listener is not None:
        listener(text)
