"""The TUI's decode speed against the headless engine's, reply by reply, on one conversation.

    .venv/bin/python benchmarks/tui_vs_headless.py [--model M] [--replies 5] [--tokens 400]

Headless: the conversation runs through EngineClient (the engine process every front end uses),
with nothing drawing. TUI: the real app in a tmux terminal (160x48), driven by send-keys, the
replies' stats read back from its chat store. Each reply is greedy with ignore_eos, so both runs
generate the same number of tokens, reply by reply. The headless run goes before and after the TUI
run (this machine is noisy) and the table compares the TUI with their mean. Decode tok/s is the
engine's own measure (completion tokens after the first / time after the first), so it shows what
the app's drawing costs the engine: both share the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "Write about 300 words on the history of the printing press.",
    "Now write about 300 words on how paper is made.",
    "Write about 300 words on the invention of the telegraph.",
    "Write about 300 words on why bridges need expansion joints.",
    "Write about 300 words on how a lighthouse works.",
]
SESSION = "nanochat-tui-bench"


def headless(model: str, prompts: list[str], tokens: int) -> list[float]:
    from nanochat.engine import SamplingParams
    from nanochat.engine.serve.client import EngineClient

    client = EngineClient()
    try:
        client.load_model(model)
        session = client.open_session()
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return [client.submit_turn(session, p, sp).result(600).stats.decode_tok_s for p in prompts]
    finally:
        client.shutdown()


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def replies_in_store(db: Path) -> list[dict]:
    if not db.exists():
        return []
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT stats FROM messages WHERE role = 'assistant' ORDER BY id").fetchall()
    return [json.loads(s) for (s,) in rows if s]


def wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def tui(model: str, prompts: list[str], tokens: int) -> list[float]:
    from nanochat.app.paths import get_paths

    home = Path(tempfile.mkdtemp(prefix="nanochat-tui-bench-"))
    (home / "cache").symlink_to(get_paths().ensure().cache_dir)   # the built kernels and packed weights
    nanochat = shutil.which("nanochat") or str(Path(sys.executable).with_name("nanochat"))
    command = (f"NANOCHAT_HOME={home} {nanochat} --model {model} --temperature 0 --ignore-eos "
               f"--max-tokens {tokens}")
    tmux("new-session", "-d", "-s", SESSION, "-x", "160", "-y", "48", command)
    try:
        wait(lambda: "Loaded" in tmux("capture-pane", "-p", "-t", SESSION), 300, "the model to load")
        db = home / "data" / "chats.sqlite3"
        for n, prompt in enumerate(prompts, 1):
            tmux("send-keys", "-t", SESSION, "-l", prompt)
            tmux("send-keys", "-t", SESSION, "Enter")
            wait(lambda: len(replies_in_store(db)) >= n, 600, f"reply {n}")
        return [s["decode_tok_s"] for s in replies_in_store(db)]
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def main() -> int:
    from nanochat.models.catalog import resolve_default_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    p.add_argument("--replies", type=int, default=5)
    p.add_argument("--tokens", type=int, default=400, help="tokens per reply (~300 words)")
    args = p.parse_args()
    model = resolve_default_model(args.model)
    prompts = PROMPTS[:args.replies]
    before = headless(model, prompts, args.tokens)
    in_tui = tui(model, prompts, args.tokens)
    after = headless(model, prompts, args.tokens)
    print(f"model {Path(model).name}, {os.cpu_count()} CPUs, {args.tokens} tokens per reply")
    print("| reply | headless tok/s (before, after) | TUI tok/s | TUI / headless |")
    print("|---|---|---|---|")
    for i, t in enumerate(in_tui):
        h = (before[i] + after[i]) / 2
        print(f"| {i + 1} | {h:.1f} ({before[i]:.1f}, {after[i]:.1f}) | {t:.1f} | {t / h:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
