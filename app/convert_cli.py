"""`nanochat convert-model`: write a model's weight map (checkpoint tensors -> the engine's fused
parameters, see models/formats/weight_map.py) as JSON.

    nanochat convert-model --model path/to/hf-folder            -> path/to/hf-folder/weights-map.json
    nanochat convert-model --model model.gguf --out map.json
    nanochat convert-model --model model.gguf --out -           -> stdout

The output is deterministic (sorted keys, fixed indent, trailing newline): byte-identical across runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

from nanochat.app.errors import EXIT_OK, UsageError, one_line, run_guarded
from nanochat.app.options import add_option, name_arg, resolve_model
from nanochat.app.terminal_text import for_stream

PROG = "nanochat convert-model"


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert-model", help="write the weight map of a model (checkpoint -> engine tensors)",
                              description="Write a deterministic JSON plan mapping a checkpoint's tensors "
                                          "(HF folder or GGUF file) to the engine's fused parameters.")
    add_option(p, True, "--model", "-m", type=name_arg, metavar="PATH|HUB_ID",
               help="a .gguf file, a Hugging Face model folder or hub id (default: settings, else the built-in model)")
    p.add_argument("--out", "-o", type=name_arg, metavar="FILE",
                   help=f"where to write the map ('-' for stdout; default: DIR/{_default_name()} beside the model)")
    p.add_argument("--quiet", "-q", action="store_true", default=argparse.SUPPRESS, help="no summary on stderr")
    p.set_defaults(func=run_convert_cli)
    return p


def _default_name() -> str:
    from nanochat.models.formats.weight_map import DEFAULT_PLAN_NAME
    return DEFAULT_PLAN_NAME


def default_out(model: str) -> Path:
    """HF folder: DIR/weights-map.json; GGUF file: <stem>.weights-map.json beside it."""
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        return path / _default_name()
    if path.is_file():
        return path.with_name(f"{path.stem}.{_default_name()}")
    return Path(_default_name())   # hub id: the current directory


def run_convert_cli(args) -> int:
    """Run `nanochat convert-model` for parsed `args`; returns the exit code. ModelLoadError, OSError,
    ValueError: one line on stderr, no traceback; Ctrl-C: 130 without a message."""
    return run_guarded(lambda: _convert(args), PROG, describe=partial(one_line, oom_advice=None),
                       say_interrupted=False)


def _convert(args) -> int:
    from nanochat.models.formats.weight_map import make_plan, plan_json, write_plan

    model = resolve_model(args, args.settings)
    out = getattr(args, "out", None)
    _check_out(out)
    plan = make_plan(model)
    if out == "-":
        sys.stdout.write(for_stream(plan_json(plan), sys.stdout))   # ASCII JSON: unchanged
        sys.stdout.flush()
        return EXIT_OK
    path = write_plan(plan, out or default_out(model))
    if not getattr(args, "quiet", False):
        fused = sum(1 for t in plan["targets"].values() if t["op"] != "copy")
        print(for_stream(f"wrote {path}: {len(plan['targets'])} engine tensors ({fused} fused) from "
                         f"{len(plan['tensors'])} checkpoint tensors", sys.stderr), file=sys.stderr, flush=True)
    return EXIT_OK


def _check_out(out: str | None) -> None:
    """Refuse an --out that cannot be a file before reading the model: the writer's own errors named
    its temporary file (`/tmp.tmp: Is a directory` for --out /tmp) or said `File exists` for a file in the
    way of a folder. Missing parent folders are created."""
    if out is None or out == "-":
        return
    path = Path(os.path.expanduser(out))
    if path.is_dir():
        raise UsageError(f"--out {out}: is a folder; give a file name (or - for stdout)")
    existing = next((p for p in path.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UsageError(f"--out {out}: {existing} is a file, not a folder")
