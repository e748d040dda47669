"""The OpenAI-compatible HTTP API of `nanochat serve`: an ASGI app over one AsyncEngineClient.

    POST /v1/chat/completions   chat, streamed (server-sent events ending in `data: [DONE]`) or not
    POST /v1/completions        raw text (no chat template)
    POST /v1/responses          OpenAI's Responses API over the same chat (app/responses_api.py); GET and
                                DELETE /v1/responses/{id} read and forget a stored response
    POST /v1/messages           Anthropic's Messages API over the same chat (app/messages_api.py), and
                                /v1/messages/count_tokens
    POST /api/chat, /api/generate  Ollama's API over the same chat (app/ollama_api.py), with GET /api/tags,
                                /api/ps, /api/version and POST /api/show
    POST /v1/embeddings         embeddings (app/embeddings_api.py), and Ollama's /api/embed and /api/embeddings
    GET  /v1/models             the models served, the loaded one first (/v1/models/{id}: one, by any of its
                                names); a request naming another loads it (app/serve_models.py)
    POST /tokenize, /detokenize text (or a chat's prompt) to ids and back, as llama.cpp's and vLLM's servers
    GET  /health                200 when a request would be served now, 503 while the engine restarts
    GET  /metrics               Prometheus text (app/metrics.py)

Every request shares the one engine through the one client, so concurrent requests batch together.
A request with `n` choices runs n sequences of its prompt (choice i with seed + i when a seed is given):
the first prefills it, the rest then find it in the prefix cache, and all decode in one batch.

Clients re-send the whole transcript every turn. Each conversation is a chat session of the client
(engine/serve/session.py), kept here between requests under its transcript: the next request whose
messages are that transcript plus a new user message (or the tool results that answer its last reply's
calls) continues it, so the engine prefills only the new messages (its canonical ids, generated ids
included, are the cached KV's). A reply that called tools is kept as the model wrote it, and matched to
the assistant message the client sends back by its text and calls. A transcript no session holds (the
first turn, a server restart, an edited message) opens one seeded with it, rendered turn by turn as a
live chat renders it (a client's own tool_calls through the template's handling of them); one that cuts
a kept conversation short (a regenerated reply) branches it at that turn, sharing the cached prefix.
Sessions are kept in LRU order, at most `max_sessions`.

Request fields are checked with the rules and words the command line uses (app/options.py), then by
SamplingParams itself. Besides OpenAI's fields a request may state vLLM's top_k, repetition_penalty,
ignore_eos and chat_template_kwargs (enable_thinking), llama.cpp's `grammar` (GBNF or Lark: what the answer
follows), vLLM's structured outputs (`structured_outputs`, `guided_json`, ...: held_reply), and `speculative`
(off, ngram or draft): its speculative decoding proposer. A reply's thinking (a <think> block, harmony's
analysis) comes back apart from its answer (ReplyReader), as reasoning_content. Errors are OpenAI's error
object: 400 a bad request or a prompt over the context, 401 a bad key, 404 an unknown model or path, 413 a
body over the limit, 429 too many sequences in flight, 503 while the engine restarts after a crash.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from nanochat.app import embeddings_api, messages_api, ollama_api
from nanochat.app.api_errors import ApiError, flag, type_error as _type_error
from nanochat.app.http_guard import Guard
from nanochat.app.metrics import Metrics
from nanochat.app.options import REQUEST_RULES, model_config, speculative_refusal
from nanochat.app.reasoning import CLOSE as THINK_CLOSE
from nanochat.app.reply_parts import ReplyReader, answer_text, new_id
from nanochat.app.responses_api import Asked, EventStream, ResponseStore, chat_request, output_items, \
    reply_message, response_object, usage_of
from nanochat.app.serve_models import Roster, Served
from nanochat.app.tool_calls import call_grammar
from nanochat.app.tool_calls import split as split_tool_calls
from nanochat.engine.output import TokenEvent, TokenLogprobs
from nanochat.engine.rules import LOGPROBS, SAMPLING_RULES, Rule, accepts
from nanochat.engine.sampling_params import ANY_OBJECT, SamplingParams
from nanochat.engine.serve.client import AsyncEngineClient, AsyncRequestStream, Session
from nanochat.engine.serve.protocol import EngineError, EngineRestarting, one_line, split_harmony

MAX_BODY_BYTES = 4 * 2 ** 20   # a request body past this is refused (413) before it is parsed
MAX_MESSAGES = 1024            # messages in one chat request
MAX_SESSIONS = 256             # conversations kept between requests
MAX_QUEUE = 256                # sequences in flight, running or waiting for the engine; past it 429
MAX_N = 16                     # choices of one request (each a sequence of the batch)
OLLAMA = ("ollama_chat", "ollama_generate")
SYSTEM_ROLES = ("system", "developer")   # OpenAI's newer name for the system message


@dataclass
class ServerConfig:
    model_id: str                      # what /v1/models lists and requests name
    aliases: tuple[str, ...] = ()      # other names a request may use for it (the path it was loaded from)
    model_path: str | None = None      # the file or folder it was loaded from (Ollama's /api/show reads it)
    chat_template: str | None = None   # --chat-template's file, if one was given (it stays with that model)
    discover: Callable[[], list] | None = None   # the catalog's other models (ModelEntry), loaded when named
    engine_config: dict = field(default_factory=dict)   # how they are loaded (the command line's engine options)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()   # web page origins allowed besides this machine's ("*": any)
    loopback: bool = True              # it listens on loopback only (app/http_guard.py checks Host then)
    max_queue: int = MAX_QUEUE
    max_n: int = MAX_N
    max_body_bytes: int = MAX_BODY_BYTES
    max_messages: int = MAX_MESSAGES
    max_sessions: int = MAX_SESSIONS
    log: Callable[[str], None] | None = None   # one line per request (already safe for its stream)


# ---------------------------------------------------------------------------------- requests
@dataclass
class Generation:
    """What a request asks the engine for, checked."""

    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    system: str | None = None
    history: list[dict] = field(default_factory=list)   # finished turns' messages, each turn ending with the reply
    turn: list[dict] | None = None                      # the new turn's messages: the user's, or tool results (chat)
    prompt: str | list[int] | None = None               # the raw prompt (completions)
    suffix: str | None = None                           # the text after the completion: fill in the middle
    n: int = 1                                          # choices: sequences of the same prompt
    tools: list[dict] | None = None                     # for the chat template; calls are parsed from replies
    harmony: bool = False                               # replies in harmony's channels (gpt-oss): split them
    reasoning_effort: str | None = None                 # OpenAI's reasoning_effort, for templates that read it
    enable_thinking: bool | None = None                 # chat_template_kwargs' switch, for templates that read it
    prompted: bool = False                              # the prompt opens the <think> block (the reply starts in it)

    @property
    def template_kwargs(self) -> dict | None:
        out = {"tools": self.tools} if self.tools else {}
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        if self.enable_thinking is not None:
            out["enable_thinking"] = self.enable_thinking
        return out or None

    def sampling_for(self, index: int) -> SamplingParams:
        """Choice i's sampling: a stated seed plus i, so each choice is reproducible and they differ."""
        if self.sampling.seed is None or index == 0:
            return self.sampling
        return replace(self.sampling, seed=(self.sampling.seed + index) % 2 ** 64)


@dataclass(eq=False)
class Choice:
    """One of a request's n sequences."""

    index: int
    session: Session | None = None          # its chat session (chat)
    astream: AsyncRequestStream | None = None
    final: TokenEvent | None = None
    seen: float | None = None               # when its latest token events arrived (/metrics)
    text_offset: int = 0                    # chars of its streamed tokens' texts (completions' logprobs)
    reader: ReplyReader | None = None       # its reply's reasoning, answer and calls (chat)


