"""Chat sessions whose token history is canonical, so each turn prefills only the new message.

The session renders the chat template for the NEW user message only and appends those ids to its
history; after generation it appends the generated ids verbatim (plus the end-of-turn token when
generation did not end with it). Earlier turns are never re-rendered, so the ids match the cached
KV blocks exactly, even for templates that rewrite history (Qwen3 strips <think> blocks).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field

_session_ids = itertools.count()
_MARK = "\u2063nanochat-turn-marker\u2063"   # unlikely text used to find a template's turn boundary


@dataclass
class TurnStats:
    prompt_tokens: int = 0          # whole history sent for this turn
    cached_tokens: int = 0          # served from the prefix cache
    prefilled_tokens: int = 0       # newly computed
    completion_tokens: int = 0
    ttft: float | None = None
    decode_tok_s: float | None = None
    finish_reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ChatMessage:
    role: str
    content: str
    stats: TurnStats | None = None
    created: float = field(default_factory=time.time)


class ChatSession:
    def __init__(self, tokenizer, template, system_prompt: str | None = None, session_id: str | None = None):
        self.tokenizer, self.template = tokenizer, template
        self.session_id = session_id or f"chat-{next(_session_ids)}"
        self.system_prompt = system_prompt
        self.messages: list[ChatMessage] = []
        self.token_ids: list[int] = []
        self._eot = self._end_of_turn_id()
        self._pending_user: str | None = None
        self._history_len = 0

    # ------------------------------------------------------------------ template helpers
    def _end_of_turn_id(self) -> int | None:
        from nanochat.models.chat_template import end_of_turn_token

        tok = end_of_turn_token(self.template, self.tokenizer)
        return self.tokenizer.token_to_id(tok) if tok else self.tokenizer.eos_token_id

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def _encode(self, text: str) -> list[int]:
        # The template already writes any BOS it wants, as transformers' apply_chat_template does.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _render_first(self, user: str) -> str:
        return self.template.render(self._head() + [{"role": "user", "content": user}], add_generation_prompt=True)

    def _render_next(self, user: str) -> str:
        """Text that follows an earlier assistant turn's end-of-turn token, up to the new generation prompt."""
        past = self._head() + [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
        full = self.template.render(past + [{"role": "user", "content": user}], add_generation_prompt=True)
        at = full.rindex(_MARK) + len(_MARK)
        eot_text = self.tokenizer.id_to_token(self._eot) if self._eot is not None else None
        if eot_text and full.startswith(eot_text, at):
            at += len(eot_text)
        return full[at:]

    # ------------------------------------------------------------------ turns
    @property
    def num_turns(self) -> int:
        return sum(1 for m in self.messages if m.role == "assistant")

    def prepare_turn(self, user: str) -> list[int]:
        """Append the new user message; return the full prompt ids (history + new message)."""
        if self._pending_user is not None:
            raise RuntimeError("the previous turn is still in progress")
        text = self._render_next(user) if self.token_ids else self._render_first(user)
        self._history_len = len(self.token_ids)
        self.token_ids = self.token_ids + self._encode(text)
        self.messages.append(ChatMessage("user", user))
        self._pending_user = user
        return list(self.token_ids)

    def complete_turn(self, reply_text: str, generated_ids: list[int], stats: TurnStats | None = None) -> None:
        """Record the reply; its ids go into the history verbatim, closed by the end-of-turn token."""
        ids = list(generated_ids)
        if self._eot is not None and (not ids or ids[-1] != self._eot):
            ids.append(self._eot)
        self.token_ids.extend(ids)
        self.messages.append(ChatMessage("assistant", reply_text, stats))
        self._pending_user = None

    def abandon_turn(self) -> None:
        """Forget a turn that produced nothing (it failed before any token): history as before it."""
        if self._pending_user is None:
            return
        self.messages.pop()
        self.token_ids = self.token_ids[:self._history_len]
        self._pending_user = None

    def clear(self) -> None:
        """Forget the conversation (the system prompt stays). The caller releases its KV."""
        self.messages, self.token_ids, self._pending_user, self._history_len = [], [], None, 0

    def transcript(self) -> list[dict]:
        return self._head() + [{"role": m.role, "content": m.content} for m in self.messages]


def turn_stats_from_event(event) -> TurnStats:
    s = event.stats
    if s is None:
        return TurnStats(finish_reason=event.finish_reason)
    return TurnStats(prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                     prefilled_tokens=s.prompt_tokens - s.cached_tokens, completion_tokens=s.completion_tokens,
                     ttft=s.ttft, decode_tok_s=s.decode_tok_s, finish_reason=event.finish_reason)


def send(session: ChatSession, engine_thread, user: str, sampling_params=None, on_event=None):
    """Run one turn of `session` on an EngineThread; the session records the reply when it ends.

    `on_event` is called (on the engine thread) for every TokenEvent after the session's own
    bookkeeping. Returns the RequestHandle (iterate it, or wait on `handle.done`)."""
    ids = session.prepare_turn(user)
    parts: list[str] = []
    generated: list[int] = []

    def handle(event):
        parts.append(event.text)
        if event.token_id is not None:
            generated.append(event.token_id)
        if event.finished:
            if not generated:
                session.abandon_turn()
            else:
                session.complete_turn("".join(parts), generated, turn_stats_from_event(event))
        if on_event is not None:
            on_event(event)

    return engine_thread.submit(ids, sampling_params, session_id=session.session_id, on_event=handle)
