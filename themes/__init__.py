"""Textual themes shipped with nanochat. `register_themes(app)` makes them selectable by name."""

from __future__ import annotations

from nanochat.themes.nanochat import NANOCHAT_DARK, NANOCHAT_EMBER, NANOCHAT_LIGHT, THEMES

DEFAULT_THEME = NANOCHAT_DARK.name
THEME_NAMES: tuple[str, ...] = tuple(t.name for t in THEMES)


def register_themes(app) -> None:
    for theme in THEMES:
        app.register_theme(theme)


__all__ = ["THEMES", "THEME_NAMES", "DEFAULT_THEME", "register_themes", "NANOCHAT_DARK", "NANOCHAT_LIGHT",
           "NANOCHAT_EMBER"]