def sampling_from(body: dict, defaults: dict, context: int) -> SamplingParams:
    """SamplingParams from the request's fields over the model's recommended ones. max_tokens (or
    max_completion_tokens) defaults to the context and is clamped to it: the engine ends a reply where
    the context ends in any case, with finish_reason "length"."""
    stated = {}
    for name in ("max_completion_tokens", *SAMPLING_RULES):
        value = body.get(name)
        if value is None:
            continue
        rule = SAMPLING_RULES["max_tokens" if name == "max_completion_tokens" else name]
        if not accepts(rule, value):
            raise _type_error(name, rule.text, value)
        stated["max_tokens" if name == "max_completion_tokens" else name] = value
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise _type_error("stop", "a non-empty string or a list of them", stop)
        stated["stop"] = tuple(stops)
    bias = body.get("logit_bias")
    if bias is not None:
        if not (isinstance(bias, dict) and all(isinstance(k, str) and k.isascii() and k.isdigit() for k in bias)):
            raise _type_error("logit_bias", "an object mapping token ids to numbers from -100 to 100", bias)
        stated["logit_bias"] = {int(k): v for k, v in bias.items()}
    stated.update(held_reply(body))
    if flag(body, "ignore_eos"):   # vLLM's extra, for fixed-length replies (benchmarks)
        stated["ignore_eos"] = True
    for name, rule in REQUEST_RULES.items():   # nanochat's extra: the request's speculative proposer
        value = body.get(name)
        if value is not None:
            if not accepts(rule, value):
                raise _type_error(name, rule.text, value)
            stated[name] = value
    sampling = {name: value for name, value in defaults.items() if name in SAMPLING_RULES and name != "max_tokens"}
    sampling.update(stated)
    sampling["max_tokens"] = min(stated.get("max_tokens", context), context)
    try:
        return SamplingParams(**sampling)
    except ValueError as e:   # the engine's own checks, in its words
        raise ApiError(400, str(e)) from None


KINDS = ("json", "regex", "choice", "grammar")   # vLLM's structured outputs


def held_reply(body: dict) -> dict:
    """SamplingParams' json_schema or grammar from whichever field of the request holds the reply: OpenAI's
    response_format, llama.cpp server's `grammar` (GBNF or Lark), or vLLM's `structured_outputs` ({"json": ...},
    {"regex": ...}, {"choice": [...]} or {"grammar": ...}) and its older `guided_json`, `guided_regex`,
    `guided_choice`, `guided_grammar`. Two of them is a 400: they would fight over the reply."""
    found = {}
    schema = response_schema(body.get("response_format"))
    if schema is not None:
        found["response_format"] = {"json_schema": schema}
    outputs = body.get("structured_outputs")
    if outputs is not None and not (isinstance(outputs, dict) and len(outputs) == 1 and next(iter(outputs)) in KINDS):
        raise _type_error("structured_outputs", 'one of {"json": ...}, {"regex": ...}, {"choice": [...]} or '
                          '{"grammar": ...}', outputs)
    fields = [("grammar", "grammar", body.get("grammar"))]
    fields += [(f"guided_{kind}", kind, body.get(f"guided_{kind}")) for kind in KINDS]
    fields += [(f"structured_outputs.{kind}", kind, value) for kind, value in (outputs or {}).items()]
    for name, kind, value in fields:
        if value is not None:
            found[name] = _held(name, kind, value)
    if len(found) > 1:
        raise ApiError(400, f"{' and '.join(found)} cannot both hold a reply", param=list(found)[1])
    return next(iter(found.values()), {})


def _held(name: str, kind: str, value) -> dict:
    """One vLLM or llama.cpp structured-output field as SamplingParams keywords."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise _type_error(name, "a JSON schema", value) from None
        if not isinstance(value, (dict, bool)):
            raise _type_error(name, "a JSON schema", value)
        return {"json_schema": value}
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
            raise _type_error(name, "a non-empty list of non-empty strings", value)
        return {"grammar": "start: " + " | ".join(json.dumps(v, ensure_ascii=False) for v in value)}
    if not (isinstance(value, str) and value.strip()):
        raise _type_error(name, "a regular expression" if kind == "regex" else "a grammar's text (GBNF or Lark)",
                          value)
    if kind == "regex":   # a Lark terminal: its slashes escaped (those escaped already kept so)
        return {"grammar": "start: HELD\nHELD: /" + value.replace("\\/", "/").replace("/", "\\/") + "/"}
    return {"grammar": value}


def response_schema(fmt) -> str | dict | bool | None:
    """The JSON schema a response_format holds the reply to (engine/structured.py): None for text (or none given),
    any object for {"type": "json_object"}, the schema of {"type": "json_schema", "json_schema": {"schema": ...}}
    (its "strict" is always honoured: the reply is held to the schema token by token)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, "response_format json_schema needs its schema: "
                                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                           param="response_format")
        return schema
    what = f"response_format {json.dumps(kind)[:40]}" if isinstance(kind, str) else "this response_format"
    raise ApiError(400, f'{what} is not supported: "text", "json_object" or "json_schema"', param="response_format")


def _unsupported(body: dict) -> None:
    """Fields that would change what the reply is, which this server cannot honour: a 400, not a reply that
    silently ignores them (a client asking for JSON must not get prose it then fails to parse)."""
    if body.get("functions") or body.get("function_call"):
        raise ApiError(400, "functions and function_call are not supported: use tools", param="functions")
    if body.get("echo"):
        raise ApiError(400, "echo is not supported by this server", param="echo")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of is not supported by this server: use n", param="best_of")


def parse_reasoning_effort(body: dict, efforts: tuple) -> str | None:
    """OpenAI's reasoning_effort: one of the values the model's template reads (gpt-oss: low, medium, high)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    if not efforts:
        raise ApiError(400, "this model's chat template has no reasoning effort", param="reasoning_effort")
    if effort not in efforts:
        raise _type_error("reasoning_effort", " or ".join(efforts), effort)
    return effort


def parse_template_switches(body: dict) -> bool | None:
    """vLLM's chat_template_kwargs, of which the one variable templates read for it: enable_thinking (Qwen3,
    SmolLM3 think unless it is false). A template without the switch ignores it, as vLLM's does."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not (isinstance(kwargs, dict) and set(kwargs) <= {"enable_thinking"}
            and isinstance(kwargs.get("enable_thinking", False), bool)):
        raise _type_error("chat_template_kwargs", '{"enable_thinking": true or false}', kwargs)
    return kwargs.get("enable_thinking")


def parse_tools(body: dict, template_takes_tools: bool) -> tuple[list[dict] | None, str | bool]:
    """The tools the chat template is given (None: none) and whether the reply must call one: False (tool_choice
    "auto", the default with tools: the model decides), True ("required": any of them) or the function's name
    ({"type": "function", "function": {"name": ...}}). "none" leaves the tools out of the prompt."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    named = isinstance(function, dict) and isinstance(function.get("name"), str)
    if choice is not None and choice not in ("auto", "none", "required") and not named:
        raise _type_error("tool_choice",
                          '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}', choice)
    if not tools or choice == "none":
        if choice == "required" or named:
            raise ApiError(400, "tool_choice forces a call, but the request gives no tools", param="tool_choice")
        return None, False
    if not (isinstance(tools, list) and all(isinstance(t, dict) and t.get("type") == "function"
                                            and isinstance(t.get("function"), dict)
                                            and isinstance(t["function"].get("name"), str)
                                            and isinstance(t["function"].get("parameters", {}), dict) for t in tools)):
        raise _type_error("tools", 'a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}',
                          tools)
    if not template_takes_tools:
        raise ApiError(400, "this model's chat template does not render tools: it cannot call them", param="tools")
    if named:
        name = function["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"tool_choice names {json.dumps(name)[:60]}, which is not among the tools",
                           param="tool_choice")
        return tools, name
    return tools, choice == "required"


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many alternatives per token a request wants with its tokens' log-probabilities (None: none).
    Chat says `logprobs: true` and `top_logprobs: k`; completions `logprobs: k`."""
    if chat:
        top = body.get("top_logprobs")
        if not flag(body, "logprobs"):
            if top is not None:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        name, value = "top_logprobs", 0 if top is None else top
    else:
        name, value = "logprobs", body.get("logprobs")
        if value is None:
            return None
    if not accepts(LOGPROBS, value):
        raise _type_error(name, LOGPROBS.text, value)
    return value


