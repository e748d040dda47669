"""`nanochat pull REPO[:QUANT]`: a GGUF from a Hugging Face repo into the hub cache, with a progress bar on a
terminal (app/fetch.py; the same fetch runs wherever a model is named `REPO:QUANT`).

    nanochat pull bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M    -> prints the file's local path
    nanochat --model bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q8_0    -> fetches it (once), then chats
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

from nanochat.app.errors import EXIT_OK, UsageError, one_line, run_guarded
from nanochat.app.options import name_arg
from nanochat.app.fetch import fetch_with_progress
from nanochat.app.terminal_text import for_stream

PROG = "nanochat pull"


def add_pull_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("pull", help="download a GGUF from a Hugging Face repo (REPO[:QUANT])",
                              description="Download a GGUF model file from a Hugging Face repo into the hub cache, "
                                          "resuming an interrupted download. QUANT picks the file by the tag in its "
                                          "name (default Q4_K_M, else Q8_0, else the first); prints its path.")
    p.add_argument("ref", type=name_arg, metavar="REPO[:QUANT]", help="e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run_pull_cli)
    return p


def run_pull_cli(args) -> int:
    return run_guarded(lambda: _pull(args), PROG, describe=partial(one_line, oom_advice=None))


def _pull(args) -> int:
    from nanochat.models.formats.hub_gguf import parse_ref

    ref = parse_ref(args.ref, any_repo=True)
    if ref is None:
        raise UsageError(f"{args.ref!r} is not REPO[:QUANT] (for example owner/Model-GGUF:Q4_K_M)")
    path = fetch_with_progress(ref, quiet=bool(args.quiet))
    print(for_stream(str(path), sys.stdout))
    return EXIT_OK
