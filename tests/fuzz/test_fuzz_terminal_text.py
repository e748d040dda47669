"""Generated hostile text through the terminal sanitizer and the paste guard (seeded, so a failure
repeats): escape sequences of every family, lone controls, bidi overrides and ordinary text, cut into
stream chunks or terminal reads at random places.
"""

from __future__ import annotations

import random

import pytest
from textual import events

from nanochat.app.terminal_text import SHOWN, sanitize
from nanochat.app.tui.paste import PASTE_END, PASTE_START, PasteSafeParser

PIECES = [
    "\x1b]2;PWNED\x07", "\x1b]0;t\x1b\\", "\x1b]52;c;aGk=\x07", "\x1b]8;;http://x\x1b\\", "\x1b[41m", "\x1b[0m",
    "\x1b[2J", "\x1b[?1049h", "\x1bP1$r\x1b\\", "\x1b_a\x1b\\", "\x9b31m", "\x9d2;x\x9c", "\x90q\x9c", "\x1b",
    "\x07", "\x08", "\r", "\r\n", "\n", "\t", "\x00", "\x7f", "\u202e", "\u2066", "\u2069", "\u200f", "\u061c",
    "é", "日本", "🙂", "e\u0301", "[/]", "```", " ", "text", PASTE_START,
]
SEEDS = range(20)


def hostile(rng: random.Random, pieces: list[str] = PIECES) -> str:
    """Pieces of escape sequences and text, with single random characters (controls among them)."""
    parts = [rng.choice(pieces) if rng.random() < 0.8 else chr(rng.randrange(0, 0x2100))
             for _ in range(rng.randrange(0, 40))]
    return "".join(parts)


def cuts(rng: random.Random, text: str) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize("seed", SEEDS)
def test_sanitized_text_holds_no_control_and_the_rest_unchanged(seed):
    rng = random.Random(seed)
    for _ in range(200):
        text = hostile(rng)
        shown = sanitize(text)
        assert not set(shown) & SHOWN
        # each character is shown by itself: a control as visible symbols, anything else as it is
        assert shown == "".join(sanitize(c) for c in text.replace("\r\n", "\n"))
        for c in set(text):
            assert sanitize(c) == c if c not in SHOWN else (sanitize(c).isprintable() and sanitize(c) != c)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_stream_cut_anywhere_is_shown_as_the_whole(seed):
    rng = random.Random(seed)
    for _ in range(200):
        text = hostile(rng)
        chunks = cuts(rng, text)
        shown = "".join(sanitize(chunk) for chunk in chunks)
        assert not set(shown) & SHOWN
        if not any(a.endswith("\r") and b.startswith("\n") for a, b in zip(chunks, chunks[1:])):
            assert shown == sanitize(text)            # (a CRLF cut in two shows its CR)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_paste_is_one_event_whatever_it_holds_and_however_it_is_read(seed):
    rng = random.Random(seed)
    for _ in range(50):
        pasted = [without_end(hostile(rng)) for _ in range(rng.randrange(1, 3))]
        typed = ["".join(rng.choices("abc xyz", k=rng.randrange(0, 4))) for _ in range(len(pasted) + 1)]
        stream = typed[0] + "".join(PASTE_START + p + PASTE_END + t for p, t in zip(pasted, typed[1:]))
        parser = PasteSafeParser()
        parsed = [event for chunk in cuts(rng, stream) for event in parser.feed(chunk)]
        pastes = [e.text for e in parsed if isinstance(e, events.Paste)]
        keys = "".join(e.character for e in parsed if isinstance(e, events.Key))
        expected = [p.replace("\x1b", "␛").replace("\x00", "") for p in pasted]
        assert pastes == expected and keys == "".join(typed), repr(stream)


def without_end(text: str) -> str:
    """A paste cannot hold the marker that ends it (the terminal's guard, not ours)."""
    while PASTE_END in text:
        text = text.replace(PASTE_END, "")
    return text
