"""The one sanitizer for text bound for a terminal: model output and stored text are untrusted.

A terminal obeys the control characters in what it is given: ESC starts the sequences that set the
window title (OSC 0/2), write the clipboard (OSC 52), make hyperlinks (OSC 8) or recolour the screen
(CSI), C1 controls (U+0080-U+009F) are 8-bit forms of the same, a lone CR returns to the start of the
line to overwrite it, and bidi overrides and isolates reorder what is shown after them. `sanitize`
shows each of these as visible text instead:

- C0 controls other than tab and newline as Unicode Control Pictures: ESC as "␛", BEL "␇", NUL "␀",
  a lone CR "␍" (CRLF becomes a newline); DEL as "␡";
- C1 controls and the bidi embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) as their
  code point, "<U+009B>". The bidi marks (LRM, RLM, ALM) stay: they reorder no text, only the neutral
  characters beside them, and right-to-left text uses them.

Everything else is unchanged. The mapping is character by character, so a stream may be sanitized a
chunk at a time, split anywhere (a CRLF split between two chunks shows its CR). Pipes, files and
exports keep the exact text: `for_terminal` and `dim` sanitize only for a terminal (and --json keeps
it too: on a terminal it escapes these characters as JSON does, which decodes to the same text).
"""

from __future__ import annotations

import re

_DIM, _UNDIM = "\x1b[2m", "\x1b[0m"


def _visible(code: int) -> str:
    if code < 0x20:
        return chr(0x2400 + code)      # the Control Pictures block: U+2400 NUL ... U+241F US
    if code == 0x7F:
        return "\u2421"                # ␡
    return f"<U+{code:04X}>"


# C0 but tab and newline, DEL and C1, the bidi embeddings and overrides, the bidi isolates
_RANGES = ((0x00, 0x08), (0x0B, 0x1F), (0x7F, 0x9F), (0x202A, 0x202E), (0x2066, 0x2069))
SHOWN = frozenset(chr(code) for first, last in _RANGES for code in range(first, last + 1))
"""The characters that never reach a terminal as themselves."""
_VISIBLE = {char: _visible(ord(char)) for char in SHOWN} | {"\r\n": "\n"}
# One regex scan, whatever the text: str.translate is several times slower on non-ASCII text.
_UNSAFE = re.compile("\r\n|[" + "".join(f"\\u{first:04x}-\\u{last:04x}" for first, last in _RANGES) + "]")


def sanitize(text: str) -> str:
    """`text` with its control characters and bidi overrides shown as visible symbols."""
    return _UNSAFE.sub(_show, text)


def _show(match: re.Match) -> str:
    return _VISIBLE[match.group()]


def for_terminal(text: str, terminal: bool) -> str:
    """`text` as it should be written: sanitized for a terminal, exact for a pipe or a file."""
    return sanitize(text) if terminal else text


def for_stream(text: str, stream) -> str:
    """`text` as it should be written to `stream` (see for_terminal)."""
    return for_terminal(text, is_terminal(stream))


def dim(text: str, terminal: bool) -> str:
    """A note, dim and sanitized on a terminal, exact elsewhere."""
    return f"{_DIM}{sanitize(text)}{_UNDIM}" if terminal else text


def is_terminal(stream) -> bool:
    """Whether `stream` is a terminal (False for one that cannot tell, such as a closed stream)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False
