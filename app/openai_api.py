"""The OpenAI-compatible HTTP API of `nanochat serve`: an ASGI app over one AsyncEngineClient.

    POST /v1/chat/completions   chat, streamed (server-sent events ending in `data: [DONE]`) or not
    POST /v1/completions        raw text (no chat template)
    GET  /v1/models             the one model served
    GET  /health                200 when a request would be served now, 503 while the engine restarts

Every request shares the one engine through the one client, so concurrent requests batch together.

Clients re-send the whole transcript every turn. Each conversation is a chat session of the client
(engine/serve/session.py), kept here between requests under its transcript: the next request whose
messages are that transcript plus a new user message continues it, so the engine prefills only the new
message (its canonical ids, generated ids included, are the cached KV's). A transcript no session holds
(the first turn, a server restart, an edited message) opens one seeded with it, rendered turn by turn as
a live chat renders it; one that cuts a kept conversation short (a regenerated reply) branches it at
that turn, sharing the cached prefix. Sessions are kept in LRU order, at most `max_sessions`.

Request fields are checked with the rules and words the command line uses (app/options.py), then by
SamplingParams itself. Errors are OpenAI's error object: 400 a bad request or a prompt over the context,
401 a bad key, 404 an unknown model or path, 413 a body over the limit, 429 too many requests in
flight, 503 while the engine restarts after a crash.
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
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanochat.app.options import SAMPLING_RULES, accepts
from nanochat.engine.sampling_params import SamplingParams
from nanochat.engine.serve.client import AsyncEngineClient, AsyncRequestStream
from nanochat.engine.serve.protocol import EngineError, EngineRestarting

MAX_BODY_BYTES = 4 * 2 ** 20   # a request body past this is refused (413) before it is parsed
MAX_MESSAGES = 1024            # messages in one chat request
MAX_SESSIONS = 256             # conversations kept between requests
MAX_QUEUE = 256                # requests in flight, running or waiting for the engine; past it 429
SYSTEM_ROLES = ("system", "developer")   # OpenAI's newer name for the system message


class ApiError(Exception):
    """A request answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 404 and self.code == "model_not_found":
            return "invalid_request_error"
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass
class ServerConfig:
    model_id: str                      # what /v1/models lists and requests name
    aliases: tuple[str, ...] = ()      # other names a request may use for it (the path it was loaded from)
    api_key: str | None = None
    max_queue: int = MAX_QUEUE
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
    history: list[dict] = field(default_factory=list)   # finished turns: user, assistant, ...
    user: str | None = None                             # the new user message (chat)
    prompt: str | list[int] | None = None               # the raw prompt (completions)


def _type_error(name: str, wanted: str, value) -> ApiError:
    return ApiError(400, f"{name} must be {wanted}, got {json.dumps(value)[:80]}", param=name)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _type_error(name, "true or false", value)
    return value


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
    if _flag(body, "ignore_eos"):   # vLLM's extra, for fixed-length replies (benchmarks)
        stated["ignore_eos"] = True
    sampling = {name: value for name, value in defaults.items() if name in SAMPLING_RULES and name != "max_tokens"}
    sampling.update(stated)
    sampling["max_tokens"] = min(stated.get("max_tokens", context), context)
    try:
        return SamplingParams(**sampling)
    except ValueError as e:   # the engine's own checks, in its words
        raise ApiError(400, str(e)) from None


def _unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "n must be 1: this server returns one choice per request", param="n")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ApiError(400, "logprobs are not supported by this server", param="logprobs")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tools are not supported by this server", param="tools")
    if body.get("echo"):
        raise ApiError(400, "echo is not supported by this server", param="echo")


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    return _flag(options, "include_usage")


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


