"""A plain line-based chat: `nanochat repl`.

The conversation is a chat session of the engine process (through EngineClient), so turn k+1
prefills only its new message (the stats line after each reply shows cached vs new prompt tokens).
If the engine process dies, the reply in progress says why and the next message restarts it. When the
chat no longer fits in the model's context, the oldest exchanges are left out of what the model sees
(the system prompt stays; /history still shows them) and the message goes again, as the chat app's
"drop the oldest turns" does.

prompt_toolkit gives line editing and a persistent history on a terminal; without one (stdin
piped) lines are read with input(), replies go to stdout and stats lines to stderr. What goes to a
terminal passes the sanitizer (app/terminal_text.py); a pipe or a file gets the exact text.

A reasoning model's thinking (<think>...</think>) is not printed unless --show-thinking asks for it
(then first, dim on a terminal, as one-shots do); /thinking prints the last reply's, and /think on|off
switches it (the chat template's enable_thinking).

Keys: Ctrl-C during a reply cancels it (the partial reply is kept), Ctrl-C at the prompt clears
the line, Ctrl-D exits.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field

from nanochat.app.conversation import ChatError, Message, as_history, exchanges_to_drop
from nanochat.app.export import format_stats, model_name
from nanochat.app.oneshot import ReplyPrinter
from nanochat.app.options import effective_sampling, on_off, speculative_refusal
from nanochat.app.reasoning import reply_thought
from nanochat.app.terminal_text import dim, for_terminal, is_terminal

PROMPT = "> "
COMMANDS = {
    "/help": "show this help",
    "/history": "show the conversation with per-turn stats",
    "/clear": "start over (keeps the system prompt, frees the conversation's KV cache)",
    "/system [TEXT]": "show the system prompt, or set it (starts over)",
    "/set [NAME VALUE|NAME -]": "show or set this chat's sampling (temperature, top_p, ...), speculative "
                                "decoding (speculative off|ngram|draft) or what holds the replies (json_schema "
                                "object|@FILE|JSON, grammar @FILE|TEXT); - : the default again",
    "/think on|off|-": "reasoning models: think before answering, or not (- : the model's default)",
    "/thinking": "show the last reply's thinking",
    "/exit": "leave (also /quit or Ctrl-D)",
}


@dataclass
class ReplOptions:
    model: str
    engine_config: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)     # SamplingParams keyword arguments
    system: str | None = None
    history_file: str | None = None                  # prompt_toolkit FileHistory path
    show_thinking: bool = False                      # print a reply's thinking before its answer
    template_kwargs: dict | None = None              # chat template variables from flags (reasoning_effort)


class _Terminal:
    """Where text goes: replies to stdout; notes and stats dim on a terminal, else to stderr. Every
    write passes for_terminal or dim, which sanitize what goes to a terminal."""

    def __init__(self, interactive: bool):
        self.interactive = interactive
        self.tty = is_terminal(sys.stdout)
        self.err_tty = is_terminal(sys.stderr)

    def newline(self) -> None:
        print(flush=True)

    def note(self, text: str) -> None:
        if self.interactive:
            print(dim(text, self.tty), flush=True)
        else:
            print(for_terminal(text, self.err_tty), file=sys.stderr, flush=True)

    def info(self, text: str) -> None:
        """Answers to commands: part of the conversation's output, so stdout."""
        print(for_terminal(text, self.tty), flush=True)

    def error(self, text: str) -> None:
        print(for_terminal(f"nanochat: error: {text}", self.err_tty), file=sys.stderr, flush=True)


