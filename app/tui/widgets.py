"""Widgets of the main screen: messages, the chat pane, the input, slash-command hints, gauges.

Text that is not a literal reaches a widget through `sanitize` (app/terminal_text.py): a message, a
title, a model's name are untrusted, and a control character Textual passed on would reach the
terminal (tests/test_terminal_text.py checks every widget call of app/tui)."""

from __future__ import annotations

import json
import math
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.message import Message as TextualMessage
from textual.geometry import Size
from textual.reactive import Reactive, reactive, var
from textual.widget import Widget
from textual.widgets import Label, LoadingIndicator, Markdown, OptionList, ProgressBar, Sparkline, Static, TextArea
from textual.widgets.option_list import Option
from textual.widgets.text_area import Edit, EditResult

from nanochat.app.controller import Chat
from nanochat.app.conversation import Conversation, Message
from nanochat.app.export import format_stats
from nanochat.app.reasoning import Thought, describe_thought
from nanochat.app.terminal_text import sanitize
from nanochat.app.tui.commands import matching
from nanochat.app.tui.messages import MessageAction
from nanochat.engine.output import EngineStats

ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System"}
_FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)


def code_blocks(markdown: str) -> list[str]:
    """Contents of the fenced code blocks in a message (an unclosed last fence, mid-stream, counts too)."""
    blocks = [m.group(2) for m in _FENCE.finditer(markdown)]
    rest = _FENCE.sub("", markdown)
    if rest.count("```") % 2 == 1:
        parts = rest[rest.rfind("```"):].split("\n", 1)
        if len(parts) == 2:
            blocks.append(parts[1])
    return [b.rstrip("\n") for b in blocks]


def _show_soft_breaks(state: StateCore) -> None:
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


def chat_markdown() -> MarkdownIt:
    """The messages' Markdown parser: GFM where a single newline breaks the line, as chat apps show
    replies (a poem's lines stay lines), instead of joining the lines as CommonMark does."""
    parser = MarkdownIt("gfm-like")
    parser.core.ruler.push("show_soft_breaks", _show_soft_breaks)
    return parser


FenceBlock = Markdown.BLOCKS["fence"]   # MarkdownFence, which Textual does not export


class BodyParagraph(Markdown.BLOCKS["paragraph_open"]):   # MarkdownParagraph, which Textual does not export
    """A paragraph of a message. `virtual_size` (the scrollable size) is a layout reactive in Textual,
    so each paragraph that grew would lay the whole screen out a second time, after the layout that
    grew it; a paragraph never scrolls, so here it only repaints."""

    virtual_size = Reactive(Size(0, 0), layout=False)


class MessageBody(Markdown):
    """A message's Markdown, whose growth while a reply streams costs one layout a tick, not two (see
    BodyParagraph; the body's overflow is hidden, so it never scrolls either)."""

    BLOCKS = {**Markdown.BLOCKS, "paragraph_open": BodyParagraph}
    virtual_size = Reactive(Size(0, 0), layout=False)


class ThinkingBlock(Vertical):
    """A reply's thinking, collapsed to a line: "▸ Thinking… 42 tokens · 3.1 s" and its latest line while
    the model thinks, "▸ Thought for 3.2 s · 120 tokens" once it is done; expanded (a click on it, or
    Enter or t on its message) it shows the text. The lines that change while it streams are Readouts,
    so they repaint without a layout; the text is drawn only while expanded."""

    expanded: var[bool] = var(False, init=False)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.thought: Thought | None = None   # set through show()
        self.live = False                     # the model is thinking now
        self._drawn: str | None = None        # the text the expanded view shows

    def compose(self) -> ComposeResult:
        yield Readout(classes="thinking-title")
        yield Readout(classes="thinking-tail")
        yield Static("", classes="thinking-text", markup=False)

    def on_mount(self) -> None:
        self._draw()

    def show(self, thought: Thought, live: bool) -> None:
        self.thought, self.live = thought, live
        if self.is_mounted:
            self._draw()

    def watch_expanded(self) -> None:
        self._draw()

    def on_click(self, event: events.Click) -> None:
        if event.widget is not self.query_one(".thinking-text"):   # (not while selecting its text)
            event.stop()
            self.expanded = not self.expanded

    def _draw(self) -> None:
        thought = self.thought
        if thought is None:
            return
        self.query_one(".thinking-title", Readout).text = \
            f"{'▾' if self.expanded else '▸'} {describe_thought(thought, self.live)}"
        tail = self.query_one(".thinking-tail", Readout)
        tail.display = self.live and not self.expanded and bool(thought.text)
        if tail.display:
            tail.text = thought.text.rstrip().rsplit("\n", 1)[-1][-300:]
        text = self.query_one(".thinking-text", Static)
        text.display = self.expanded
        if self.expanded and self._drawn != thought.text:
            self._drawn = thought.text
            text.update(sanitize(thought.text))