def _logprob(value: float) -> float:
    return max(value, -9999.0)   # JSON has no -Infinity; vLLM's floor


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(items: list[TokenLogprobs]) -> dict:
    """OpenAI's chat shape: per token its text, log-probability, UTF-8 bytes and the top alternatives."""
    return {"content": [{**_token(t.token, t.logprob), "top_logprobs": [_token(text, lp) for text, lp, _ in t.top]}
                        for t in items]}


def completion_logprobs(items: list[TokenLogprobs], offset: int) -> dict:
    """The completions shape; `offset`: where the first token's text starts in the reply."""
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [_logprob(t.logprob) for t in items],
            "top_logprobs": [{text: _logprob(lp) for text, lp, _ in t.top} for t in items], "text_offset": offsets}


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    return flag(options, "include_usage")


def _content(message: dict, at: int) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"messages[{at}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                    "are supported", param=f"messages[{at}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise _type_error(f"messages[{at}].content", "a string or a list of text parts", content)


def _tool_calls(message: dict, at: int) -> list[dict]:
    """An assistant message's calls as the template gets them: their arguments parsed from OpenAI's JSON
    text, as vLLM passes them (Qwen2.5's template writes them with tojson, which would quote the text)."""
    calls = message["tool_calls"]
    shape = '{"type": "function", "function": {"name": ..., "arguments": "{...}"}}'
    if not isinstance(calls, list):
        raise _type_error(f"messages[{at}].tool_calls", f"a list of {shape}", calls)
    parsed = []
    for k, call in enumerate(calls):
        where = f"messages[{at}].tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str) and isinstance(call.get("id", ""), str)):
            raise _type_error(where, shape, call)
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise _type_error(f"{where}.function.arguments", "a JSON object's text", function["arguments"])
        parsed.append({"id": call.get("id"), "type": "function",
                       "function": {"name": function["name"], "arguments": arguments}})
    return parsed


# What may follow each kind of message (None: the start) and why, in the order of a conversation.
_FOLLOWS = {None: (("user",), "a user message: the conversation starts with the user's"),
            "user": (("assistant", "user"), "a user or assistant message"),
            "assistant": (("user",), "a user message: user and assistant messages take turns"),
            "calls": (("tool",), "a tool message: an assistant's tool_calls are answered by tool results"),
            "tool": (("tool", "assistant", "user"), "")}


def parse_messages(messages, limit: int) -> tuple[str | None, list[dict], list[dict]]:
    """(system prompt, finished turns' messages, the new turn's messages). A chat session takes an
    optional system prompt (the leading system or developer messages, joined), then user and assistant
    messages in turn (user messages in a row are one turn), an assistant's tool_calls answered by tool
    messages; it ends with the user's message or the tool results. A system message later on joins the
    user's turn it belongs to (the one before it, else the next): a session has its system prompt only
    at the start, and the clients that send such messages (Claude Code, Codex) mean them for that turn."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", param="messages")
    if len(messages) > limit:
        raise ApiError(400, f"too many messages: {len(messages)}, at most {limit}", param="messages")
    system, parsed, last, aside = None, [], None, []
    for at, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _type_error(f"messages[{at}]", "an object with role and content", message)
        role = message.get("role")
        if role not in (*SYSTEM_ROLES, "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{at}].role must be system, user, assistant or tool, got "
                                f"{json.dumps(role)[:40]}", param=f"messages[{at}].role")
        calls = role == "assistant" and message.get("tool_calls")
        text = "" if calls and message.get("content") is None else _content(message, at)
        if role in SYSTEM_ROLES:
            if last is None:
                system = text if system is None else f"{system}\n\n{text}"
            elif last == "user":
                parsed[-1]["content"] += f"\n\n{text}"
            else:
                aside.append(text)
            continue
        if role == "user" and aside:
            text, aside = "\n\n".join([*aside, text]), []
        allowed, why = _FOLLOWS[last]
        if role not in allowed:
            raise ApiError(400, f"messages[{at}]: a tool message must answer an assistant message's tool_calls"
                           if role == "tool" else f"messages[{at}] must be {why}", param="messages")
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise _type_error(f"messages[{at}].tool_call_id", "a string", message.get("tool_call_id"))
            parsed.append({"role": role, "content": text, "tool_call_id": message["tool_call_id"]})
        elif calls:
            parsed.append({"role": role, "content": text, "tool_calls": _tool_calls(message, at)})
        else:
            parsed.append({"role": role, "content": text})
        last = "calls" if calls else role
    if aside and last != "calls":
        parsed.append({"role": "user", "content": "\n\n".join(aside)})
        last = "user"
    if last not in ("user", "tool"):
        raise ApiError(400, "the last message must be the user's or a tool result", param="messages")
    start = max((at + 1 for at, m in enumerate(parsed) if m["role"] == "assistant"), default=0)
    return system, parsed[:start], parsed[start:]


def parse_suffix(suffix, prompt) -> str | None:
    """A completion's suffix (OpenAI's field): the text after the one to write; None when there is none."""
    if suffix is None or suffix == "":
        return None
    if not isinstance(suffix, str):
        raise _type_error("suffix", "a string", suffix)
    if not isinstance(prompt, str):
        raise ApiError(400, "suffix needs a text prompt (the text before the one to write)", param="suffix")
    return suffix


def parse_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise _type_error("prompt", "a string or a list of token ids", prompt)


# ---------------------------------------------------------------------------------- conversations
def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _view(message: dict):
    """What identifies a message between requests. An assistant's calls count by name and arguments,
    whether its session holds them as the model wrote them (<tool_call> text) or the client sends them
    back as tool_calls (with ids made up for its reply, kept nowhere), and its text then without the
    whitespace around the calls, which the reply's content loses."""
    if message["role"] != "assistant":
        return message
    if THINK_CLOSE in message["content"]:   # a reasoning reply as its session holds it: the client sees its answer
        message = {**message, "content": message["content"].rsplit(THINK_CLOSE, 1)[1].lstrip()}
    if "<|channel|>" in message["content"]:   # a harmony reply as its session holds it: the client sees its answer
        split = split_harmony(message["content"])
        message = {**message, "content": split.answer, "tool_calls": split.calls + (message.get("tool_calls") or [])}
    content, calls = split_tool_calls(message["content"])
    calls += message.get("tool_calls") or []
    if not calls:
        return ["assistant", message["content"]]
    return ["assistant", content.strip(), [[c["function"]["name"], _arguments(c["function"]["arguments"])]
                                           for c in calls]]


