"""Where nanochat keeps its files (platformdirs), all relocatable with NANOCHAT_HOME (tests use it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from nanochat.kernels.cpp_build import cache_root

APP = "nanochat"


class HomeInUse(RuntimeError):
    """Another app instance holds this home's chat store."""


@dataclass(frozen=True)
class Paths:
    config_dir: Path
    data_dir: Path
    state_dir: Path
    cache_dir: Path

    @property
    def settings_file(self) -> Path:
        return self.config_dir / "settings.json"

    @property
    def chat_db(self) -> Path:
        return self.data_dir / "chats.sqlite3"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def repl_history(self) -> Path:
        return self.state_dir / "repl_history"

    @property
    def input_history(self) -> Path:
        return self.state_dir / "input_history"

    @property
    def exports_dir(self) -> Path:
        return self.data_dir / "exports"

    def ensure(self) -> "Paths":
        for d in (self.config_dir, self.data_dir, self.state_dir, self.cache_dir, self.models_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def lock_chats(self):
        """Claim the chat store for this app instance: an open file holding an exclusive lock, released
        when it is closed or the process ends. Two apps on one home would interleave their turns in
        the same conversations, so a second one is refused with HomeInUse. None where the lock file
        cannot be written (a read-only home): then no app can save chats there, nor mix them."""
        import fcntl

        try:
            handle = open(self.data_dir / "chats.lock", "a+")
        except OSError:
            return None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise HomeInUse(f"another nanochat app is using the chats in {self.data_dir}; close it first, "
                            "or set NANOCHAT_HOME to use another home") from None
        return handle

    def describe(self) -> dict[str, str]:
        return {"config": str(self.settings_file), "chats": str(self.chat_db), "models": str(self.models_dir),
                "history": str(self.repl_history), "exports": str(self.exports_dir), "cache": str(self.cache_dir)}


def get_paths() -> Paths:
    # The cache dir is the kernels' cache_root (compiled kernels, packed weights): the one definition, at
    # the lowest layer that needs it, so that `nanochat --paths` names where they are.
    home = os.environ.get("NANOCHAT_HOME")
    if home:
        root = Path(home).expanduser()
        return Paths(root / "config", root / "data", root / "state", cache_root())
    return Paths(Path(platformdirs.user_config_dir(APP)), Path(platformdirs.user_data_dir(APP)),
                 Path(platformdirs.user_state_dir(APP)), cache_root())
