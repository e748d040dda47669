"""A bracketed paste is one event, whatever bytes it carries.

Textual's input parser (textual._xterm_parser.XTermParser) reads an ESC inside a bracketed paste as it
does outside one, as the start of a key sequence: what follows, not being one, is reissued as key
presses ("^" for the ESC), and only the text before the first ESC makes the Paste event, which comes
after those keys. A pasted coloured log, "a\n\x1b[31mred\x1b[0m\nc" (a terminal pastes line breaks as
CR, the Enter key), so typed "^[31mred^[0m" and pressed Enter, sending it as a message at once, then
typed "c", and the paste brought only "a".

PasteGuard rewrites the terminal's input before Textual parses it: inside a paste, each ESC becomes
the sanitizer's "␛", so the parser finds no sequence there but the paste's end, and the whole text
arrives as one Paste event (the input shows its other control characters through the sanitizer).
"""

from __future__ import annotations

from textual._xterm_parser import XTermParser

from nanochat.app.terminal_text import sanitize

PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
ESC = "\x1b"


class PasteGuard:
    """Called with each chunk of the terminal's input (split anywhere), returns what the parser gets."""

    def __init__(self):
        self.pasting = False
        # Outside a paste, the last characters seen (already passed on), where PASTE_START may have
        # begun; inside one, characters held back because they may begin PASTE_END.
        self.tail = ""

    def __call__(self, data: str) -> str:
        out = []
        while data:
            seen, marker = self.tail + data, PASTE_END if self.pasting else PASTE_START
            at = seen.find(marker)
            if at < 0:
                if self.pasting:
                    keep = _partial_marker(seen)
                    out.append(_shown(seen[:len(seen) - keep]))
                    self.tail = seen[len(seen) - keep:]
                else:   # passed on at once: a lone ESC is the Escape key, and must not wait
                    out.append(data)
                    self.tail = seen[-(len(PASTE_START) - 1):]
                break
            end = at + len(marker)
            if self.pasting:
                out.append(_shown(seen[:at]) + PASTE_END)
                data = seen[end:]
            else:   # the marker ends in `data` (it cannot fit in the shorter tail)
                start = end - len(self.tail)
                out.append(data[:start])
                data = data[start:]
            self.pasting, self.tail = not self.pasting, ""
        return "".join(out)


def _partial_marker(text: str) -> int:
    """How many of `text`'s last characters PASTE_END could begin with."""
    for n in range(min(len(text), len(PASTE_END) - 1), 0, -1):
        if text.endswith(PASTE_END[:n]):
            return n
    return 0


def _shown(pasted: str) -> str:
    return pasted.replace(ESC, sanitize(ESC))


class PasteSafeParser(XTermParser):
    """Textual's parser, fed through a PasteGuard."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._guard = PasteGuard()

    def feed(self, data: str):
        guarded = self._guard(data)
        if data and not guarded:   # all held back; feeding "" would mean the end of the input
            return ()
        return super().feed(guarded)


def install() -> None:
    """Make Textual's terminal driver (Linux and macOS) parse its input with PasteSafeParser. The
    driver builds its parser in its input thread, by this module-level name, and offers no hook."""
    from textual.drivers import linux_driver

    linux_driver.XTermParser = PasteSafeParser
