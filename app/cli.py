"""The `nanochat` command.

    nanochat                          full-screen app (TUI)
    nanochat --prompt "..."           headless one-shot: the reply on stdout, stats on stderr
    nanochat run --prompt A [--prompt B ...]   the same, several prompts batched
    nanochat repl                     line-based chat
    nanochat bench / convert-model    (app/bench_cli.py, app/convert_cli.py)
    nanochat serve                    OpenAI-compatible HTTP server (app/serve.py)

Exit codes: 0 ok, 1 runtime error, 2 usage error, 130 interrupted. Errors are one line on stderr,
never a traceback (NANOCHAT_DEBUG=1 shows one). The value checks, the engine flags and how flags and
settings combine are app/options.py's, shared with the subcommands and the TUI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanochat.app.errors import (EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, UsageError,
                                 debug_enabled, one_line, report)
from nanochat.app.terminal_text import for_stream
from nanochat.app.options import (add_engine_options, add_option, argv_text, engine_config, grammar_arg,
                                  json_schema_arg, pick, positive_int, penalty_float, reasoning_effort_word,
                                  repetition_penalty_float, resolve_model, sampling_options, seed_int,
                                  temperature_float, top_k_int, top_p_float)


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2)."""

    commands: dict = {}      # the top-level parser's subcommand parsers, by name

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def check_applies(self, args) -> None:
        """A top-level flag given with a subcommand that has no such flag (`nanochat --prompt hi repl`,
        `nanochat --temperature 0 convert-model`) would be ignored without a word: refuse it."""
        command = getattr(args, "command", None)
        if command not in self.commands:
            return
        theirs = {a.dest for a in self.commands[command]._actions}
        for action in self._actions:
            if not action.option_strings or action.dest in theirs or action.dest in ("help", "version", "paths"):
                continue
            if getattr(args, action.dest, action.default) != action.default:
                flag = max(action.option_strings, key=len)
                raise UsageError(f"{flag} does not apply to `nanochat {command}`; drop it")


# ---------------------------------------------------------------------------------- parser
def add_generation_options(parser, suppress: bool = False) -> None:
    add_option(parser, suppress, "--max-tokens", type=positive_int, metavar="N", help="most tokens to generate")
    add_option(parser, suppress, "--temperature", "-t", type=temperature_float, metavar="T", help="0 = greedy")
    add_option(parser, suppress, "--top-p", type=top_p_float, metavar="P")
    add_option(parser, suppress, "--top-k", type=top_k_int, metavar="K", help="-1 = off")
    add_option(parser, suppress, "--seed", type=seed_int, metavar="N")
    add_option(parser, suppress, "--repetition-penalty", type=repetition_penalty_float, metavar="R",
               help="divide the logits of tokens already in the chat by R (1 = off; 1.1-1.3 stops loops)")
    add_option(parser, suppress, "--presence-penalty", type=penalty_float, metavar="P",
               help="-2..2: subtract P from tokens already generated (0 = off)")
    add_option(parser, suppress, "--frequency-penalty", type=penalty_float, metavar="F",
               help="-2..2: subtract F per earlier occurrence in the reply (0 = off)")
    add_option(parser, suppress, "--system", type=argv_text, metavar="TEXT", help="system prompt")
    add_option(parser, suppress, "--ignore-eos", action="store_true", help="always generate --max-tokens tokens")


def add_oneshot_options(parser, suppress: bool = False) -> None:
    add_option(parser, suppress, "--prompt", "-p", action="append", type=argv_text, metavar="TEXT",
               help="generate a reply and exit (repeat to batch several prompts); piped stdin is prepended")
    add_option(parser, suppress, "--no-chat-template", action="store_true",
               help="send the prompt as raw text, without the model's chat template")
    add_option(parser, suppress, "--json", action="store_true", help="print one JSON object per prompt on stdout")
    add_option(parser, suppress, "--json-schema", type=json_schema_arg, metavar="SCHEMA",
               help="hold the reply to this JSON schema (its JSON text, or @FILE), or to any JSON object (`object`)")
    add_option(parser, suppress, "--grammar", type=grammar_arg, metavar="GRAMMAR",
               help="hold the reply to this grammar: GBNF as llama.cpp's (`root ::= ...`) or Lark (its text, or @FILE)")
    add_thinking_option(parser, suppress)
    add_option(parser, suppress, "--quiet", "-q", action="store_true", help="no progress or stats on stderr")


def add_thinking_option(parser, suppress: bool = False) -> None:
    add_option(parser, suppress, "--show-thinking", action="store_true",
               help="print a reasoning model's thinking (<think>...</think>) before its answer (default: the answer only)")
    add_option(parser, suppress, "--reasoning-effort", type=reasoning_effort_word, metavar="LEVEL",
               help="low, medium or high: how long gpt-oss reasons (its chat template's reasoning_effort; "
                    "default: the template's, medium)")


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
    add_option(repl, True, "--quiet", "-q", action="store_true", help="no loading indicator")
    add_thinking_option(repl, suppress=True)

    info = sub.add_parser("info", help="load a model and say what it runs on (types, kernels, fast path, KV cache)")
    add_engine_options(info, suppress=True)
    add_option(info, True, "--json", action="store_true", help="one JSON object on stdout")

    argv = sys.argv[1:] if argv is None else argv
    for name, module, adder, summary in EXTERNAL:
        _add_external(sub, name, module, adder, summary, argv)
    parser.commands = sub.choices
    return parser


