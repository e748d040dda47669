"""Load benchmark of `nanochat serve` (and, for comparison, llama.cpp's OpenAI server): N concurrent
clients, each a multi-turn conversation that re-sends its whole transcript every turn, streaming.

    python benchmarks/bench_serve.py                          32 clients x 6 turns, the built-in model
    python benchmarks/bench_serve.py --clients 8 --turns 4 --max-tokens 24
    python benchmarks/bench_serve.py --peer llama-cpp         the same load on llama_cpp.server, same file
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000   a server already running
    python benchmarks/bench_serve.py --api responses          the same load through /v1/responses (or messages:
                                                              Anthropic's /v1/messages)

Reports p50/p99 time to first token and inter-token latency (per request: the time from its first to
its last token over the tokens between), aggregate generated tok/s over the wall time, errors, and per
turn the mean prompt and cached tokens. From turn 2 on a conversation's cached tokens should cover its
previous transcript less at most one KV block (the check it prints).

The clients speak raw HTTP/1.1 on asyncio (no SDK) so that on a small machine the load generator costs
as little CPU as it can beside the server it measures. Bounded: every request has a timeout, and the
whole run stops at --deadline seconds. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

TOPICS = ["the sea", "volcanoes", "bread", "chess", "owls", "rivers", "glass", "trains", "maps", "bees",
          "clocks", "salt", "comets", "moss", "kites", "copper"]


@dataclass
class Turn:
    client: int
    turn: int
    ttft: float | None = None
    itl: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    previous_transcript: int = 0
    error: str | None = None
    started: float = 0.0
    ended: float = 0.0


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    wall: float = 0.0


async def post_stream(host: str, port: int, path: str, body: dict, key: str | None, timeout: float):
    """POST and yield (time, parsed event) for each event of a streamed reply: server-sent events' data, or the JSON
    objects of a newline-delimited stream (Ollama's /api paths)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n"
                + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n")
        writer.write(head.encode() + payload)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        status = int(status_line.split()[1])
        headers = {}
        while (line := await asyncio.wait_for(reader.readline(), timeout)) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read(300)).decode(errors='replace')}")
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        buffer = b""
        while True:
            if chunked:
                size = int((await asyncio.wait_for(reader.readline(), timeout)).strip() or b"0", 16)
                if size == 0:
                    return
                data = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
                buffer += data[:-2]
            else:
                data = await asyncio.wait_for(reader.read(65536), timeout)
                if not data:
                    return
                buffer += data
            now = time.perf_counter()
            buffer = buffer.replace(b"\r\n", b"\n")   # sse-starlette (llama_cpp.server) ends lines with CRLF
            if path.startswith("/api/"):
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield now, json.loads(line)
                continue
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        text = line[6:].strip()
                        if text == b"[DONE]":
                            return
                        yield now, json.loads(text)
    finally:
        writer.close()


async def converse(n: int, args, host: str, port: int, run: Run, deadline: float, model: str) -> None:
    rng = random.Random(n)
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer in a few sentences."}]
    previous = 0
    for t in range(args.turns):
        if time.perf_counter() > deadline:
            return
        topic = rng.choice(TOPICS)
        messages.append({"role": "user", "content": f"Conversation {n}, question {t + 1}: tell me something "
                                                     f"surprising about {topic}, and why it matters."})
        path, body = request(args.api, model, messages, args.max_tokens, seed=n * 100 + t)
        if args.ignore_eos:
            body["ignore_eos"] = True
        turn = Turn(n, t + 1, previous_transcript=previous, started=time.perf_counter())
        text, times = [], []

        async def read() -> str | None:
            finish = None
            async for at, event in post_stream(host, port, path, body, args.api_key, args.request_timeout):
                if "error" in event:
                    error = event["error"]
                    raise RuntimeError(error.get("message", "error event") if isinstance(error, dict) else error)
                piece, ended = read_event(args.api, event, turn)
                finish = ended or finish
                if piece:
                    text.append(piece)
                    times.append(at)
            return finish

        try:   # the run's deadline bounds the requests in flight too
            if await asyncio.wait_for(read(), max(1.0, deadline - time.perf_counter())) is None:
                raise RuntimeError("the stream ended without a finish_reason")
        except Exception as e:   # counted, and the conversation stops: its transcript is unknown
            turn.error = " ".join(str(e).split())[:200] or type(e).__name__
            if isinstance(e, asyncio.TimeoutError):
                turn.error = "cut off at the run's deadline"
            run.turns.append(turn)
            return
        turn.ended = time.perf_counter()
        if not turn.tokens:   # a server that sends no usage in streams (llama_cpp.server): a token a chunk
            turn.tokens, turn.prompt_tokens, turn.cached_tokens = len(times), -1, -1
        if times:
            turn.ttft = times[0] - turn.started
            if turn.tokens > 1 and times[-1] > times[0]:
                turn.itl = (times[-1] - times[0]) / (turn.tokens - 1)
        run.turns.append(turn)
        messages.append({"role": "assistant", "content": "".join(text)})
        previous = turn.prompt_tokens + turn.tokens


