"""The chat screen: conversation list | chat views, slash-command hints and input | gauges.

It drives the ChatController (passed down by the app): the input sends through it, slash commands run
through ChatCommands, and the controller's news arrive as messages (ReplyStreamed, TurnFinished) that
update the views. What the engine does (load, restart, stats) is the app's; this screen only restarts a
stopped engine when a message is sent, since that is part of sending.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import ContentSwitcher, Footer, Header, Label, OptionList

from nanochat.app.controller import ChatController, ChatError, Conversation, EngineState, Turn
from nanochat.app.tui import commands as slash
from nanochat.app.tui.chat_commands import ChatCommands
from nanochat.app.tui.commands import NanochatCommands
from nanochat.app.tui.messages import ReplyStreamed, RunCommand, TurnFinished
from nanochat.app.tui.screens import GaugedScreen
from nanochat.app.tui.widgets import ChatInput, ChatView, CommandHints, ConversationList, GaugePanel, InputHistory
from nanochat.engine.serve.protocol import one_line
from nanochat.themes import THEME_NAMES

# Why a message cannot be sent now, by engine state (the others can send).
NOT_READY = {
    EngineState.NO_MODEL: ("No model is loaded: press Ctrl+L or type /model", "error"),
    EngineState.LOADING: ("A model is loading; send again when it is ready", "warning"),
    EngineState.RESTARTING: ("The engine is restarting; send again when it is ready", "warning"),
}


class ChatScreen(GaugedScreen):
    COMMANDS = {NanochatCommands}
    BINDINGS = [
        Binding("escape", "cancel_reply", "Cancel reply"),
        Binding("ctrl+n", "new_conversation", "New chat"),
        Binding("ctrl+r", "retry", "Retry"),
        Binding("ctrl+l", "pick_model", "Model"),
        Binding("f2", "focus_conversations", "Chats"),
        Binding("f1", "help", "Help"),
    ]

    def __init__(self, controller: ChatController, input_history: InputHistory, exports_dir: Path,
                 discover: Callable[[], list], bench_overrides: dict | None = None):
        super().__init__(id="chat")
        self.controller = controller
        self.input_history = input_history
        self.commands = ChatCommands(self, exports_dir, discover, bench_overrides)
        self.current_id: int = next(iter(controller.conversations))
        self._restart_pending = False

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="sidebar"):
                yield Label("Conversations", classes="section")
                yield ConversationList(id="conversations")
                yield Label("n/r/d: new/rename/delete", classes="hint")
            with Vertical(id="main"):
                yield ContentSwitcher(id="chats")
                yield CommandHints(id="hints")
                yield ChatInput(self.input_history, THEME_NAMES, id="input")
            yield GaugePanel(id="gauges", classes="gauges").data_bind(status=GaugedScreen.engine_status)
        yield Footer()

    async def on_mount(self) -> None:
        self.refresh_list()
        await self.show_conversation(self.current_id)
        self.query_one(ChatInput).focus()

    # ------------------------------------------------------------------ conversations
    @property
    def current(self) -> Conversation:
        return self.controller.conversations[self.current_id]

    def chat_view(self, conv: Conversation) -> ChatView | None:
        try:
            return self.query_one(f"#chat-{conv.id}", ChatView)
        except NoMatches:
            return None

    def refresh_list(self) -> None:
        self.query_one(ConversationList).set_conversations(list(self.controller.conversations.values()),
                                                           self.current_id)

    def refresh_item(self, conv: Conversation) -> None:
        self.query_one(ConversationList).refresh_conversation(conv)
        if conv.id == self.current_id:
            self.sub_title = conv.title

    async def show_conversation(self, conversation_id: int) -> None:
        conv = self.controller.conversations[conversation_id]
        switcher = self.query_one("#chats", ContentSwitcher)
        if self.chat_view(conv) is None:
            await switcher.add_content(ChatView(conv))
        switcher.current = f"chat-{conv.id}"
        self.current_id = conv.id
        self.sub_title = conv.title
        self.query_one(ConversationList).select_id(conv.id)

    @on(OptionList.OptionSelected, "#conversations")
    async def _conversation_selected(self, event: OptionList.OptionSelected) -> None:
        await self.show_conversation(int(event.option.id))
        self.query_one(ChatInput).focus()

    async def new_conversation(self, title: str = "") -> Conversation:
        conv = self.controller.new_conversation(title)
        self.refresh_list()
        await self.show_conversation(conv.id)
        self.query_one(ChatInput).focus()
        return conv

    def rename_conversation(self, conv: Conversation, title: str) -> None:
        if self.controller.rename(conv, title):
            self.refresh_item(conv)

    async def delete_conversation(self, conv: Conversation) -> None:
        self.controller.delete(conv)
        view = self.chat_view(conv)
        if view is not None:
            await view.remove()
        self.refresh_list()
        if self.current_id not in self.controller.conversations:
            await self.show_conversation(next(iter(self.controller.conversations)))

    async def clear_conversation(self, conv: Conversation) -> None:
        self.controller.clear(conv)
        view = self.chat_view(conv)
        if view is not None:
            await view.clear_messages()
        self.refresh_item(conv)

    # ------------------------------------------------------------------ sending
    @on(ChatInput.Submitted)
    async def _input_submitted(self, event: ChatInput.Submitted) -> None:
        self.query_one(CommandHints).display = False
        text = event.text
        if slash.parse(text) is not None:
            await self.commands.run(text)
            return
        if text.lstrip().startswith("//"):
            text = text.lstrip()[1:]
        await self.send_message(text)

    async def send_message(self, text: str, conv: Conversation | None = None) -> bool:
        """Start a turn in `conv` (default: the current one); False when it could not start. When the
        engine has stopped, it is restarted first (in a worker) and the message sent after that."""
        conv = conv or self.current
        state = self.controller.engine_state
        if state in NOT_READY:
            message, severity = NOT_READY[state]
            self.notify(message, severity=severity)
            return False
        if conv.generating:
            self.notify("This conversation is still replying (Esc cancels it)", severity="warning")
            return False
        if state is EngineState.STOPPED:
            if self._restart_pending:    # the worker has not reached restart_engine yet
                self.notify(NOT_READY[EngineState.RESTARTING][0], severity="warning")
                return False
            self._restart_pending = True
            self.restart_then_send(conv, text)
            return True
        try:
            turn = self.controller.send(conv, text)
        except ChatError as e:
            self.notify(f"cannot send: {e}", severity="error")
            return False
        view = self.chat_view(conv)
        if view is not None:   # events wait in the controller's inbox until these views exist
            await view.add_message(turn.user)
            await view.add_message(turn.reply)
        self.refresh_item(conv)   # the generating dot, and the title taken from the first message
        return True

    async def retry(self, conv: Conversation) -> None:
        """Regenerate the last reply: take back the last exchange and send its message again."""
        state = self.controller.engine_state
        if state in NOT_READY:
            message, severity = NOT_READY[state]
            self.notify(message, severity=severity)
            return
        try:
            old = list(conv.messages)
            text = self.controller.rewind(conv)
        except ChatError as e:
            self.notify(f"cannot retry: {e}", severity="warning")
            return
        view = self.chat_view(conv)
        if view is not None:
            for m in old[len(conv.messages):]:
                mview = view.view_for(m)
                if mview is not None:
                    await mview.remove()
        if not await self.send_message(text, conv):
            self.give_back(conv, text)

    @work(group="engine")
    async def restart_then_send(self, conv: Conversation, text: str) -> None:
        try:
            await asyncio.to_thread(self.controller.restart_engine)
        except Exception as e:   # the engine cannot start again: say why, and keep what was typed
            self.notify(f"could not restart the engine: {one_line(e)}", severity="error", timeout=10)
            self.give_back(conv, text)
            return
        finally:
            self._restart_pending = False
        await self.send_message(text, conv)

    def give_back(self, conv: Conversation, text: str) -> None:
        """Put an unsent message back into the input (unless something else was typed since)."""
        chat_input = self.query_one(ChatInput)
        if conv.id == self.current_id and not chat_input.text:
            chat_input.set_text(text)

    # ------------------------------------------------------------------ replies
    @on(ReplyStreamed)
    async def _reply_streamed(self, message: ReplyStreamed) -> None:
        view = self.chat_view(message.turn.conversation)
        mview = view.view_for(message.turn.reply) if view is not None else None
        if mview is not None:
            await mview.sync()

    @on(TurnFinished)
    async def _turn_finished(self, message: TurnFinished) -> None:
        turn = message.turn
        conv = turn.conversation
        view = self.chat_view(conv)
        if turn.kept:
            mview = view.view_for(turn.reply) if view is not None else None
            if mview is not None:
                await mview.finish()
            if turn.finish_reason == "error" and not turn.interrupted:
                self.notify(f"reply stopped by an error: {turn.error}", severity="error", timeout=8)
        else:
            await self._forget_turn(view, turn)
        self.refresh_item(conv)

    async def _forget_turn(self, view: ChatView | None, turn: Turn) -> None:
        """A turn that ended before its first token: its messages go, and the text goes back to the input."""
        if view is not None:
            for m in (turn.reply, turn.user):
                mview = view.view_for(m)
                if mview is not None:
                    await mview.remove()
            view.refresh_placeholder()
        if turn.interrupted:
            pass            # the engine died: the app says so, in one line
        elif turn.finish_reason == "error":
            self.notify(f"reply failed: {turn.error or 'unknown error'}", severity="error", timeout=8)
        else:
            self.notify("Reply cancelled before the first token")
        self.give_back(turn.conversation, turn.user.content)

    # ------------------------------------------------------------------ actions
    @on(RunCommand)
    async def _run_command(self, message: RunCommand) -> None:
        await self.commands.run(message.command)

    def action_cancel_reply(self) -> None:
        hints = self.query_one(CommandHints)
        if hints.display:
            hints.display = False
            return
        self.controller.cancel(self.current)

    def _run_soon(self, command: str) -> None:
        self.call_later(self.commands.run, command)

    def action_retry(self) -> None:
        self._run_soon("/retry")

    def action_new_conversation(self) -> None:
        self._run_soon("/new")

    def action_rename_conversation(self) -> None:
        self._run_soon("/rename")

    def action_delete_conversation(self) -> None:
        self._run_soon("/delete")

    def action_pick_model(self) -> None:
        self._run_soon("/model")

    def action_help(self) -> None:
        self._run_soon("/help")

    def action_focus_conversations(self) -> None:
        self.query_one(ConversationList).focus()
