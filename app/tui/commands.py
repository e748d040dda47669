"""Slash commands: their table, parsing, completion and help (no Textual; the chat screen runs them
through ChatCommands, the command palette offers them through palette.py)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from nanochat.app.controller import CHAT_SETTINGS
from nanochat.app.options import REPLY_FORMATS, REQUEST_RULES, TEMPLATE_RULES


@dataclass(frozen=True)
class SlashCommand:
    name: str          # without the slash
    usage: str
    help: str


SLASH_COMMANDS: tuple[SlashCommand, ...] = (
    SlashCommand("help", "/help", "list commands and keys"),
    SlashCommand("new", "/new [TITLE]", "start a new conversation"),
    SlashCommand("rename", "/rename [TITLE]", "rename this conversation"),
    SlashCommand("delete", "/delete", "delete this conversation"),
    SlashCommand("retry", "/retry", "a new version of the last reply (or answer an unanswered message)"),
    SlashCommand("edit", "/edit", "edit your last message and send it as a new version (a branch)"),
    SlashCommand("fork", "/fork", "copy this conversation's branch shown into a new conversation"),
    SlashCommand("set", "/set [NAME VALUE|NAME -]", "show or set this chat's sampling (temperature, top_p, top_k, "
                 "seed, max_tokens, repetition_penalty, presence_penalty, frequency_penalty), speculative decoding "
                 "(speculative off|ngram|draft) or what holds the replies (json_schema object|@FILE|JSON, "
                 "grammar @FILE|TEXT); - drops one"),
    SlashCommand("think", "/think [on|off|-]", "show or switch this chat's thinking (reasoning models: the chat "
                 "template's enable_thinking); - goes back to the model's default"),
    SlashCommand("clear", "/clear", "forget this conversation's messages (keeps the system prompt, frees its KV)"),
    SlashCommand("history", "/history", "the branch shown, message by message, with token/cache stats"),
    SlashCommand("system", "/system [TEXT|-]", "show, set, or (with -) remove the system prompt"),
    SlashCommand("model", "/model [PATH|HUB-ID]", "pick a model, or load the one named"),
    SlashCommand("bench", "/bench [fast|normal|heavy] [key=value ...]", "run the bench workload on the loaded model"),
    SlashCommand("export", "/export [json|md] [PATH]", "save the branch shown as Markdown, or (json, or a PATH "
                 "ending in .json) every branch as JSON, to the exports folder or to PATH (a file, or a folder "
                 "for the default name; never overwrites)"),
    SlashCommand("copy", "/copy [code]", "copy the last reply (or its last code block) to the clipboard"),
    SlashCommand("theme", "/theme [NAME]", "pick or set the theme"),
    SlashCommand("exit", "/exit", "quit nanochat"),
)
COMMANDS_BY_NAME = {c.name: c for c in SLASH_COMMANDS}
BENCH_TIERS = ("fast", "normal", "heavy")


def parse(text: str) -> tuple[str, str] | None:
    """'/name rest' -> ('name', 'rest'); None when the text is not a command."""
    text = text.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, rest = text[1:].partition(" ")
    return name.lower(), rest.strip()


def parse_export(arg: str) -> tuple[bool, str]:
    """/export's argument, `[json|md] [PATH]` -> (every branch as JSON, PATH or ""): without json or md
    first, a PATH ending in .json means JSON. PATH is the rest of the line (spaces and all), one pair of
    quotes around it dropped."""
    word, _, rest = arg.partition(" ")
    if word.lower() in ("json", "md"):
        return word.lower() == "json", _unquote(rest.strip())
    path = _unquote(arg)
    return path.lower().endswith(".json"), path


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def unknown_message(name: str) -> str:
    close = difflib.get_close_matches(name, COMMANDS_BY_NAME, n=1)
    hint = f" Did you mean /{close[0]}?" if close else ""
    return f"Unknown command /{name}.{hint} Type /help for the list."


SPECULATIVE_HINTS = {"off": "this chat decodes one token per step", "ngram": "this chat's replies speculate on "
                     "n-gram matches in the chat", "draft": "this chat's replies speculate with the draft model"}


def speculative_choices(modes: tuple) -> tuple[str, ...]:
    """The /set speculative values worth offering on an engine whose requests may pick `modes`
    (ModelInfo.speculative_modes): none when it cannot speculate, draft only with a draft model."""
    return tuple(modes) if len(modes) > 1 else ()


def completions(theme_names: tuple[str, ...] = (), reasoning_efforts: tuple[str, ...] = (),
                speculative: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(text to insert, description) for every command and the arguments worth completing;
    `reasoning_efforts`: the values the model's chat template reads (none: /set reasoning_effort is not offered);
    `speculative`: the /set speculative values the engine can run (speculative_choices)."""
    out = [(f"/{c.name}", c.help) for c in SLASH_COMMANDS]
    out += [(f"/bench {t}", f"bench, {t} tier") for t in BENCH_TIERS]
    out += [(f"/theme {t}", "theme") for t in theme_names]
    out += [("/copy code", "copy the last code block of the last reply")]
    out += [("/export json", "every branch of this conversation as JSON")]
    out += [(f"/set {name} ", "this chat's sampling") for name in CHAT_SETTINGS
            if name not in TEMPLATE_RULES and name not in REQUEST_RULES and name not in REPLY_FORMATS]
    out += [("/set json_schema object", "this chat's replies: a JSON object"),
            ("/set json_schema @", "this chat's replies follow a JSON schema (@FILE, or the schema's JSON)"),
            ("/set grammar @", "this chat's replies follow a grammar (@FILE, or its GBNF or Lark text)")]
    out += [(f"/set reasoning_effort {v}", "this chat's reasoning effort (gpt-oss)") for v in reasoning_efforts]
    out += [(f"/set speculative {v}", SPECULATIVE_HINTS[v]) for v in speculative]
    out += [("/think on", "this chat's replies think first"), ("/think off", "this chat's replies answer at once")]
    return out


