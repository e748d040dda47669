"""Tool calls in a reply, as Hermes-style templates (Qwen2.5, Qwen3) teach models to write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

ToolCallParser takes the reply's text as it streams and splits it into content (what is outside the
tags) and OpenAI tool calls, each handed out once its closing tag has arrived. A tagged body that is not
such a JSON object, or a call never closed, stays content: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid

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