# External subcommands: (name, module, parser adder, one-line help for the listing).
EXTERNAL = (("bench", "nanochat.app.bench_cli", "add_bench_parser", "benchmark the engine"),
            ("convert-model", "nanochat.app.convert_cli", "add_convert_parser", "convert a model"),
            ("embed", "nanochat.app.embed_cli", "add_embed_parser", "print the embeddings of texts (one JSON line each)"),
            ("pull", "nanochat.app.pull", "add_pull_parser", "download a GGUF from a Hugging Face repo (REPO[:QUANT])"),
            ("serve", "nanochat.app.serve", "add_serve_parser", "serve the model over an OpenAI-compatible HTTP API"))


def _add_external(sub, name: str, module: str, adder: str, summary: str, argv: list[str]) -> None:
    """Register a subcommand that lives in its own module (it adds the flags it takes). The module is
    imported only when the command line names it; otherwise a placeholder keeps it in `--help`."""
    if name not in argv:
        sub.add_parser(name, help=summary, add_help=False)
        return
    import importlib

    getattr(importlib.import_module(module), adder)(sub)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("nanochat")
    except Exception:
        return "0.1.0"


# ---------------------------------------------------------------------------------- commands
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


def cmd_paths() -> int:
    from nanochat.app.paths import get_paths

    described = get_paths().describe()
    width = max(len(k) for k in described)
    for key, value in described.items():
        print(for_stream(f"{key.ljust(width)}  {value}", sys.stdout))
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
    blank = [n for n, p in enumerate(prompts, 1) if not p.strip()]
    if blank:
        which = "the prompt is" if len(prompts) == 1 else f"prompt {blank[0]} is"
        raise UsageError(f"{which} empty: give some text")
    if args.no_chat_template and args.system:
        raise UsageError("--system needs the chat template; drop --no-chat-template")
    system = None if args.no_chat_template else pick(args, "system", settings.system_prompt)
    opts = OneShotOptions(model=resolve_model(args, settings), prompts=prompts,
                          engine_config=engine_config(args, settings), sampling=sampling_options(args, settings),
                          system=system, chat_template=not args.no_chat_template, json=bool(args.json),
                          quiet=bool(args.quiet), show_thinking=bool(args.show_thinking),
                          template_kwargs=_template_kwargs(args))
    code = run_oneshot(opts)
    if code == EXIT_OK:
        _remember(args, settings)
    return code


def _template_kwargs(args) -> dict | None:
    """The chat template variables the flags set (--reasoning-effort); None: none."""
    effort = getattr(args, "reasoning_effort", None)
    return {"reasoning_effort": effort} if effort else None


def cmd_repl(args, settings) -> int:
    from nanochat.app.paths import get_paths
    from nanochat.app.repl import ReplOptions, run_repl

    opts = ReplOptions(model=resolve_model(args, settings), engine_config=engine_config(args, settings),
                       sampling=sampling_options(args, settings), system=pick(args, "system", settings.system_prompt),
                       history_file=str(get_paths().repl_history),
                       show_thinking=bool(getattr(args, "show_thinking", False)),
                       template_kwargs=_template_kwargs(args))
    return run_repl(opts, quiet=bool(getattr(args, "quiet", False)), on_loaded=lambda: _remember(args, settings))


def cmd_info(args, settings) -> int:
    """`nanochat info`: what the model runs on, and why not the CPU fast path when it does not."""
    import json

    from nanochat.app.export import model_name
    from nanochat.app.oneshot import load_client

    model = resolve_model(args, settings)
    client, _ = load_client(model, engine_config(args, settings), quiet=False)
    # what the other front ends call it (the "model" row is the name the file gives itself)
    name = model_name(model)
    try:
        rows = [("file", model if name in (model, Path(model).name) else f"{name}: {model}"), *client.describe()]
    finally:
        client.shutdown()
    if getattr(args, "json", False):
        print(json.dumps(dict(rows), indent=1))
    else:
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(for_stream(f"{key:<{width}}  {value}", sys.stdout))
    return EXIT_OK


def cmd_tui(args, settings) -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):   # a full-screen app needs a terminal
        return cmd_repl(args, settings)
    try:
        from nanochat.app.tui import main as tui_main
    except ImportError as e:
        message = f"nanochat: the full-screen app is not available ({one_line(e)}); starting the REPL instead"
        print(for_stream(message, sys.stderr), file=sys.stderr, flush=True)
        return cmd_repl(args, settings)
    code = tui_main(args)
    return EXIT_OK if code is None else int(code)


def dispatch(args) -> int:
    if args.paths:
        return cmd_paths()
    from nanochat.app.settings import Settings

    settings = Settings.load()
    for warning in settings.warnings:
        print(for_stream(f"nanochat: warning: {warning}", sys.stderr), file=sys.stderr, flush=True)
    args.settings = settings
    command = args.command
    if command in {name for name, *_ in EXTERNAL}:
        return args.func(args)       # set by the subcommand's parser
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
    for flag, given in (("--json", args.json), ("--no-chat-template", args.no_chat_template)):
        if given:   # one-shot options the chat app would ignore
            raise UsageError(f"{flag} needs a prompt: give --prompt TEXT or pipe text on stdin")
    return cmd_tui(args, settings)


def main(argv: list[str] | None = None) -> int:
    from nanochat.engine.config import launched_rank
    if launched_rank():   # torchrun started this process as a rank other than 0: it becomes a worker of rank 0
        import os
        os.execv(sys.executable, [sys.executable, "-m", "nanochat.engine.tensor_parallel"])
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
        parser.check_applies(args)
        return dispatch(args)
    except SystemExit as e:          # argparse: --help, --version, usage errors
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_RUNTIME)
    except UsageError as e:
        print(for_stream(f"nanochat: error: {e} (see `nanochat --help`)", sys.stderr), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK
    except BaseException as e:   # ModelLoadError, OSError, MemoryError, a Rust extension's panic (pyo3's
        # PanicException is a BaseException); SystemExit and KeyboardInterrupt are handled above
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
