"""Where nanochat keeps its files (platformdirs), all relocatable with NANOCHAT_HOME (tests use it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP = "nanochat"


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

    def describe(self) -> dict[str, str]:
        return {"config": str(self.settings_file), "chats": str(self.chat_db), "models": str(self.models_dir),
                "history": str(self.repl_history), "exports": str(self.exports_dir), "cache": str(self.cache_dir)}


def get_paths() -> Paths:
    home = os.environ.get("NANOCHAT_HOME")
    if home:
        root = Path(home).expanduser()
        return Paths(root / "config", root / "data", root / "state", root / "cache")
    return Paths(Path(platformdirs.user_config_dir(APP)), Path(platformdirs.user_data_dir(APP)),
                 Path(platformdirs.user_state_dir(APP)), Path(platformdirs.user_cache_dir(APP)))
