"""Screens: the gauged-screen base, model picker, bench, history, help, and small prompts.

As in widgets.py, text that is not a literal is shown through `sanitize`, and as plain text, not
markup (a model file, a title or a message may hold "[/]"): DataTable cells as rich Text."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message as TextualMessage
from textual.reactive import var
from textual.screen import ModalScreen, Screen
from textual.widgets import (DataTable, Footer, Input, Label, LoadingIndicator, Markdown, OptionList, ProgressBar,
                             Static)
from textual.widgets.option_list import Option

from nanochat.app.conversation import Conversation
from nanochat.app.reasoning import describe_thought
from nanochat.app.terminal_text import sanitize
from nanochat.app.tui.messages import LoadModel
from nanochat.app.tui.widgets import EngineStatus, GaugePanel
from nanochat.engine.output import EngineStats, RequestStats
from nanochat.engine.serve.bench import BenchCancelled, spec_from
from nanochat.engine.serve.client import EngineClient


def human_size(n: int) -> str:
    if not n:
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def short_path(path: str, width: int = 30) -> str:
    """~ for the home folder, and an ellipsis in the middle of what is still too long."""
    home = str(Path.home())
    if path.startswith(home + "/"):
        path = "~" + path[len(home):]
    if len(path) <= width:
        return path
    keep = width - 1
    return path[:keep // 3] + "…" + path[-(keep - keep // 3):]


def cells(*values: str) -> list[Text]:
    """A DataTable row as rich Text: DataTable reads a str cell as markup."""
    return [Text(sanitize(value)) for value in values]


# ---------------------------------------------------------------------------------- gauged screens
class GaugedScreen(Screen):
    """A screen with a gauge panel. The app's engine status flows down into `engine_status`, which
    the screen's GaugePanel binds to (`GaugePanel().data_bind(status=GaugedScreen.engine_status)`)."""

    engine_status: var[EngineStatus] = var(EngineStatus())

    def on_mount(self) -> None:
        self.watch(self.app, "engine_status", self._app_status_changed)

    def _app_status_changed(self, status: EngineStatus) -> None:
        self.engine_status = status


# ---------------------------------------------------------------------------------- model picker
class ModelPicker(ModalScreen[str | None]):
    """Pick a discovered model or type a path / hub id. The app loads it (LoadModel) and answers with
    load_finished: a failure keeps the picker open, with the previous model still loaded."""

    BINDINGS = [Binding("escape", "close", "Close")]

    def __init__(self, discover: Callable[[], list], current: str | None = None):
        super().__init__(id="model-picker")
        self._discover = discover
        self._current = current
        self._loading = False

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Label("Choose a model", classes="title")
            yield Static(sanitize(f"loaded: {self._current or 'none'}"), id="picker-current", markup=False)
            # select_on_focus off: a key typed on the list focuses the field, and the next would replace it
            yield Input(placeholder="a .gguf file, a model folder, or a Hugging Face id (org/name) + Enter",
                        id="picker-path", select_on_focus=False)
            yield DataTable(id="picker-table", cursor_type="row", zebra_stripes=True)
            with Horizontal(id="picker-status"):
                yield LoadingIndicator(id="picker-loading")
                yield Label("looking for models…", id="picker-message", markup=False)
            yield Label("Enter: load · Tab: switch field · Esc: close", classes="hint")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Name", "Arch", "Size", "Quant", "From", "Path")
        self.query_one("#picker-loading").display = False
        self.discover()

    @work(thread=True, exclusive=True, group="discover")
    def discover(self) -> None:
        try:
            entries = self._discover()
        except Exception as e:   # discovery is best effort; the path field still works
            self.app.call_from_thread(self._show_entries, [], f"could not list models: {e}")
            return
        self.app.call_from_thread(self._show_entries, entries, None)

    def _show_entries(self, entries: list, error: str | None) -> None:
        table = self.query_one(DataTable)
        table.clear()
        for e in entries:
            if e.path in table.rows:
                continue
            table.add_row(*cells(e.name, e.arch or "?", human_size(e.size_bytes), e.quant or "?", e.origin,
                                 short_path(e.path)), key=e.path)
        message = error or (f"{len(entries)} model(s) found" if entries else
                            "no models found: type a path or a hub id")
        self.query_one("#picker-message", Label).update(sanitize(message))
        if entries:
            table.focus()
        else:
            self.query_one(Input).focus()

    def on_key(self, event: events.Key) -> None:
        """Typing while the list has the focus types into the path field (it was lost, and the Enter after it
        loaded the highlighted model instead)."""
        field = self.query_one("#picker-path", Input)
        if event.is_printable and self.focused is not field:
            field.focus()
            field.insert_text_at_cursor(event.character)
            event.stop()

    @on(Input.Submitted, "#picker-path")
    def _path_submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.load(event.value.strip())

    @on(DataTable.RowSelected, "#picker-table")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        self.load(event.row_key.value)

    def load(self, model: str) -> None:
        if self._loading:
            return
        self._loading = True
        self.query_one("#picker-loading").display = True
        self.query_one("#picker-message", Label).update(sanitize(f"loading {model} …"))
        self.post_message(LoadModel(model, done=self.load_finished))

    def load_finished(self, model: str, error: str | None) -> None:
        """The app's answer to LoadModel (error: None when the model is loaded)."""
        self._loading = False
        if error is None:
            self.dismiss(model)
            return
        self.query_one("#picker-loading").display = False
        self.query_one("#picker-message", Label).update(sanitize(f"could not load {model}; the previous model is kept"))

    def action_close(self) -> None:
        if not self._loading:
            self.dismiss(None)