class MessageView(Vertical, can_focus=True):
    """One message: a role label (with ‹k/n› when it has other versions), a reply's thinking (collapsed;
    see ThinkingBlock), its Markdown body (streamed while the reply arrives), a stats footer."""

    BINDINGS = [
        Binding("t,enter", "toggle_thinking", "Thinking"),
        Binding("c", "copy_message", "Copy message"),
        Binding("k", "copy_code", "Copy code"),
        Binding("left", "act('prev')", "Previous version"),
        Binding("right", "act('next')", "Next version"),
        Binding("e", "act('edit')", "Edit"),
        Binding("f", "act('fork')", "Fork here"),
    ]
    KEYS = frozenset(key for binding in BINDINGS for key in binding.key.split(","))

    room: var[int] = var(0, init=False)   # the least height of the body (ChatView's room for a reply)

    def __init__(self, message: Message, versions: tuple[int, int] = (1, 1), **kwargs):
        super().__init__(classes=f"message {message.role}", **kwargs)
        self.message = message
        self.versions = versions  # (this one's number, how many): ‹2/3›
        self._shown = 0          # characters of message.content already handed to the Markdown widget
        self._edges: tuple[Widget | None, Widget | None] = (None, None)   # the body's first and last blocks

    def compose(self) -> ComposeResult:
        self._shown = len(self.message.content)
        yield Label(self._role_text(), classes="role", markup=False)
        if self.message.role == "assistant":
            yield ThinkingBlock()
        body = MessageBody(sanitize(self.message.content), classes="body", parser_factory=chat_markdown)
        body.styles.min_height = self.room or None
        yield body
        yield Static(self._footer_text(), classes="footer", markup=False)

    async def on_mount(self) -> None:
        if self.message.streaming:
            self.add_class("streaming")
        await self.sync()

    @property
    def body(self) -> MessageBody:
        return self.query_one(".body", MessageBody)

    @property
    def intact(self) -> bool:
        """On screen with its parts: Textual takes a removed view's children away before the view."""
        return self.is_attached and bool(self.query_children(".body")) and bool(self.query_children(".footer"))

    def watch_room(self, room: int) -> None:
        if self.intact:
            self.body.styles.min_height = room or None

    def _role_text(self) -> str:
        label = ROLE_LABELS.get(self.message.role, self.message.role)
        k, n = self.versions
        return sanitize(f"{label}  ‹{k}/{n}›" if n > 1 else label)

    def action_act(self, action: str) -> None:
        self.post_message(MessageAction(self.message, action))

    def _footer_text(self) -> str:
        if self.message.role != "assistant":
            return sanitize(self.message.note)
        if self.message.streaming:
            return sanitize(f"generating… {self.message.generated_tokens} tok")
        return sanitize(format_stats(self.message.stats, self.message.note))

    async def sync(self) -> None:
        """Show what the message gained since the last call. The message text is the source of truth,
        so text that arrived before this view was mounted is never lost or doubled."""
        if not self.intact:   # a stream tick while the view is taken apart (a refused turn's goes)
            return
        self._show_thinking()
        new = self.message.content[self._shown:]
        self._shown = len(self.message.content)    # before the await: a second call adds only what is newer
        if new:   # the app calls this once per stream tick, so each call brings many tokens
            await self.body.append(sanitize(new))   # character by character: safe at any split
            self._mark_edges()
        self.refresh_footer()

    def _show_thinking(self) -> None:
        thought = self.message.thought
        blocks = self.query_children(ThinkingBlock)
        if not blocks:
            return
        block = blocks.first()
        # shown while the model thinks, and after when it wrote something (an empty block says nothing)
        block.display = thought is not None and (bool(thought.text) or self.message.streaming)
        if block.display:
            block.show(thought, live=self.message.streaming and not thought.closed)

    @property
    def thinking(self) -> ThinkingBlock | None:
        """The block of the thinking shown (None: the message shows none)."""
        blocks = self.query_children(ThinkingBlock)
        return blocks.first() if blocks and blocks.first().display else None

    def check_action(self, action: str, parameters: tuple) -> bool:
        return action != "toggle_thinking" or self.thinking is not None   # the key goes on where there is none

    def action_toggle_thinking(self) -> None:
        self.thinking.expanded = not self.thinking.expanded

    def on_markdown_table_of_contents_updated(self) -> None:
        self._mark_edges()   # the body's first blocks are mounted: posted at the end of Markdown.update

    def _mark_edges(self) -> None:
        """Trim the body's outer margins: no blank line above a code block that opens it, nor below its
        last block. Inline styles, set on the blocks that start or stop being an edge: a CSS rule with
        :last-child would restyle every block of the body at each mount, and a CSS class the block and
        its subtree (~2 ms a block), several times a second while a reply streams."""
        if not self.intact:   # (after sync's await: the view may have begun to go)
            return
        blocks = self.body.children
        edges = (blocks[0], blocks[-1]) if blocks else (None, None)
        if edges == self._edges:
            return
        old, self._edges = self._edges, edges
        for block in {*old, *edges}:
            if block is not None and block.parent is self.body:
                self._trim(block, first=block is edges[0], last=block is edges[1])

    @staticmethod
    def _trim(block: Widget, first: bool, last: bool) -> None:
        block.styles.clear_rule("margin")   # back to the stylesheet's
        top, right, bottom, left = block.styles.margin
        trimmed = (0 if first and isinstance(block, FenceBlock) else top, right, 0 if last else bottom, left)
        if trimmed != (top, right, bottom, left):
            block.styles.margin = trimmed

    async def finish(self) -> None:
        await self.sync()
        self.remove_class("streaming")
        self.refresh_footer()

    def refresh_footer(self) -> None:
        if not self.intact:
            return
        footer = self.query_one(".footer", Static)
        text = self._footer_text()
        footer.update(text)
        footer.display = bool(text)

    def action_copy_message(self) -> None:
        self.app.copy_to_clipboard(self.message.content)
        self.notify("Message copied to the clipboard")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.message.content)
        if not blocks:
            self.notify("This message has no code block", severity="warning")
            return
        self.app.copy_to_clipboard(blocks[-1])
        self.notify("Code block copied to the clipboard")