def matching(prefix: str, theme_names: tuple[str, ...] = (), reasoning_efforts: tuple[str, ...] = (),
             speculative: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    if not prefix.startswith("/") or "\n" in prefix:
        return []
    items = completions(theme_names, reasoning_efforts, speculative)
    if " " not in prefix:   # first word: only the commands themselves
        items = [i for i in items if " " not in i[0]]
    return [i for i in items if i[0].startswith(prefix.lower()) and i[0] != prefix]


def help_markdown(theme_names: tuple[str, ...] = ()) -> str:
    def cell(text: str) -> str:   # a table's "|" splits cells, inside code spans too, unless escaped
        return text.replace("|", "\\|")

    rows = "\n".join(f"| `{cell(c.usage)}` | {cell(c.help)} |" for c in SLASH_COMMANDS)
    return f"""# nanochat

| Command | What it does |
|---|---|
{rows}

| Key | Action |
|---|---|
| `Enter` | send |
| `Shift+Enter` / `Ctrl+J` | new line |
| `Up` / `Down` | input history (on the first / last line) |
| `Tab` | complete a slash command |
| `Esc` | cancel the reply being generated (or the bench) |
| `Ctrl+N` | new conversation |
| `Ctrl+R` | a new version of the last reply |
| `Alt+Left` / `Alt+Right` | previous / next version of the last message that has several (‹2/3›) |
| `F2` | go to the conversation list (`n` new, `r` rename, `d` delete, `Enter` open) |
| `Ctrl+L` | model picker |
| `Ctrl+P` | command palette |
| `c` / `k` on a focused message | copy the message / its code block |
| `Left` / `Right` on a focused message | its previous / next version |
| `t` / `Enter` on a focused reply, or a click on its "Thinking" line | show or hide its thinking |
| `e` / `f` on a focused message | edit it (yours) and send it as a new version / fork the chat there |
| `Ctrl+Q` | quit |

Themes: {", ".join(theme_names)}
"""
