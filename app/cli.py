"""The `nanochat` command.

    nanochat                          full-screen app (TUI)
    nanochat --prompt "..."           headless one-shot: the reply on stdout, stats on stderr
    nanochat run --prompt A [--prompt B ...]   the same, several prompts batched
    nanochat repl                     line-based chat
    nanochat bench / convert-model    (app/bench_cli.py, app/convert_cli.py)

Exit codes: 0 ok, 1 runtime error, 2 usage error, 130 interrupted. Errors are one line on stderr,
never a traceback (NANOCHAT_DEBUG=1 shows one).
"""

from __future__ import annotations

import argparse
import sys

from nanochat.app.errors import (EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, UsageError,
                                 debug_enabled, one_line, report)

DTYPE_CHOICES = ("auto", "float32", "fp32", "float16", "fp16", "half", "bfloat16", "bf16")


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# ---------------------------------------------------------------------------------- value checks
def _number(cast, label: str, ok, text: str):
    def parse(raw: str):
        try:
            value = cast(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {label}, got {raw!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {text}, got {raw!r}")
        return value
    parse.__name__ = label
    return parse


positive_int = _number(int, "an integer", lambda v: v > 0, "a positive integer")
non_negative_int = _number(int, "an integer", lambda v: v >= 0, "a non-negative integer")
top_k_int = _number(int, "an integer", lambda v: v >= -1, "-1 (off) or a positive integer")
temperature_float = _number(float, "a number", lambda v: v >= 0 and v == v and v != float("inf"), ">= 0")
top_p_float = _number(float, "a number", lambda v: 0 < v <= 1, "in (0, 1]")
positive_float = _number(float, "a number", lambda v: v > 0 and v != float("inf"), "> 0")


def device_name(raw: str) -> str:
    if raw in ("cpu", "cuda", "auto") or (raw.startswith("cuda:") and raw[5:].isdigit()):
        return raw
    raise argparse.ArgumentTypeError(f"must be cpu, cuda, cuda:N or auto, got {raw!r}")


# ---------------------------------------------------------------------------------- parser
def _add(parser, suppress: bool, *flags, **kw):
    """Options shared by the top level and the subcommands: subcommands use SUPPRESS defaults so
    that `nanochat --model M run` keeps M unless `run` gives its own."""
    kw.setdefault("default", argparse.SUPPRESS if suppress else None)
    try:
        parser.add_argument(*flags, **kw)
    except argparse.ArgumentError:
        pass   # an external subcommand already defines it


def add_engine_options(parser, suppress: bool = False) -> None:
    _add(parser, suppress, "--model", "-m", metavar="PATH|HUB_ID",
         help="a .gguf file, a Hugging Face model folder or hub id (default: settings, else built-in SmolLM2)")
    _add(parser, suppress, "--device", type=device_name, metavar="DEVICE", help="cpu, cuda, cuda:N or auto")
    _add(parser, suppress, "--dtype", choices=DTYPE_CHOICES, help="compute dtype (auto: fp32 on CPU, bf16 on CUDA)")
    _add(parser, suppress, "--max-model-len", type=positive_int, metavar="N", help="context length in tokens")
    _add(parser, suppress, "--kv-cache-gib", type=positive_float, metavar="GIB", help="CPU KV-cache budget")
    _add(parser, suppress, "--dequantize", action="store_true", default=argparse.SUPPRESS if suppress else False,
         help="materialise GGUF weights as dense tensors (more memory, exact fp32/bf16 maths)")
    _add(parser, suppress, "--quantize", choices=["q8_0"],
         help="quantize a Hugging Face checkpoint's linears to Q8_0 at load (~4x less memory than fp32, "
              "the fast CPU path)")


def add_generation_options(parser, suppress: bool = False) -> None:
    _add(parser, suppress, "--max-tokens", type=positive_int, metavar="N", help="most tokens to generate")
    _add(parser, suppress, "--temperature", "-t", type=temperature_float, metavar="T", help="0 = greedy")
    _add(parser, suppress, "--top-p", type=top_p_float, metavar="P")
    _add(parser, suppress, "--top-k", type=top_k_int, metavar="K", help="-1 = off")
    _add(parser, suppress, "--seed", type=non_negative_int, metavar="N")
    _add(parser, suppress, "--system", metavar="TEXT", help="system prompt")
    _add(parser, suppress, "--ignore-eos", action="store_true", help="always generate --max-tokens tokens")


def add_oneshot_options(parser, suppress: bool = False) -> None:
    _add(parser, suppress, "--prompt", "-p", action="append", metavar="TEXT",
         help="generate a reply and exit (repeat to batch several prompts); piped stdin is prepended")
    _add(parser, suppress, "--no-chat-template", action="store_true",
         help="send the prompt as raw text, without the model's chat template")
    _add(parser, suppress, "--json", action="store_true", help="print one JSON object per prompt on stdout")
    _add(parser, suppress, "--quiet", "-q", action="store_true", help="no progress or stats on stderr")


def build_parser(argv: list[str] | None = None) -> Parser:
    parser = Parser(prog="nanochat", description="A terminal chat app with its own inference engine.")
    add_engine_options(parser)
    add_generation_options(parser)
    add_oneshot_options(parser)
    parser.add_argument("--paths", action="store_true", help="print where nanochat keeps its files and exit")
    parser.add_argument("--version", action="version", version=f"nanochat {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="generate replies for --prompt(s) and exit (like --prompt)")
    add_engine_options(run, suppress=True)
    add_generation_options(run, suppress=True)
    add_oneshot_options(run, suppress=True)

    repl = sub.add_parser("repl", help="line-based chat in the terminal")
    add_engine_options(repl, suppress=True)
    add_generation_options(repl, suppress=True)
    _add(repl, True, "--quiet", "-q", action="store_true", help="no loading indicator")

    info = sub.add_parser("info", help="load a model and say what it runs on (types, kernels, fast path, KV cache)")
    add_engine_options(info, suppress=True)
    _add(info, True, "--json", action="store_true", help="one JSON object on stdout")

    argv = sys.argv[1:] if argv is None else argv
    for name, module, adder, summary in EXTERNAL:
        _add_external(sub, name, module, adder, summary, argv)
    return parser


# External subcommands: (name, module, parser adder, one-line help for the listing).
EXTERNAL = (("bench", "nanochat.app.bench_cli", "add_bench_parser", "benchmark the engine"),
            ("convert-model", "nanochat.app.convert_cli", "add_convert_parser", "convert a model"))


def _add_external(sub, name: str, module: str, adder: str, summary: str, argv: list[str]) -> None:
    """Register a subcommand that lives in its own module, if that module is there. The module
    (which may import torch) is imported only when the command line names it; otherwise a
    placeholder keeps it in `--help`."""
    import importlib.util

    try:
        if importlib.util.find_spec(module) is None:
            return
    except (ImportError, ValueError):
        return
    if name not in argv:
        sub.add_parser(name, help=summary, add_help=False)
        return
    try:
        mod = __import__(module, fromlist=[adder])
        getattr(mod, adder)(sub)
    except (ImportError, AttributeError):
        return
    child = sub.choices.get(name)
    if child is not None:
        add_engine_options(child, suppress=True)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("nanochat")
    except Exception:
        return "0.1.0"


# ---------------------------------------------------------------------------------- option merging
def _pick(args, name: str, default):
    value = getattr(args, name, None)
    return default if value is None else value


def engine_config(args, settings) -> dict:
    """Engine keyword arguments: command line over settings (None values are left to the engine)."""
    cfg = {"device": _pick(args, "device", settings.device), "dtype": _pick(args, "dtype", settings.dtype),
           "max_model_len": _pick(args, "max_model_len", settings.max_model_len),
           "kv_cache_gib": _pick(args, "kv_cache_gib", settings.kv_cache_gib),
           "dequantize": True if getattr(args, "dequantize", False) else None,
           "quantize": getattr(args, "quantize", None)}
    return {k: v for k, v in cfg.items() if v is not None}


def sampling_options(args, settings) -> dict:
    opts = {"temperature": _pick(args, "temperature", settings.temperature),
            "top_p": _pick(args, "top_p", settings.top_p), "top_k": _pick(args, "top_k", settings.top_k),
            "max_tokens": _pick(args, "max_tokens", settings.max_tokens), "seed": getattr(args, "seed", None)}
    if getattr(args, "ignore_eos", False):
        opts["ignore_eos"] = True
    return opts


def resolve_model(args, settings) -> str:
    from nanochat.models.catalog import resolve_default_model

    return resolve_default_model(getattr(args, "model", None) or settings.default_model)


def _remember(args, settings) -> None:
    """Add an explicitly given --model to the recent list (never over a settings file we could not read)."""
    model = getattr(args, "model", None)
    if not model or settings.warnings:
        return
    try:
        settings.remember_model(model)
        settings.save()
    except OSError:
        pass


# ---------------------------------------------------------------------------------- commands
def cmd_paths() -> int:
    from nanochat.app.paths import get_paths

    described = get_paths().describe()
    width = max(len(k) for k in described)
    for key, value in described.items():
        print(f"{key.ljust(width)}  {value}")
    return EXIT_OK


def cmd_oneshot(args, settings, piped: str) -> int:
    from nanochat.app.oneshot import OneShotOptions, combine_prompt, run_oneshot

    prompts = list(args.prompt or [])
    if prompts:
        prompts[0] = combine_prompt(piped, prompts[0])
    elif piped.strip():
        prompts = [piped.rstrip()]
    else:
        raise UsageError("no prompt: give --prompt TEXT or pipe text on stdin")
    if args.no_chat_template and args.system:
        raise UsageError("--system needs the chat template; drop --no-chat-template")
    system = None if args.no_chat_template else _pick(args, "system", settings.system_prompt)
    opts = OneShotOptions(model=resolve_model(args, settings), prompts=prompts,
                          engine_config=engine_config(args, settings), sampling=sampling_options(args, settings),
                          system=system, chat_template=not args.no_chat_template, json=bool(args.json),
                          quiet=bool(args.quiet))
    code = run_oneshot(opts)
    if code == EXIT_OK:
        _remember(args, settings)
    return code


def cmd_repl(args, settings) -> int:
    from nanochat.app.paths import get_paths
    from nanochat.app.repl import ReplOptions, run_repl

    opts = ReplOptions(model=resolve_model(args, settings), engine_config=engine_config(args, settings),
                       sampling=sampling_options(args, settings), system=_pick(args, "system", settings.system_prompt),
                       history_file=str(get_paths().repl_history))
    return run_repl(opts, quiet=bool(getattr(args, "quiet", False)), on_loaded=lambda: _remember(args, settings))


def cmd_info(args, settings) -> int:
    """`nanochat info`: what the model runs on, and why not the CPU fast path when it does not."""
    import json

    from nanochat.app.oneshot import loading_indicator, model_label
    from nanochat.engine import LLM

    model = resolve_model(args, settings)
    with loading_indicator(f"Loading {model_label(model)}") as progress:
        report = LLM(model, load_progress=progress, **engine_config(args, settings)).describe()
    rows = report.lines()
    if getattr(args, "json", False):
        print(json.dumps(dict(rows), indent=1))
    else:
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
    return EXIT_OK


def cmd_tui(args, settings) -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):   # a full-screen app needs a terminal
        return cmd_repl(args, settings)
    try:
        from nanochat.app.tui import main as tui_main
    except ImportError as e:
        print(f"nanochat: the full-screen app is not available ({one_line(e)}); starting the REPL instead",
              file=sys.stderr, flush=True)
        return cmd_repl(args, settings)
    code = tui_main(args)
    return EXIT_OK if code is None else int(code)


def dispatch(args) -> int:
    if args.paths:
        return cmd_paths()
    from nanochat.app.settings import Settings

    settings = Settings.load()
    for warning in settings.warnings:
        print(f"nanochat: warning: {warning}", file=sys.stderr, flush=True)
    args.settings = settings
    command = args.command
    if command == "bench":
        from nanochat.app.bench_cli import run_bench
        return run_bench(args)
    if command == "convert-model":
        from nanochat.app.convert_cli import run_convert
        return run_convert(args)
    if command == "repl":
        return cmd_repl(args, settings)
    if command == "info":
        return cmd_info(args, settings)
    from nanochat.app.oneshot import read_piped_stdin

    if command == "run" or args.prompt:
        return cmd_oneshot(args, settings, read_piped_stdin())
    piped = read_piped_stdin()      # `echo "question" | nanochat` answers and exits
    if piped.strip():
        return cmd_oneshot(args, settings, piped)
    return cmd_tui(args, settings)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
        return dispatch(args)
    except SystemExit as e:          # argparse: --help, --version, usage errors
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_RUNTIME)
    except UsageError as e:
        print(f"nanochat: error: {e} (see `nanochat --help`)", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK
    except Exception as e:   # ModelLoadError, RequestError, ValueError, OSError, MemoryError, ...
        if debug_enabled():
            raise
        report(one_line(e))
        return EXIT_RUNTIME


def _silence_stdout() -> None:
    """After the reader of our stdout went away, keep the interpreter's final flush from failing."""
    import os
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
