"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`) on the chat
machinery of app/openai_api.py, for the tools that speak it (the `ollama` SDKs, oterm, Open WebUI, Continue,
LangChain's ChatOllama): `nanochat serve --port 11434` stands where they look for Ollama.

A chat request becomes a chat completions request (`chat_request`): its messages (an assistant's tool_calls, whose
arguments are objects, keep their ids or get ones; a tool message answers the open call its `tool_call_id` or
`tool_name` names), `tools` as they are,
`format` ("json" or a JSON schema) the response_format, `think` the template's enable_thinking (or, as "low" /
"medium" / "high", the reasoning effort of templates that read one), `options` the sampling fields. /api/generate
renders its prompt as a one-turn chat with its `system`, sends it as it is with `raw`, or with a `suffix` asks for
the middle (completions' fill in the middle). Replies are Ollama's
objects (`reply`, `final`): the answer as content, the reasoning as `thinking`, calls as `tool_calls` with object
arguments, durations in nanoseconds; streamed (Ollama's default) as newline-delimited JSON. A chat longer than the
context loses its oldest turns, as Ollama's server drops them (Api._fit_to_context).

/api/tags lists every model the server may load (app/serve_models.py), the loaded one first; one is loaded at a time,
and a request naming another loads it, as Ollama's server does (a load request too); `keep_alive` changes nothing.
The model-managing endpoints (pull of a model the server has not, create, copy, push, delete) are one-line errors;
/api/embed and /api/embeddings are app/embeddings_api.py's.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nanochat.app.api_errors import ApiError, flag, type_error
from nanochat.app.reply_parts import call_arguments
from nanochat.engine.rules import SAMPLING_RULES, accepts

API_VERSION = "0.13.0"   # the Ollama API these endpoints follow (clients compare it against what they need)
NDJSON = "application/x-ndjson"
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
             "num_predict": "max_tokens", "repeat_penalty": "repetition_penalty",
             "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# Sampling methods the engine does not have: their "off" value passes, any other is a 400 (the reply would differ
# from what was asked). The other options (num_ctx, num_thread, num_gpu, num_batch, use_mmap, ...) say how Ollama
# loads and runs a model, which this server's own flags decide: ignored, as Ollama ignores the ones it cannot apply.
_OFF = {"mirostat": 0, "typical_p": 1, "tfs_z": 1, "min_p": 0}
_REFUSED = {"images": "images are not supported: the model reads text only",
            "context": "context (Ollama's deprecated token memory) is not supported: send the conversation to "
                       "/api/chat",
            "template": "Go templates are not supported: give the server a Jinja template with --chat-template FILE"}


def error_body(e: ApiError) -> dict:
    return {"error": e.message}


def now() -> str:
    """Ollama's created_at: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------------- requests
def chat_request(body: dict) -> dict | None:
    """The chat completions body an /api/chat request stands for; None for a load request (no messages)."""
    messages = body.get("messages")
    if messages is None or messages == []:
        return None
    chat = _common(body)
    chat["messages"] = messages_of(messages)
    tools = body.get("tools")
    if tools:   # Ollama's tools are OpenAI's function tools; its clients may leave the type out
        if not isinstance(tools, list):
            raise type_error("tools", "a list of tools", tools)
        chat["tools"] = [{"type": "function", **t} if isinstance(t, dict) and "type" not in t else t for t in tools]
    return chat


def generate_request(body: dict) -> tuple[dict | None, bool]:
    """(the chat completions body an /api/generate request stands for, or the completions body with `raw`; None for
    a load request: no prompt), and whether it is raw."""
    for name, why in _REFUSED.items():
        if body.get(name):
            raise ApiError(400, f"{name}: {why}", param=name)
    prompt = body.get("prompt")
    if prompt is None or prompt == "":
        return None, False
    if not isinstance(prompt, str):
        raise type_error("prompt", "a string", prompt)
    raw = flag(body, "raw") or bool(body.get("suffix"))   # fill in the middle: no chat template either
    out = _common(body)
    if raw:   # no template: the completions endpoint's body, whose logprobs field is the alternatives per token
        out.pop("chat_template_kwargs", None)
        out.pop("reasoning_effort", None)
        out["prompt"] = prompt
        if body.get("suffix"):
            out["suffix"] = body["suffix"]
        if out.pop("logprobs", False):
            out["logprobs"] = out.pop("top_logprobs", None) or 0
        out.pop("top_logprobs", None)
        return out, True
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise type_error("system", "a string", system)
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                       "content": prompt}]
    return out, False


def _common(body: dict) -> dict:
    """The fields /api/chat and /api/generate share, as chat completions fields."""
    out = {"model": body.get("model"), "stream": flag(body, "stream", True)}
    out.update(sampling_fields(body.get("options")))
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}
    elif fmt not in (None, ""):
        raise type_error("format", '"json" or a JSON schema', fmt)
    think = body.get("think")
    if isinstance(think, bool):
        out["chat_template_kwargs"] = {"enable_thinking": think}
    elif think in ("low", "medium", "high"):
        out["chat_template_kwargs"] = {"enable_thinking": True}
        out["reasoning_effort"] = think
    elif think is not None:
        raise type_error("think", 'true, false, "low", "medium" or "high"', think)
    if flag(body, "logprobs"):
        out["logprobs"] = True
        if body.get("top_logprobs") is not None:
            out["top_logprobs"] = body["top_logprobs"]
    return out


def sampling_fields(options) -> dict:
    """Ollama's options as chat completions' sampling fields, checked here so that a refusal names the option."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise type_error("options", "an object", options)
    out = {}
    for name, value in options.items():
        where = f"options.{name}"
        if value is None:
            continue
        if name in _OFF:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != _OFF[name]:
                raise ApiError(400, f"{where} is not supported by this server (only {_OFF[name]}: off)", param=where)
        elif name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
                raise type_error(where, "a list of strings", value)
            if any(stops):
                out["stop"] = [s for s in stops if s]
        elif name in _SAMPLING:
            if name in ("seed", "num_predict") and isinstance(value, int) and not isinstance(value, bool) and value < 0:
                continue   # seed -1: a random one; num_predict -1 (no limit) or -2 (fill the context)
            rule = SAMPLING_RULES[_SAMPLING[name]]
            if not accepts(rule, value):
                raise type_error(where, rule.text, value)
            out[_SAMPLING[name]] = value
    return out


def messages_of(messages) -> list[dict]:
    """Ollama messages as chat messages. An assistant's calls keep their ids or get ones; a tool message answers the
    open call its tool_call_id names, else the first open call of its tool_name, else the first open call."""
    if not isinstance(messages, list):
        raise type_error("messages", "a list of messages", messages)
    out, open_calls = [], []   # the last assistant message's calls that no tool message has answered: (id, name)
    for at, message in enumerate(messages):
        where = f"messages[{at}]"
        if not isinstance(message, dict):
            raise type_error(where, "an object with role and content", message)
        if message.get("images"):
            raise ApiError(400, f"{where}.images: images are not supported: the model reads text only",
                           param=f"{where}.images")
        role, content = message.get("role"), message.get("content")
        content = "" if content is None else content
        if not isinstance(content, str):
            raise type_error(f"{where}.content", "a string", content)
        if role == "assistant":   # its thinking is dropped, as chat templates drop earlier turns' thinking
            calls = [_call(call, f"{where}.tool_calls[{k}]", f"call_{at}_{k}")
                     for k, call in enumerate(message.get("tool_calls") or [])]
            out.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
            open_calls = [(c["id"], c["function"]["name"]) for c in calls]
        elif role == "tool":   # the call its id names (newer clients send ids), else its tool_name's, else the next
            name, ident = message.get("tool_name") or message.get("name"), message.get("tool_call_id")
            match = next((c for c in open_calls if c[0] == ident), None) or \
                next((c for c in open_calls if c[1] == name), open_calls[0] if open_calls else None)
            if match is not None:
                open_calls.remove(match)
            out.append({"role": "tool", "content": content,
                        "tool_call_id": match[0] if match else f"call_{at}"})   # unanswerable: parse_messages says so
        else:   # system, user, or a role parse_messages refuses
            out.append({"role": role, "content": content})
    return out


def _call(call, where: str, ident: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise type_error(where, '{"function": {"name": ..., "arguments": {...}}}', call)
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call.get("id") if isinstance(call.get("id"), str) else ident, "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


# ---------------------------------------------------------------------------------- replies
def tool_calls(calls: list[dict]) -> list[dict]:
    return [{"function": {"name": c["function"]["name"], "arguments": call_arguments(c)}} for c in calls]


def message(answer: str, reasoning: str, calls: list[dict]) -> dict:
    """An assistant message (or a streamed piece of one): the answer, its thinking, its calls."""
    out = {"role": "assistant", "content": answer}
    if reasoning:
        out["thinking"] = reasoning
    if calls:
        out["tool_calls"] = tool_calls(calls)
    return out


def reply(model: str, chat: bool, answer: str, reasoning: str = "", calls: list[dict] = (),
          logprobs: list[dict] | None = None) -> dict:
    """A reply object (or a streamed piece of one, done false until `final` adds the end)."""
    out = {"model": model, "created_at": now()}
    if chat:
        out["message"] = message(answer, reasoning, list(calls))
    else:
        out["response"] = answer
        if reasoning:
            out["thinking"] = reasoning
    if logprobs:
        out["logprobs"] = logprobs
    out["done"] = False
    return out


def final(piece: dict, finish_reason: str, stats, seconds: float) -> dict:
    """`piece` as the last object: done, why, and Ollama's counts and durations (nanoseconds). The prompt's count
    is all its tokens; its duration the time to the first token (the cached part took none)."""
    ttft = stats.ttft or 0.0
    return {**piece, "done": True, "done_reason": "length" if finish_reason == "length" else "stop",
            "total_duration": _ns(seconds), "load_duration": 0, "prompt_eval_count": stats.prompt_tokens,
            "prompt_eval_duration": _ns(ttft), "eval_count": stats.completion_tokens,
            "eval_duration": _ns(stats.elapsed - ttft)}


def loaded(model: str, chat: bool) -> dict:
    """The answer to a load request: the model it names is loaded (the Api loads it first); keep_alive changes
    nothing."""
    return {**reply(model, chat, ""), "done": True, "done_reason": "load"}


def _ns(seconds: float) -> int:
    return int(max(seconds, 0.0) * 1e9)


def line(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"


# ---------------------------------------------------------------------------------- the model's entry
def model_entry(path: str | None, chat_template: str | None, context: int) -> dict:
    """What /api/tags, /api/show and /api/ps say about a model: its details, size, date, Ollama's model_info
    (a GGUF's metadata scalars, with its parameter count) and template; `context`: the context it is served with
    (0: not loaded). Read from the file once."""
    from nanochat.models.formats.catalog import describe_path

    entry = describe_path(path) if path else None
    info, template = {}, None
    if entry is not None and entry.kind == "gguf":
        info, template = _gguf_info(entry.path)
    elif entry is not None:
        info = {"general.architecture": entry.arch}
    arch = (entry.arch if entry else None) or "unknown"
    if context:   # the loaded model's context as served; another keeps its file's
        info[f"{arch}.context_length"] = context
    if chat_template:
        try:
            template = Path(chat_template).read_text(encoding="utf-8")
        except OSError:
            pass
    count = info.get("general.parameter_count")
    modified = datetime.fromtimestamp(os.stat(path).st_mtime, timezone.utc) if path and os.path.exists(path) else \
        datetime.now(timezone.utc)
    details = {"parent_model": "", "format": entry.kind if entry else "unknown", "family": arch, "families": [arch],
               "parameter_size": _size_label(count) if count else "",
               "quantization_level": (entry.quant or "") if entry else ""}
    return {"size": entry.size_bytes if entry else 0, "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "details": details, "model_info": info, "template": template or "", "context": context}


def _gguf_info(path: str) -> tuple[dict, str | None]:
    from nanochat.models.formats.catalog import gguf_details

    try:
        info = gguf_details(path)
    except (OSError, ValueError):
        return {}, None
    template = info.pop("tokenizer.chat_template", None)
    return info, template if isinstance(template, str) else None


def _size_label(count: int) -> str:
    """135.5M, 7.6B: Ollama's parameter_size."""
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


class Endpoints:
    """The endpoints that describe the models or would manage them, over the Api of app/openai_api.py (its
    roster says which models it serves and which is loaded)."""

    def __init__(self, api):
        self.api = api
        self._entries: dict[tuple[str, int], dict] = {}   # by model and served context

    async def entry(self, served) -> dict:
        """model_entry's answer for a served model, read once (in a thread: a large file's header takes a while);
        the context is the loaded model's, 0 for the others until they load."""
        model, loaded = self.api.client.model, served == self.api.roster.loaded
        context = model.max_model_len if model and loaded else 0
        key = (served.id, context)
        if key not in self._entries:
            template = self.api.config.chat_template if served == self.api.roster.first else None
            self._entries[key] = await asyncio.to_thread(model_entry, served.path, template, context)
        return self._entries[key]

    async def _listed(self, served) -> dict:
        e = await self.entry(served)
        return {"name": served.id, "model": served.id, "modified_at": e["modified_at"], "size": e["size"],
                "digest": "", "details": e["details"]}

    async def _guarded(self, request: Request, answer) -> Response:
        try:
            self.api.authorize(request)
            return await answer()
        except ApiError as e:
            return e.response(error_body(e))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": API_VERSION})

    async def tags(self, request: Request) -> Response:
        async def answer():
            await self.api.roster.refresh()
            return JSONResponse({"models": [await self._listed(m) for m in self.api.roster.models]})
        return await self._guarded(request, answer)

    async def running(self, request: Request) -> Response:
        async def answer():
            served, model = self.api.roster.loaded, self.api.client.model
            e = await self.entry(served)
            on_gpu = bool(model and model.device.startswith("cuda"))
            return JSONResponse({"models": [{**await self._listed(served), "expires_at": "9999-12-31T23:59:59Z",
                                             "size_vram": e["size"] if on_gpu else 0, "context_length": e["context"]}]})
        return await self._guarded(request, answer)

    async def show(self, request: Request) -> Response:
        """A model's details; what its chat template can do (tools, thinking) is known once it is loaded."""
        async def answer():
            body = await self.api.read_json(request)
            served = await self.api.find_model({"model": body.get("model", body.get("name"))})
            e = await self.entry(served)
            model = self.api.client.model if served == self.api.roster.loaded else None
            stated = (model.sampling_defaults if model else {}) or {}
            # an embedding model (its file states a pooling) is Ollama's "embedding" model; the rest complete
            embedding = model.embedding_model if model else any(
                key.endswith(".pooling_type") and value in (1, 2, 3) for key, value in e["model_info"].items())
            capabilities = ["embedding"] if embedding else ["completion"] + (["tools"] if model and model.tools else []) \
                + (["thinking"] if model and (model.thinking_switch or model.harmony or model.thinking_opened) else [])
            parameters = "\n".join(f"{name:<20}{value}" for name, value in stated.items())
            modelfile = f"# served by nanochat\nFROM {served.path}\n"
            return JSONResponse({"license": "", "modelfile": modelfile, "parameters": parameters,
                                 "template": e["template"], "details": e["details"], "model_info": e["model_info"],
                                 "capabilities": capabilities, "modified_at": e["modified_at"]})
        return await self._guarded(request, answer)

    async def pull(self, request: Request) -> Response:
        """A model the server has is there already; any other is refused (fetch it with `nanochat pull`)."""
        async def answer():
            body = await self.api.read_json(request)
            await self.api.find_model({"model": body.get("model", body.get("name"))})
            return JSONResponse({"status": "success"})
        return await self._guarded(request, answer)

    async def unsupported(self, request: Request) -> Response:
        async def answer():
            what = request.url.path.removeprefix("/api/")
            raise ApiError(501, f"/api/{what} is not supported: nanochat serve serves the models it finds (the "
                                "models folder, ./models, the hub cache); fetch GGUFs with `nanochat pull`")
        return await self._guarded(request, answer)