class Conversations:
    """The chat sessions kept between requests, keyed by transcript (see the module docstring)."""

    def __init__(self, client: AsyncEngineClient, capacity: int):
        self.client, self.capacity = client, capacity
        self._idle: OrderedDict[str, object] = OrderedDict()

    @staticmethod
    def _key(system: str | None, history: list[dict], tools: list[dict] | None) -> str:
        # the tools are part of the prompt (the template renders them at its head)
        text = json.dumps([system or None, [_view(m) for m in history], tools or None], ensure_ascii=False,
                          sort_keys=True)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    @staticmethod
    def _tools(session) -> list[dict] | None:
        return (session.template_kwargs or {}).get("tools")

    def take(self, system: str | None, history: list[dict], tools: list[dict] | None = None):
        """A session holding exactly `history` (rendered with `tools`), not in use by another request."""
        session = self._idle.pop(self._key(system, history, tools), None)
        if session is not None:
            return session
        turns, views = sum(m["role"] == "assistant" for m in history), [_view(m) for m in history]
        for other in reversed(self._idle.values()):
            if other.system_prompt == (system or None) and other.turns > turns and self._tools(other) == tools \
                    and [_view(m) for m in other.history[:len(history)]] == views:
                return self.client.branch_session(other, turns)
        return self.client.open_session(system, history)

    def held_tokens(self, system: str | None, history: list[dict], tools: list[dict] | None = None) -> int | None:
        """The tokens of the kept session holding exactly `history`, when its ids are all known."""
        session = self._idle.get(self._key(system, history, tools))
        if session is None or session.token_ids is None or len(session.turn_starts or ()) != session.turns:
            return None
        return len(session.token_ids)

    def keep(self, session) -> None:
        """A session whose turn ended well, kept for the transcript's next turn."""
        key = self._key(session.system_prompt, session.history, self._tools(session))
        old = self._idle.pop(key, None)
        if old is not None:   # two clients with the same transcript: keep one
            self.client.close_session(old)
        self._idle[key] = session
        while len(self._idle) > self.capacity:
            self.client.close_session(self._idle.popitem(last=False)[1])

    def close_all(self) -> None:
        """Forget every kept conversation (another model is loading: their KV was the previous model's)."""
        while self._idle:
            self.client.close_session(self._idle.popitem()[1])

    def drop(self, session) -> None:
        """Forget a session (its turn failed, or its client went away): its KV is released at once."""
        self.client.close_session(session)


