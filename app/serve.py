"""`nanochat serve`: the engine behind an OpenAI-compatible HTTP API (app/openai_api.py; Anthropic's and Ollama's
APIs beside it), for the tools that speak them (editors, agents, notebooks, the `openai` SDK, curl).

    nanochat serve                                  the built-in model on http://127.0.0.1:8000/v1
    nanochat serve --model M.gguf --port 9000 --api-key SECRET

The stack is uvicorn + Starlette, from PyPI: an ASGI server and a small toolkit whose streaming response
and request objects are all the API needs. FastAPI would add pydantic models and an OpenAPI schema that
would duplicate the request checks the command line already has (app/options.py's rules, then
SamplingParams'); aiohttp would work as well but brings its own server instead of the standard ASGI
interface that uvicorn, hypercorn or gunicorn can all run.

The socket is bound before the model loads, so a port in use is a one-line error at once. Loopback only
unless --host says otherwise, with a warning when that is done without --api-key. Log lines go to
stderr through the terminal sanitizer: they quote model names and paths that clients choose.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

from nanochat.app.errors import EXIT_OK, UsageError, run_guarded
from nanochat.app.http_guard import is_loopback_name
from nanochat.app.options import (Rule, add_engine_options, add_option, arg_type, engine_config, positive_int,
                                  resolve_model)
from nanochat.app.terminal_text import for_stream

PROG = "nanochat serve"
port_int = arg_type(Rule(int, lambda v: 0 <= v <= 65535, "from 0 to 65535 (0: any free port)"))


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from nanochat.app.openai_api import MAX_QUEUE

    p = subparsers.add_parser("serve", help="serve the model over HTTP: OpenAI's, Anthropic's and Ollama's APIs",
                              description="Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                                          "/v1/responses, /v1/completions, /v1/models, /tokenize, /detokenize, "
                                          "/health, /metrics), Anthropic's Messages API (/v1/messages) and "
                                          "Ollama's (/api/chat, /api/generate, /api/tags, /api/show; --port 11434 "
                                          "where Ollama's clients look). "
                                          "Concurrent requests share the engine's batching; a conversation's "
                                          "earlier turns come from the KV cache.")
    add_engine_options(p, suppress=True)
    add_option(p, True, "--quiet", "-q", action="store_true", help="no loading progress or per-request log lines")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=port_int, default=8000, metavar="N", help="port (default 8000)")
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every request but /health")
    g.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN", default=(),
                   help="web page origins (https://app.example) whose requests are served, with CORS headers, besides "
                        "pages from this machine; \"*\" for any. Other pages' requests get 403")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME", default=None,
                   help="the model's name in the API (the first is listed; requests may use any of them, or the "
                        "model's path); default: the file or folder name")
    g.add_argument("--max-queue", type=positive_int, default=MAX_QUEUE, metavar="N",
                   help=f"most sequences in flight, running or waiting (a request with n choices counts n); past "
                        f"it a request gets 429 (default {MAX_QUEUE})")
    p.set_defaults(func=run_serve_cli)
    return p


def run_serve_cli(args) -> int:
    return run_guarded(lambda: _serve(args), PROG)   # one_line's default advice on running out of memory


def say(line: str) -> None:
    print(for_stream(f"{PROG}: {line}", sys.stderr), file=sys.stderr, flush=True)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (UsageError when the address is not this machine's or is taken)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class SanitizingHandler(logging.StreamHandler):
    """uvicorn's own log lines (a malformed request, a failure) through the terminal sanitizer."""

    def format(self, record: logging.LogRecord) -> str:
        return for_stream(f"{PROG}: {super().format(record)}", self.stream)


def run_server(app, sock: socket.socket) -> None:
    """Serve `app` on `sock` until Ctrl-C or SIGTERM. uvicorn's handlers stop it gracefully (requests in
    flight get a few seconds); it then raises the signal again for the handlers it found, which are
    no-ops here: the engine still has to be shut down, and a stop by signal is how a server ends."""
    import signal

    import uvicorn

    logger = logging.getLogger("uvicorn")
    logger.handlers[:] = [SanitizingHandler(sys.stderr)]
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=3)
    stops = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, lambda *_: None) for sig in stops}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    say("stopped")


def catalog(settings) -> list:
    """The models the server may load besides the one it started with: those the app's model picker lists (the
    built-in one, recent ones, the models folder, ./models, the hub cache)."""
    from nanochat.app.paths import get_paths
    from nanochat.models.formats.catalog import discover_models

    return discover_models([get_paths().models_dir, Path.cwd() / "models"], recent=list(settings.recent_models))


def _serve(args) -> int:
    from nanochat.app.oneshot import load_client
    from nanochat.app.openai_api import ServerConfig, build_app
    from nanochat.engine.serve.client import AsyncEngineClient

    settings = args.settings
    quiet = bool(getattr(args, "quiet", False))
    config = engine_config(args, settings)
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key must not be empty")
    sock = bind(args.host, args.port)
    model = resolve_model(args, settings)
    given = getattr(args, "model", None) or settings.default_model
    client, _ = load_client(model, config, quiet)
    info = client.model
    file_name = Path(model.rstrip("/")).name or model   # the API's model id: the file or folder name
    names = [n.strip() for n in args.served_model_name or () if n.strip()]
    if args.served_model_name is not None and not names:
        raise UsageError("--served-model-name needs a name")
    model_id = names[0] if names else given or file_name
    url = url_of(sock, args.host)
    say(f"serving {model_id} ({info.arch}, {info.device}, {info.dtype}, context {info.max_model_len}) "
        f"at {url}/v1 (Ollama's API at {url}/api)")
    if not is_loopback_name(args.host) and args.api_key is None:
        say(f"warning: listening on {args.host} without --api-key: anyone who can reach this machine can use the model")
    server_config = ServerConfig(model_id=model_id, aliases=tuple(sorted({model, file_name, *names} - {model_id})),
                                 model_path=model, chat_template=config.get("chat_template"),
                                 discover=lambda: catalog(settings), engine_config=config, api_key=args.api_key,
                                 allowed_origins=tuple(args.allowed_origins), loopback=is_loopback_name(args.host),
                                 max_queue=args.max_queue, log=None if quiet else say)
    aclient = AsyncEngineClient(client)
    try:
        run_server(build_app(aclient, server_config), sock)
    finally:
        client.shutdown()
        sock.close()
    return EXIT_OK