class ChatView(VerticalScroll):
    """The messages of one conversation. Anchored: follows new tokens only while scrolled to the bottom;
    a streaming reply grows into room made below its question (make_room)."""

    def __init__(self, conversation: Conversation, **kwargs):
        super().__init__(id=f"chat-{conversation.id}", classes="chat", **kwargs)
        self.conversation = conversation
        self._room: MessageView | None = None   # the reply given room below its question (_make_room)
        self._room_bottom = 0                   # where that room ends, in the chat's virtual space

    def compose(self) -> ComposeResult:
        yield Static("Type a message and press Enter. /help lists the commands, Ctrl+P opens the palette.",
                     classes="placeholder")
        for m in self.conversation.path:
            yield self._view(m)

    def _view(self, message: Message) -> MessageView:
        return MessageView(message, self.conversation.version(message))

    def on_mount(self) -> None:
        self.refresh_placeholder()
        self.anchor()

    def refresh_placeholder(self) -> None:
        self.query_one(".placeholder").display = not self.conversation.path

    async def clear_messages(self) -> None:
        self._drop_room()   # first: a reply's pending room callback then finds no room to move
        await self.query(MessageView).remove()
        self.refresh_placeholder()

    def view_for(self, message: Message) -> MessageView | None:
        for view in self.query(MessageView):
            if view.message is message:
                return view
        return None

    async def show_path(self) -> None:
        """Follow the path shown (after a regenerate, an edit, a move to another version, a forgotten
        turn): the views of the messages it shares with what is on screen stay, the rest are replaced."""
        views = list(self.query(MessageView))
        path = self.conversation.path
        keep = 0
        while keep < min(len(views), len(path)) and views[keep].message is path[keep]:
            keep += 1
        self._drop_room()   # before the removal, as in clear_messages
        if views[keep:]:
            await self.remove_children(views[keep:])
        if path[keep:]:
            new = [self._view(m) for m in path[keep:]]
            if new[-1].message.streaming and len(path) > 1 and path[-2].role == "user":
                self._make_room(path[-2], new[-1])
            await self.mount_all(new)
        self.refresh_placeholder()
        self.anchor()
        if self._room is not None:
            self.call_after_refresh(self._fit_room, self._room)

    # ------------------------------------------------------------------ the room of a streaming reply
    # A streaming reply gets the rest of the view below its question (the question at the top, as web
    # chats do), so it grows into space already laid out: a tick redraws the lines that changed, where
    # a reply growing at the bottom of an anchored view scrolls, and so redraws, the whole chat at every
    # new line. The room is estimated before the views mount (one layout), checked once they have
    # (_fit_room), moved below the reply when it ends (room_below), and taken over by the next turn.
    def _make_room(self, question: Message, reply: MessageView) -> None:
        width = self.scrollable_content_region.width - 4   # a message's border and padding
        if width <= 0:
            return
        lines = sum(max(1, math.ceil(len(line) / width)) for line in question.content.splitlines() or [""])
        # question: margin, role, text; reply: margin, role, (text), footer
        room = self.scrollable_content_region.height - (lines + 5)
        if room > 0:
            reply.room = room
            self._room = reply

    def _fit_room(self, reply: MessageView, tries: int = 10) -> None:
        """Correct the estimated room once the views are laid out (a question that wraps otherwise)."""
        if reply is not self._room or not reply.intact or not reply.message.streaming:
            return
        siblings = list(self.children)
        question = siblings[siblings.index(reply) - 1]
        if not (isinstance(question, MessageView) and question.virtual_region and reply.virtual_region):
            if tries:
                self.call_after_refresh(self._fit_room, reply, tries - 1)
            return
        top = question.virtual_region.y - question.styles.margin.top
        self._room_bottom = top + self.scrollable_content_region.height
        room = reply.body.outer_size.height + self._room_bottom - reply.virtual_region.bottom
        if room != reply.room:
            reply.room = max(0, room)

    def _drop_room(self) -> None:
        if self._room is not None and self._room.intact:   # (not: removed with its conversation)
            self._room.room = 0
            self._room.styles.margin = None
        self._room, self._room_bottom = None, 0

    def on_resize(self) -> None:
        if self._room is not None and self._room.message.streaming:
            self.call_after_refresh(self._fit_room, self._room)

    def room_below(self, reply: MessageView) -> None:
        """Move the room of a reply that ended below it, once its last text is laid out: its stats line
        follows the text, and the chat's height, so its scroll position, stays as it is."""
        if reply is not self._room or not reply.intact or not reply.room:
            return
        blocks = [b for b in reply.body.children if b.display]
        text = max((b.virtual_region.bottom + b.styles.margin.bottom for b in blocks), default=0)
        height = reply.outer_size.height - reply.body.outer_size.height + text   # without the room
        reply.room = 0
        spare = self._room_bottom - (reply.virtual_region.y + height)
        if spare > 0:
            reply.styles.margin = (reply.styles.margin.top, 0, spare, 0)