# ---------------------------------------------------------------------------------- bench
BENCH_ALIASES = {"seqs": "num_seqs", "input": "max_input_len", "output": "max_output_len"}

# (label, key in an iteration / in the mean, unit)
BENCH_METRICS = (
    ("requests", "num_requests", ""),
    ("prompt tokens", "prompt_tokens", ""),
    ("cached prompt tokens", "cached_tokens", ""),
    ("generated tokens", "generated_tokens", ""),
    ("elapsed", "elapsed_s", "s"),
    ("throughput", "throughput_tok_s", "tok/s"),
    ("prefill", "prefill_tok_s", "tok/s"),
    ("decode", "decode_tok_s", "tok/s"),
    ("TTFT mean", "ttft_ms.mean", "ms"),
    ("TTFT p50", "ttft_ms.p50", "ms"),
    ("TTFT p90", "ttft_ms.p90", "ms"),
    ("TTFT p99", "ttft_ms.p99", "ms"),
    ("TPOT mean", "tpot_ms.mean", "ms"),
    ("TPOT p90", "tpot_ms.p90", "ms"),
    ("preemptions", "preemptions", ""),
)


# Speculative decoding's rows, shown when the bench's requests proposed anything.
SPEC_METRICS = (
    ("proposed tokens", "spec_proposed", ""),
    ("accepted tokens", "spec_accepted", ""),
    ("tokens per step", "spec_tokens_per_step", ""),
)


