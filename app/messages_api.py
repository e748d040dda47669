"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the chat machinery of
app/openai_api.py, for the tools that speak it (Claude Code, the `anthropic` SDK).

A request becomes a chat request (`chat_request`): `system` the system message, each message's blocks chat
messages (text; an assistant's tool_use blocks its tool_calls; a user's tool_result blocks tool messages before
its text; thinking blocks are dropped, as chat templates drop earlier turns' thinking), `tools` (name,
description, input_schema) OpenAI's function tools, `tool_choice` (auto, any, tool, none; disable_parallel_tool_use)
OpenAI's, `stop_sequences` the stop strings, `thinking` the template's enable_thinking, `output_config` (its
format the response_format, its effort the reasoning_effort, for templates that read one). The reply becomes
content blocks (`content_blocks`): thinking, text, one tool_use block per call; streamed, the same blocks as
Messages events (`EventStream`). Errors are Anthropic's error object (`error_body`).
"""

from __future__ import annotations

import json

from nanochat.app.api_errors import ApiError, type_error
from nanochat.app.reply_parts import BlockStream, answer_text, call_arguments

# Fields this server cannot honour, which would change what the reply is: a 400 rather than a reply that ignores them.
_REFUSED = {"container": "code execution containers are not supported",
            "mcp_servers": "MCP servers are not supported: give the tools as tools"}
# Fields of a Messages request that the chat request does not take as they are (the rest pass through: max_tokens,
# temperature, top_p, top_k, and extras such as seed or logit_bias).
_OWN = ("messages", "system", "tools", "tool_choice", "thinking", "stop_sequences", "output_format", "output_config",
        "metadata", "service_tier", "cache_control", "container", "mcp_servers", "speed", "inference_geo",
        "diagnostics", "user_profile_id", "workspace_id", "context_management", "betas", "stop", "response_format",
        "chat_template_kwargs", "reasoning_effort", "n", "logprobs", "top_logprobs", "max_completion_tokens")
# Anthropic's error types by HTTP status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


# ---------------------------------------------------------------------------------- requests
def chat_request(body: dict) -> dict:
    """The chat completions body a Messages request stands for."""
    for name, why in _REFUSED.items():
        if body.get(name):
            raise ApiError(400, why, param=name)
    if body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens is required", param="max_tokens")
    chat = {k: v for k, v in body.items() if k not in _OWN}   # model, stream, max_tokens, sampling and extras
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    system = _system(body.get("system"))
    chat["messages"] = ([{"role": "system", "content": system}] if system is not None else []) + \
        messages_of(body.get("messages"))
    chat.update(_tools(body.get("tools"), body.get("tool_choice")))
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise type_error("thinking", '{"type": "enabled", ...} or {"type": "disabled"}', thinking)
        chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    config = body.get("output_config", {})
    if not isinstance(config, dict):
        raise type_error("output_config", 'an object such as {"format": {"type": "json_schema", ...}}', config)
    fmt, where = config.get("format"), "output_config.format"
    if fmt is None:   # the structured outputs beta's older field
        fmt, where = body.get("output_format"), "output_format"
    if fmt is not None:
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
            raise type_error(where, '{"type": "json_schema", "schema": {...}}', fmt)
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]
    return chat


def _system(system) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return _text_of(system, "system")


def _text_of(blocks, where: str) -> str:
    """Text blocks' text, joined (a tool_result's or the system's content)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise type_error(where, "a string or a list of text blocks", blocks)
    texts = []
    for k, block in enumerate(blocks):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise _unsupported_block(block, f"{where}[{k}]")
        texts.append(block["text"])
    return "".join(texts)


def _unsupported_block(block, where: str) -> ApiError:
    kind = block.get("type") if isinstance(block, dict) else None
    return ApiError(400, f"{where}: content blocks of type {json.dumps(kind)[:40]} are not supported here (text, "
                         "tool_use, tool_result and thinking are)", param=where)


def messages_of(messages) -> list[dict]:
    """Anthropic messages as chat messages (a system message among them stays one: see parse_messages)."""
    if not isinstance(messages, list) or not messages:
        raise type_error("messages", "a non-empty list of messages", messages)
    out: list[dict] = []
    for at, message in enumerate(messages):
        where = f"messages[{at}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise ApiError(400, f"{where}.role must be user, assistant or system, got {json.dumps(role)[:40]}",
                           param=f"{where}.role")
        content = message.get("content")
        if role == "system":
            out.append({"role": "system", "content": _text_of(content, f"{where}.content")})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "assistant":   # its text, then its calls
            texts, calls, _ = _blocks(content, role, f"{where}.content")
            out.append({"role": "assistant", "content": "".join(texts) if texts or not calls else None,
                        **({"tool_calls": calls} if calls else {})})
        else:   # the tool results first (they answer the calls before), then the user's text
            texts, _, results = _blocks(content, role, f"{where}.content")
            out += results
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    if out[-1]["role"] == "assistant":
        raise ApiError(400, "the last message must be the user's: continuing a given assistant message (prefill) is "
                            "not supported", param="messages")
    return out


