"""The damaged chat database: a dialog that offers to move the file aside and start a new one.

The app runs on an in-memory store holding what could be read of the file (store.open_store), and the
file stays as it is unless the user chooses otherwise here.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from nanochat.app.store import ChatStore, StoreError
from nanochat.app.terminal_text import sanitize


class RecoveryScreen(ModalScreen[bool]):
    """Dismissed with True: keep the damaged file beside it under a new name and start a new database;
    False: go on without saving."""

    DEFAULT_CSS = """
    RecoveryScreen {
        align: center middle;
    }
    RecoveryScreen > Vertical {
        width: 84;
        max-width: 95%;
        height: auto;
        border: thick $error;
        background: $surface;
        padding: 1 2;
    }
    RecoveryScreen .title {
        text-style: bold;
        margin-bottom: 1;
    }
    RecoveryScreen OptionList {
        height: auto;
        margin: 1 0;
    }
    RecoveryScreen .hint {
        color: $text-muted;
    }
    """
    BINDINGS = [Binding("escape", "dismiss(False)", "Not now")]

    def __init__(self, warning: str):
        super().__init__()
        self.warning = warning

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("The chat database is damaged", classes="title")
            yield Label(Text(sanitize(f"{self.warning[:1].upper()}{self.warning[1:]}.")))   # not markup
            yield OptionList(
                Option("Keep the damaged file beside it (renamed .damaged-DATE) and start a new database with "
                       "what could be read", id="replace"),
                Option("Not now: chat without saving; the file stays as it is", id="later"),
                id="recovery-choices")
            yield Label("Enter: choose · Esc: not now", classes="hint")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id == "replace")


def offer_recovery(app: App, store: ChatStore, warning: str) -> None:
    """Ask what to do about the damaged file `store` stands in for (never decided silently), and do it."""

    def answered(replace: bool | None) -> None:
        if not replace:
            app.notify(warning, severity="error", timeout=30)
            return
        try:
            kept = store.replace_damaged()
        except StoreError as e:
            app.notify(f"{e}; chats are still not saved", severity="error", timeout=30)
            return
        app.notify(f"New chat database at {store.path}; the damaged file is kept as {kept}", timeout=15)

    app.push_screen(RecoveryScreen(warning), answered)
