"""How the command line reports failures: one line on stderr, exit 1 (runtime) or 2 (usage).

`run_guarded` is the try/except every subcommand entry point (`nanochat bench`, `convert-model`) wraps
its work in.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from nanochat.app.terminal_text import for_stream
from nanochat.models.errors import one_line as shared_one_line

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEBUG_ENV = "NANOCHAT_DEBUG"   # set to 1 to get tracebacks instead of one-line messages


class UsageError(Exception):
    """A bad combination of command-line options found after argparse (exit code 2)."""


def one_line(exc: BaseException, oom_advice: str | None = "a smaller model or --kv-cache-gib",
             os_filename: bool = True) -> str:
    """models/errors.py's one_line, with two readings only a command line wants: the user acts on them.

    os_filename: an OSError with a file name reads "FILE: strerror" (without the errno and quotes).
    oom_advice: a MemoryError reads "out of memory (...); try <oom_advice>" (None: its plain message)."""
    text = shared_one_line(str(exc))   # the text alone: an empty message is told apart below
    if os_filename and isinstance(exc, OSError) and exc.filename and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    if oom_advice is not None and isinstance(exc, MemoryError):
        text = "out of memory" + (f" ({text})" if text else "") + f"; try {oom_advice}"
    return text or type(exc).__name__


def report(message: str, prog: str = "nanochat") -> None:
    print(for_stream(f"{prog}: error: {message}", sys.stderr), file=sys.stderr, flush=True)


def debug_enabled() -> bool:
    # NANOCHAT_DEBUG=false or =off asks for no tracebacks, as the engine's flag variables read those words
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def run_guarded(body: Callable[[], int], prog: str, describe: Callable[[BaseException], str] = one_line,
                interrupts: tuple[type[BaseException], ...] = (KeyboardInterrupt,),
                say_interrupted: bool = True) -> int:
    """body()'s exit code, or the exit code of what it raised, reported as one line on stderr:
    UsageError -> "PROG: error: MESSAGE", 2; one of `interrupts` -> "PROG: interrupted" (unless not
    say_interrupted), 130; any other Exception -> "PROG: error: describe(e)", 1 (re-raised instead
    when NANOCHAT_DEBUG is set)."""
    try:
        return body()
    except UsageError as e:
        report(str(e), prog)
        return EXIT_USAGE
    except interrupts:
        if say_interrupted:
            print(for_stream(f"{prog}: interrupted", sys.stderr), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:
        if debug_enabled():
            raise
        report(describe(e), prog)
        return EXIT_RUNTIME