class InputHistory:
    """Sent inputs, newest last, persisted as JSON lines (entries may span several lines)."""

    def __init__(self, path: Path | None, limit: int = 1000):
        self.path, self.limit = path, limit
        self.entries: list[str] = []
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    value = json.loads(line)
                except ValueError:
                    continue
                if isinstance(value, str):
                    self.entries.append(value)
        self.entries = self.entries[-limit:]
        self.index: int | None = None   # position while browsing, None = editing a new entry
        self.draft = ""

    def add(self, text: str) -> None:
        self.index = None
        if not text.strip() or (self.entries and self.entries[-1] == text):
            return
        self.entries.append(text)
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(text) + "\n")
                if len(self.entries) > self.limit * 2:   # compact now and then
                    self.entries = self.entries[-self.limit:]
                    self.path.write_text("".join(json.dumps(e) + "\n" for e in self.entries), encoding="utf-8")
            except OSError:
                pass   # history is a convenience; never fail a send over it

    def previous(self, current: str) -> str | None:
        if not self.entries:
            return None
        if self.index is None:
            self.draft, self.index = current, len(self.entries)
        if self.index == 0:
            return None
        self.index -= 1
        return self.entries[self.index]

    def next(self) -> str | None:
        if self.index is None:
            return None
        self.index += 1
        if self.index >= len(self.entries):
            self.index = None
            return self.draft
        return self.entries[self.index]


