"""Errors raised while finding or loading a model, each with a one-line message for the user."""


class ModelLoadError(ValueError):
    """A model could not be found or read (missing/corrupt files, unsupported architecture or type)."""