def parse_messages(messages, limit: int) -> tuple[str | None, list[dict], str]:
    """(system prompt, finished turns, new user message). A chat session takes an optional system
    message, then user and assistant messages in turn, ending with the user's."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", param="messages")
    if len(messages) > limit:
        raise ApiError(400, f"too many messages: {len(messages)}, at most {limit}", param="messages")
    system = None
    turns = []
    for at, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _type_error(f"messages[{at}]", "an object with role and content", message)
        role = message.get("role")
        if role not in (*SYSTEM_ROLES, "user", "assistant"):
            raise ApiError(400, f"messages[{at}].role must be system, user or assistant, got {json.dumps(role)[:40]}",
                           param=f"messages[{at}].role")
        text = _content(message, at)
        if role in SYSTEM_ROLES:
            if at != 0:
                raise ApiError(400, f"messages[{at}]: a system message may only come first", param="messages")
            system = text
            continue
        wanted = "user" if len(turns) % 2 == 0 else "assistant"
        if role != wanted:
            raise ApiError(400, f"messages[{at}] must be a {wanted} message: user and assistant messages "
                                "take turns, starting and ending with the user's", param="messages")
        turns.append({"role": role, "content": text})
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", param="messages")
    return system, turns[:-1], turns[-1]["content"]


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
class Conversations:
    """The chat sessions kept between requests, keyed by transcript (see the module docstring)."""

    def __init__(self, client: AsyncEngineClient, capacity: int):
        self.client, self.capacity = client, capacity
        self._idle: OrderedDict[str, object] = OrderedDict()

    @staticmethod
    def _key(system: str | None, history: list[dict]) -> str:
        text = json.dumps([system or None, [[m["role"], m["content"]] for m in history]], ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def take(self, system: str | None, history: list[dict]):
        """A session holding exactly `history`, not in use by another request."""
        session = self._idle.pop(self._key(system, history), None)
        if session is not None:
            return session
        turns = len(history) // 2
        for other in reversed(self._idle.values()):
            if other.system_prompt == (system or None) and other.turns > turns \
                    and other.history[:len(history)] == history:
                return self.client.branch_session(other, turns)
        return self.client.open_session(system, history)

    def keep(self, session) -> None:
        """A session whose turn ended well, kept for the transcript's next turn."""
        key = self._key(session.system_prompt, session.history)
        old = self._idle.pop(key, None)
        if old is not None:   # two clients with the same transcript: keep one
            self.client.close_session(old)
        self._idle[key] = session
        while len(self._idle) > self.capacity:
            self.client.close_session(self._idle.popitem(last=False)[1])

    def drop(self, session) -> None:
        """Forget a session (its turn failed, or its client went away): its KV is released at once."""
        self.client.close_session(session)

    def close_all(self) -> None:
        while self._idle:
            self.client.close_session(self._idle.popitem()[1])