class CommandHints(OptionList):
    """Slash-command completions shown above the input while a command is typed."""

    def show(self, items: list[tuple[str, str]]) -> None:
        self.clear_options()
        if not items:
            self.display = False
            return
        self.add_options([Option(sanitize(f"{text:<16} {desc}"), id=text) for text, desc in items[:12]])
        self.highlighted = 0
        self.display = True

    def chosen(self) -> str | None:
        if not self.display or self.option_count == 0:
            return None
        option = self.get_option_at_index(self.highlighted or 0)
        return option.id


def as_typed(text: str) -> str:
    """Text put into the input as it is shown there: a CR is a line break (terminals paste line breaks as
    CR), other control characters are shown by the sanitizer, and so are sent as shown."""
    return sanitize(text.replace("\r\n", "\n").replace("\r", "\n"))


class ChatInput(TextArea):
    """Multi-line input: Enter sends, Shift+Enter / Ctrl+J insert a newline, Up/Down browse history.
    Whatever comes in (keys, a paste, a message to edit, history) passes `as_typed`."""

    BINDINGS = [
        Binding("shift+enter,ctrl+j", "newline", "New line", show=False),
        Binding("tab", "complete", "Complete", show=False),
    ]

    class Submitted(TextualMessage):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, history: InputHistory, theme_names: tuple[str, ...] = (), **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.input_history = history
        self.theme_names = theme_names
        self.reasoning_efforts: tuple[str, ...] = ()   # the loaded model's (its chat screen sets them)
        self.speculative: tuple[str, ...] = ()         # the /set speculative values its engine runs (likewise)

    @property
    def hints(self) -> CommandHints | None:
        try:
            return self.screen.query_one(CommandHints)
        except Exception:
            return None

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if not text.strip():
                return
            self.input_history.add(text)
            self.clear()
            self.post_message(self.Submitted(text))
            return
        await super()._on_key(event)

    def edit(self, edit: Edit) -> EditResult:
        """Every change of the text (typing, a paste, insert, replace) comes through here."""
        edit.text = as_typed(edit.text)
        return super().edit(edit)

    def load_text(self, text: str) -> None:
        super().load_text(as_typed(text))

    def action_newline(self) -> None:
        start, end = self.selection
        self._replace_via_keyboard("\n", start, end)

    def action_complete(self) -> None:
        hints = self.hints
        choice = hints.chosen() if hints is not None else None
        if choice is None:
            self.screen.focus_next()
            return
        self.set_text(choice + " ")

    def set_text(self, text: str) -> None:
        self.load_text(text)
        last = self.document.line_count - 1
        self.cursor_location = (last, len(self.document.get_line(last)))

    def action_cursor_up(self, select: bool = False) -> None:
        hints = self.hints
        if hints is not None and hints.display and not select:
            hints.action_cursor_up()
            return
        if not select and self.cursor_location[0] == 0:
            entry = self.input_history.previous(self.text)
            if entry is not None:
                self.set_text(entry)
                return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        hints = self.hints
        if hints is not None and hints.display and not select:
            hints.action_cursor_down()
            return
        if not select and self.cursor_location[0] == self.document.line_count - 1:
            entry = self.input_history.next()
            if entry is not None:
                self.set_text(entry)
                return
        super().action_cursor_down(select)

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        hints = self.hints
        if hints is not None:
            hints.show(matching(self.text, self.theme_names, self.reasoning_efforts, self.speculative))


