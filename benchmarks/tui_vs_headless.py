"""The TUI's decode speed against the headless engine's, reply by reply, on one conversation.

    .venv/bin/python benchmarks/tui_vs_headless.py [--model M] [--replies 5] [--tokens 400] [--rounds 3] [--control]

Headless: the conversation runs through EngineClient (the engine process every front end uses),
with nothing drawing. TUI: the real app in a tmux terminal (160x48), driven by send-keys, the
replies' stats read back from its chat store. Each reply is greedy with ignore_eos, so both
conversations generate the same number of tokens, reply by reply.

The two conversations advance in lockstep, reply k of one right after reply k of the other (which
goes first alternates), and each engine is idle while the other generates. (Run one after the other,
the second conversation was often the slower one in its later replies, whichever it was.) Even in
lockstep, two engines on these shared machines can differ a lot at long contexts (benchmarks/README.md):
`--control` puts a second headless conversation in the app's place, to show that noise floor. So
take many rounds: the table gives each reply's best over `--rounds` (noise only ever slows a run
down) and the median of the pairs' ratios. Decode tok/s is the engine's own measure (completion
tokens after the first / time after the first), so it shows what the app's drawing costs the
engine: both share the CPU. The last column is the app process's CPU time over each reply's wall
time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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


class Headless:
    """The conversation through EngineClient, one reply at a time."""

    def __init__(self, model: str, tokens: int):
        from nanochat.engine import SamplingParams
        from nanochat.engine.serve.client import EngineClient

        self.client = EngineClient()
        self.client.load_model(model)
        self.session = self.client.open_session()
        self.sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def reply(self, prompt: str) -> float:
        return self.client.submit_turn(self.session, prompt, self.sampling).result(600).stats.decode_tok_s

    def close(self) -> None:
        self.client.shutdown()


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


class Tui:
    """The real app in tmux, one reply at a time: (decode tok/s, the app's CPU over the reply's wall time)."""

    def __init__(self, model: str, tokens: int):
        from nanochat.app.paths import get_paths

        self.home = Path(tempfile.mkdtemp(prefix="nanochat-tui-bench-"))
        (self.home / "cache").symlink_to(get_paths().ensure().cache_dir)   # the built kernels, packed weights
        nanochat = shutil.which("nanochat") or str(Path(sys.executable).with_name("nanochat"))
        # A tmux server that is already running would give the app its own environment, not ours.
        knobs = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                         if k.startswith(("NANOCHAT_", "NANO_VLLM_")) and k != "NANOCHAT_HOME")
        command = (f"{knobs} NANOCHAT_HOME={self.home} {nanochat} --model {model} --temperature 0 --ignore-eos "
                   f"--max-tokens {tokens}")
        tmux("new-session", "-d", "-s", SESSION, "-x", "160", "-y", "48", command)
        try:
            wait(lambda: "Loaded" in tmux("capture-pane", "-p", "-t", SESSION), 300, "the model to load")
            self.db = self.home / "data" / "chats.sqlite3"
            self.pid = ui_pid(int(tmux("display-message", "-p", "-t", SESSION, "#{pane_pid}")))
        except BaseException:
            self.close()
            raise

    def reply(self, prompt: str) -> tuple[float, float]:
        n = len(replies_in_store(self.db)) + 1
        before, start = cpu_seconds(self.pid), time.monotonic()
        tmux("send-keys", "-t", SESSION, "-l", prompt)
        tmux("send-keys", "-t", SESSION, "Enter")
        wait(lambda: len(replies_in_store(self.db)) >= n, 600, f"reply {n}")
        cores = (cpu_seconds(self.pid) - before) / (time.monotonic() - start)
        return replies_in_store(self.db)[-1]["decode_tok_s"], cores

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)


class Control(Headless):
    """`--control`: a second headless conversation in the app's place. What it shows against the first
    is the machine's noise: the ratios a TUI that cost nothing would get."""

    def reply(self, prompt: str) -> tuple[float, float]:
        return super().reply(prompt), 0.0


def conversation_pair(model: str, prompts: list[str], tokens: int, flip: bool,
                      control: bool = False) -> tuple[list[float], ...]:
    """One round: both conversations in lockstep, headless first on even replies (odd ones with `flip`).
    Headless tok/s, TUI (or control) tok/s and the app's CPU, per reply."""
    head, app = Headless(model, tokens), None
    try:
        app = Control(model, tokens) if control else Tui(model, tokens)
        heads, tuis, cpus = [], [], []
        for k, prompt in enumerate(prompts):
            if (k + flip) % 2 == 0:
                heads.append(head.reply(prompt))
            tok_s, cores = app.reply(prompt)
            tuis.append(tok_s)
            cpus.append(cores)
            if (k + flip) % 2 == 1:
                heads.append(head.reply(prompt))
        return heads, tuis, cpus
    finally:
        head.close()
        if app is not None:
            app.close()


def main() -> int:
    from nanochat.models.formats.catalog import resolve_default_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    p.add_argument("--replies", type=int, default=5)
    p.add_argument("--tokens", type=int, default=400, help="tokens per reply (~300 words)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the two conversations")
    p.add_argument("--control", action="store_true",
                   help="a second headless conversation instead of the app: the noise floor of the ratios")
    args = p.parse_args()
    model = resolve_default_model(args.model)
    prompts = PROMPTS[:args.replies]
    other = "control" if args.control else "TUI"
    heads, tuis, cpus = [], [], []
    for r in range(args.rounds):
        h, t, c = conversation_pair(model, prompts, args.tokens, flip=bool(r % 2), control=args.control)
        print(f"round {r + 1}: headless", " ".join(f"{x:.0f}" for x in h), f"| {other}",
              " ".join(f"{x:.0f}" for x in t), file=sys.stderr, flush=True)
        heads.append(h)
        tuis.append(t)
        cpus.append(c)
    print(f"model {Path(model).name}, {os.cpu_count()} CPUs, {args.tokens} tokens per reply, "
          f"{args.rounds} rounds, replies paired")
    print(f"| reply | headless tok/s (best) | {other} tok/s (best) | best / best | {other} / headless, median of "
          "rounds | UI process, cores (mean) |")
    print("|---|---|---|---|---|---|")
    for i in range(len(prompts)):
        h, t = max(run[i] for run in heads), max(run[i] for run in tuis)
        paired = statistics.median(tui_run[i] / head_run[i] for head_run, tui_run in zip(heads, tuis))
        cores = sum(run[i] for run in cpus) / len(cpus)
        print(f"| {i + 1} | {h:.1f} | {t:.1f} | {t / h:.1%} | {paired:.1%} | {cores:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
