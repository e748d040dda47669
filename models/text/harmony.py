"""Replies in OpenAI's harmony format (gpt-oss), split into reasoning, answer and tool calls.

After the generation prompt `<|start|>assistant` the model writes one message or more:

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

(the recipient `to=...` may also come before <|channel|>, as the template writes it in the history).
The analysis channel is reasoning; final is the answer; commentary addressed to a function is a tool
call, commentary to no one a preamble the user sees (answer). <|return|> and <|call|> end the reply
(the engine stops on them, so their text usually never arrives).

`HarmonySplitter` has ThinkingSplitter's surface (app/reasoning.py): it is fed decoded text chunk by
chunk, with the special tokens split across chunks anywhere, and keeps `reasoning` (None: no analysis)
and `answer`, both only growing, plus `calls` (OpenAI tool calls, each once its message ended). The
special tokens must reach it as text: the engine decodes replies with skip_special_tokens=False.
`call_grammar` writes the same syntax as a grammar, to force a call (nanochat serve's tool_choice).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_TERMINATORS = (END, RETURN, CALL)
ANALYSIS, COMMENTARY, FINAL = "analysis", "commentary", "final"
ANSWER_HEADER = CHANNEL + FINAL + MESSAGE   # what opens the answer's text
FUNCTIONS = "functions."                   # a tool call's recipient: functions.NAME
_HEADER, _BODY = "header", "body"
_LONGEST = max(map(len, TOKENS))


def _partial_token(text: str) -> int:
    """Length of the longest end of `text` that begins a harmony token (one a later chunk may finish)."""
    for n in range(min(len(text), _LONGEST - 1), 0, -1):
        tail = text[-n:]
        if any(tok.startswith(tail) for tok in TOKENS):
            return n
    return 0


def _next_token(text: str) -> tuple[int, str | None]:
    """(where, which) of the first harmony token in `text`; (-1, None) when there is none."""
    best, which = -1, None
    for tok in TOKENS:
        at = text.find(tok)
        if at >= 0 and (best < 0 or at < best):
            best, which = at, tok
    return best, which


@dataclass
class _Header:
    """What a message's header says: its channel and recipient (`to=...`)."""

    text: str = ""

    @property
    def channel(self) -> str | None:
        if CHANNEL not in self.text:
            return None
        words = self.text.split(CHANNEL, 1)[1].replace(CONSTRAIN, " ").split()
        return words[0] if words else None

    @property
    def recipient(self) -> str | None:
        for word in self.text.replace(CHANNEL, " ").replace(CONSTRAIN, " ").split():
            if word.startswith("to="):
                return word[3:]
        return None


def tool_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call (its arguments as the JSON text the model wrote)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments.strip()}}


class HarmonySplitter:
    """A streamed harmony reply split into reasoning, answer and tool calls (see the module's doc)."""

    prompted = False   # the harmony prompt opens no reasoning block: the model names its channel

    def __init__(self):
        self.reasoning: str | None = None
        self.answer = ""
        self.calls: list[dict] = []
        self.closed = False                # an analysis message ended (the reasoning before the answer)
        self._state = _HEADER              # the reply starts with the first message's header
        self._header = _Header()
        self._body = ""                    # a tool call's arguments so far
        self._held = ""                    # text that may begin a token

    @property
    def thinking(self) -> bool:
        """Inside an analysis message now."""
        return self._state == _BODY and self._route() == "reasoning"

    def feed(self, text: str) -> None:
        text, self._held = self._held + text, ""
        while text:
            at, tok = _next_token(text)
            if tok is None:
                keep = _partial_token(text)
                self._text(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                return
            self._text(text[:at])
            self._token(tok)
            text = text[at + len(tok):]

    def finish(self) -> None:
        """The reply ended (a stop token, the token limit, a cancel): place what was held back and end
        the message in progress."""
        held, self._held = self._held, ""
        self._text(held)
        if self._state == _HEADER and self._header.text and CHANNEL not in self._header.text:
            # no harmony at all (a raw prompt, a confused model): the text is the answer, nothing is lost
            self.answer += self._header.text
        self._end_message(CALL if self._route() == "call" else END)

    # ------------------------------------------------------------------ the grammar
    def _route(self) -> str:
        channel, recipient = self._header.channel, self._header.recipient
        if recipient and recipient != "assistant" and channel != ANALYSIS:
            return "call"
        return "reasoning" if channel == ANALYSIS else "answer"

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._state == _HEADER:
            self._header.text += text
            return
        route = self._route()
        if route == "reasoning":
            self.reasoning += text
        elif route == "call":
            self._body += text
        else:
            self.answer += text

    def _token(self, tok: str) -> None:
        if tok == MESSAGE and self._state == _HEADER:
            self._state = _BODY
            route = self._route()
            if route == "reasoning":
                self.reasoning = (self.reasoning + "\n\n") if self.reasoning else ""
            elif route == "answer" and self.answer:
                self.answer += "\n\n"   # a preamble, then the final answer: two paragraphs
        elif tok in _TERMINATORS and self._state == _BODY:
            self._end_message(tok)
        elif tok == START:
            self._state, self._header, self._body = _HEADER, _Header(), ""
        elif self._state == _HEADER:
            self._header.text += tok   # <|channel|>, <|constrain|>: parts of the header
        else:
            self._text(tok)            # a token out of place: text as written

    def _end_message(self, tok: str) -> None:
        if self._state != _BODY:
            return
        route = self._route()
        if route == "reasoning":
            self.closed = True
        elif route == "call":
            name = self._header.recipient.removeprefix(FUNCTIONS)
            self.calls.append(tool_call(name, self._body))
        self._state, self._header, self._body = _HEADER, _Header(), ""


@dataclass
class HarmonySplit:
    reasoning: str | None
    answer: str
    closed: bool
    calls: list[dict] = field(default_factory=list)


def split_harmony(text: str) -> HarmonySplit:
    """A whole reply's reasoning, answer and tool calls."""
    splitter = HarmonySplitter()
    splitter.feed(text)
    splitter.finish()
    return HarmonySplit(splitter.reasoning, splitter.answer, splitter.closed, splitter.calls)


def call_grammar(calls: list[tuple[str, str]]) -> str:
    """The grammar (llguidance's Lark, which names special tokens by their text) of a reply that calls one function
    of `calls` (its name, the Lark rule body its arguments follow), after an analysis message if the model writes
    one: the call is a commentary message to it, and <|call|> ends the reply."""
    rules = [f"fn{i}" for i in range(len(calls))]
    lines = ["start: analysis? call", f'analysis: {CHANNEL} "{ANALYSIS}" {MESSAGE} TEXT {END} {START} "assistant"',
             r"TEXT: /(.|\n)*/", f"call: {' | '.join(rules)}"]
    lines += [f'{rule}: {CHANNEL} {json.dumps(f"{COMMENTARY} to={FUNCTIONS}{name}")} " " {CONSTRAIN} "json" {MESSAGE} '
              f"{arguments} {CALL}" for rule, (name, arguments) in zip(rules, calls)]
    return "\n".join(["%llguidance {}", *lines]) + "\n"


def call_arguments(call: dict):
    """A tool call's arguments as the harmony template renders them (`arguments|tojson`): parsed JSON
    where the text is JSON, else the text."""
    arguments = call.get("function", call).get("arguments", "")
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