def _ctrl_c_interrupts() -> None:
    """Make a Ctrl-C during a reply reach this process as KeyboardInterrupt, whatever it inherited: a
    SIGINT that its parent ignored or blocked (both pass through exec), or a terminal left without
    ISIG (Ctrl-C would be a byte on stdin until the next prompt). prompt_toolkit reads Ctrl-C at the
    prompt as a key, so without this the prompt clears and a reply cannot be stopped."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    import termios

    try:  # stdin may be a terminal that refuses (or, under a wrapper, no terminal at all)
        fd = sys.stdin.fileno()
        attrs = termios.tcgetattr(fd)
        if not attrs[3] & termios.ISIG:
            attrs[3] |= termios.ISIG
            termios.tcsetattr(fd, termios.TCSANOW, attrs)
    except (OSError, ValueError, termios.error):
        pass


def _line_reader(opts: ReplOptions, interactive: bool):
    """A function returning the next input line; raises EOFError at the end, KeyboardInterrupt on Ctrl-C."""
    if interactive:
        try:
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import FileHistory, InMemoryHistory

            history = InMemoryHistory()
            if opts.history_file:
                try:
                    from pathlib import Path
                    Path(opts.history_file).parent.mkdir(parents=True, exist_ok=True)
                    history = FileHistory(opts.history_file)
                except OSError:
                    pass
            session = PromptSession(history=history)
            return lambda: session.prompt(PROMPT)
        except Exception:   # no usable terminal after all: plain input() below
            pass
    return lambda: input(PROMPT if interactive else "")


class Repl:
    def __init__(self, opts: ReplOptions, client, interactive: bool):
        from nanochat.engine import SamplingParams

        self.opts = opts
        self.client = client
        self.own: dict = {}               # what /set states, over the flags' sampling
        self.sp = SamplingParams(**self._sampling(self.own))
        self.term = _Terminal(interactive)
        self.system_prompt = opts.system
        self.session = client.open_session(opts.system)
        self.turns: list[Message] = []    # user, reply, user, reply, ...
        self.seen_from = 0                # the first exchange the model still sees (older ones no longer fit)
        self.think: bool | None = None    # enable_thinking for the template (None: not given)

    @property
    def seen(self) -> list[Message]:
        """The messages the model still sees (the chat's session history)."""
        return self.turns[2 * self.seen_from:]

    def _sampling(self, own: dict) -> dict:
        """SamplingParams keywords: /set's over the flags' over the model file's over CHAT_DEFAULTS."""
        return effective_sampling({**self.opts.sampling, **own}, self.client.model.sampling_defaults)

    # ------------------------------------------------------------------ loop
    def run(self, read_line) -> int:
        if self.term.interactive:
            _ctrl_c_interrupts()
        while True:
            try:
                line = read_line()
            except KeyboardInterrupt:
                continue          # prompt_toolkit already cleared the line
            except EOFError:
                if self.term.interactive:
                    self.term.newline()
                return 0
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if self.command(line) == "exit":
                    return 0
                continue
            try:
                self.turn(line)
            except KeyboardInterrupt:   # a Ctrl-C after the reply ended (its stats line): keep the chat
                self.term.newline()

    def turn(self, text: str) -> None:
        while True:
            sent = self._send(text)
            if sent is None:          # Ctrl-C before the request was submitted
                return
            reply, printer = sent
            final = reply.final
            if reply.token_ids:
                self.turns += [Message("user", text), Message("assistant", printer.splitter.answer, reply.stats,
                                                              thought=reply_thought(printer.splitter))]
            if final.finish_reason == "error" and not reply.token_ids and final.stats is not None \
                    and final.stats.context_full and self.seen:
                if self._leave_out_oldest(final.stats.prompt_tokens):
                    continue                # the message again, in what is left of the chat
                return
            break
        if final.finish_reason == "error":
            if printer.printed:
                self.term.newline()
            hint = " (type /clear to start over)" if self.turns and self.client.alive else ""
            self.term.error(f"{final.error or 'generation failed'}{hint}")
            return
        self.term.newline()
        st = reply.stats
        self.term.note(f"[{format_stats(st)}]")

    def _send(self, text: str):
        """Submit the message and print the reply as it streams: (Reply, its ReplyPrinter), or None on a Ctrl-C
        before the request was submitted."""
        try:
            if not self.client.alive:
                self.term.note("restarting the engine…")
            variables = {**(self.opts.template_kwargs or {}),
                         **({} if self.think is None else {"enable_thinking": self.think})} or None
            stream = self.client.submit_turn(self.session, text, self.sp, template_kwargs=variables)
        except KeyboardInterrupt:
            return None
        printer = ReplyPrinter(sys.stdout, self.think in self.client.model.thinking_opened, self.opts.show_thinking,
                               model=self.client.model)
        self._stream(stream, printer)   # a cancel ends the reply with finish_reason "abort": its note says so
        return stream.result(), printer

    def _leave_out_oldest(self, prompt_tokens: int) -> bool:
        """The chat with the new message did not fit in the context: the model stops seeing the oldest
        exchanges that make room for it and a reply (a new session with the rest as its history). False, with
        an error, when even the message alone does not fit."""
        limit = self.client.model.max_model_len
        try:
            n = exchanges_to_drop(self.seen, prompt_tokens, limit, self.sp.max_tokens)
        except ChatError as e:
            self.term.error(f"{e}: shorten it, or type /clear to start over")
            return False
        self.seen_from += n
        self.client.close_session(self.session)
        self.session = self.client.open_session(self.system_prompt, as_history(self.seen))
        oldest = "the oldest exchange (/history still shows it)" if n == 1 else \
            f"the oldest {n} exchanges (/history still shows them)"
        self.term.note(f"the chat no longer fits in the model's context ({limit:,} tokens): it no longer sees {oldest}")
        return True

    def _stream(self, stream, printer: ReplyPrinter) -> None:
        """Print deltas as they come; Ctrl-C cancels the request and waits for its final event."""
        cancelled = False
        while True:
            try:
                for event in stream:
                    printer.add(event.text)
                printer.finish()
                return
            except KeyboardInterrupt:
                if not cancelled:
                    stream.cancel()
                    cancelled = True

    # ------------------------------------------------------------------ commands
    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        name = name.lower()
        if name in ("/exit", "/quit", "/q"):
            return "exit"
        if name in ("/help", "/?"):
            self.term.info(self.help_text())
        elif name == "/history":
            self.term.info(self.history_text())
        elif name == "/clear":
            self.clear()
            self.term.note("conversation cleared")
        elif name == "/system":
            self.system(arg.strip())
        elif name == "/set":
            self.set_option(arg.strip())
        elif name == "/think":
            self.set_think(arg.strip())
        elif name == "/thinking":
            reply = next((m for m in reversed(self.turns) if m.role == "assistant"), None)
            thought = reply.thought if reply is not None else None
            self.term.note(thought.text if thought is not None and thought.text else "(the last reply has no thinking)")
        else:
            self.term.info(f"unknown command {name}; type /help for the list of commands")
        return None

    @staticmethod
    def help_text() -> str:
        width = max(len(c) for c in COMMANDS)
        lines = [f"  {c.ljust(width)}  {d}" for c, d in COMMANDS.items()]
        return "\n".join(["commands:", *lines,
                          "Ctrl-C stops a reply (the partial reply is kept); Ctrl-D exits."])

    def history_text(self) -> str:
        if not self.turns:
            return "(no messages yet)"
        lines = [f"system: {self.system_prompt}"] if self.system_prompt else []
        for i, m in enumerate(self.turns):
            if i == 2 * self.seen_from and i:
                lines.append("(the model no longer sees the messages above: they did not fit in its context)")
            lines.append(f"{m.role}: {m.content}")
            if m.stats is not None:
                st = m.stats
                parts = [f"prompt {st.prompt_tokens}", f"cached {st.cached_tokens}",
                         f"prefilled {st.prefilled_tokens}", f"{st.completion_tokens} tokens"]
                if st.ttft is not None:
                    parts.append(f"TTFT {st.ttft:.2f}s")
                if st.decode_tok_s:
                    parts.append(f"{st.decode_tok_s:.1f} tok/s")
                if st.finish_reason and st.finish_reason != "stop":
                    parts.append(st.finish_reason)
                lines.append("    (" + " · ".join(parts) + ")")
        return "\n".join(lines)

    def set_option(self, arg: str) -> None:
        """/set NAME VALUE (or -: the default again) for this chat's next turns, checked as the chat app's /set is."""
        from nanochat.app.controller import TURN_SETTINGS, describe_settings, setting_value
        from nanochat.app.options import REPLY_FORMATS
        from nanochat.engine.serve.protocol import EngineError
        from nanochat.engine import SamplingParams

        if not arg:
            self.term.info(f"settings: {describe_settings(self._sampling(self.own), self.own)}")
            return
        name, _, raw = arg.partition(" ")
        raw = raw.strip()
        if name not in TURN_SETTINGS:
            self.term.info(f"/set: unknown setting {name!r}; one of: {', '.join(TURN_SETTINGS)}")
            return
        if not raw:
            self.term.info(f"/set {name}: give a value, or - to use the default again")
            return
        own = {k: v for k, v in self.own.items() if k != name}
        try:
            value = None if raw == "-" else setting_value(name, raw)
            if value is not None:
                own[name] = value
            sp = SamplingParams(**self._sampling(own))
            refusal = speculative_refusal(value, self.client.model.speculative_modes) if name == "speculative" else None
            if refusal:
                raise ValueError(refusal)
            if name in REPLY_FORMATS and value is not None:
                self.client.check_hold(**{name: value})
        except (ValueError, EngineError) as e:
            self.term.info(f"/set {name}: {e}")
            return
        self.own, self.sp = own, sp
        self.term.note(f"{name} {raw} from the next reply" if value is not None else f"{name}: back to the default")

    def set_think(self, arg: str) -> None:
        if not arg:
            self.term.info(f"thinking: {({True: 'on', False: 'off'}).get(self.think, 'the model default')}")
            return
        try:
            self.think = None if arg == "-" else on_off(arg)
        except ValueError as e:
            self.term.info(f"/think: {e}")
            return
        if not self.client.model.thinking_switch:
            self.term.note("this model's chat template has no thinking switch (enable_thinking): nothing changes")
        else:
            self.term.note(f"thinking {({True: 'on', False: 'off'}).get(self.think, 'as the model does by default')}"
                           " from the next reply")

    def clear(self) -> None:
        self.client.close_session(self.session)
        self.session = self.client.open_session(self.system_prompt)
        self.turns, self.seen_from = [], 0

    def system(self, text: str) -> None:
        if not text:
            self.term.info(f"system prompt: {self.system_prompt or '(none)'}")
            return
        self.system_prompt = text
        self.clear()
        self.term.note("system prompt set; conversation cleared")


def run_repl(opts: ReplOptions, quiet: bool = False, on_loaded=None) -> int:
    """Load the model (progress on stderr), then chat until /exit or end of input.
    `on_loaded()` runs once the model loaded (the CLI records it as a recent model)."""
    from nanochat.app.oneshot import load_client
    from nanochat.engine.output import embeddings_only

    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    client, _ = load_client(opts.model, opts.engine_config, quiet)
    try:
        if on_loaded is not None:
            on_loaded()
        repl = Repl(opts, client, interactive)
        if client.model is not None and not client.model.writes_text:   # every message would be refused
            repl.term.error(embeddings_only(model_name(opts.model)))
            return 1
        if interactive:
            repl.term.note(f"nanochat · {model_name(opts.model)} · /help for commands, Ctrl-D to exit")
        return repl.run(_line_reader(opts, interactive))
    finally:
        client.shutdown()
