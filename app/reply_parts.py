"""A chat reply in parts, for the HTTP APIs: `ReplyReader` reads it as it streams into reasoning, answer and tool
calls; `BlockStream` turns those parts into the blocks (OpenAI's Responses items, Anthropic's content blocks) that
the Responses and Messages APIs stream, each subclass saying what events a block's steps send."""

from __future__ import annotations

import json
import uuid

from nanochat.app.reasoning import reply_splitter
from nanochat.app.tool_calls import ToolCallParser


def new_id(prefix: str, digits: int = 32) -> str:
    """An API object's id: `prefix`_ and random hex digits."""
    return f"{prefix}_{uuid.uuid4().hex[:digits]}"


def call_arguments(call: dict) -> dict:
    """A call's arguments as an object, for the APIs that send objects (Anthropic's tool_use, Ollama's tool_calls):
    the model's text when it is not one, under a key that says so."""
    text = call["function"]["arguments"]
    try:
        arguments = json.loads(text)
    except ValueError:
        arguments = None
    return arguments if isinstance(arguments, dict) else {"arguments": text}


def answer_text(answer: str, calls: list[dict]) -> str | None:
    """A whole reply's answer as its message or text block shows it: the text itself, or beside calls the text
    without the whitespace around them; None (no message) for calls with no text."""
    if not calls:
        return answer
    return answer.strip() or None


class ReplyReader:
    """A chat reply read as it streams: its reasoning (a <think> block, or harmony's analysis channel), its answer,
    and its tool calls (Hermes tags in the answer of a request with tools; harmony's calls), each only growing."""

    def __init__(self, model, prompted: bool, tools: bool):
        self.splitter = reply_splitter(model, prompted)
        harmony = getattr(model, "harmony", False)
        self.parser = ToolCallParser() if tools and not harmony else None
        self.calls: list[dict] = []
        self.reasoning_tokens = 0   # tokens written inside the reasoning
        self._answer: list[str] = []

    @property
    def answer(self) -> str:
        """The answer so far (without the calls' text)."""
        return "".join(self._answer)

    @property
    def reasoning(self) -> str:
        return self.splitter.reasoning or ""

    @property
    def reasoned(self) -> bool:
        """The reply has a reasoning part (perhaps empty)."""
        return self.splitter.reasoning is not None

    def feed(self, text: str, final: bool = False, tokens: int = 0) -> tuple[str, str, list[dict]]:
        """What `text` (`tokens` tokens; `final`: the reply's last) adds: (answer, reasoning, calls)."""
        s = self.splitter
        answered, reasoned, called = len(s.answer), len(s.reasoning or ""), len(getattr(s, "calls", ()))
        was_thinking = s.thinking
        s.feed(text)
        if final:
            s.finish()
        answer, reasoning = s.answer[answered:], (s.reasoning or "")[reasoned:]
        calls = list(getattr(s, "calls", ())[called:])
        if self.parser is not None:
            answer, found = self.parser.feed(answer)
            if final:
                answer += self.parser.finish()
            calls += found
        if was_thinking or s.thinking or reasoning:
            self.reasoning_tokens += tokens
        self._answer.append(answer)
        self.calls += calls
        return answer, reasoning, calls


class BlockStream:
    """A reply's parts as a sequence of blocks: a block opens with its first text (reasoning, then the answer's
    text, then one block per call) and closes when the next one opens or the reply ends. Answer text of whitespace
    alone waits for more (whitespace before calls opens no block); a reply with no text and no calls is one empty
    text block. Subclasses give each step's events: `opened`, `wrote`, `closed` (kind "reasoning" or "text") and
    `called`."""

    def __init__(self):
        self.kind: str | None = None   # the open block's kind
        self.texts = self.calls = 0    # text blocks opened, calls written
        self._blank = ""

    def add(self, reasoning: str, answer: str, calls: list[dict]) -> list[dict]:
        """The events of a reply's new reasoning, answer text and calls."""
        out = []
        if reasoning:
            out += self._write("reasoning", reasoning)
        if answer:
            if self.kind == "text":
                out += self._write("text", answer)
            else:
                self._blank += answer
                if self._blank.strip():
                    out += self._write("text", self._blank)
                    self._blank = ""
        for call in calls:
            out += self._close() + self.called(call)
            self.calls += 1
        return out

    def finish(self, cut: bool = False) -> list[dict]:
        """The reply ended (`cut`: at its token limit, in the block this closes): close its last block."""
        out = [] if self.texts or self.calls else self._write("text", self._blank)
        return out + self._close("incomplete" if cut else "completed")

    def _write(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.kind != kind:
            out += self._close() + self.opened(kind)
            self.kind, self.texts = kind, self.texts + (kind == "text")
        return out + self.wrote(kind, text)

    def _close(self, status: str = "completed") -> list[dict]:
        if self.kind is None:
            return []
        out = self.closed(self.kind, status)
        self.kind = None
        return out

    def opened(self, kind: str) -> list[dict]:
        raise NotImplementedError

    def wrote(self, kind: str, text: str) -> list[dict]:
        raise NotImplementedError

    def closed(self, kind: str, status: str) -> list[dict]:
        raise NotImplementedError

    def called(self, call: dict) -> list[dict]:
        raise NotImplementedError
