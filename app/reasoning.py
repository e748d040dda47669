"""A reply's thinking apart from its answer: reasoning models (Qwen3, SmolLM3, Phi-4 reasoning) write
their thinking between <think> and </think> before the answer.

`ThinkingSplitter` is fed a reply chunk by chunk, as it streams, with the tags split across chunks
anywhere, and keeps `reasoning` (None: the reply has no thinking) and `answer`. Both only grow, so a
front end can show what each gained. The block counts only at the start of a reply (after whitespace):
a <think> later in the answer is text. A template that opens the block in the prompt itself (the model
then writes only the body and </think>) starts the splitter inside it (`prompted`). The whitespace
around the thinking ("<think>\\n", "\\n</think>\\n\\n") is dropped; a reply without thinking is its
answer, exactly.

gpt-oss replies are in the harmony format instead (channels, not tags): `reply_splitter` is the one
place that picks the splitter for a model, and HarmonySplitter (models/text/harmony.py) has the same
surface (reasoning, answer, closed, thinking, prompted; feed, finish), plus the tool calls it found.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from nanochat.engine.serve.protocol import HarmonySplitter

# The tags as the models write them (models/text/chat_template.py has its own copy: app/ cannot import it).
OPEN, CLOSE = "<think>", "</think>"
_START, _THINKING, _ANSWER = "start", "thinking", "answer"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is the beginning of `tag` (a tag a later chunk may finish)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkingSplitter:
    """A streamed reply split into its thinking and its answer (see the module's doc)."""

    def __init__(self, prompted: bool = False):
        self.prompted = prompted       # the prompt opened the block
        self.reasoning: str | None = "" if prompted else None
        self.answer = ""
        self.closed = False            # </think> came
        self._state = _THINKING if prompted else _START
        self._held = ""                # text not placed yet: whitespace, or what may begin a tag

    @property
    def thinking(self) -> bool:
        """Inside the thinking block now (it opened, and has not closed yet)."""
        return self._state == _THINKING

    def feed(self, text: str) -> None:
        text, self._held = self._held + text, ""
        if self._state == _START:
            head = text.lstrip()
            if head.startswith(OPEN):
                self._state, self.reasoning = _THINKING, ""
                text = head[len(OPEN):]
            elif OPEN.startswith(head):   # only whitespace yet, or the beginning of <think>
                self._held = text
                return
            else:
                self._state = _ANSWER
        if self._state == _THINKING:
            self._think(text)
        else:
            self._answer(text)

    def finish(self) -> None:
        """The reply ended: place what was held back (an unfinished tag is text)."""
        held, self._held = self._held, ""
        if self._state == _THINKING:
            self._add_reasoning(held.rstrip())
        elif held:
            self._state = _ANSWER
            self._answer(held)

    def _think(self, text: str) -> None:
        at = text.find(CLOSE)
        if at >= 0:
            self._add_reasoning(text[:at].rstrip())
            self._state, self.closed = _ANSWER, True
            self._answer(text[at + len(CLOSE):])
            return
        body = text[:len(text) - _partial_tag(text, CLOSE)]
        shown = body.rstrip()   # trailing whitespace waits: it goes if </think> follows
        self._held = text[len(shown):]
        self._add_reasoning(shown)

    def _add_reasoning(self, text: str) -> None:
        self.reasoning += text if self.reasoning else text.lstrip()

    def _answer(self, text: str) -> None:
        self.answer += text.lstrip() if self.closed and not self.answer else text


@dataclass
class Split:
    reasoning: str | None   # None: no thinking
    answer: str
    closed: bool            # the thinking ended with </think> (False: none, or cut off)


def split_reasoning(text: str, prompted: bool = False) -> Split:
    """A whole reply's thinking and answer."""
    splitter = ThinkingSplitter(prompted)
    splitter.feed(text)
    splitter.finish()
    return Split(splitter.reasoning, splitter.answer, splitter.closed)


def reply_splitter(model=None, prompted: bool = False):
    """A new splitter for a reply of `model` (a ModelInfo; None: no model): harmony channels for a
    harmony model, else <think> blocks (`prompted`: the prompt opened the block)."""
    return HarmonySplitter() if getattr(model, "harmony", False) else ThinkingSplitter(prompted)


def split_reply(text: str, model=None, prompted: bool = False) -> Split:
    """A whole reply's thinking and answer, split as `model` writes them (see reply_splitter)."""
    splitter = reply_splitter(model, prompted)
    splitter.feed(text)
    splitter.finish()
    return Split(splitter.reasoning, splitter.answer, splitter.closed)


def join_reasoning(reasoning: str, answer: str, closed: bool = True, prompted: bool = False) -> str:
    """The reply as the model wrote it, tags and all (what it sees again in the chat's history); the
    inverse of split_reasoning. `prompted`: the prompt opened the block, so the reply does not."""
    head = "" if prompted else f"{OPEN}\n"
    return f"{head}{reasoning}\n{CLOSE}\n\n{answer}" if closed else f"{head}{reasoning}"


@dataclass
class Thought:
    """A reply's thinking: its text, how long it took, how it ended."""

    text: str
    tokens: int = 0                # tokens generated inside the block (its tags included)
    seconds: float | None = None   # from the message sent to </think> (or the reply's end); None: unknown
    closed: bool = True            # False: cut off (token limit, cancel, crash) before </think>
    prompted: bool = False         # the prompt opened the block (the model wrote no <think>)
    harmony: bool = False          # written on harmony's analysis channel (gpt-oss), which the history drops

    def meta(self) -> dict:
        """Everything but the text (stored beside it)."""
        return {k: v for k, v in asdict(self).items() if k != "text"}

    @classmethod
    def from_meta(cls, text: str, meta: dict | None) -> "Thought":
        """A thought read back; keys of other versions are ignored."""
        names = {f.name for f in fields(cls)} - {"text"}
        return cls(text, **{k: v for k, v in (meta or {}).items() if k in names})


def describe_thought(thought: Thought, live: bool = False) -> str:
    """'Thinking… 42 tokens · 3.1 s' while it streams, 'Thought for 3.2 s · 120 tokens' once closed,
    'Thinking stopped · ...' when it never closed."""
    parts = []
    if thought.seconds is not None:
        parts.append(f"{thought.seconds:.1f} s")
    if thought.tokens:
        parts.append(f"{thought.tokens} token{'s' if thought.tokens != 1 else ''}")
    if live:
        return f"Thinking… {' · '.join(parts[::-1])}".rstrip()
    if thought.closed:
        return f"Thought for {' · '.join(parts)}" if parts else "Thought"
    return " · ".join(["Thinking stopped before the answer", *parts])


def reply_thought(splitter) -> Thought | None:
    """The thinking of a finished reply that `splitter` (reply_splitter's) read; None when it had none."""
    if splitter.reasoning is None:
        return None
    return Thought(splitter.reasoning, closed=splitter.closed, prompted=splitter.prompted,
                   harmony=not isinstance(splitter, ThinkingSplitter))
