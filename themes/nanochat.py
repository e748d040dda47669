"""nanochat's own Textual themes: a dark default, a light one, and a warm low-contrast one."""

from __future__ import annotations

from textual.theme import Theme

NANOCHAT_DARK = Theme(
    name="nanochat-dark",
    primary="#4FA3E0",
    secondary="#7A8CFF",
    accent="#F2B35E",
    warning="#F2B35E",
    error="#E0566C",
    success="#5CC98A",
    foreground="#DCE3EA",
    background="#11161C",
    surface="#182029",
    panel="#212C38",
    dark=True,
    variables={"footer-key-foreground": "#4FA3E0", "block-cursor-text-style": "none"},
)

NANOCHAT_LIGHT = Theme(
    name="nanochat-light",
    primary="#1F6FB2",
    secondary="#5A4FCF",
    accent="#B35C00",
    warning="#B35C00",
    error="#B3261E",
    success="#2E7D32",
    foreground="#1D232A",
    background="#F6F7F9",
    surface="#ECEFF3",
    panel="#DDE3EA",
    dark=False,
    variables={"footer-key-foreground": "#1F6FB2"},
)

NANOCHAT_EMBER = Theme(
    name="nanochat-ember",
    primary="#E08A4F",
    secondary="#C9A66B",
    accent="#8FBF7F",
    warning="#E8C35A",
    error="#E25D4F",
    success="#8FBF7F",
    foreground="#EDE3D6",
    background="#1C1714",
    surface="#26201B",
    panel="#332A23",
    dark=True,
    variables={"footer-key-foreground": "#E08A4F"},
)

THEMES: tuple[Theme, ...] = (NANOCHAT_DARK, NANOCHAT_LIGHT, NANOCHAT_EMBER)
