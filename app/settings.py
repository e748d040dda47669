"""User settings: one JSON file at get_paths().settings_file.

Loading never fails: a missing file gives the defaults, a corrupt file or a bad value gives the
defaults for what could not be read plus a warning in `Settings.warnings` (the CLI prints them,
the TUI can show them). Unknown keys are ignored so older and newer versions share a file.
A file that could not be read whole is never overwritten: `save` refuses (SettingsNotSaved), so the
user's file survives for them to fix, whatever front end was running.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from nanochat.app.options import DTYPE_NAMES, speculative_arg, valid_device
from nanochat.engine.rules import KV_CACHE_GIB, POSITIVE_INT, SAMPLING_RULES, SPECULATIVE_K, accepts

MAX_RECENT = 10
VERSION = 2
# Version 1 files hold every sampling setting, its default written out whether chosen or not. Read as
# "not stated", those defaults let the model file's recommendations apply (options.effective_sampling).
V1_SAMPLING_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "max_tokens": 512,
                        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class SettingsNotSaved(OSError):
    """The settings file on disk could not be read whole when loaded: it is not overwritten."""


def _optional_str(v) -> bool:
    return v is None or isinstance(v, str)


def _optional(rule, v) -> bool:
    return v is None or accepts(rule, v)


def _speculative(v) -> bool:
    """--speculative's rule, the value as written (a file's "Ngram" or "ngarm" is no model to load)."""
    if v is None:
        return True
    try:
        return isinstance(v, str) and speculative_arg(v) == v
    except argparse.ArgumentTypeError:
        return False


# field -> check of a value read from the file (the command line's checks, app/options.py)
_CHECKS = {
    "default_model": _optional_str,
    "device": valid_device,
    "dtype": lambda v: v in DTYPE_NAMES,
    "theme": lambda v: isinstance(v, str) and bool(v),
    **{name: partial(_optional, rule) for name, rule in SAMPLING_RULES.items() if name != "seed"},
    "system_prompt": _optional_str,
    "recent_models": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "kv_cache_gib": lambda v: v is None or accepts(KV_CACHE_GIB, v),
    "max_model_len": lambda v: v is None or accepts(POSITIVE_INT, v),
    "speculative": _speculative,
    "speculative_k": lambda v: v is None or accepts(SPECULATIVE_K, v),
}


@dataclass
class Settings:
    default_model: str | None = None      # None: the built-in model (models.catalog)
    device: str = "cpu"
    dtype: str = "auto"
    theme: str = "nanochat-dark"
    # Sampling: None is "not stated": the model file's recommendation, else options.CHAT_DEFAULTS (the
    # penalties are off unless someone turns them on).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    system_prompt: str | None = None
    recent_models: list[str] = field(default_factory=list)
    kv_cache_gib: float | None = None     # None: the engine's default CPU KV budget
    max_model_len: int | None = None      # None: NANO_VLLM_MAX_MODEL_LEN, else the engine's default (a number
    # here by default would win over that variable, which then did nothing)
    speculative: str | None = None        # off | ngram | a draft model; None: NANOCHAT_SPECULATIVE, else the engine's
    speculative_k: int | None = None      # None: NANOCHAT_SPECULATIVE_K, else the engine's
    warnings: list[str] = field(default_factory=list, repr=False, compare=False)   # not saved

    # ------------------------------------------------------------------ load / save
    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Settings":
        path = Path(path) if path is not None else _default_path()
        settings = cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return settings
        except (OSError, UnicodeDecodeError, ValueError) as e:
            settings.warnings.append(f"{path}: cannot read settings ({e.__class__.__name__}); using defaults")
            return settings
        if not isinstance(raw, dict):
            settings.warnings.append(f"{path}: settings must be a JSON object; using defaults")
            return settings
        unchosen = V1_SAMPLING_DEFAULTS if raw.get("version", 1) < VERSION else {}
        for name, check in _CHECKS.items():
            # a version-1 file's untouched default is no choice (False == 0.0 in Python: a bool is never one)
            if name not in raw or (name in unchosen and raw[name] == unchosen[name]
                                   and not isinstance(raw[name], bool)):
                continue
            value = raw[name]
            if check(value):
                setattr(settings, name, list(value) if isinstance(value, list) else value)
            else:
                settings.warnings.append(f"{path}: ignoring invalid {name} = {value!r}")
        return settings

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write atomically (temp file + rename), so a crash never leaves half a file."""
        path = Path(path) if path is not None else _default_path()
        if self.warnings:
            raise SettingsNotSaved(f"{path} was not read whole, so it is left as it is "
                                   "(fix or remove it to save settings again)")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=".settings-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("warnings")
        return {"version": VERSION, **d}

    # ------------------------------------------------------------------ helpers
    def remember_model(self, model: str) -> None:
        """Put `model` first in the recent list (most recent first, no duplicates)."""
        self.recent_models = [model] + [m for m in self.recent_models if m != model]
        del self.recent_models[MAX_RECENT:]


def _default_path() -> Path:
    from nanochat.app.paths import get_paths

    return get_paths().settings_file