def _dig(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def format_value(v) -> str:
    if isinstance(v, bool) or v is None:
        return "—" if v is None else str(v)
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e6:
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def report_table(report: dict) -> tuple[list[str], list[list[str]]]:
    """Columns and rows for a BenchReport.to_dict(): one row per metric, the mean then each iteration."""
    iterations = report.get("iterations") or []
    mean = report.get("mean") or {}
    columns = ["Metric", "Mean"] + ([f"iter {it.get('iteration', i) + 1}" for i, it in enumerate(iterations)]
                                    if len(iterations) > 1 else [])
    rows = []
    metrics = BENCH_METRICS + (SPEC_METRICS if mean.get("spec_proposed") else ())
    for label, key, unit in metrics:
        first = _dig(iterations[0], key) if iterations else None
        value = _dig(mean, key) if key != "num_requests" else first
        cells = [format_value(value)] + ([format_value(_dig(it, key)) for it in iterations]
                                         if len(iterations) > 1 else [])
        rows.append([f"{label} ({unit})" if unit else label] + cells)
    return columns, rows


def report_summary(report: dict) -> str:
    spec, engine = report.get("spec") or {}, report.get("engine") or {}
    parts = [str(report.get("model", "?")), str(report.get("device", "?")), str(engine.get("dtype", "")),
             f"{spec.get('num_seqs', '?')} seqs, input ≤ {spec.get('max_input_len', '?')}, "
             f"output ≤ {spec.get('max_output_len', '?')}",
             f"KV blocks {engine.get('num_kvcache_blocks', '?')}"]
    return " · ".join(p for p in parts if p)


def progress_text(p) -> str:
    return (f"{p.phase} {p.index + 1}/{p.count} · requests {p.finished_requests}/{p.total_requests} · "
            f"tokens {p.done_tokens}/{p.total_tokens} · {p.elapsed_s:.1f} s")


class BenchUpdate(TextualMessage):
    """Progress of the running bench and the engine's stats, posted from the client's reader thread."""

    def __init__(self, progress, stats: EngineStats):
        super().__init__()
        self.progress, self.stats = progress, stats


class BenchScreen(GaugedScreen):
    """Runs the bench workload in the engine (client.bench, in a worker thread) with live gauges; Esc
    cancels (client.cancel_bench), then closes.

    While the bench runs it owns the engine (chats wait), and the engine reports its stats with the
    bench's progress rather than on its own, so those stats feed this screen's gauges."""

    BINDINGS = [Binding("escape", "cancel_or_close", "Cancel / close")]

    def __init__(self, client: EngineClient, tier: str = "fast", overrides: dict | None = None,
                 report: dict | None = None):
        super().__init__(id="bench")
        self.client = client
        self.tier = tier
        self.overrides = {BENCH_ALIASES.get(k, k.replace("-", "_")): v for k, v in (overrides or {}).items()}
        self.report = report
        self.running = False
        self.cancelled = False

    def compose(self) -> ComposeResult:
        with Horizontal(id="bench-body"):
            with Vertical(id="bench-main"):
                extra = " ".join(f"{k}={v}" for k, v in self.overrides.items())
                yield Label(sanitize(f"Bench: {self.tier} {extra}".strip()), classes="title", markup=False)
                yield Label("starting…", id="bench-status", markup=False)
                yield ProgressBar(total=None, show_eta=False, id="bench-progress")
                yield Static("", id="bench-summary", classes="dim", markup=False)
                yield DataTable(id="bench-results", cursor_type="row", zebra_stripes=True)
            yield GaugePanel(id="bench-gauges", classes="gauges").data_bind(status=GaugedScreen.engine_status)
        yield Footer()

    def on_mount(self) -> None:
        if self.report is not None:
            self.show_report(self.report)
        else:
            self.running = True
            self.run_bench()

    @work(exclusive=True, group="bench")
    async def run_bench(self) -> None:
        try:
            spec = spec_from(self.tier, **self.overrides)
            report = await asyncio.to_thread(self.client.bench, spec, self._progress)
        except BenchCancelled:
            self.cancelled = True
            self._set_status("cancelled · Esc to close")
            self.query_one("#bench-progress", ProgressBar).update(total=1, progress=0)
        except Exception as e:   # a bad spec, a busy engine, the engine died: one line, and stay open
            self._set_status(f"bench failed: {e} · Esc to close")
            self.notify(f"bench failed: {e}", severity="error")
        else:
            self.show_report(report.to_dict())
        finally:
            self.running = False

    def _progress(self, progress, stats: EngineStats) -> None:      # the client's reader thread
        self.post_message(BenchUpdate(progress, stats))

    def _set_status(self, text: str) -> None:
        self.query_one("#bench-status", Label).update(sanitize(text))

    def on_bench_update(self, message: BenchUpdate) -> None:
        p = message.progress
        self._set_status(progress_text(p))
        self.query_one("#bench-progress", ProgressBar).update(total=max(1, p.total_tokens), progress=p.done_tokens)
        self.engine_status = replace(self.engine_status, stats=message.stats)

    def show_report(self, data: dict) -> None:
        self.report = data
        table = self.query_one(DataTable)
        table.clear(columns=True)
        columns, rows = report_table(data)
        table.add_columns(*cells(*columns))
        for row in rows:
            table.add_row(*cells(*row))
        self.query_one("#bench-summary", Static).update(sanitize(report_summary(data)))
        self._set_status("done · Esc to close")
        self.query_one("#bench-progress", ProgressBar).update(total=1, progress=1)
        table.focus()

    def action_cancel_or_close(self) -> None:
        if self.running:
            self.client.cancel_bench()
            self._set_status("cancelling…")
        else:
            self.dismiss()


# ---------------------------------------------------------------------------------- history
class HistoryScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q", "close", "Close")]

    def __init__(self, conversation: Conversation):
        super().__init__(id="history")
        self.conversation = conversation

    def compose(self) -> ComposeResult:
        c = self.conversation
        with Vertical(id="history-box"):
            yield Label(sanitize(f"History: {c.title} (the branch shown)"), classes="title", markup=False)
            yield Static(sanitize(f"system prompt: {c.system_prompt or '(none)'}"), markup=False, classes="dim")
            yield DataTable(id="history-table", cursor_type="row", zebra_stripes=True)
            yield Label(sanitize(self._totals()), id="history-totals", markup=False)
            yield Label("Esc: close", classes="hint")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("#", "Role", "Message", "Prompt", "Cached", "Prefilled", "Output", "TTFT", "tok/s", "Note")
        for i, m in enumerate(self.conversation.path, 1):
            text = " ".join(m.content.split())
            text = text if len(text) <= 48 else text[:47] + "…"
            k, n = self.conversation.version(m)
            role = f"{m.role} ‹{k}/{n}›" if n > 1 else m.role
            thought = describe_thought(m.thought) if m.thought is not None and m.thought.text else ""
            table.add_row(*cells(str(i), role, text, *self._stats_cells(m.stats),
                                 " · ".join(x for x in (thought, m.note or ("generating" if m.streaming else "")) if x)))
        table.focus()

    @staticmethod
    def _stats_cells(s: RequestStats | None) -> list[str]:
        """Prompt, cached, prefilled, output, TTFT, tok/s (blank where unknown: a user message, or a reply
        saved while the app quit, whose prompt numbers never came back)."""
        if s is None:
            return [""] * 6
        prompt = [str(s.prompt_tokens), str(s.cached_tokens), str(s.prefilled_tokens)] if s.prompt_tokens else [""] * 3
        return [*prompt, str(s.completion_tokens),
                f"{s.ttft * 1000:.0f} ms" if s.ttft is not None else "",
                f"{s.decode_tok_s:.1f}" if s.decode_tok_s else ""]

    def _totals(self) -> str:
        stats = [m.stats for m in self.conversation.path if m.stats is not None]
        prompt = sum(s.prompt_tokens for s in stats)
        cached = sum(s.cached_tokens for s in stats)
        out = sum(s.completion_tokens for s in stats)
        rate = f"{cached / prompt * 100:.0f}%" if prompt else "—"
        return (f"{len(self.conversation.path)} messages · {len(stats)} replies · prompt {prompt} tok, "
                f"cached {cached} ({rate}) · generated {out} tok")

    def action_close(self) -> None:
        self.dismiss(None)


# ---------------------------------------------------------------------------------- help
class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q", "close", "Close")]

    def __init__(self, markdown: str):
        super().__init__(id="help")
        self.markdown = markdown

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Markdown(sanitize(self.markdown))
            yield Label("Esc: close", classes="hint")

    def action_close(self) -> None:
        self.dismiss(None)


# ---------------------------------------------------------------------------------- small prompts
class TextPrompt(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = "", placeholder: str = ""):
        super().__init__(classes="prompt")
        self.title_text, self.value, self.placeholder = title, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="prompt-box"):
            yield Label(sanitize(self.title_text), classes="title", markup=False)
            yield Input(sanitize(self.value), placeholder=sanitize(self.placeholder))
            yield Label("Enter: OK · Esc: cancel", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y,enter", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str):
        super().__init__(classes="prompt")
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="prompt-box"):
            yield Label(sanitize(self.question), classes="title", markup=False)
            yield Label("y / Enter: yes · n / Esc: no", classes="hint")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class ContextFullScreen(ModalScreen[str | None]):
    """The chat no longer fits in the model's context: drop the oldest turns, go on in a new chat from a
    summary the model writes, or cancel. Dismissed with "drop", "summary" or None."""

    CHOICES = (("drop", "Drop the oldest turns (the model no longer sees them; the system prompt stays)"),
               ("summary", "Start a new chat from a summary the model writes of this one"),
               ("cancel", "Cancel (your message goes back to the input)"))
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, prompt_tokens: int, limit: int):
        super().__init__(classes="prompt")
        self.prompt_tokens, self.limit = prompt_tokens, limit

    def compose(self) -> ComposeResult:
        with Vertical(classes="prompt-box"):
            yield Label(sanitize(f"This chat no longer fits: the next turn needs {self.prompt_tokens:,} tokens, the "
                                 f"model's context holds {self.limit:,}."), classes="title", markup=False)
            yield OptionList(*[Option(sanitize(text), id=key) for key, text in self.CHOICES], id="context-choices")
            yield Label("Enter: choose · Esc: cancel", classes="hint")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(None if event.option.id == "cancel" else event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ThemePicker(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, names: list[str], current: str):
        super().__init__(classes="prompt")
        self.names, self.current = names, current

    def compose(self) -> ComposeResult:
        with Vertical(classes="prompt-box"):
            yield Label("Theme", classes="title")
            yield OptionList(*[Option(sanitize(n), id=n) for n in self.names], id="theme-list")
            yield Label("Enter: choose · Esc: cancel", classes="hint")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        if self.current in self.names:
            options.highlighted = self.names.index(self.current)
        options.focus()

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self.app.theme = event.option.id      # live preview

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.app.theme = self.current
        self.dismiss(None)


__all__ = ["GaugedScreen", "ModelPicker", "BenchScreen", "HistoryScreen", "HelpScreen", "TextPrompt", "ConfirmScreen",
           "ContextFullScreen", "ThemePicker", "human_size"]
