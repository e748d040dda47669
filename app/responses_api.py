"""OpenAI's Responses API (`POST /v1/responses`) on the chat machinery of app/openai_api.py.

A request becomes a chat request (`chat_request`): its `input` items the messages (a function call the
assistant's tool_calls, a function_call_output a tool message; reasoning items are dropped, as chat templates
drop earlier turns' thinking), `instructions` the system message, its flat function tools OpenAI's nested ones,
`text.format` the response_format, `reasoning.effort` the reasoning_effort (for templates that read one),
`max_output_tokens` max_tokens. The reply becomes output items (`output_items`): a reasoning item (a <think>
block, harmony's analysis), a message with its output_text, and one function_call item per call; streamed, the
same items as Responses events (`EventStream`).

`previous_response_id` continues a stored response: `ResponseStore` keeps the last responses in memory (their
input and output as chat messages, without instructions, which OpenAI does not carry over); `store: false` keeps
none. A conversation continued either way keeps its KV: the chat sessions find the transcript as they do for
chat completions.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

from nanochat.app.api_errors import ApiError, type_error
from nanochat.app.reply_parts import BlockStream, answer_text, new_id

MAX_STORED = 1024              # responses kept for previous_response_id and GET /v1/responses/{id}
MAX_STORED_BYTES = 256 * 2 ** 20   # and the most text they hold (each counts its own input and output)

# Fields of a Responses request that the chat request does not take as they are (the rest pass through: sampling
# extras such as top_k or seed, held replies such as grammar).
_OWN = ("input", "instructions", "previous_response_id", "store", "metadata", "text", "reasoning",
        "max_output_tokens", "tools", "tool_choice", "include", "truncation", "background", "user", "service_tier",
        "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "top_logprobs", "max_tool_calls",
        "conversation", "prompt", "stream_options", "messages", "n", "response_format", "reasoning_effort",
        "max_tokens", "max_completion_tokens", "logprobs", "functions", "function_call")
# Fields this server cannot honour, which would change what the reply is: a 400 rather than a reply that ignores them.
_REFUSED = {"background": "background responses are not supported: send the request and wait for it",
            "conversation": "conversation objects are not supported: use previous_response_id or send the input",
            "prompt": "stored prompt templates are not supported: send the input",
            "top_logprobs": "top_logprobs is not supported on /v1/responses: use /v1/chat/completions",
            "n": "n is not a Responses field: one response a request",
            "messages": "messages is a chat completions field: /v1/responses takes input"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# Tools OpenAI's servers run themselves (by type prefix): this server runs none, so a request's are left out.
HOSTED = ("web_search", "file_search", "code_interpreter", "image_generation", "mcp")


class ResponseStore:
    """The last responses, for previous_response_id and GET/DELETE /v1/responses/{id}, least recently used first out,
    at most `capacity` of them holding at most `max_bytes` of text (a chain of responses shares its earlier
    messages, so each counts only what it added)."""

    def __init__(self, capacity: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.bytes = 0

    def put(self, response: dict, messages: list[dict], added: list[dict]) -> None:
        """A finished response and its conversation's messages, its own reply last; `added`: the messages it
        added (its input and reply), what it costs."""
        size = len(json.dumps(added, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        self._items[response["id"]] = (response, messages, size)
        self.bytes += size
        while self._items and (len(self._items) > self.capacity or self.bytes > self.max_bytes):
            self.bytes -= self._items.popitem(last=False)[1][2]

    def get(self, ident: str) -> tuple[dict, list[dict]]:
        if ident not in self._items:
            raise ApiError(404, f"no response {json.dumps(ident)[:80]} is stored here (a response made with store: "
                                f"false, or one of more than the last {self.capacity}, is not kept)",
                           param="previous_response_id", code="response_not_found")
        self._items.move_to_end(ident)
        return self._items[ident][:2]

    def delete(self, ident: str) -> None:
        self.get(ident)
        self.bytes -= self._items.pop(ident)[2]


# ---------------------------------------------------------------------------------- requests
@dataclass
class Asked:
    """A Responses request as the chat machinery runs it."""

    body: dict              # the request (what its Response states)
    chat: dict              # the chat completions body it stands for
    messages: list[dict]    # the conversation's messages without the system message: what a stored response carries
    added: list[dict]       # those its input added
    namespaces: dict        # each namespaced function's namespace


def chat_request(body: dict, store: ResponseStore) -> Asked:
    """The chat completions body a Responses request stands for, with what its Response needs."""
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise ApiError(400, why, param=name)
    if body.get("truncation") not in (None, "disabled"):
        raise ApiError(400, 'truncation "auto" is not supported: a conversation longer than the context is a 400',
                       param="truncation")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise type_error("include", "a list of strings", include)
    if any("logprobs" in i for i in include or ()):
        raise ApiError(400, "logprobs are not supported on /v1/responses: use /v1/chat/completions", param="include")
    earlier = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise type_error("previous_response_id", "a string", previous)
        earlier = store.get(previous)[1]
    added = input_messages(body.get("input"))
    messages = earlier + added
    system = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise type_error("instructions", "a string", instructions)
        system = [{"role": "system", "content": instructions}]
    chat = {k: v for k, v in body.items() if k not in _OWN}
    chat["messages"] = system + messages
    chat.update(_tools(body))
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    effort = _effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return Asked(body, chat, messages, added, namespaces_of(body))


def input_messages(items) -> list[dict]:
    """Responses input (a string, or a list of items) as chat messages."""
    if isinstance(items, str):
        if not items:
            raise ApiError(400, "input must not be empty", param="input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise type_error("input", "a string or a non-empty list of input items", items)
    messages: list[dict] = []
    for at, item in enumerate(items):
        where = f"input[{at}]"
        if not isinstance(item, dict):
            raise type_error(where, "an input item (an object)", item)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer, got "
                                    f"{json.dumps(role)[:40]}", param=f"{where}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":   # the same turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise type_error(f"{where}.call_id", "a string", item.get("call_id"))
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue   # earlier turns' thinking: chat templates leave it out of the prompt
        else:
            raise ApiError(400, f"{where}: input items of type {json.dumps(kind)[:40]} are not supported (message, "
                                "function_call, function_call_output and reasoning are)", param=f"{where}.type")
    return messages


def _text(content, where: str) -> str:
    """A message's or a tool output's text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS
                    and isinstance(part.get("text", part.get("refusal")), str)):
                kind = part.get("type") if isinstance(part, dict) else None
                raise ApiError(400, f"{where}[{k}]: only text parts (input_text, output_text) are supported, got "
                                    f"{json.dumps(kind)[:40]}", param=f"{where}[{k}]")
            texts.append(part.get("text", part.get("refusal")))
        return "".join(texts)
    raise type_error(where, "a string or a list of text parts", content)