def request(api: str, model: str, messages: list[dict], max_tokens: int, seed: int) -> tuple[str, dict]:
    """The streamed request of a turn in `api`'s dialect: its path and body."""
    system, rest = messages[0]["content"], messages[1:]
    common = {"model": model, "stream": True, "temperature": 0.7, "seed": seed}
    if api == "responses":
        return "/v1/responses", {**common, "instructions": system, "input": rest, "max_output_tokens": max_tokens}
    if api == "messages":
        return "/v1/messages", {**common, "system": system, "messages": rest, "max_tokens": max_tokens}
    if api == "ollama":
        return "/api/chat", {"model": model, "messages": messages,
                             "options": {"temperature": 0.7, "seed": seed, "num_predict": max_tokens}}
    return "/v1/chat/completions", {**common, "messages": messages, "max_tokens": max_tokens,
                                    "stream_options": {"include_usage": True}}


def read_event(api: str, event: dict, turn: Turn) -> tuple[str | None, str | None]:
    """A streamed event's new answer text and finish (None: none yet); the usage, when it comes, into `turn`."""
    if api == "responses":
        kind = event.get("type", "")
        if kind == "response.output_text.delta":
            return event["delta"], None
        if kind in ("response.completed", "response.incomplete"):
            usage = event["response"]["usage"]
            turn.tokens, turn.prompt_tokens = usage["output_tokens"], usage["input_tokens"]
            turn.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
            return None, event["response"]["status"]
        return None, None
    if api == "ollama":   # counts the whole prompt, not the part the cache served (unknown: -1)
        if event.get("done"):
            turn.tokens, turn.prompt_tokens, turn.cached_tokens = event["eval_count"], event["prompt_eval_count"], -1
            return None, event["done_reason"]
        return event["message"]["content"] or None, None
    if api == "messages":
        if event.get("type") == "content_block_delta" and event["delta"].get("type") == "text_delta":
            return event["delta"]["text"], None
        if event.get("type") == "message_delta":
            usage = event["usage"]
            turn.tokens, turn.cached_tokens = usage["output_tokens"], usage.get("cache_read_input_tokens") or 0
            turn.prompt_tokens = usage["input_tokens"] + turn.cached_tokens
            return None, event["delta"]["stop_reason"]
        return None, None
    finish, piece = None, None
    for choice in event.get("choices", []):
        finish = choice.get("finish_reason") or finish
        piece = (choice.get("delta") or {}).get("content") or piece
    usage = event.get("usage")
    if usage:
        turn.tokens, turn.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
        turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return piece, finish


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def report(name: str, run: Run, args) -> dict:
    done = [t for t in run.turns if t.error is None]
    errors = [t for t in run.turns if t.error is not None]
    ttfts = [t.ttft for t in done if t.ttft is not None]
    itls = [t.itl for t in done if t.itl is not None]
    tokens = sum(t.tokens for t in done)
    summary = {"server": name, "api": args.api, "clients": args.clients, "turns": args.turns, "max_tokens": args.max_tokens,
               "requests": len(run.turns), "errors": len(errors), "wall_s": round(run.wall, 2),
               "tok_s": round(tokens / run.wall, 1) if run.wall else None,
               "ttft_p50_ms": _ms(pct(ttfts, 50)), "ttft_p99_ms": _ms(pct(ttfts, 99)),
               "itl_p50_ms": _ms(pct(itls, 50)), "itl_p99_ms": _ms(pct(itls, 99)), "per_turn": []}
    print(f"\n== {name} ({args.api} API): {args.clients} clients x {args.turns} turns, up to {args.max_tokens} tokens a "
          "reply")
    print(f"requests {len(run.turns)} · errors {len(errors)} · wall {run.wall:.1f} s · {tokens} tokens · "
          f"{summary['tok_s']} tok/s aggregate")
    print(f"TTFT p50 {ms(pct(ttfts, 50))} p99 {ms(pct(ttfts, 99))} · "
          f"inter-token p50 {ms(pct(itls, 50))} p99 {ms(pct(itls, 99))}")
    print("turn  requests  prompt  cached  cached>=previous-16")
    for n in range(1, args.turns + 1):
        these = [t for t in done if t.turn == n]
        if not these:
            continue
        if these[0].prompt_tokens < 0:
            print(f"{n:>4}  {len(these):>8}  (the server reports no usage in streams)")
            continue
        prompt = statistics.mean(t.prompt_tokens for t in these)
        cached = statistics.mean(t.cached_tokens for t in these)
        ok = sum(t.cached_tokens >= t.previous_transcript - 16 for t in these) if n > 1 else None
        print(f"{n:>4}  {len(these):>8}  {prompt:>6.0f}  {cached:>6.0f}  {'' if ok is None else f'{ok}/{len(these)}'}")
        summary["per_turn"].append({"turn": n, "prompt": round(prompt, 1), "cached": round(cached, 1), "ok": ok})
    for t in errors[:5]:
        print(f"error (client {t.client}, turn {t.turn}): {t.error}")
    return summary