# ---------------------------------------------------------------------------------- the app
class Api:
    def __init__(self, client: AsyncEngineClient, config: ServerConfig):
        self.client, self.config = client, config
        self.conversations = Conversations(client, config.max_sessions)
        first = Served(config.model_id, config.model_path or config.model_id, config.aliases)
        self.roster = Roster(first, config.discover)
        self.stored = ResponseStore()          # responses kept for previous_response_id (/v1/responses)
        self.in_flight = 0                    # sequences (a request with n choices counts n)
        self.metrics = Metrics()
        self.created = int(time.time())
        self._key = config.api_key.encode("utf-8") if config.api_key else None

    # ------------------------------------------------------------------ shared
    def authorize(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":   # Anthropic's clients send the key as x-api-key
            given = request.headers.get("x-api-key", "")
        # compare_digest: the time taken says nothing about how much of the key matched
        if not hmac.compare_digest(given.strip().encode("utf-8"), self._key):
            raise ApiError(401, "invalid API key: send it as `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
                           code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
        too_large = ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:   # RecursionError: nesting deeper than the parser goes
            raise ApiError(400, f"the request body is not valid JSON ({one_line(e)[:120]})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return data

    @property
    def model_id(self) -> str:
        """The loaded model's name in the API."""
        return self.roster.loaded.id

    async def find_model(self, body: dict) -> Served:
        """The model a request names (its `model`; none: the loaded one); 404 for one the server does not have."""
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise _type_error("model", "a string", name)
        served = await self.roster.find(name)
        if served is None:
            others = len(self.roster.models) - 1
            more = f" and {others} more (GET /v1/models)" if others else ""
            raise ApiError(404, f"the model {json.dumps(name)[:120]} does not exist; this server serves "
                                f"{json.dumps(self.model_id)}{more}", param="model", code="model_not_found")
        return served

    async def hold_model(self, body: dict) -> None:
        """The model a request names loaded, and held so until `roster.release()`: another one is loaded first
        (after the requests in flight end), as Ollama's server does."""
        await self.roster.use(await self.find_model(body), self._load)

    @asynccontextmanager
    async def using_model(self, body: dict):
        await self.hold_model(body)
        try:
            yield
        finally:
            self.roster.release()

    async def _load(self, path: str) -> None:
        self.conversations.close_all()   # their KV was the previous model's
        if self.config.log:
            self.config.log(f"loading {path}")
        try:
            # --chat-template stays with the model the server started with
            config = model_config(self.config.engine_config, path, self.roster.first.path)
            await self.client.load_model(path, **config)
        except Exception as e:   # a bad file, no memory: the previous model stays loaded
            raise ApiError(500, f"cannot load the model {path}: {one_line(e)}", code="model_load_failed") from None

    def _admit(self, n: int) -> None:
        if self.in_flight + n > self.config.max_queue:
            raise ApiError(429, f"the server is busy: {self.in_flight} sequences in flight (n each request), the most "
                                "it takes is --max-queue; try again shortly", code="queue_full")

    def _log(self, request: Request, status: int, choices: list[Choice] | None = None,
             started: float | None = None, detail: str = "") -> None:
        """One line per request; `choices` once they all ended well; `detail`: what else it did."""
        if self.config.log is None:
            return
        peer = request.client.host if request.client else "-"
        line = f"{peer} {request.method} {request.url.path} {status}"
        if choices is not None:
            usage, ttft = self._usage(choices), choices[0].final.stats.ttft
            line += (f" · {usage['prompt_tokens']} prompt ({usage['prompt_tokens_details']['cached_tokens']} cached)"
                     f" · {usage['completion_tokens']} out")
            if ttft is not None:
                line += f" · TTFT {ttft:.2f}s"
        line += detail
        if started is not None:
            line += f" · {time.monotonic() - started:.2f}s"
        self.config.log(line)

    @staticmethod
    async def _watch_disconnect(request: Request, choices: list[Choice]) -> None:
        """Cancel the request when its client goes away, so its blocks are freed at once."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for c in choices:
                    if c.astream is not None:
                        c.astream.cancel()
                return

    @staticmethod
    def _refusal(final, astream: AsyncRequestStream) -> ApiError:
        """The error a request that ended before any token gets."""
        if astream.lost:
            return ApiError(503, f"{final.error}; a new engine is starting: try again shortly", code="engine_restarting")
        if final.finish_reason == "abort":
            return ApiError(503, "the request was cancelled: the server is stopping", code="cancelled")
        if final.stats is not None and final.stats.context_full:
            return ApiError(400, final.error, param="messages", code="context_length_exceeded")
        if final.stats is None:   # the engine refused it (an empty prompt, a template that fails)
            return ApiError(400, final.error or "the engine refused the request")
        return ApiError(500, final.error or "generation failed", code="generation_failed")

    @staticmethod
    def _usage(choices: list[Choice]) -> dict:
        """The prompt once (choice 0's: the others found it cached), every choice's completion tokens."""
        prompt = choices[0].final.stats
        completion = sum(c.final.stats.completion_tokens for c in choices)
        return {"prompt_tokens": prompt.prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": prompt.cached_tokens}}

    @staticmethod
    def _finish_reason(final, tool_calls: list | None = None) -> str:
        if final.finish_reason == "length":
            return "length"
        return "tool_calls" if tool_calls else "stop"

    # ------------------------------------------------------------------ endpoints
    async def embed(self, request: Request, api: str) -> Response:
        """An embeddings request (app/embeddings_api.py; `api`: embeddings, ollama_embed, ollama_embeddings): one
        engine request per input, batched, cancelled when the client goes away."""
        started = time.monotonic()
        dialect = "chat" if api == "embeddings" else "ollama_chat"
        choices: list[Choice] = []
        try:
            self.authorize(request)
            body = await self.read_json(request)
            async with self.using_model(body):
                model = self.client.model
                pooling, width = (model.pooling, model.embedding_length) if model else ("mean", 0)
                fmt, truncate = "float", True
                if api == "embeddings":
                    inputs, params, fmt = embeddings_api.openai_request(body, pooling, width)
                    truncate = False
                elif api == "ollama_embed":
                    inputs, params, truncate = embeddings_api.ollama_embed_request(body, pooling, width)
                else:
                    inputs, params = embeddings_api.ollama_embeddings_request(body, pooling)
                if not inputs:   # Ollama's load request: the model is loaded
                    self._log(request, 200)
                    return JSONResponse({"model": self.model_id, "embeddings": []} if api == "ollama_embed"
                                        else {"embedding": []})
                self._admit(len(inputs))
                self.in_flight += len(inputs)
                choices = [Choice(i) for i in range(len(inputs))]
                watcher = None
                try:
                    await self._streams(choices, self.client.embed(inputs, params, truncate))
                    watcher = asyncio.create_task(self._watch_disconnect(request, choices))
                    for c in choices:
                        c.final = (await c.astream.result()).final
                        self.metrics.finished(c.final.finish_reason, c.final.stats)
                finally:
                    if watcher is not None:
                        watcher.cancel()
                    self.in_flight -= len(inputs)
                failed = next((c for c in choices if c.astream.reply.embedding is None), None)
                if failed is not None:
                    raise self._refusal(failed.final, failed.astream)
        except ApiError as e:
            self._log(request, e.status, started=started)
            return self._error(e, dialect)
        vectors = [c.astream.reply.embedding for c in choices]
        tokens = sum(c.final.stats.prompt_tokens for c in choices)
        self._log(request, 200, started=started, detail=f" · {len(vectors)} input(s) · {tokens} tokens")
        if api == "embeddings":
            return JSONResponse(embeddings_api.openai_response(self.model_id, vectors, tokens, fmt))
        if api == "ollama_embed":
            return JSONResponse(embeddings_api.ollama_embed_response(self.model_id, vectors, tokens,
                                                                     time.monotonic() - started))
        return JSONResponse({"embedding": vectors[0]})

    @staticmethod
    def _error(e: ApiError, api: str) -> Response:
        """The error in the request's dialect: Anthropic's object for its Messages API, Ollama's for its API, else
        OpenAI's."""
        if api == "messages":
            return e.response(messages_api.error_body(e))
        return e.response(ollama_api.error_body(e) if api in OLLAMA else None)

    async def generate(self, request: Request, api: str) -> Response:
        """A generation request of any of the APIs (`api`: chat, completions, responses, messages, ollama_chat,
        ollama_generate), all run as chat completions (or completions) are."""
        started = time.monotonic()
        chat = api != "completions"
        asked = None   # a Responses request (responses_api.Asked)
        held = False   # the model is held for this request: _settle releases it once the request has choices
        try:
            self.authorize(request)
            body = await self.read_json(request)
            await self.hold_model(body)
            held = True
            if api == "responses":
                asked = chat_request(body, self.stored)
                body = asked.chat
            elif api == "messages":
                body = messages_api.chat_request(body)
            elif api == "ollama_chat":
                body = ollama_api.chat_request(body)
            elif api == "ollama_generate":
                body, raw = ollama_api.generate_request(body)
                chat = not raw
            if body is None:   # an Ollama load request: the model is loaded
                self._log(request, 200)
                self.roster.release()
                return JSONResponse(ollama_api.loaded(self.model_id, api == "ollama_chat"))
            if api != "chat" and not (self.client.model and self.client.model.reasoning_efforts):
                body.pop("reasoning_effort", None)   # their clients send an effort to any model
            _unsupported(body)
            gen = self._parse(body, chat)
            if gen.suffix is not None:
                await self._fill_in_the_middle(gen)
            if api == "ollama_chat":
                await self._fit_to_context(gen)
            if asked:   # the Response states the sampling it ran with
                asked.body = {**asked.body, "temperature": gen.sampling.temperature, "top_p": gen.sampling.top_p}
            self._admit(gen.n)
        except BaseException as e:
            if held:
                self.roster.release()
            if not isinstance(e, ApiError):
                raise
            self._log(request, e.status)
            return self._error(e, api)
        self.in_flight += gen.n
        choices = [Choice(i, reader=ReplyReader(self.client.model, gen.prompted, bool(gen.tools)) if chat else None)
                   for i in range(gen.n)]
        handed_over = False
        watcher = None
        try:
            if chat:
                first = self.conversations.take(gen.system, gen.history, gen.tools)
                choices[0].session = first
                for c in choices[1:]:   # forks share the conversation's cached prefix
                    c.session = self.client.branch_session(first, first.turns)
            # The engine caches a block once its KV is computed, so choice 0 prefills the prompt alone; the
            # others follow as soon as it has (its first token) and find it all in the prefix cache.
            await self._submit(gen, choices[:1])
            watcher = asyncio.create_task(self._watch_disconnect(request, choices))
            events = await self._fetch(choices[0], started)
            final, astream = choices[0].final, choices[0].astream
            if final is not None and final.finish_reason in ("error", "abort") and not astream.reply.token_ids:
                raise self._refusal(final, astream)
            if gen.n > 1:
                await self._submit(gen, choices[1:])
                if watcher.done():   # the client went away meanwhile
                    for c in choices[1:]:
                        c.astream.cancel()
            arrivals = self._arrivals(choices, events, started)
            ident = new_id("resp") if asked else new_id("msg", 24) if api == "messages" else \
                f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if gen.stream:
                if asked:
                    stream = self._response_events(ident, asked, choices[0], arrivals, watcher, request, started)
                elif api == "messages":
                    stream = self._message_events(ident, choices[0], arrivals, watcher, request, started)
                elif api in OLLAMA:
                    stream = self._ollama_lines(api, choices[0], arrivals, watcher, request, started)
                else:
                    stream = self._sse(ident, chat, gen, choices, arrivals, watcher, request, started)
                handed_over = True
                return StreamingResponse(stream, media_type=ollama_api.NDJSON if api in OLLAMA else "text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            async for c, got in arrivals:
                if chat:
                    self._read(c, got)
            failed = next((c for c in choices if c.final.finish_reason not in ("stop", "length")), None)
            if failed is not None:
                raise self._refusal(failed.final, failed.astream) if not failed.astream.reply.token_ids else \
                    ApiError(500 if not failed.astream.lost else 503, failed.final.error or "generation failed")
            self._log(request, 200, choices, started)
            if asked:
                return JSONResponse(self._response(ident, asked, choices[0]))
            if api == "messages":
                return JSONResponse(self._message(ident, choices[0]))
            if api in OLLAMA:
                return JSONResponse(self._ollama_whole(api, choices[0], started))
            return JSONResponse(self._whole(ident, chat, gen, choices, self._usage(choices)))
        except ApiError as e:
            self._log(request, e.status, started=started)
            return self._error(e, api)
        finally:
            if not handed_over:
                self._settle(choices, watcher)

    async def _submit(self, gen: Generation, choices: list[Choice]) -> None:
        samplings = [gen.sampling_for(c.index) for c in choices]
        if gen.prompt is None:
            await self._streams(choices, self.client.submit_turns([c.session for c in choices], gen.turn, samplings,
                                                                  gen.template_kwargs))
        else:
            await self._streams(choices, self.client.submit_many(gen.prompt, samplings))

    @staticmethod
    async def _streams(choices: list[Choice], submitted) -> None:
        """Each choice's stream, from the client call `submitted` (awaited here): what the client refuses is a 400,
        an engine that is restarting or gone a 503."""
        try:
            streams = await submitted
        except EngineRestarting as e:
            raise ApiError(503, str(e), code="engine_restarting") from None
        except (EngineError, ValueError) as e:
            raise ApiError(400 if isinstance(e, ValueError) else 503, one_line(e)) from None
        for c, astream in zip(choices, streams):
            c.astream = astream

    async def _fetch(self, c: Choice, started: float) -> list[TokenEvent]:
        """A choice's next events, timed for /metrics as they arrive."""
        events = await c.astream.next_events()
        now = time.monotonic()
        tokens = sum(e.token_id is not None for e in events)
        if tokens:
            if c.seen is None:
                self.metrics.ttft.observe(now - started)
                tokens -= 1   # a batch's later tokens came during the same wait: no gap of their own is known
            else:
                self.metrics.itl.observe((now - c.seen) / tokens, tokens)
            if tokens or c.seen is None:
                c.seen = now
        if events[-1].finished:
            c.final = events[-1]
            self.metrics.finished(c.final.finish_reason, c.final.stats)
        return events

    async def _arrivals(self, choices: list[Choice], events: list[TokenEvent], started: float):
        """(choice, its new events) as they arrive from every choice, until each has ended; `events`:
        choice 0's, already fetched."""
        tasks: dict[Choice, asyncio.Task] = {}
        ready = [(choices[0], events)]
        try:
            while True:
                for c, got in ready:
                    yield c, got
                live = [c for c in choices if c.astream is not None and c.final is None]
                if not live:
                    return
                if len(live) == 1 and not tasks:   # the usual case (n = 1): no task per batch
                    ready = [(live[0], await self._fetch(live[0], started))]
                    continue
                for c in live:
                    if c not in tasks:
                        tasks[c] = asyncio.ensure_future(self._fetch(c, started))
                done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
                ready = [(c, tasks.pop(c).result()) for c in list(tasks) if tasks[c] in done]
        finally:
            for task in tasks.values():
                task.cancel()

    def _settle(self, choices: list[Choice], watcher) -> None:
        """The request is over: keep each conversation whose turn ended well for its next turn, release
        the rest, and stop whatever still generates (its client went away)."""
        if watcher is not None:
            watcher.cancel()
        for c in choices:
            ok = c.final is not None and c.final.finish_reason in ("stop", "length")
            if c.astream is not None and c.final is None:
                c.astream.cancel()
            if c.session is not None:
                (self.conversations.keep if ok else self.conversations.drop)(c.session)
        self.in_flight -= len(choices)
        self.roster.release()

    def _parse(self, body: dict, chat: bool) -> Generation:
        model = self.client.model
        sampling = sampling_from(body, model.sampling_defaults if model else {},
                                 model.max_model_len if model else 1)
        if sampling.speculative == "draft" and model is not None:   # an engine without a draft model refuses it
            refusal = speculative_refusal("draft", model.speculative_modes, "nanochat serve")
            if refusal:
                raise ApiError(400, refusal, param="speculative")
        stream = flag(body, "stream")
        asked = logprobs_asked(body, chat)
        if asked is not None:
            sampling = replace(sampling, logprobs=asked)
        gen = Generation(sampling, stream, _stream_options(body, stream), n=self._n(body))
        if chat:
            if body.get("suffix"):
                raise ApiError(400, "suffix (fill in the middle) is for /v1/completions", param="suffix")
            gen.system, gen.history, gen.turn = parse_messages(body.get("messages"), self.config.max_messages)
            gen.tools, forced = parse_tools(body, bool(model and model.tools))
            gen.harmony = bool(model and model.harmony)
            parallel = body.get("parallel_tool_calls", True)
            if not isinstance(parallel, bool):
                raise _type_error("parallel_tool_calls", "true or false", parallel)
            if forced and gen.sampling.grammar is not None:
                raise ApiError(400, "grammar and a forced tool call cannot both hold a reply", param="grammar")
            # A forced call replaces response_format (the reply is calls, no JSON answer); "auto" under a schema or a
            # grammar writes no calls, so there is nothing more to hold.
            if gen.tools and (forced or gen.sampling.json_schema is None and gen.sampling.grammar is None):
                try:
                    grammar = call_grammar(gen.tools, forced, gen.harmony, parallel)
                except ValueError as e:
                    raise ApiError(400, str(e), param="tools") from None
                if grammar is not None:
                    gen.sampling = replace(gen.sampling, json_schema=None, grammar=grammar)
            gen.reasoning_effort = parse_reasoning_effort(body, model.reasoning_efforts if model else ())
            gen.enable_thinking = parse_template_switches(body)
            gen.prompted = bool(model) and gen.enable_thinking in model.thinking_opened
            if not (model and model.tools) and any(m["role"] == "tool" or m.get("tool_calls")
                                                   for m in gen.history + gen.turn):
                raise ApiError(400, "this model's chat template does not render tools: it cannot take their calls "
                                    "or results", param="messages")
        else:
            gen.prompt = parse_prompt(body.get("prompt"))
            gen.suffix = parse_suffix(body.get("suffix"), gen.prompt)
        return gen

    async def _fit_to_context(self, gen: Generation) -> None:
        """Drop a chat's oldest turns until its prompt leaves the reply room in the context (its max_tokens, at most a
        quarter of the context), as Ollama's server drops them for its clients: they send long chats whole and expect
        them to go on (the other APIs answer 400 instead). The system prompt and the new turn stay; a cut starts at a
        user message. A conversation kept from its last turn whose ids plus a bound on the new messages' fit is not
        counted (the usual case); else counting renders the prompt in the engine: once when it fits, a binary search
        over the cuts when it does not."""
        context = self.client.model.max_model_len if self.client.model else 0
        room = min(gen.sampling.max_tokens, context // 4)
        held = self.conversations.held_tokens(gen.system, gen.history, gen.tools)
        if held is not None:   # a token is at least a byte; the template adds a few words around each message
            bound = held + sum(len(m["content"].encode("utf-8", "surrogatepass")) + 32 for m in gen.turn) + 32
            if bound + room <= context:
                return

        async def fits(history: list[dict]) -> bool:
            ids = await self._engine_call(self.client.tokenize(system_prompt=gen.system, messages=history + gen.turn,
                                                                template_kwargs=gen.template_kwargs))
            return len(ids) + room <= context

        if not gen.history or await fits(gen.history):
            return
        cuts = [at for at, m in enumerate(gen.history) if at and m["role"] == "user"
                and gen.history[at - 1]["role"] == "assistant"] + [len(gen.history)]
        low, high = 0, len(cuts) - 1   # cuts[high] (no history) is the last resort, fitting or not
        while low < high:
            mid = (low + high) // 2
            if await fits(gen.history[cuts[mid]:]):
                high = mid
            else:
                low = mid + 1
        gen.history = gen.history[cuts[low]:]

    async def _fill_in_the_middle(self, gen: Generation) -> None:
        """A completion with a suffix: its prompt becomes the model's fill-in-the-middle prompt (half the context
        at least; longer text is cut at its far ends), and the FIM tokens that end a middle stop it."""
        context = self.client.model.max_model_len if self.client.model else 1
        budget = context - min(gen.sampling.max_tokens, context // 2)
        ids, ends = await self._engine_call(self.client.infill(gen.prompt, gen.suffix, budget))
        gen.prompt = ids
        gen.sampling = replace(gen.sampling, stop_token_ids=gen.sampling.stop_token_ids + tuple(ends))

    def _n(self, body: dict) -> int:
        n, most = body.get("n"), min(self.config.max_n, self.config.max_queue)
        if n is None:
            return 1
        if not accepts(Rule(int, lambda v: 1 <= v <= most, f"an integer from 1 to {most}"), n):
            raise _type_error("n", f"an integer from 1 to {most}", n)
        return n

    def _whole(self, ident: str, chat: bool, gen: Generation, choices: list[Choice], usage: dict) -> dict:
        out = []
        for c in choices:
            logprobs = c.astream.reply.logprobs
            choice = {"index": c.index, "finish_reason": self._finish_reason(c.final),
                      "logprobs": None if gen.sampling.logprobs is None else
                      chat_logprobs(logprobs) if chat else completion_logprobs(logprobs, 0)}
            if chat:   # content: the answer; reasoning_content: the thinking or harmony's analysis (vLLM's name)
                reader = c.reader
                choice["message"] = message = {"role": "assistant", "content": reader.answer}
                if reader.reasoned:
                    message["reasoning_content"] = reader.reasoning
                if reader.calls:
                    message["content"] = answer_text(reader.answer, reader.calls)
                    message["tool_calls"] = reader.calls
                    choice["finish_reason"] = self._finish_reason(c.final, reader.calls)
            else:
                choice["text"] = c.astream.reply.text
            out.append(choice)
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_id, "choices": out, "usage": usage}

    @staticmethod
    def _read(c: Choice, events: list[TokenEvent]) -> tuple[str, str, list[dict]]:
        """What a chat choice's new events add to its reply: (answer, reasoning, calls), read token by token
        (each token counts as reasoning or not)."""
        answer, reasoning, calls = "", "", []
        for k, e in enumerate(events):
            last = c.final is not None and k == len(events) - 1
            a, r, found = c.reader.feed(e.text, last, int(e.token_id is not None))
            answer, reasoning, calls = answer + a, reasoning + r, calls + found
        return answer, reasoning, calls

    # ------------------------------------------------------------------ /v1/responses
    def _response(self, ident: str, asked: Asked, c: Choice) -> dict:
        """A finished Responses request's Response object, stored unless it says store: false."""
        reader = c.reader
        output = output_items(reader.reasoning if reader.reasoned else None, reader.answer, reader.calls,
                              cut=c.final.finish_reason == "length", namespaces=asked.namespaces)
        return self._finished_response(ident, asked, c, output, time.time())

    def _finished_response(self, ident: str, asked: Asked, c: Choice, output: list[dict], created: float) -> dict:
        stats = c.final.stats
        usage = usage_of(stats.prompt_tokens, stats.cached_tokens, stats.completion_tokens,
                         c.reader.reasoning_tokens)
        status = "incomplete" if c.final.finish_reason == "length" else "completed"
        response = response_object(ident, asked.body, self.model_id, status, output, usage, created)
        if asked.body.get("store") is not False:
            reply = reply_message(output)
            self.stored.put(response, asked.messages + [reply], asked.added + [reply])
        return response

    async def _response_events(self, ident, asked, c, arrivals, watcher, request, started):
        """A streamed Responses request's events (EventStream), ending with response.completed (or .incomplete
        at max_output_tokens, .failed when the engine fails mid-reply)."""
        created, stream = time.time(), EventStream(asked.namespaces)

        def sse(payload: dict) -> bytes:
            return f"event: {payload['type']}\n".encode() + _sse(payload)

        def lifecycle(kind: str, status: str, output: list[dict], error: dict | None = None) -> bytes:
            return sse(stream.event(kind, response=response_object(ident, asked.body, self.model_id, status,
                                                                   output, None, created, error)))

        try:
            yield lifecycle("response.created", "in_progress", [])
            yield lifecycle("response.in_progress", "in_progress", [])
            async for _, events in arrivals:
                answer, reasoning, calls = self._read(c, events)
                for event in stream.add(reasoning, answer, calls):
                    yield sse(event)
            if c.final.finish_reason in ("stop", "length"):
                for event in stream.finish(cut=c.final.finish_reason == "length"):
                    yield sse(event)
                response = self._finished_response(ident, asked, c, stream.items, created)
                kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                yield sse(stream.event(kind, response=response))
            else:   # the engine died or failed mid-reply
                lost = c.astream.lost
                error = {"code": "server_error", "message": (c.final.error or "generation failed")
                         + ("; a new engine is starting: try again shortly" if lost else "")}
                yield lifecycle("response.failed", "failed", stream.items, error)
        finally:
            await self._stream_ended([c], arrivals, watcher, request, started)

    async def retrieve(self, request: Request) -> Response:
        """GET /v1/responses/{id}: a stored response; DELETE forgets it."""
        try:
            self.authorize(request)
            ident = request.path_params["ident"]
            if request.method == "DELETE":
                self.stored.delete(ident)
                return JSONResponse({"id": ident, "object": "response", "deleted": True})
            return JSONResponse(self.stored.get(ident)[0])
        except ApiError as e:
            return e.response()

    # ------------------------------------------------------------------ /v1/messages
    def _message(self, ident: str, c: Choice) -> dict:
        reader, stats = c.reader, c.final.stats
        content = messages_api.content_blocks(reader.reasoning if reader.reasoned else None, reader.answer,
                                              reader.calls)
        stop = messages_api.stop_reason(c.final.finish_reason, stats, reader.calls)
        return messages_api.message_object(ident, self.model_id, content, stop, messages_api.usage_of(stats))

    async def _message_events(self, ident, c, arrivals, watcher, request, started):
        """A streamed Messages request's events (messages_api.EventStream), from message_start to message_stop;
        an engine failure mid-reply is an error event."""
        stream = messages_api.EventStream()

        def sse(payload: dict) -> bytes:
            return f"event: {payload['type']}\n".encode() + _sse(payload)

        try:
            start = messages_api.message_object(ident, self.model_id, [], (None, None),
                                                {"input_tokens": 0, "output_tokens": 0})
            yield sse({"type": "message_start", "message": start})
            async for _, events in arrivals:
                answer, reasoning, calls = self._read(c, events)
                for event in stream.add(reasoning, answer, calls):
                    yield sse(event)
            if c.final.finish_reason in ("stop", "length"):
                for event in stream.finish():
                    yield sse(event)
                stop = messages_api.stop_reason(c.final.finish_reason, c.final.stats, c.reader.calls)
                yield sse({"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                           "usage": messages_api.usage_of(c.final.stats)})
                yield sse({"type": "message_stop"})
            else:   # the engine died or failed mid-reply
                error = ApiError(503 if c.astream.lost else 500, c.final.error or "generation failed")
                yield sse(messages_api.error_body(error))
        finally:
            await self._stream_ended([c], arrivals, watcher, request, started)

    # ------------------------------------------------------------------ Ollama's /api/chat, /api/generate
    def _ollama_piece(self, api: str, answer: str, reasoning: str, calls: list[dict], items: list) -> dict:
        logprobs = chat_logprobs(items)["content"] if items else None   # Ollama's list is OpenAI's chat list
        return ollama_api.reply(self.model_id, api == "ollama_chat", answer, reasoning, calls, logprobs)

    def _ollama_whole(self, api: str, c: Choice, started: float) -> dict:
        if c.reader is None:   # raw /api/generate
            answer, reasoning, calls = c.astream.reply.text, "", []
        else:
            reader = c.reader
            answer, reasoning, calls = answer_text(reader.answer, reader.calls) or "", reader.reasoning, reader.calls
        piece = self._ollama_piece(api, answer, reasoning, calls, c.astream.reply.logprobs)
        return ollama_api.final(piece, c.final.finish_reason, c.final.stats, time.monotonic() - started)

    async def _ollama_lines(self, api, c, arrivals, watcher, request, started):
        """A streamed Ollama request's objects, one JSON per line, the last one `done` (or an error object when the
        engine fails mid-reply)."""
        try:
            async for _, events in arrivals:
                if c.reader is None:
                    answer, reasoning, calls = "".join(e.text for e in events), "", []
                else:
                    answer, reasoning, calls = self._read(c, events)
                items = [e.logprobs for e in events if e.logprobs is not None]
                if answer or reasoning or calls or items:
                    yield ollama_api.line(self._ollama_piece(api, answer, reasoning, calls, items))
            if c.final.finish_reason in ("stop", "length"):
                piece = self._ollama_piece(api, "", "", [], [])
                yield ollama_api.line(ollama_api.final(piece, c.final.finish_reason, c.final.stats,
                                                       time.monotonic() - started))
            else:   # the engine died or failed mid-reply
                lost = c.astream.lost
                yield ollama_api.line({"error": (c.final.error or "generation failed")
                                       + ("; a new engine is starting: try again shortly" if lost else "")})
        finally:
            await self._stream_ended([c], arrivals, watcher, request, started)

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: the prompt tokens a Messages request would take."""
        try:
            self.authorize(request)
            body = await self.read_json(request)
            async with self.using_model(body):
                ids = await self._prompt_ids(messages_api.chat_request({**body, "max_tokens": 1}))
            return JSONResponse({"input_tokens": len(ids)})
        except ApiError as e:
            return self._error(e, "messages")

    async def _prompt_ids(self, chat: dict) -> list[int]:
        """The ids of the prompt a chat completions body would be given."""
        gen = self._parse(chat, chat=True)
        return await self._engine_call(self.client.tokenize(
            system_prompt=gen.system, messages=gen.history + gen.turn, template_kwargs=gen.template_kwargs))

    @staticmethod
    async def _engine_call(call):
        """An engine call's answer; what the engine refuses is a 400, a dead engine a 503."""
        try:
            return await call
        except (EngineError, ValueError) as e:
            raise ApiError(400 if isinstance(e, ValueError) else 503, one_line(e)) from None

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize, as llama.cpp's server takes it ({"content": ...}, add_special default false) and as
        vLLM's does ({"prompt": ...}, add_special_tokens default true; or a chat's {"messages": ...} rendered as
        its prompt). The answer carries both servers' fields: tokens, count, max_model_len."""
        try:
            self.authorize(request)
            body = await self.read_json(request)
            async with self.using_model(body):
                if body.get("messages") is not None:
                    ids = await self._prompt_ids({**body, "max_tokens": 1, "stream": False})
                else:
                    name = "content" if "content" in body else "prompt"
                    text, special = body.get(name), "add_special" if name == "content" else "add_special_tokens"
                    if not isinstance(text, str):
                        raise _type_error(name, "a string", text)
                    add = body.get(special, name == "prompt")
                    if not isinstance(add, bool):
                        raise _type_error(special, "true or false", add)
                    ids = await self._engine_call(self.client.tokenize(text, add))
                model = self.client.model
            return JSONResponse({"tokens": ids, "count": len(ids),
                                 "max_model_len": model.max_model_len if model else None})
        except ApiError as e:
            return e.response()

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize {"tokens": [...]}: their text, special tokens included (as "content", llama.cpp's
        name, and "prompt", vLLM's)."""
        try:
            self.authorize(request)
            body = await self.read_json(request)
            ids = body.get("tokens")
            if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
                raise _type_error("tokens", "a list of token ids", ids)
            async with self.using_model(body):
                text = await self._engine_call(self.client.detokenize(ids))
            return JSONResponse({"content": text, "prompt": text})
        except ApiError as e:
            return e.response()

    # ------------------------------------------------------------------ chat completions' stream
    async def _sse(self, ident, chat, gen, choices, arrivals, watcher, request, started):
        """The stream's server-sent events, each choice's chunks carrying its index; whatever ends it (the
        replies' end, the client going away, the engine dying) ends its requests in the engine and
        settles their sessions."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: str | None, finish: str | None = None, first: bool = False,
                  logprobs: dict | None = None, calls: list[dict] | None = None, reasoning: str = "") -> bytes:
            if chat:
                delta = {} if text is None else {"content": text}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if first:
                    delta["role"] = "assistant"
                if calls:
                    delta["tool_calls"] = calls
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            return _sse({"id": ident, "object": kind, "created": created, "model": self.model_id,
                         "choices": [choice]})

        failed = None
        try:
            if chat:
                for c in choices:
                    yield chunk(c.index, "", first=True)
            async for c, events in arrivals:
                text = "".join(e.text for e in events)
                calls, reasoning = None, ""
                if chat:
                    text, reasoning, found = self._read(c, events)
                    start = len(c.reader.calls) - len(found)   # a call's index among the choice's calls
                    calls = [{"index": start + k, **call} for k, call in enumerate(found)]
                items = [e.logprobs for e in events if e.logprobs is not None]
                logprobs = None
                if items:
                    logprobs = chat_logprobs(items) if chat else completion_logprobs(items, c.text_offset)
                    c.text_offset += sum(len(t.token) for t in items)
                if text or items or calls or reasoning:
                    yield chunk(c.index, text, logprobs=logprobs, calls=calls, reasoning=reasoning)
                if c.final is not None:
                    if c.final.finish_reason not in ("stop", "length"):
                        failed = c
                        break
                    yield chunk(c.index, None, self._finish_reason(c.final, c.reader and c.reader.calls))
            if failed is None:
                if gen.include_usage:
                    yield _sse({"id": ident, "object": kind, "created": created, "model": self.model_id,
                                "choices": [], "usage": self._usage(choices)})
            else:   # the engine died or failed mid-reply: the SDKs raise on an error event
                lost = failed.astream.lost
                error = ApiError(503 if lost else 500, failed.final.error or "generation failed",
                                 code="engine_restarting" if lost else "generation_failed")
                yield _sse(error.body())
            yield b"data: [DONE]\n\n"
        finally:
            await self._stream_ended(choices, arrivals, watcher, request, started)

    async def _stream_ended(self, choices: list[Choice], arrivals, watcher, request: Request, started: float) -> None:
        """Whatever ended a stream (the replies' end, the client going away, the engine dying): end its requests
        in the engine, settle their sessions, log the request."""
        await arrivals.aclose()
        self._settle(choices, watcher)
        ended = all(c.final is not None and c.final.finish_reason in ("stop", "length") for c in choices)
        self._log(request, 200, choices if ended else None, started)

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except ApiError as e:
            return e.response()
        name = request.path_params.get("name")
        model = self.client.model

        def entry(served: Served) -> dict:   # the context is known for the loaded model only
            loaded = served == self.roster.loaded
            return {"id": served.id, "object": "model", "created": self.created, "owned_by": "nanochat",
                    "loaded": loaded, "max_model_len": model.max_model_len if model and loaded else None}

        if name is not None:
            try:
                return JSONResponse(entry(await self.find_model({"model": name})))
            except ApiError as e:
                return e.response()
        await self.roster.refresh()
        return JSONResponse({"object": "list", "data": [entry(m) for m in self.roster.models]})

    async def metrics_text(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except ApiError as e:
            return e.response()
        text = self.metrics.render(self.client.stats(), self.in_flight, self.client.restarts)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(self, request: Request) -> Response:
        if self.client.restarting or not self.client.client.alive:
            return JSONResponse({"status": "restarting", "model": self.model_id}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_id})


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n\n"


def build_app(client: AsyncEngineClient, config: ServerConfig) -> Starlette:
    api = Api(client, config)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = "no such endpoint" if exc.status_code == 404 else exc.detail
        return ApiError(exc.status_code, f"{message}: {request.method} {request.url.path}").response()

    async def root(request: Request) -> Response:   # where Ollama's clients check that a server is up
        return PlainTextResponse("nanochat is running")

    def post(path: str, endpoint, name: str) -> Route:   # one endpoint method serves several APIs, by name
        return Route(path, partial(endpoint, api=name), methods=["POST"])

    ollama = ollama_api.Endpoints(api)
    routes = [post("/v1/chat/completions", api.generate, "chat"),
              post("/v1/completions", api.generate, "completions"),
              post("/v1/responses", api.generate, "responses"),
              post("/v1/messages", api.generate, "messages"),
              Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
              Route("/v1/responses/{ident}", api.retrieve, methods=["GET", "DELETE"]),
              Route("/v1/models", api.models, methods=["GET"]),
              post("/v1/embeddings", api.embed, "embeddings"),
              Route("/tokenize", api.tokenize, methods=["POST"]),
              Route("/detokenize", api.detokenize, methods=["POST"]),
              Route("/v1/models/{name:path}", api.models, methods=["GET"]),
              Route("/health", api.health, methods=["GET"]),
              Route("/metrics", api.metrics_text, methods=["GET"]),
              Route("/", root, methods=["GET"]),
              post("/api/chat", api.generate, "ollama_chat"),
              post("/api/generate", api.generate, "ollama_generate"),
              Route("/api/tags", ollama.tags, methods=["GET"]),
              Route("/api/ps", ollama.running, methods=["GET"]),
              Route("/api/show", ollama.show, methods=["POST"]),
              Route("/api/version", ollama.version, methods=["GET"]),
              Route("/api/pull", ollama.pull, methods=["POST"]),
              post("/api/embed", api.embed, "ollama_embed"),
              post("/api/embeddings", api.embed, "ollama_embeddings"),
              *[Route(f"/api/{what}", ollama.unsupported, methods=["POST"]) for what in ("create", "copy", "push")],
              Route("/api/delete", ollama.unsupported, methods=["DELETE"])]
    guard = Middleware(Guard, allowed_origins=config.allowed_origins,
                       check_host=config.loopback and config.api_key is None)
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=[guard])
    app.state.api = api
    return app
