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
