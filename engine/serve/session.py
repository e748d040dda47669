"""Chat sessions whose token history is canonical, so each turn prefills only the new messages.

A turn is its input messages (a user message, or the tool results that answer the assistant's calls)
and the assistant's reply. A session renders the chat template for the NEW input messages only and
appends those ids to its history; after generation it appends the generated ids verbatim (plus the
end-of-turn token when generation did not end with it). Earlier turns are never re-rendered, so the
ids match the cached KV blocks exactly, even for templates that rewrite history (Qwen3 strips <think>
blocks). A reply that calls tools is kept as the model wrote it (its <tool_call> text), which is also
how Hermes-style templates (Qwen2.5, Qwen3) render an assistant message's tool_calls.

A session seeded with a transcript (a branch of a conversation tree, a model switch, a new engine
process) is built the same way, turn by turn, optionally after canonical ids of its first turns; so
every session knows where each of its turns starts in ids (`turn_starts`), which is what lets a client
cut a session at any turn and branch from there with the shared prefix found in the prefix cache.

Sessions live in the engine process, beside the tokenizer and the chat template.
"""

from __future__ import annotations

import itertools

_session_ids = itertools.count()
_MARK = "\u2063nanochat-turn-marker\u2063"   # unlikely text used to find a template's turn boundary


class ChatSession:
    def __init__(self, tokenizer, template, system_prompt: str | None = None, session_id: str | None = None):
        self.tokenizer, self.template = tokenizer, template
        self.session_id = session_id or f"chat-{next(_session_ids)}"
        self.system_prompt = system_prompt or None
        self.transcript_messages: list[dict] = []   # the messages of finished turns
        self.token_ids: list[int] = []
        self.turn_starts: list[int] = []            # len(token_ids) when each finished turn began
        self._eot = self._end_of_turn_id()
        self._pending: list[dict] | None = None      # the input messages of the turn in progress
        self._history_len = 0

    # ------------------------------------------------------------------ building
    @classmethod
    def from_history(cls, tokenizer, template, system_prompt: str | None, history: list[dict],
                     session_id: str | None = None, token_ids: list[int] | None = None,
                     turn_starts: list[int] | None = None, template_kwargs: dict | None = None) -> "ChatSession":
        """A session seeded with a transcript of finished turns (each its input messages, then an
        assistant message), prefilled on its next turn.

        `token_ids` and `turn_starts`, when given, are canonical ids of the first len(turn_starts)
        turns, kept as they are; the remaining turns are rendered one by one, exactly as live turns
        are (the reply's text encoded where a live turn has its generated ids), with the template
        variables `template_kwargs` (enable_thinking)."""
        session = cls(tokenizer, template, system_prompt, session_id)
        if token_ids is not None:
            session.token_ids, session.turn_starts = list(token_ids), list(turn_starts or [])
        turns, inputs = [], []
        for message in history:
            if message["role"] == "assistant":
                turns.append((inputs, message))
                inputs = []
            else:
                inputs.append(message)
        for inputs, reply in turns[len(session.turn_starts):]:
            session.prepare_turn(inputs, template_kwargs)
            text = session._reply_text(reply)
            session.complete_turn(text, session._encode(text))
        session.transcript_messages = [dict(m) for m in history]
        return session

    def fork(self, session_id: str | None = None) -> "ChatSession":
        """A copy that goes its own way from here; it shares the cached prefix through the prefix cache."""
        if self._pending is not None:
            raise RuntimeError("cannot fork a session while its turn is in progress")
        other = ChatSession(self.tokenizer, self.template, self.system_prompt, session_id)
        other.token_ids, other.turn_starts = list(self.token_ids), list(self.turn_starts)
        other.transcript_messages = list(self.transcript_messages)
        return other

    # ------------------------------------------------------------------ template helpers
    def _end_of_turn_id(self) -> int | None:
        from nanochat.models.text.chat_template import end_of_turn_token

        tok = end_of_turn_token(self.template, self.tokenizer)
        return self.tokenizer.token_to_id(tok) if tok else self.tokenizer.eos_token_id

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def _encode(self, text: str) -> list[int]:
        # The template already writes any BOS it wants, as transformers' apply_chat_template does.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _eot_text(self) -> str | None:
        return self.tokenizer.id_to_token(self._eot) if self._eot is not None else None

    def _render_first(self, messages: list[dict], variables: dict) -> str:
        return self.template.render(self._head() + messages, add_generation_prompt=True, **variables)

    def _render_next(self, messages: list[dict], variables: dict) -> str:
        """Text that follows an earlier assistant turn's end-of-turn token, up to the new generation prompt."""
        past = self._head() + [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
        full = self.template.render(past + messages, add_generation_prompt=True, **variables)
        at = full.rindex(_MARK) + len(_MARK)
        eot_text = self._eot_text()
        if eot_text and full.startswith(eot_text, at):
            at += len(eot_text)
        return full[at:]

    def _reply_text(self, message: dict) -> str:
        """An assistant message as the model would have written it after the generation prompt: its text,
        or, where its calls come as structured tool_calls (a client built it), the template's own
        rendering of them, cut between the assistant's header and its end of turn."""
        if not message.get("tool_calls"):
            return message["content"]
        asked = self._head() + [{"role": "user", "content": _MARK}]
        opened = self.template.render(asked, add_generation_prompt=True)
        # a tool result after it, as in the transcript: Qwen3 renders a last assistant message otherwise
        answered = self.template.render(asked + [message, {"role": "tool", "content": _MARK}])
        eot_text = self._eot_text()
        end = answered.find(eot_text, len(opened)) if eot_text and answered.startswith(opened) else -1
        if end < 0:
            raise ValueError("the chat template does not render an assistant's tool_calls as a reply")
        return answered[len(opened):end]

    # ------------------------------------------------------------------ turns
    @property
    def in_turn(self) -> bool:
        return self._pending is not None

    def prepare_turn(self, messages: str | list[dict], template_kwargs: dict | None = None) -> list[int]:
        """Append the turn's input messages (a string: one user message); return the full prompt ids
        (history + new messages). `template_kwargs`: variables for the template's render of this turn
        (enable_thinking=False, tools); the turns before it keep their ids."""
        if self._pending is not None:
            raise RuntimeError("the previous turn is still in progress")
        messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        variables = dict(template_kwargs or {})
        text = self._render_next(messages, variables) if self.token_ids else self._render_first(messages, variables)
        self._history_len = len(self.token_ids)
        self.token_ids = self.token_ids + self._encode(text)
        self._pending = messages
        return list(self.token_ids)

    def complete_turn(self, reply_text: str, generated_ids: list[int]) -> None:
        """Record the reply; its ids go into the history verbatim, closed by the end-of-turn token."""
        ids = list(generated_ids)
        if self._eot is not None and (not ids or ids[-1] != self._eot):
            ids.append(self._eot)
        self.token_ids.extend(ids)
        self.turn_starts.append(self._history_len)
        self.transcript_messages += [*self._pending, {"role": "assistant", "content": reply_text}]
        self._pending = None

    def abandon_turn(self) -> None:
        """Forget a turn that produced nothing (it failed before any token): history as before it."""
        if self._pending is None:
            return
        self.token_ids = self.token_ids[:self._history_len]
        self._pending = None

    def finish_turn(self, reply) -> None:
        """Record a finished turn from its folded Reply: kept when it produced tokens, else forgotten."""
        if reply.token_ids:
            self.complete_turn(reply.text, reply.token_ids)
        else:
            self.abandon_turn()

    def transcript(self) -> list[dict]:
        return self._head() + list(self.transcript_messages)