# ---------------------------------------------------------------------------------- the app
class Api:
    def __init__(self, client: AsyncEngineClient, config: ServerConfig):
        self.client, self.config = client, config
        self.conversations = Conversations(client, config.max_sessions)
        self.in_flight = 0
        self.created = int(time.time())
        self._key = config.api_key.encode("utf-8") if config.api_key else None

    # ------------------------------------------------------------------ shared
    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken says nothing about how much of the key matched
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8"), self._key):
            raise ApiError(401, "invalid API key: send it as `Authorization: Bearer KEY`", code="invalid_api_key")

    async def _read_json(self, request: Request) -> dict:
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
            raise ApiError(400, f"the request body is not valid JSON ({' '.join(str(e).split())[:120]})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return data

    def _check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is None:
            return
        if not isinstance(name, str):
            raise _type_error("model", "a string", name)
        if name != self.config.model_id and name not in self.config.aliases:
            raise ApiError(404, f"the model {json.dumps(name)[:120]} does not exist; this server serves "
                                f"{json.dumps(self.config.model_id)}", param="model", code="model_not_found")

    def _admit(self) -> None:
        if self.in_flight >= self.config.max_queue:
            raise ApiError(429, f"the server is busy: {self.in_flight} requests in flight, the most it takes "
                                "(--max-queue); try again shortly", code="queue_full")

    def _log(self, request: Request, status: int, stats=None, started: float | None = None) -> None:
        if self.config.log is None:
            return
        peer = request.client.host if request.client else "-"
        line = f"{peer} {request.method} {request.url.path} {status}"
        if stats is not None:
            line += f" · {stats.prompt_tokens} prompt ({stats.cached_tokens} cached) · {stats.completion_tokens} out"
            if stats.ttft is not None:
                line += f" · TTFT {stats.ttft:.2f}s"
        if started is not None:
            line += f" · {time.monotonic() - started:.2f}s"
        self.config.log(line)

    @staticmethod
    async def _watch_disconnect(request: Request, astream: AsyncRequestStream) -> None:
        """Cancel the request when its client goes away, so its blocks are freed at once."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                astream.cancel()
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
    def _usage(stats) -> dict:
        return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
                "total_tokens": stats.prompt_tokens + stats.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}

    @staticmethod
    def _finish_reason(final) -> str:
        return "length" if final.finish_reason == "length" else "stop"

    # ------------------------------------------------------------------ endpoints
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        started = time.monotonic()
        try:
            self._authorize(request)
            body = await self._read_json(request)
            self._check_model(body)
            _unsupported(body)
            gen = self._parse(body, chat)
            self._admit()
        except ApiError as e:
            self._log(request, e.status)
            return e.response()
        self.in_flight += 1
        handed_over = False
        session = None
        try:
            try:
                if chat:
                    session = self.conversations.take(gen.system, gen.history)
                    astream = await self.client.submit_turn(session, gen.user, gen.sampling)
                else:
                    astream = await self.client.submit(gen.prompt, gen.sampling)
            except EngineRestarting as e:
                raise ApiError(503, str(e), code="engine_restarting") from None
            except (EngineError, ValueError) as e:
                raise ApiError(400 if isinstance(e, ValueError) else 503, " ".join(str(e).split())) from None
            watcher = asyncio.create_task(self._watch_disconnect(request, astream))
            try:
                first = await astream.next_events()
            except BaseException:
                watcher.cancel()
                astream.cancel()
                raise
            final = first[-1] if first[-1].finished else None
            if final is not None and final.finish_reason in ("error", "abort") and not astream.reply.token_ids:
                watcher.cancel()
                raise self._refusal(final, astream)
            ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if gen.stream:
                events = self._sse(ident, chat, gen, astream, first, watcher, session, request, started)
                handed_over = True
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            try:
                while final is None:
                    final = (await astream.next_events())[-1]
                    final = final if final.finished else None
            finally:
                watcher.cancel()
            if final.finish_reason in ("error", "abort"):
                raise self._refusal(final, astream) if not astream.reply.token_ids else \
                    ApiError(500 if not astream.lost else 503, final.error or "generation failed")
            self._end(session, final)
            session = None
            self._log(request, 200, final.stats, started)
            return JSONResponse(self._whole(ident, chat, astream.reply, final))
        except ApiError as e:
            self._log(request, e.status, started=started)
            return e.response()
        finally:
            if not handed_over:
                self.in_flight -= 1
                if session is not None:
                    self.conversations.drop(session)

    def _end(self, session, final) -> None:
        """Keep the conversation for its next turn when this one ended well; else release it."""
        if session is None:
            return
        if final is not None and final.finish_reason in ("stop", "length"):
            self.conversations.keep(session)
        else:
            self.conversations.drop(session)

    def _parse(self, body: dict, chat: bool) -> Generation:
        model = self.client.model
        sampling = sampling_from(body, model.sampling_defaults if model else {},
                                 model.max_model_len if model else 1)
        stream = _flag(body, "stream")
        gen = Generation(sampling, stream, _stream_options(body, stream))
        if chat:
            gen.system, gen.history, gen.user = parse_messages(body.get("messages"), self.config.max_messages)
        else:
            gen.prompt = parse_prompt(body.get("prompt"))
        return gen

    def _whole(self, ident: str, chat: bool, reply, final) -> dict:
        choice = {"index": 0, "finish_reason": self._finish_reason(final), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": reply.text}
        else:
            choice["text"] = reply.text
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.config.model_id, "choices": [choice], "usage": self._usage(final.stats)}

    async def _sse(self, ident, chat, gen, astream, events, watcher, session, request, started):
        """The stream's server-sent events; whatever ends it (the reply's end, the client going away,
        the engine dying) ends the request in the engine and settles its session."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, first: bool = False) -> bytes:
            if chat:
                delta = {} if text is None else {"content": text}
                if first:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return _sse({"id": ident, "object": kind, "created": created, "model": self.config.model_id,
                         "choices": [choice]})

        final = None
        try:
            if chat:
                yield chunk("", first=True)
            while True:
                text = "".join(e.text for e in events)
                if text:
                    yield chunk(text)
                if events[-1].finished:
                    final = events[-1]
                    break
                events = await astream.next_events()
            if final.finish_reason in ("stop", "length"):
                yield chunk(None, self._finish_reason(final))
                if gen.include_usage:
                    yield _sse({"id": ident, "object": kind, "created": created, "model": self.config.model_id,
                                "choices": [], "usage": self._usage(final.stats)})
            else:   # the engine died or failed mid-reply: the SDKs raise on an error event
                error = ApiError(503 if astream.lost else 500, final.error or "generation failed",
                                 code="engine_restarting" if astream.lost else "generation_failed")
                yield _sse(error.body())
            yield b"data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if final is None:   # the client went away: stop generating for it
                astream.cancel()
            self._end(session, final)
            self.in_flight -= 1
            self._log(request, 200, final.stats if final is not None else None, started)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as e:
            return e.response()
        model = self.client.model
        entry = {"id": self.config.model_id, "object": "model", "created": self.created, "owned_by": "nanochat",
                 "max_model_len": model.max_model_len if model else None}
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(self, request: Request) -> Response:
        if self.client.restarting or not self.client.client.alive:
            return JSONResponse({"status": "restarting", "model": self.config.model_id}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.config.model_id})


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n\n"


def build_app(client: AsyncEngineClient, config: ServerConfig) -> Starlette:
    api = Api(client, config)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = "no such endpoint" if exc.status_code == 404 else exc.detail
        return ApiError(exc.status_code, f"{message}: {request.method} {request.url.path}").response()

    routes = [Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/health", api.health, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.api = api
    return app