def _ms(x):
    return None if x is None else round(x * 1000, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, path: str, within: float = 600) -> None:
    import http.client

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited (code {proc.returncode})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become ready")


def start_server(args, port: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, NANO_VLLM_MAX_NUM_SEQS=str(args.max_num_seqs))
    if args.peer == "llama-cpp":
        cmd = [args.peer_python, "-m", "llama_cpp.server", "--model", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(args.ctx), "--n_threads", str(args.threads),
               "--n_threads_batch", str(args.threads),
               "--interrupt_requests", "False"]   # else each new request cuts the one streaming off
        name, ready = "llama_cpp.server", "/v1/models"
    else:
        cmd = [sys.executable, "-m", "nanochat.app.cli", "serve", "--model", args.model, "--port", str(port),
               "--max-queue", str(max(256, args.clients)), "--max-model-len", str(args.ctx), "--quiet"]
        name, ready = "nanochat serve", "/health"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(port, proc, ready)
    return proc, name


async def load(args, host: str, port: int, model: str) -> Run:
    run = Run()
    start = time.perf_counter()
    deadline = start + args.deadline
    await asyncio.gather(*(converse(n, args, host, port, run, deadline, model) for n in range(args.clients)))
    run.wall = time.perf_counter() - start
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per reply (48)")
    p.add_argument("--ignore-eos", action="store_true", help="every reply max-tokens long (nanochat's extra field)")
    p.add_argument("--model", default=None, help="a GGUF file (default: the built-in model)")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--peer", choices=["llama-cpp"], default=None, help="start llama_cpp.server instead")
    p.add_argument("--api", choices=["chat", "responses", "messages", "ollama"], default="chat",
                   help="the API the clients speak: chat completions (default), OpenAI's Responses, Anthropic's "
                        "Messages, Ollama's /api/chat")
    p.add_argument("--peer-python", default="/work/peers-venv/bin/python")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--ctx", type=int, default=4096, help="context length of the server started")
    p.add_argument("--max-num-seqs", type=int, default=32, help="the engine's batch (NANO_VLLM_MAX_NUM_SEQS)")
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--deadline", type=float, default=900, help="stop starting turns after this many seconds")
    p.add_argument("--json", default=None, help="also write the summary to this file")
    args = p.parse_args()
    if args.model is None:
        from nanochat.models.formats.catalog import resolve_default_model
        args.model = resolve_default_model(None)
    proc = None
    try:
        if args.url:
            url = urlparse(args.url)
            host, port, name = url.hostname, url.port or 80, args.url
        else:
            host, port = "127.0.0.1", free_port()
            proc, name = start_server(args, port)
        run = asyncio.run(load(args, host, port, _served_model(host, port, args)))
        summary = report(name, run, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
        return 0 if summary["errors"] == 0 else 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _served_model(host: str, port: int, args) -> str:
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    return json.loads(conn.getresponse().read())["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