def _call(item: dict, where: str) -> dict:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise type_error(f"{where}.{name}", "a string", item.get(name))
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def functions_of(tools) -> list[tuple[dict, str | None]]:
    """The request's function tools, each with its namespace (None: none): a namespace's functions are tools of
    their own; tools the server would run (web search, file search, ...) are left out, as it runs none."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise type_error("tools", "a list of function tools", tools)
    out = []
    for k, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append((tool, None))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            out += [(function, tool.get("name")) for function, _ in functions_of(tool["tools"])]
        elif not (isinstance(kind, str) and kind.startswith(HOSTED)):
            raise ApiError(400, f"tools[{k}]: only function tools are supported, got {json.dumps(kind)[:40]}",
                           param=f"tools[{k}]")
    return out


def _tools(body: dict) -> dict:
    """tools and tool_choice in chat's form (a function's fields nested under "function")."""
    out = {}
    if body.get("tools") is not None:
        chat_tools = []
        for tool, _ in functions_of(body["tools"]):
            function = {name: tool[name] for name in ("name", "description", "parameters", "strict") if name in tool}
            chat_tools.append({"type": "function", "function": function})
        out["tools"] = chat_tools or None
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _response_format(text) -> dict | None:
    """text.format as chat's response_format (json_schema's fields nested under "json_schema")."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise type_error("text", 'an object such as {"format": {"type": "json_schema", ...}}', text)
    fmt = text.get("format")
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), (dict, bool)):
            raise ApiError(400, 'text.format json_schema needs its schema: {"type": "json_schema", "name": ..., '
                                '"schema": {...}}', param="text.format")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt   # text, json_object, or what response_format's own check refuses


def _effort(reasoning) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise type_error("reasoning", 'an object such as {"effort": "low"}', reasoning)
    return reasoning.get("effort")


