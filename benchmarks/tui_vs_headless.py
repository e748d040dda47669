"""The TUI's decode speed against the headless engine's, reply by reply, on one conversation.

    .venv/bin/python benchmarks/tui_vs_headless.py [--model M] [--replies 5] [--tokens 400] [--rounds 3]

Headless: the conversation runs through EngineClient (the engine process every front end uses),
with nothing drawing. TUI: the real app in a tmux terminal (160x48), driven by send-keys, the
replies' stats read back from its chat store. Each reply is greedy with ignore_eos, so both runs
generate the same number of tokens, reply by reply. Headless and TUI runs alternate, `--rounds` of
each; the table compares each reply's best (noise from other work on the machine only ever slows a
run down) and gives the median of the rounds' ratios (each TUI run against the headless run just
before it). Decode tok/s is the engine's own measure (completion tokens after the first / time
after the first), so it shows what the app's drawing costs the engine: both share the CPU. The last
column is the app process's CPU time over each reply's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ui_pid(pane_pid: int) -> int:
    """The app's process: the pane's shell may have exec'd it or may be its parent."""
    for pid in (pane_pid, *map(int, Path(f"/proc/{pane_pid}/task/{pane_pid}/children").read_text().split())):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2]
        if any(b"nanochat" in arg or arg.endswith(b".py") for arg in argv):
            return pid
    raise RuntimeError("the nanochat process was not found in the tmux pane")


def tui(model: str, prompts: list[str], tokens: int) -> tuple[list[float], list[float]]:
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
        pid = ui_pid(int(tmux("display-message", "-p", "-t", SESSION, "#{pane_pid}")))
        ui_cpu = []
        for n, prompt in enumerate(prompts, 1):
            before, start = cpu_seconds(pid), time.monotonic()
            tmux("send-keys", "-t", SESSION, "-l", prompt)
            tmux("send-keys", "-t", SESSION, "Enter")
            wait(lambda: len(replies_in_store(db)) >= n, 600, f"reply {n}")
            ui_cpu.append((cpu_seconds(pid) - before) / (time.monotonic() - start))
        return [s["decode_tok_s"] for s in replies_in_store(db)], ui_cpu
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def main() -> int:
    from nanochat.models.catalog import resolve_default_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    p.add_argument("--replies", type=int, default=5)
    p.add_argument("--tokens", type=int, default=400, help="tokens per reply (~300 words)")
    p.add_argument("--rounds", type=int, default=3, help="headless and TUI runs, alternated")
    args = p.parse_args()
    model = resolve_default_model(args.model)
    prompts = PROMPTS[:args.replies]
    heads, tuis, cpus = [], [], []
    for _ in range(args.rounds):
        heads.append(headless(model, prompts, args.tokens))
        tok_s, ui_cpu = tui(model, prompts, args.tokens)
        tuis.append(tok_s)
        cpus.append(ui_cpu)
    print(f"model {Path(model).name}, {os.cpu_count()} CPUs, {args.tokens} tokens per reply, "
          f"{args.rounds} alternated rounds")
    print("| reply | headless tok/s (best) | TUI tok/s (best) | best / best | TUI / headless, median of rounds "
          "| UI process, cores (mean) |")
    print("|---|---|---|---|---|---|")
    for i in range(len(prompts)):
        h, t = max(run[i] for run in heads), max(run[i] for run in tuis)
        paired = statistics.median(tui_run[i] / head_run[i] for head_run, tui_run in zip(heads, tuis))
        cores = sum(run[i] for run in cpus) / len(cpus)
        print(f"| {i + 1} | {h:.1f} | {t:.1f} | {t / h:.1%} | {paired:.1%} | {cores:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
