"""A conversation as a tree of messages, as the store keeps it: no engine, no Textual.

`regenerate` and `edit` (app/controller.py) add versions beside the messages they replace; a
conversation shows one path through the tree (`Conversation.path`), from a first message to its leaf.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nanochat.app.reasoning import Thought, join_reasoning
from nanochat.app.store import StoredConversation
from nanochat.engine.output import RequestStats

DEFAULT_TITLE = "New chat"
REPLAY_NOTE = "history re-prefilled"
INTERRUPTED_NOTE = "interrupted: engine stopped"
STOPPED_NOTE = "interrupted: nanochat stopped"   # saved mid-reply and never finished (/retry regenerates it)
UNANSWERED_NOTE = "not answered: nanochat stopped · /retry sends it again"


class ChatError(Exception):
    """A chat operation cannot be done; the message is one line for the user."""


@dataclass(eq=False)   # identity: two messages with the same text are still two messages
class Message:
    role: str                       # "user" | "assistant"
    content: str                    # a reply's answer (its thinking is `thought`)
    stats: RequestStats | None = None   # an assistant reply's numbers
    created: float = field(default_factory=time.time)
    note: str = ""                  # REPLAY_NOTE, INTERRUPTED_NOTE, STOPPED_NOTE
    id: int | None = None           # row id in the store (None until saved)
    streaming: bool = False
    generated_tokens: int = 0       # tokens received so far while streaming
    parent: "Message | None" = field(default=None, repr=False)   # None: a first message
    children: list["Message"] = field(default_factory=list, repr=False)   # versions that follow it, oldest first
    thought: Thought | None = None  # a reply's thinking (None: it had none)

    @property
    def spoken(self) -> str:
        """The text as the model wrote it, thinking and all: what it sees again in the chat's history
        (as a live session keeps the ids it generated; the template decides what earlier turns keep)."""
        t = self.thought
        if t is None or t.harmony:   # harmony's template drops an answered turn's analysis
            return self.content
        return join_reasoning(t.text, self.content, t.closed, t.prompted)


@dataclass(eq=False)
class Conversation:
    """A tree of messages; `path` is the branch shown, first message to `leaf`."""

    id: int
    title: str
    system_prompt: str | None = None
    model: str | None = None
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    path: list[Message] = field(default_factory=list)
    roots: list[Message] = field(default_factory=list)      # the first messages of every branch
    settings: dict = field(default_factory=dict)            # the chat's own sampling settings (/set)
    context_after: "Message | None" = None  # the model sees only what follows it (older turns dropped to fit)

    @property
    def leaf(self) -> Message | None:
        return self.path[-1] if self.path else None

    def siblings(self, message: Message) -> list[Message]:
        """The versions of `message`: its parent's children (the first messages, for a first message)."""
        return message.parent.children if message.parent is not None else self.roots

    def version(self, message: Message) -> tuple[int, int]:
        """(k, n): `message` is version k of n (‹k/n›)."""
        versions = self.siblings(message)
        return versions.index(message) + 1, len(versions)

    def show(self, leaf: Message | None) -> None:
        """Make the path ending at `leaf` the one shown."""
        path = []
        while leaf is not None:
            path.append(leaf)
            leaf = leaf.parent
        self.path = path[::-1]

    def attach(self, message: Message, parent: Message | None) -> None:
        message.parent = parent
        (parent.children if parent is not None else self.roots).append(message)

    def detach(self, message: Message) -> None:
        siblings = self.siblings(message)
        if message in siblings:
            siblings.remove(message)

    @classmethod
    def from_stored(cls, stored: StoredConversation) -> "Conversation":
        conv = cls(stored.id, stored.title, stored.system_prompt, stored.model, stored.created, stored.updated,
                   settings=dict(stored.settings))
        by_id: dict[int, Message] = {}
        for m in stored.messages:   # oldest first: a parent comes before its children
            message = Message(m.role, m.content, m.stats, m.created,
                              join_notes(m.note, STOPPED_NOTE) if m.partial else m.note, m.id, thought=m.thought)
            by_id[m.id] = message
            conv.attach(message, by_id.get(m.parent_id))
        for m in by_id.values():
            if m.role == "user" and not any(c.role == "assistant" for c in m.children):
                m.note = UNANSWERED_NOTE   # the app stopped before the reply's first token
        leaf = by_id.get(stored.leaf_id) if stored.leaf_id is not None else None
        conv.show(leaf if leaf is not None else latest_leaf(conv.roots))
        conv.context_after = by_id.get(stored.context_after) if stored.context_after is not None else None
        return conv

    def held(self, messages: list[Message] | None = None) -> list[Message]:
        """The exchanges of a path (default: the one shown) that the model sees: after context_after."""
        path = self.path if messages is None else messages
        if self.context_after is not None and self.context_after in path:
            path = path[path.index(self.context_after) + 1:]
        return exchanges(path)


def latest_leaf(messages: list[Message]) -> Message | None:
    """The newest message at the end of a branch under (or among) `messages`: where a move to one of
    them lands."""
    best = None
    stack = list(messages)
    while stack:
        m = stack.pop()
        if not m.children and (best is None or (m.created, m.id or 0) > (best.created, best.id or 0)):
            best = m
        stack.extend(m.children)
    return best


def exchanges(messages: list[Message]) -> list[Message]:
    """The messages of a path a session holds: user messages that got a reply, and the replies."""
    out: list[Message] = []
    for i, m in enumerate(messages):
        if m.streaming:
            continue
        if m.role == "user":
            nxt = messages[i + 1] if i + 1 < len(messages) else None
            if nxt is None or nxt.role != "assistant" or nxt.streaming:
                continue   # never answered (a crash mid-reply): the model never saw it answered
        out.append(m)
    return out


def as_history(messages) -> list[dict]:
    return [{"role": m.role, "content": m.spoken} for m in messages]


def exchange_sizes(held: list[Message]) -> list[int]:
    """Tokens of each exchange (a user message and its reply) of a path the model sees, from the replies'
    stats (a reply's prompt + output ends where the next exchange begins); text length / 3 where no stats
    say, or where they count from another session than the exchange before."""
    sizes, end = [], 0
    for user, reply in zip(held[::2], held[1::2]):
        s = reply.stats
        new_end = s.prompt_tokens + s.completion_tokens if s is not None and s.prompt_tokens else 0
        if new_end <= end:   # no stats, or a later session's (the chat was trimmed or re-prefilled since)
            new_end = end + (len(user.content) + len(reply.content)) // 3 + 8
        sizes.append(max(1, new_end - end))
        end = new_end
    return sizes


def reply_room(max_tokens: int, limit: int) -> int:
    """Tokens kept free for a reply when a chat is trimmed to its context: max_tokens, at most a quarter of it."""
    return min(int(max_tokens), limit // 4)


def exchanges_to_drop(held: list[Message], prompt_tokens: int, limit: int, max_tokens: int) -> int:
    """How many of the oldest exchanges of `held` to leave out so that a refused prompt of `prompt_tokens`
    fits in a context of `limit` with room for a reply. ChatError when even the new message alone does not."""
    need = max(1, prompt_tokens - (limit - reply_room(max_tokens, limit)))   # it was refused: something must go
    sizes = exchange_sizes(held)
    dropped, freed = 0, 0
    while freed < need and dropped < len(sizes):
        freed += sizes[dropped]
        dropped += 1
    if freed < need:
        raise ChatError(f"the message alone does not fit in the context ({limit} tokens)")
    return dropped


def join_notes(*notes: str) -> str:
    return " · ".join(n for n in notes if n)