def _blocks(content, role: str, where: str) -> tuple[list[str], list[dict], list[dict]]:
    """A message's content blocks: its texts, its calls (an assistant's tool_use) and its tool results (a user's
    tool_result) in chat's form. Thinking blocks are dropped: chat templates leave earlier thinking out."""
    if not isinstance(content, list):
        raise type_error(where, "a string or a list of content blocks", content)
    texts, calls, results = [], [], []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        spot = f"{where}[{k}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise type_error(spot, '{"type": "tool_use", "id": ..., "name": ..., "input": {...}}', block)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise type_error(f"{spot}.tool_use_id", "a string", block.get("tool_use_id"))
            text = _text_of(block.get("content", ""), f"{spot}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": f"Error: {text}" if block.get("is_error") else text})
        else:
            raise _unsupported_block(block, spot)
    return texts, calls, results


def _tools(tools, choice) -> dict:
    out = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise type_error("tools", "a list of tools", tools)
        functions = []
        for k, tool in enumerate(tools):
            if not (isinstance(tool, dict) and tool.get("type") in (None, "custom")
                    and isinstance(tool.get("name"), str)):
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise ApiError(400, f"tools[{k}]: only client tools (name, description, input_schema) are supported, "
                                    f"got {json.dumps(kind)[:40]}", param=f"tools[{k}]")
            function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        out["tools"] = functions or None
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise type_error("tool_choice", '{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or '
                             '{"type": "none"}', choice)
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


# ---------------------------------------------------------------------------------- replies
def stop_reason(finish_reason: str, stats, calls: list) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished reply."""
    if finish_reason == "length":
        return ("model_context_window_exceeded" if stats.context_full else "max_tokens"), None
    if calls:
        return "tool_use", None
    if stats.stop_string is not None:
        return "stop_sequence", stats.stop_string
    return "end_turn", None


def usage_of(stats) -> dict:
    """Anthropic counts the prompt apart from the part the cache served (input_tokens excludes it)."""
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens, "cache_read_input_tokens": stats.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": stats.completion_tokens}


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1), "name": call["function"]["name"],
            "input": call_arguments(call)}


def content_blocks(reasoning: str | None, answer: str, calls: list[dict]) -> list[dict]:
    blocks = [] if reasoning is None else [thinking_block(reasoning)]
    text = answer_text(answer, calls)
    if text is not None:
        blocks.append({"type": "text", "text": text})
    return blocks + [tool_use_block(call) for call in calls]


def message_object(ident: str, model: str, content: list[dict], stop: tuple[str | None, str | None],
                   usage: dict) -> dict:
    return {"id": ident, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


class EventStream(BlockStream):
    """A streamed reply as Messages events: thinking, text and tool_use blocks (BlockStream's blocks)."""

    def __init__(self):
        super().__init__()
        self.index = 0   # the next block's

    def opened(self, kind: str) -> list[dict]:
        block = thinking_block("") if kind == "reasoning" else {"type": "text", "text": ""}
        return [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def wrote(self, kind: str, text: str) -> list[dict]:
        delta = {"type": "thinking_delta", "thinking": text} if kind == "reasoning" else \
            {"type": "text_delta", "text": text}
        return [{"type": "content_block_delta", "index": self.index, "delta": delta}] if text else []

    def closed(self, kind: str, status: str) -> list[dict]:
        out = []
        if kind == "reasoning":   # a signature closes a thinking block (empty: nanochat signs nothing)
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "signature_delta", "signature": ""}})
        out.append({"type": "content_block_stop", "index": self.index})
        self.index += 1
        return out

    def called(self, call: dict) -> list[dict]:
        block = tool_use_block(call)
        arguments = json.dumps(block["input"], ensure_ascii=False)
        out = [{"type": "content_block_start", "index": self.index, "content_block": {**block, "input": {}}},
               {"type": "content_block_delta", "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": arguments}},
               {"type": "content_block_stop", "index": self.index}]
        self.index += 1
        return out