class Readout(Widget):
    """One line of text that changes while replies stream. Setting `text` repaints this line only:
    `Label.update` would ask for a layout of the whole screen (a frame of 10-20 ms in a long chat)."""

    DEFAULT_CSS = "Readout { width: 1fr; height: 1; }"
    text: reactive[str] = reactive("", layout=False)

    def __init__(self, text: str = "", **kwargs):
        super().__init__(**kwargs)
        self.set_reactive(Readout.text, text)

    def render(self) -> str:
        return sanitize(self.text)


class Gauge(Vertical):
    """A number with its recent history as a sparkline."""

    def __init__(self, title: str, **kwargs):
        super().__init__(classes="gauge", **kwargs)
        self.title = title
        self.history: deque[float] = deque([0.0] * 40, maxlen=40)
        self.readout = Readout(f"{title}  —", classes="gauge-value")
        self.sparkline = Sparkline(list(self.history), summary_function=max)

    def compose(self) -> ComposeResult:
        yield self.readout
        yield self.sparkline

    def set_value(self, text: str, value: float | None = None) -> None:
        self.readout.text = f"{self.title}  {text}"
        if value is not None:
            self.history.append(value)
            self.sparkline.data = list(self.history)


@dataclass(frozen=True)
class EngineStatus:
    """What a gauge panel shows. The app keeps the current one; screens hand it down to their panels."""

    model: str = "no model"
    detail: str = ""                       # arch · device · dtype, or what the engine is doing
    busy: bool = False                     # loading a model or restarting the engine
    stats: EngineStats | None = None
    last_ttft: float | None = None         # seconds, of the last finished turn


@dataclass(frozen=True)
class ChatStatus:
    """The chat shown, for its gauges: context use and the sampling of its next turn."""

    context_used: int = 0
    context_limit: int = 0
    sampling: str = ""


def speculation_text(s: EngineStats) -> str:
    """The speculation gauge: of the recent proposals how many were accepted, and the tokens a decoding
    sequence gets per step of the model (1 without speculation); over all proposals when nothing decodes
    now; "" (the gauge hidden) before the engine has proposed anything."""
    if not s.total_spec_proposed:
        return ""
    if not s.spec_tokens_per_step:
        return f"spec  {s.total_spec_accepted / s.total_spec_proposed * 100:.0f}% accepted in all"
    if not s.spec_acceptance:   # nothing proposed of late (a chat with it off), or nothing kept
        return f"spec  none accepted · {s.spec_tokens_per_step:.1f} tok/step"
    return f"spec  {s.spec_acceptance * 100:.0f}% · {s.spec_tokens_per_step:.1f} tok/step"


