"""Tool calls in a reply, as Hermes-style templates (Qwen2.5, Qwen3) teach models to write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

ToolCallParser takes the reply's text as it streams and splits it into content (what is outside the
tags) and OpenAI tool calls, each handed out once its closing tag has arrived. A tagged body that is not
such a JSON object, or a call never closed, stays content: nothing the model wrote is lost.

`call_grammar` is what forces a call (OpenAI's tool_choice "required" or a named function): the grammar of a
reply that is only calls, in this format or in harmony's (gpt-oss), for SamplingParams.grammar.
"""

from __future__ import annotations

import json
import uuid

from nanochat.engine.sampling_params import JSON_WHITESPACE
from nanochat.engine.serve.protocol import harmony_call_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call(body: str) -> dict | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("name"), str)):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"],   # OpenAI sends the arguments as JSON text
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                               ensure_ascii=False)}}


class ToolCallParser:
    def __init__(self):
        self.calls: list[dict] = []
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content that can be shown now and the calls completed by `text`. A tail that may be the
        start of an opening tag is held back until the next text says."""
        self._buffer += text
        content, calls = [], []
        while True:
            if not self._inside:
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = next((n for n in range(min(len(OPEN) - 1, len(self._buffer)), 0, -1)
                                 if OPEN.startswith(self._buffer[-n:])), 0)
                    content.append(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._buffer[:at])
                self._buffer, self._inside = self._buffer[at + len(OPEN):], True
            end = self._buffer.find(CLOSE)
            if end < 0:
                break
            body, self._buffer, self._inside = self._buffer[:end], self._buffer[end + len(CLOSE):], False
            call = _call(body.strip())
            if call is None:
                content.append(OPEN + body + CLOSE)
            else:
                calls.append(call)
        self.calls += calls
        return "".join(content), calls

    def finish(self) -> str:
        """What is left once the reply has ended: content."""
        rest = (OPEN if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        return rest


def split(text: str) -> tuple[str, list[dict]]:
    """A whole reply's content and tool calls."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    return content + parser.finish(), calls


def _json_rule(schema: dict) -> str:
    """A Lark rule body holding text to a JSON schema, with the whitespace a held document may have."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})


def _parameters(tool: dict) -> dict:
    """A tool's parameters schema (none stated: any object, OpenAI's default), checked: ValueError names the tool
    whose schema llguidance cannot follow (the grammar's own error would point into text the client never saw)."""
    from llguidance import LLMatcher

    schema = tool["function"].get("parameters") or {"type": "object"}
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except ValueError as e:
        failed, messages = True, [str(e)]
    if failed:
        raise ValueError(f"the parameters of tool {json.dumps(tool['function']['name'])[:60]} cannot be followed: "
                         f"{messages[0].splitlines()[0]}")
    return schema


def call_grammar(tools: list[dict], choice: bool | str, harmony: bool = False, parallel: bool = True) -> str | None:
    """The grammar (llguidance's Lark) that holds a reply to OpenAI's tool_choice: `choice` True ("required": a call
    of any of `tools`), a function's name (a call of it) or False ("auto": the model decides), and to
    parallel_tool_calls (`parallel`). A call's arguments are valid under its tool's parameters. In the tags: a
    forced call, or one or more where parallel calls are allowed; "auto" without parallel calls: text, or text and
    one call that ends the reply. In harmony a reply holds one call at most (it ends at <|call|>): a forced one comes
    after an analysis message if the model writes one. None: nothing to hold ("auto" otherwise). ValueError: a tool's
    parameters are not a schema llguidance can follow."""
    if choice is False and (harmony or parallel):
        return None
    chosen = [t for t in tools if isinstance(choice, bool) or t["function"]["name"] == choice]
    if harmony:
        return harmony_call_grammar([(t["function"]["name"], _json_rule(_parameters(t))) for t in chosen])
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    open_, close = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)
    lines = [f"body: {_json_rule({'anyOf': calls} if len(calls) > 1 else calls[0])}"]
    if choice is False:   # text without the opening tag; or text up to the first one (lazily), and its call
        lines += [f"start: TEXT | head body {close}", r"TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
                  r"head[lazy]: /(?s:.*)<tool_call>\n/"]
    else:   # Qwen3 writes "\n\n" after its thinking; several calls one per line
        lines += ["start: BREAK? call" + (' ("\\n" call)*' if choice is True and parallel else ""),
                  r"BREAK: /\n{1,2}/", f"call: {open_} body {close}"]
    return "\n".join(["%llguidance {}", *lines]) + "\n"
