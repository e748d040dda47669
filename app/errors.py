"""How the command line reports failures: one line on stderr, exit 1 (runtime) or 2 (usage)."""

from __future__ import annotations

import os
import sys

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEBUG_ENV = "NANOCHAT_DEBUG"   # set to 1 to get tracebacks instead of one-line messages


class UsageError(Exception):
    """A bad combination of command-line options found after argparse (exit code 2)."""


def one_line(exc: BaseException) -> str:
    """The exception's message squeezed onto one line (the class name when it has none)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, MemoryError):
        text = "out of memory" + (f" ({text})" if text else "") + "; try a smaller model or --kv-cache-gib"
    return text or exc.__class__.__name__


def report(message: str, prog: str = "nanochat") -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")