class GaugePanel(Vertical):
    """Live engine gauges: model, decode/prefill speed, TTFT, KV cache, prefix hits, batch; with
    `chat`, also the chat shown: its context use and sampling settings."""

    status: var[EngineStatus] = var(EngineStatus())
    chat_status: var[ChatStatus] = var(ChatStatus())

    def __init__(self, chat: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.chat = chat
        self._sampling = ""

    def compose(self) -> ComposeResult:
        yield Label("Model", classes="section")
        yield Static(sanitize(self.status.model), id="g-model", classes="value", markup=False)
        yield Static(sanitize(self.status.detail), id="g-device", classes="dim", markup=False)
        yield Horizontal(id="g-loading", classes="loading-row")
        yield Gauge("decode tok/s", id="g-decode")
        yield Readout("", id="g-spec")   # shown once the engine has speculated
        yield Gauge("prefill tok/s", id="g-prefill")
        yield Readout("TTFT (last turn)  —", id="g-ttft")
        yield Readout("KV cache  —", id="g-kv-label")
        yield ProgressBar(total=1, show_eta=False, show_percentage=True, id="g-kv")
        yield Readout("prefix hits  —", id="g-hit")
        yield Readout("running 0 · waiting 0", id="g-seqs")
        if self.chat:
            yield Label("This chat", classes="section")
            yield Readout("context  —", id="g-context-label")
            yield ProgressBar(total=1, show_eta=False, show_percentage=True, id="g-context")
            yield Static("", id="g-sampling", classes="dim", markup=False)

    def watch_chat_status(self, status: ChatStatus) -> None:
        if not self.chat or not self.is_mounted:
            return
        limit = max(1, status.context_limit)
        self._set("#g-context-label", f"context  {status.context_used:,}/{status.context_limit:,} tokens"
                  if status.context_limit else "context  —")
        bar = self.query_one("#g-context", ProgressBar)
        if (bar.total, bar.progress) != (limit, status.context_used):
            bar.update(total=limit, progress=min(status.context_used, limit))
        if self._sampling != status.sampling:   # Static.update re-lays out the screen, even for the same text
            self._sampling = status.sampling
            self.query_one("#g-sampling", Static).update(sanitize(status.sampling))

    def on_mount(self) -> None:
        self.query_one("#g-loading").display = False
        self.query_one("#g-spec").display = False
        self._show(None, self.status)
        self.watch_chat_status(self.chat_status)

    def watch_status(self, old: EngineStatus, new: EngineStatus) -> None:
        if self.is_mounted:
            self._show(old, new)

    def _show(self, old: EngineStatus | None, new: EngineStatus) -> None:
        """Redraw what changed from `old` (None: everything). Synchronous, so that the app's stream tick
        draws the gauges in the same frame as the reply text."""
        try:
            if old is None or (old.model, old.detail) != (new.model, new.detail):
                self.query_one("#g-model", Static).update(sanitize(new.model))
                self.query_one("#g-device", Static).update(sanitize(new.detail))
            if old is None or old.busy != new.busy:
                self.call_later(self._show_busy, new.busy)
            ttft = "—" if new.last_ttft is None else f"{new.last_ttft * 1000:.0f} ms"
            self._set("#g-ttft", f"TTFT (last turn)  {ttft}")
            if new.stats is not None and (old is None or new.stats is not old.stats):
                self._show_stats(new.stats)
        except NoMatches:   # being torn down (app exit): nothing to draw on
            pass

    async def _show_busy(self, busy: bool) -> None:
        try:
            row = self.query_one("#g-loading")
        except NoMatches:
            return
        await row.remove_children()
        if busy:
            await row.mount(LoadingIndicator())
        row.display = busy

    def _set(self, selector: str, text: str) -> None:
        self.query_one(selector, Readout).text = text

    def _show_stats(self, s: EngineStats) -> None:
        self.query_one("#g-decode", Gauge).set_value(f"{s.decode_tok_s:.1f}", s.decode_tok_s)
        self.query_one("#g-prefill", Gauge).set_value(f"{s.prefill_tok_s:.0f}", s.prefill_tok_s)
        spec = self.query_one("#g-spec", Readout)
        text = speculation_text(s)
        if spec.display != bool(text):   # toggled only when it changes: a change of display lays the panel out
            spec.display = bool(text)
        spec.text = text
        total = max(1, s.kv_blocks_total)
        bar = self.query_one("#g-kv", ProgressBar)
        if (bar.total, bar.progress) != (total, s.kv_blocks_used):
            bar.update(total=total, progress=s.kv_blocks_used)
        self._set("#g-kv-label", f"KV cache  {s.kv_blocks_used}/{s.kv_blocks_total} blocks")
        self._set("#g-hit", f"prefix hits  {s.prefix_hit_rate * 100:.0f}% · {s.kv_blocks_cached} cached")
        self._set("#g-seqs", f"running {s.running} · waiting {s.waiting}")


class ConversationList(OptionList):
    """The conversations, newest first; a dot marks one that is generating. Titles are plain text (a
    title of "[/]" is not markup)."""

    BINDINGS = [
        Binding("n", "screen.new_conversation", "New"),
        Binding("r", "screen.rename_conversation", "Rename"),
        Binding("d,delete", "screen.delete_conversation", "Delete"),
    ]

    def __init__(self, **kwargs):
        super().__init__(markup=False, **kwargs)

    def set_conversations(self, conversations: list[Chat], current_id: int | None) -> None:
        self.clear_options()
        self.add_options([Option(self._label(c), id=str(c.id)) for c in conversations])
        if current_id is not None:
            self.select_id(current_id)

    @staticmethod
    def _label(c: Chat) -> str:
        return sanitize(("● " if c.generating else "  ") + c.title)

    def select_id(self, conversation_id: int) -> None:
        try:
            self.highlighted = self.get_option_index(str(conversation_id))
        except Exception:
            pass

    def refresh_conversation(self, c: Chat) -> None:
        try:
            self.replace_option_prompt(str(c.id), self._label(c))
        except Exception:
            pass
