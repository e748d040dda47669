"""Errors raised while finding or loading a model, each with a one-line message for the user."""

import errno
import os


class ModelLoadError(ValueError):
    """A model could not be found or read (missing/corrupt files, unsupported architecture or type)."""


def missing_path(path: str | os.PathLike, what: str = "no such file") -> ModelLoadError:
    """The error for a path that does not lead to a file: a symlink loop and a dangling symlink are named
    as such, since `exists()` reports both as plain absence."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return ModelLoadError(f"{path}: symlink loop")
        if os.path.islink(path):
            return ModelLoadError(f"{path}: broken symlink (to {os.readlink(path)})")
    return ModelLoadError(f"{path}: {what}")


def one_line(message: BaseException | str) -> str:
    """`message` (an exception, or its text) on one line, its whitespace runs (newlines included) one
    space: how every layer reports an error to the user. An exception without a message reads as its
    class name. The one definition, here at the lowest layer that reports errors; app/errors.py adds the
    command line's readings of OSError and MemoryError on top."""
    text = " ".join(str(message).split())
    if not text and isinstance(message, BaseException):
        return type(message).__name__
    return text
