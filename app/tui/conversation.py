"""Conversations as the TUI holds them: messages for display and storage, plus a live ChatSession.

No Textual here: this is the bookkeeping the app drives (start a turn, finish it, rebuild a session
after a model switch by replaying the transcript, export to Markdown).
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

REPLAY_NOTE = "history re-prefilled"
_session_counter = itertools.count()


@dataclass(eq=False)   # identity: two messages with the same text are still two messages
class Message:
    role: str                       # "user" | "assistant"
    content: str
    stats: dict | None = None       # TurnStats.to_dict() of an assistant reply
    created: float = field(default_factory=time.time)
    note: str = ""
    id: int | None = None           # row id in the store
    streaming: bool = False
    generated_tokens: int = 0       # tokens received so far while streaming


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str | None = None
    model: str | None = None
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    messages: list[Message] = field(default_factory=list)
    session: object | None = None   # engine.chat.ChatSession, built lazily for the loaded model
    session_generation: int = -1    # which model load the session belongs to
    handle: object | None = None    # RequestHandle of the reply in flight
    pending: Message | None = None  # the assistant message being streamed
    pending_user: Message | None = None   # the user message of the turn in flight

    @property
    def generating(self) -> bool:
        return self.handle is not None

    @classmethod
    def from_stored(cls, stored) -> "Conversation":
        msgs = [Message(m.role, m.content, m.stats, m.created, m.note, m.id) for m in stored.messages]
        return cls(stored.id, stored.title, stored.system_prompt, stored.model, stored.created, stored.updated, msgs)


def completed_exchanges(messages: list[Message]) -> list[dict]:
    """The transcript a fresh session should know: user messages that got a reply, and the replies."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m.streaming:
            continue
        if m.role == "user":
            nxt = messages[i + 1] if i + 1 < len(messages) else None
            if nxt is None or nxt.role != "assistant" or nxt.streaming:
                continue   # no reply (crash mid-reply, or failed turn): the model never saw it answered
        out.append({"role": m.role, "content": m.content})
    return out


def new_session(engine, system_prompt: str | None, history: list[dict]):
    """A ChatSession for `engine`'s tokenizer/template, seeded with `history` (replayed on its next turn).

    The seeded ids are the template's rendering of the transcript, cut just after the last end-of-turn
    token, which is exactly how a session's ids look after complete_turn; the next prepare_turn then
    appends only the new message and the whole prompt is prefilled once (the replay)."""
    from nanochat.engine.chat import ChatMessage, ChatSession
    from nanochat.models.chat_template import end_of_turn_token

    tokenizer, template = engine.tokenizer, engine.loaded.chat_template
    session = ChatSession(tokenizer, template, system_prompt=system_prompt or None,
                          session_id=f"tui-{next(_session_counter)}")
    if not history:
        return session
    text = template.render(session.transcript() + history, add_generation_prompt=False)
    eot = end_of_turn_token(template, tokenizer) or tokenizer.eos_token
    if eot and eot in text:
        text = text[:text.rindex(eot) + len(eot)]
    session.token_ids = tokenizer.encode(text, add_special_tokens=False)
    session.messages = [ChatMessage(m["role"], m["content"]) for m in history]
    return session


def format_stats(stats: dict | None, note: str = "") -> str:
    """One footer line: tokens, TTFT, decode speed, cached prompt tokens, and any note."""
    parts: list[str] = []
    if stats:
        parts.append(f"{stats.get('completion_tokens', 0)} tok")
        if stats.get("ttft") is not None:
            parts.append(f"TTFT {stats['ttft'] * 1000:.0f} ms")
        if stats.get("decode_tok_s"):
            parts.append(f"{stats['decode_tok_s']:.1f} tok/s")
        if "prompt_tokens" in stats:
            parts.append(f"cached {stats.get('cached_tokens', 0)}/{stats['prompt_tokens']}")
        reason = stats.get("finish_reason")
        if reason == "abort":
            parts.append("cancelled")
        elif reason == "length":
            parts.append("max tokens")
        elif reason == "error":
            parts.append("error")
    if note:
        parts.append(note)
    return " · ".join(parts)


def slugify(text: str) -> str:
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", text).strip("-").lower()
    return slug[:40] or "chat"


def export_markdown(conv: Conversation, model_label: str | None = None) -> str:
    lines = [f"# {conv.title}", ""]
    meta = [f"model: {conv.model or model_label or 'unknown'}",
            f"created: {time.strftime('%Y-%m-%d %H:%M', time.localtime(conv.created))}"]
    lines += ["_" + " · ".join(meta) + "_", ""]
    if conv.system_prompt:
        lines += ["## System", "", conv.system_prompt, ""]
    for m in conv.messages:
        lines += ["## You" if m.role == "user" else "## Assistant", "", m.content, ""]
        footer = format_stats(m.stats, m.note)
        if footer:
            lines += [f"<sub>{footer}</sub>", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_export(conv: Conversation, folder: Path, model_label: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"{slugify(conv.title)}-{conv.id}-{stamp}.md"
    n = 1
    while path.exists():
        n += 1
        path = folder / f"{slugify(conv.title)}-{conv.id}-{stamp}-{n}.md"
    path.write_text(export_markdown(conv, model_label), encoding="utf-8")
    return path


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
