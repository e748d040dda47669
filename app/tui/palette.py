"""The command palette (Ctrl+P) of the chat screen: the slash commands as palette entries."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from nanochat.app.tui.messages import RunCommand

# (palette label, help, slash command it runs)
PALETTE_ACTIONS: tuple[tuple[str, str, str], ...] = (
    ("New conversation", "start a new conversation", "/new"),
    ("Rename conversation", "rename the current conversation", "/rename"),
    ("Delete conversation", "delete the current conversation", "/delete"),
    ("Regenerate the last reply", "a new version of the last reply, beside the old one", "/retry"),
    ("Edit my last message", "send it again, changed, as a new version", "/edit"),
    ("Fork conversation", "copy the branch shown into a new conversation", "/fork"),
    ("Chat settings", "this chat's sampling settings", "/set"),
    ("Thinking on", "this chat's replies think first (reasoning models)", "/think on"),
    ("Thinking off", "this chat's replies answer without thinking (reasoning models)", "/think off"),
    ("Export every branch", "save the conversation tree as JSON in the exports folder (/export json PATH: "
     "elsewhere)", "/export json"),
    ("Clear conversation", "forget messages, keep the system prompt", "/clear"),
    ("Show history", "messages with per-turn token/cache stats", "/history"),
    ("Choose model", "open the model picker", "/model"),
    ("Bench: fast", "run the fast bench workload", "/bench fast"),
    ("Bench: normal", "run the normal bench workload", "/bench normal"),
    ("Bench: heavy", "run the heavy bench workload", "/bench heavy"),
    ("Export conversation", "save as Markdown in the exports folder (/export PATH: elsewhere)", "/export"),
    ("Copy last reply", "copy the last reply to the clipboard", "/copy"),
    ("Copy last code block", "copy the last code block to the clipboard", "/copy code"),
    ("Choose theme", "pick a theme", "/theme"),
    ("Help", "commands and keys", "/help"),
    ("Quit", "quit nanochat", "/exit"),
)


class NanochatCommands(Provider):
    """Ctrl+P on the chat screen: the slash commands as palette entries (the screen runs them as typed ones)."""

    def _run(self, command: str) -> None:
        self.screen.post_message(RunCommand(command))

    async def discover(self) -> Hits:
        for label, help_text, command in PALETTE_ACTIONS:
            yield DiscoveryHit(label, partial(self._run, command), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for label, help_text, command in PALETTE_ACTIONS:
            score = max(matcher.match(label), matcher.match(command))
            if score > 0:
                yield Hit(score, matcher.highlight(label), partial(self._run, command), help=help_text)