# ---------------------------------------------------------------------------------- replies
def reasoning_item(ident: str, text: str | None, status: str = "completed") -> dict:
    return {"id": ident, "type": "reasoning", "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def message_item(ident: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": ident, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(ident: str, call: dict, status: str = "completed", namespaces: dict | None = None) -> dict:
    """A function_call item (`namespaces`: the namespace of each function that has one)."""
    name = call["function"]["name"]
    item = {"id": ident, "type": "function_call", "call_id": call["id"], "name": name,
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}
    if (namespaces or {}).get(name):
        item["namespace"] = namespaces[name]
    return item


def output_items(reasoning: str | None, answer: str, calls: list[dict], cut: bool = False,
                 namespaces: dict | None = None) -> list[dict]:
    """A whole reply's output items: its reasoning (None: none), its message (when it has text or no calls), then its
    calls. `cut`: the reply ended at max_output_tokens, in its last reasoning or message item (incomplete)."""
    items = [] if reasoning is None else [reasoning_item(new_id("rs"), reasoning)]
    text = answer_text(answer, calls)
    if text is not None:
        items.append(message_item(new_id("msg"), text))
    items += [call_item(new_id("fc"), call, namespaces=namespaces) for call in calls]
    if cut and items[-1]["type"] != "function_call":
        items[-1]["status"] = "incomplete"
    return items


def reply_message(items: list[dict]) -> dict:
    """The assistant message a response's output stands for, as the next request's history (chat's form)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def namespaces_of(body: dict) -> dict:
    """Each namespaced function's namespace, by the function's name."""
    return {tool["name"]: space for tool, space in functions_of(body.get("tools")) if space}


def response_object(ident: str, body: dict, model: str, status: str, output: list[dict], usage: dict | None,
                    created: float, error: dict | None = None) -> dict:
    """The Response object: what the request asked, with its output, status and usage."""
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    tools = body.get("tools") or []
    return {"id": ident, "object": "response", "created_at": int(created), "model": model, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": _effort(body.get("reasoning")), "summary": None},
            "store": body.get("store", True), "temperature": body.get("temperature"),
            "text": {"format": fmt or {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": tools, "top_p": body.get("top_p"), "truncation": body.get("truncation", "disabled"),
            "usage": usage, "user": body.get("user")}


def usage_of(prompt_tokens: int, cached_tokens: int, completion_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}


class EventStream(BlockStream):
    """A streamed reply as Responses events: reasoning items, a message, function_call items (BlockStream's
    blocks); `event` numbers the events."""

    def __init__(self, namespaces: dict | None = None):
        super().__init__()
        self.namespaces = namespaces   # each namespaced function's namespace
        self.sequence = 0
        self.items: list[dict] = []   # finished and open items, in output order
        self._text = ""               # the open item's text so far

    def event(self, kind: str, **fields) -> dict:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return payload

    def _added(self, item: dict) -> list[dict]:
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def opened(self, kind: str) -> list[dict]:
        reasoning = kind == "reasoning"
        item = reasoning_item(new_id("rs"), None, "in_progress") if reasoning else \
            message_item(new_id("msg"), None, "in_progress")
        self._text = ""
        part = {"type": "reasoning_text", "text": ""} if reasoning else \
            {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._added(item) + [self.event("response.content_part.added", item_id=item["id"],
                                               output_index=len(self.items) - 1, content_index=0, part=part)]

    def wrote(self, kind: str, text: str) -> list[dict]:
        self._text += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [self.event(delta, item_id=self.items[-1]["id"], output_index=len(self.items) - 1, content_index=0,
                           delta=text, **extra)]

    def closed(self, kind: str, status: str) -> list[dict]:
        at, ident, text = len(self.items) - 1, self.items[-1]["id"], self._text
        if kind == "reasoning":
            done, part = reasoning_item(ident, text, status), {"type": "reasoning_text", "text": text}
            out = [self.event("response.reasoning_text.done", item_id=ident, output_index=at, content_index=0,
                              text=text)]
        else:
            done = message_item(ident, text, status)
            part = done["content"][0]
            out = [self.event("response.output_text.done", item_id=ident, output_index=at, content_index=0,
                              text=text, logprobs=[])]
        out.append(self.event("response.content_part.done", item_id=ident, output_index=at, content_index=0,
                              part=part))
        self.items[at] = done
        return out + [self.event("response.output_item.done", output_index=at, item=done)]

    def called(self, call: dict) -> list[dict]:
        item = call_item(new_id("fc"), call, "in_progress", self.namespaces)
        out = self._added(item)
        at, arguments = len(self.items) - 1, call["function"]["arguments"]
        out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                              delta=arguments))
        out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                              arguments=arguments, name=item["name"]))
        self.items[at] = done = {**item, "arguments": arguments, "status": "completed"}
        return out + [self.event("response.output_item.done", output_index=at, item=done)]
