"""The chat screen: conversation list | chat views, slash-command hints and input | gauges.

It drives the ChatController (passed down by the app): the input sends through it, slash commands run
through ChatCommands; streamed text arrives from the app's stream tick (show_replies) and the
controller's other news as messages (TurnFinished) that update the views. What the engine does (load,
restart, stats) is the app's; this screen only restarts a stopped engine when a message is sent,
since that is part of sending.

A message sent while a model loads (or the engine restarts) waits for it: shown at once at the end of
its chat, marked as waiting, and sent once when the engine is ready (engine_ready); if the load fails
it goes back to the input, with why. One message waits at a time, as one reply runs per chat: a second
one stays in the input with a hint (it was written before any answer to the first). Esc takes the
waiting message back; retries, edits and slash commands do what they do without a model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from pathlib import Path

from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.reactive import var
from textual.widgets import ContentSwitcher, Footer, Header, Label, OptionList

from nanochat.app.controller import Chat, ChatController, EngineState, Turn, describe_settings
from nanochat.app.conversation import DEFAULT_TITLE, ChatError, Message
from nanochat.app.terminal_text import sanitize
from nanochat.app.tui import commands as slash
from nanochat.app.tui.chat_commands import ChatCommands
from nanochat.app.tui.messages import LoadNote, MessageAction, RunCommand, TurnFinished, TurnStarted
from nanochat.app.tui.palette import NanochatCommands
from nanochat.app.tui.screens import ContextFullScreen, GaugedScreen
from nanochat.app.tui.widgets import (ChatInput, ChatStatus, ChatView, CommandHints, ConversationList, GaugePanel,
                                     InputHistory, MessageView)
from nanochat.engine.serve.protocol import one_line
from nanochat.themes import THEME_NAMES

WAITING = "waiting for the model to load"
# Engine jobs a message sent meanwhile waits for.
JOBS = (EngineState.LOADING, EngineState.RESTARTING)

# Why a message cannot be sent now, by engine state (the others can send).
NOT_READY = {
    EngineState.NO_MODEL: ("No model is loaded: press Ctrl+L or type /model", "error"),
    EngineState.LOADING: ("A model is loading; send again when it is ready", "warning"),
    EngineState.RESTARTING: ("The engine is restarting; send again when it is ready", "warning"),
}


def waiting_note(load_note: str | None) -> str:
    """The footer of a message waiting for the load: what the load is doing, when it takes long."""
    return f"{WAITING}: {load_note}" if load_note else f"{WAITING}…"


ROOM_SETTLES = 0.2   # seconds: a reply's last text is laid out (a growing paragraph takes two layouts)


class ChatScreen(GaugedScreen):
    COMMANDS = {NanochatCommands}
    chat_status: var[ChatStatus] = var(ChatStatus())
    BINDINGS = [
        Binding("escape", "cancel_reply", "Cancel reply"),
        Binding("ctrl+n", "new_conversation", "New chat"),
        Binding("ctrl+r", "retry", "Retry"),
        Binding("alt+left", "version(-1)", "‹ Version", show=False),
        Binding("alt+right", "version(1)", "Version ›", show=False),
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
        # Set by the app: a load asked for and not ended (true from start-up, before the load's worker has
        # begun: the controller says LOADING only from then on, and a message sent at once waits for it),
        # and what makes that load slow (LoadNote's text).
        self.load_pending = False
        self.load_note: str | None = None
        self.editing: Message | None = None    # a message of yours being edited in the input
        # The message sent during a load, and its chat: sent by engine_ready; its view is `_waiting_view`.
        self.waiting: tuple[Chat, Message] | None = None
        self._waiting_view: MessageView | None = None

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
                yield Label("", id="editing")
                yield ChatInput(self.input_history, THEME_NAMES, id="input")
            yield GaugePanel(id="gauges", classes="gauges", chat=True).data_bind(
                status=GaugedScreen.engine_status, chat_status=ChatScreen.chat_status)
        yield Footer()

    async def on_mount(self) -> None:
        self.refresh_list()
        await self.show_conversation(self.current_id)
        self._model_hints()   # a model loaded before the app started (no status change tells of it)
        self.query_one(ChatInput).focus()

    # ------------------------------------------------------------------ conversations
    @property
    def current(self) -> Chat:
        return self.controller.conversations[self.current_id]

    def chat_view(self, conv: Chat) -> ChatView | None:
        try:
            return self.query_one(f"#chat-{conv.id}", ChatView)
        except NoMatches:
            return None

    def refresh_list(self) -> None:
        self.query_one(ConversationList).set_conversations(list(self.controller.conversations.values()),
                                                           self.current_id)

    def refresh_item(self, conv: Chat) -> None:
        self.query_one(ConversationList).refresh_conversation(conv)
        if conv.id == self.current_id:
            self.sub_title = sanitize(conv.title)

    async def show_conversation(self, conversation_id: int) -> None:
        conv = self.controller.conversations[conversation_id]
        switcher = self.query_one("#chats", ContentSwitcher)
        if self.chat_view(conv) is None:
            await switcher.add_content(ChatView(conv))
        switcher.current = f"chat-{conv.id}"
        if conv.id != self.current_id and self.editing is not None:
            self.stop_edit()
        self.current_id = conv.id
        self.sub_title = sanitize(conv.title)
        self.query_one(ConversationList).select_id(conv.id)
        self.refresh_chat_status()

    @on(OptionList.OptionSelected, "#conversations")
    async def _conversation_selected(self, event: OptionList.OptionSelected) -> None:
        await self.show_conversation(int(event.option.id))
        self.query_one(ChatInput).focus()

    async def new_conversation(self, title: str = "") -> Chat:
        conv = self.controller.new_conversation(title)
        self.refresh_list()
        await self.show_conversation(conv.id)
        self.query_one(ChatInput).focus()
        return conv

    def rename_conversation(self, conv: Chat, title: str) -> None:
        if self.controller.rename(conv, title):
            self.refresh_item(conv)

    async def delete_conversation(self, conv: Chat) -> None:
        if self.waiting is not None and self.waiting[0] is conv:
            self.waiting = None   # deleted with its chat, as the user asked
        self.controller.delete(conv)
        view = self.chat_view(conv)
        if view is not None:
            await view.remove()
        self.refresh_list()
        if self.current_id not in self.controller.conversations:
            await self.show_conversation(next(iter(self.controller.conversations)))

    async def clear_conversation(self, conv: Chat) -> None:
        self.controller.clear(conv)
        view = self.chat_view(conv)
        if view is not None:
            await view.clear_messages()
        await self._show_waiting(conv)   # it goes out into the cleared chat
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
        if self.editing is not None:
            message = self.editing
            self.stop_edit()
            await self.edit(self.current, message, text)
            return
        await self.send_message(text)

    async def send_message(self, text: str, conv: Chat | None = None) -> bool:
        """Start a turn in `conv` (default: the current one); False when it could not start. When the
        engine has stopped, it is restarted first (in a worker) and the message sent after that; while a
        model loads, it waits for the load (see the module's docstring)."""
        conv = conv or self.current
        if self.engine_coming():
            return await self._wait(conv, text)
        return await self._begin(conv, partial(self.controller.send, conv, text), text)

    # ------------------------------------------------------------------ a message waiting for the engine
    def engine_coming(self) -> bool:
        """A load or a restart runs, or has been asked for: the engine will take messages after it."""
        return self.controller.engine_state in JOBS or self.load_pending or self._restart_pending

    async def _wait(self, conv: Chat, text: str) -> bool:
        if self.waiting is not None:
            self.notify("A message is already waiting for the model; send this one after its reply",
                        severity="warning")
            self.give_back(conv, text)
            return False
        self.waiting = (conv, Message("user", text, note=waiting_note(self.load_note)))
        await self._show_waiting(conv)
        return True

    async def _show_waiting(self, conv: Chat) -> None:
        """Show the waiting message at the end of its chat (again, after the chat's views were redone)."""
        view = self.chat_view(conv)
        if self.waiting is None or self.waiting[0] is not conv or view is None:
            return
        if self._waiting_view is None or not self._waiting_view.is_attached:
            self._waiting_view = MessageView(self.waiting[1])
            self._waiting_view.add_class("waiting")
            await view.mount(self._waiting_view)
            view.query_one(".placeholder").display = False
            view.anchor()

    async def _take_waiting(self) -> tuple[Chat, Message]:
        """The waiting message (there is one), no longer waiting: its view goes."""
        waiting, self.waiting = self.waiting, None
        view, self._waiting_view = self._waiting_view, None
        if view is not None and view.is_attached:
            await view.remove()
        chat = self.chat_view(waiting[0])
        if chat is not None:
            chat.refresh_placeholder()
        return waiting

    def show_load_note(self, note: str) -> None:
        """What makes the load slow, on the waiting message too (it is where the user looks)."""
        if self.waiting is not None:
            self.waiting[1].note = waiting_note(note)
            if self._waiting_view is not None and self._waiting_view.is_attached:
                self._waiting_view.refresh_footer()

    async def engine_ready(self, failed: str | None = None) -> None:
        """A load or a restart ended (`failed`: it did not, in a few words; its error was told already):
        the waiting message goes out, once, or back to the input. Nothing yet while another load or
        restart still runs."""
        if self.waiting is None or self.engine_coming():
            return
        conv, message = await self._take_waiting()
        if failed is None and self.controller.engine_state is not EngineState.READY:
            failed = "no model is loaded"
        if failed is not None:
            if conv.id != self.current_id:   # back to the input of its own chat
                await self.show_conversation(conv.id)
            self.give_back(conv, message.content)
            self.notify(f"Your message was not sent ({failed}); it is back in the input", severity="error",
                        timeout=10)
            return
        self.controller.drain()   # the replies a model switch cancelled end first: their chat is free
        await self._begin(conv, partial(self.controller.send, conv, message.content), message.content)

    async def retry(self, conv: Chat) -> None:
        """Regenerate the last reply: a new version of it, beside the old one (‹2/2›)."""
        await self._begin(conv, partial(self.controller.regenerate, conv), "", verb="retry")

    async def edit(self, conv: Chat, message: Message, text: str) -> bool:
        """Send `text` as a new version of the user message `message`: a branch from that point."""
        return await self._begin(conv, partial(self.controller.edit, conv, message, text), text, verb="edit")

    async def _begin(self, conv: Chat, start: Callable[[], Turn], text: str, verb: str = "send") -> bool:
        """Start a turn with `start` once the engine can take it; False when it could not start (what
        was typed, `text`, goes back to the input). A stopped engine is restarted first, in a worker."""
        state = self.controller.engine_state
        if state in NOT_READY:
            message, severity = NOT_READY[state]
            self.notify(message, severity=severity)
            self.give_back(conv, text)
            return False
        if conv.generating:
            self.notify("This conversation is still replying (Esc cancels it)", severity="warning")
            self.give_back(conv, text)
            return False
        if state is EngineState.STOPPED:
            if self._restart_pending:    # the worker has not reached restart_engine yet
                self.notify(NOT_READY[EngineState.RESTARTING][0], severity="warning")
                self.give_back(conv, text)
                return False
            self._restart_pending = True
            self.restart_then_begin(conv, start, text, verb)
            return True
        try:
            start()
        except ChatError as e:
            self.notify(f"cannot {verb}: {e}", severity="error")
            self.give_back(conv, text)
            return False
        self.post_message(TurnStarted())
        with self.app.batch_update():   # one frame: each one now is time the engine's prefill loses
            await self.show_path(conv)
            self.refresh_item(conv)   # the generating dot, and the title taken from the first message
        return True

    async def show_path(self, conv: Chat) -> None:
        view = self.chat_view(conv)
        if view is not None:   # events wait in the controller's inbox until these views exist
            await view.show_path()
            await self._show_waiting(conv)   # show_path takes away views of messages not in the chat

    def post_load_note(self, text: str) -> None:
        """A restart's `status` callback (the client's reader thread): the note goes up to the app."""
        self.post_message(LoadNote(text))

    @work(group="engine")
    async def restart_then_begin(self, conv: Chat, start: Callable[[], Turn], text: str, verb: str) -> None:
        try:
            await asyncio.to_thread(self.controller.restart_engine, status=self.post_load_note)
        except Exception as e:   # the engine cannot start again: say why, and keep what was typed
            self.notify(f"could not restart the engine: {one_line(e)}", severity="error", timeout=10)
            self.give_back(conv, text)
            self._restart_pending = False
            await self.engine_ready("the engine did not restart")
            return
        self._restart_pending = False
        await self._begin(conv, start, text, verb)
        await self.engine_ready()

    # ------------------------------------------------------------------ branches
    def start_edit(self, message: Message) -> None:
        """Put a message of yours in the input; Enter sends it as a new version, Esc stops editing."""
        conv = self.current
        if message.role != "user" or message not in conv.path:
            self.notify("Only your own messages can be edited", severity="warning")
            return
        self.editing = message
        chat_input = self.query_one(ChatInput)
        chat_input.set_text(message.content)
        chat_input.select_all()   # typing replaces it; an arrow key keeps it to change
        chat_input.focus()
        label = self.query_one("#editing", Label)
        label.update(sanitize(f"Editing message {conv.path.index(message) + 1} · Enter sends a new version · "
                              "Esc stops"))
        label.display = True

    def stop_edit(self) -> None:
        self.editing = None
        self.query_one("#editing", Label).display = False

    async def switch_version(self, conv: Chat, message: Message, step: int, focus: bool = False) -> None:
        """Show the previous (-1) or next (+1) version of `message`; `focus` moves the focus to it (when
        the move came from the message itself, so that Left/Right keep moving)."""
        try:
            shown = self.controller.switch(conv, message, step)
        except ChatError as e:
            self.notify(str(e).capitalize(), severity="warning")
            return
        if shown is None:
            self.notify("No other version that way", severity="warning")
            return
        await self.show_path(conv)
        self.refresh_chat_status()
        view = self.chat_view(conv)
        mview = view.view_for(shown) if view is not None else None
        if mview is not None and focus:
            mview.focus()
            mview.scroll_visible()

    async def fork(self, conv: Chat, message: Message) -> None:
        try:
            other = self.controller.fork(conv, message)
        except ChatError as e:
            self.notify(str(e).capitalize(), severity="warning")
            return
        self.refresh_list()
        await self.show_conversation(other.id)
        self.query_one(ChatInput).focus()
        self.notify(f"Forked into “{other.title}”")

    def on_key(self, event: events.Key) -> None:
        """Typing while a message is focused (after moving between its versions) goes to the input. The
        input consumes what it is typed itself, so a key reaching here with the input focused was sent
        to a message before the focus moved (the rest of a fast burst)."""
        if isinstance(self.focused, (MessageView, ChatInput)) and event.is_printable and event.character \
                and event.key not in MessageView.KEYS:
            chat_input = self.query_one(ChatInput)
            self.set_focus(chat_input)   # at once: the keys typed after this one go to the input too
            chat_input.insert(event.character)
            event.stop()

    def on_paste(self, event: events.Paste) -> None:
        """A paste while a message has the focus goes to the input, as typing does (the input handles
        its own pastes; this sees them bubble up)."""
        if isinstance(self.focused, MessageView):
            chat_input = self.query_one(ChatInput)
            self.set_focus(chat_input)
            chat_input.insert(event.text)
            event.stop()

    @on(MessageAction)
    async def _message_action(self, event: MessageAction) -> None:
        event.stop()
        conv = self.current
        if event.action == "edit":
            self.start_edit(event.message)
        elif event.action == "fork":
            await self.fork(conv, event.message)
        else:
            await self.switch_version(conv, event.message, -1 if event.action == "prev" else 1, focus=True)

    def last_versioned(self, conv: Chat) -> Message | None:
        """The last message of the path shown that has other versions."""
        return next((m for m in reversed(conv.path) if len(conv.siblings(m)) > 1), None)

    def give_back(self, conv: Chat, text: str) -> None:
        """Put an unsent message back into the input, on lines of its own above what was typed since (a
        message sent next must not run into it)."""
        if not text or conv.id != self.current_id:   # (a retry gives back no text)
            return
        chat_input = self.query_one(ChatInput)
        typed = chat_input.text
        chat_input.set_text(f"{text}\n{typed}" if typed else text)

    def take_back(self, turn: Turn) -> None:
        """A message of a turn that was not answered goes back to the input. When it was the first of its
        chat, the chat, empty again, drops the title it took from the message."""
        if not turn.new_user:
            return
        conv = turn.conversation
        titled_by_it = " ".join(turn.user.content.split()).startswith(conv.title)   # as controller.send does
        if not conv.roots and conv.title != DEFAULT_TITLE and titled_by_it:
            self.controller.rename(conv, DEFAULT_TITLE)
            self.refresh_item(conv)
        self.give_back(conv, turn.user.content)

    # ------------------------------------------------------------------ replies
    async def show_replies(self, turns: list[Turn]) -> None:
        """Show what these replies gained (the app's stream tick calls this inside one batch update)."""
        for turn in turns:
            view = self.chat_view(turn.conversation)
            mview = view.view_for(turn.reply) if view is not None else None
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
                view.set_timer(ROOM_SETTLES, partial(view.room_below, mview))
            if turn.finish_reason == "error" and not turn.interrupted:
                self.notify(f"reply stopped by an error: {turn.error}", severity="error", timeout=8)
        else:
            await self._forget_turn(turn)
        self.refresh_item(conv)
        if conv.id == self.current_id:
            self.refresh_chat_status()

    async def _forget_turn(self, turn: Turn) -> None:
        """A turn that ended before its first token: its messages go, and the text goes back to the input."""
        await self.show_path(turn.conversation)
        if turn.interrupted:
            pass            # the engine died: the app says so, in one line
        elif turn.context_exceeded:
            await self.offer_context_choice(turn)
            return
        elif turn.finish_reason == "error":
            self.notify(f"reply failed: {turn.error or 'unknown error'}", severity="error", timeout=8)
        else:
            self.notify("Reply cancelled before the first token")
        self.take_back(turn)

    # ------------------------------------------------------------------ the context window
    async def offer_context_choice(self, turn: Turn) -> None:
        """The turn did not fit in the context: ask what to do, then do it and send the message again."""
        limit = self.controller.model.max_model_len if self.controller.model else 0

        async def chosen(choice: str | None) -> None:
            if choice == "drop":
                await self.drop_oldest_and_resend(turn)
            elif choice == "summary":
                self.notify("Writing a summary of this chat…")
                self.summarize_and_resend(turn)
            else:
                self.take_back(turn)

        await self.app.push_screen(ContextFullScreen(turn.fold.stats.prompt_tokens, limit), chosen)

    def _again(self, turn: Turn, conv: Chat | None = None) -> Callable[[], Turn]:
        """What starts `turn` over (in `conv`, default its own): an edit, a regenerate or a message."""
        conv = conv or turn.conversation
        if conv is turn.conversation and turn.edit_of is not None:
            return partial(self.controller.edit, conv, turn.edit_of, turn.user.content)
        if conv is turn.conversation and not turn.new_user:
            return partial(self.controller.regenerate, conv)
        return partial(self.controller.send, conv, turn.user.content)

    async def drop_oldest_and_resend(self, turn: Turn) -> None:
        conv = turn.conversation
        try:
            dropped = self.controller.drop_oldest(conv, turn)
        except ChatError as e:
            self.notify(f"cannot drop turns: {e}", severity="error", timeout=8)
            self.take_back(turn)
            return
        oldest = "the oldest turn (it stays on screen)" if dropped == 1 else \
            f"the oldest {dropped} turns (they stay on screen)"
        self.notify(f"The model no longer sees {oldest}", timeout=8)
        self.refresh_chat_status()
        await self._begin(conv, self._again(turn), turn.user.content if turn.new_user else "")

    @work(group="summary", exclusive=True)
    async def summarize_and_resend(self, turn: Turn) -> None:
        conv = turn.conversation
        try:
            summary = await asyncio.to_thread(self.controller.summarize, conv)
        except ChatError as e:
            self.notify(str(e), severity="error", timeout=10)
            self.take_back(turn)
            return
        other = self.controller.continue_with_summary(conv, summary)
        self.refresh_list()
        await self.show_conversation(other.id)
        self.notify(f"Continuing in “{other.title}” from a summary (its system prompt; /system shows it)",
                    timeout=10)
        await self._begin(other, self._again(turn, other), turn.user.content)

    def refresh_chat_status(self) -> None:
        """The gauges' "this chat" lines: its context use and the sampling its next turn uses."""
        conv = self.current
        model = self.controller.model
        self.chat_status = ChatStatus(self.controller.context_used(conv), model.max_model_len if model else 0,
                                      describe_settings(self.controller.sampling_for(conv), conv.settings))

    def watch_engine_status(self, old, new) -> None:
        if (old.model, old.detail) != (new.model, new.detail) and self.is_mounted:
            self.refresh_chat_status()   # another model: another context size and recommendations
            self._model_hints()

    def _model_hints(self) -> None:
        """The input's hints for what the model and its engine take: the reasoning efforts its template reads
        and the /set speculative values the engine runs."""
        model = self.controller.model
        chat_input = self.query_one(ChatInput)
        chat_input.reasoning_efforts = model.reasoning_efforts if model else ()
        chat_input.speculative = slash.speculative_choices(model.speculative_modes) if model else ()

    # ------------------------------------------------------------------ actions
    @on(RunCommand)
    async def _run_command(self, message: RunCommand) -> None:
        await self.commands.run(message.command)

    def action_cancel_reply(self) -> None:
        hints = self.query_one(CommandHints)
        if hints.display:
            hints.display = False
            return
        if self.editing is not None:
            self.stop_edit()
            self.query_one(ChatInput).set_text("")
            return
        if self.waiting is not None and self.waiting[0] is self.current:
            self.call_later(self._unwait)
            return
        self.controller.cancel(self.current)

    async def _unwait(self) -> None:
        if self.waiting is None:   # it went out meanwhile
            return
        conv, message = await self._take_waiting()
        self.give_back(conv, message.content)
        self.notify("Not sent: your message is back in the input")

    async def action_version(self, step: int) -> None:
        conv = self.current
        message = self.last_versioned(conv)
        if message is None:
            self.notify("No message here has other versions (Ctrl+R or an edit makes one)", severity="warning")
            return
        await self.switch_version(conv, message, step)

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
