"""Chat sessions: where a conversation's session state lives, its state machine, and the engine's copy.

One owner. A session's state is its `Session` record, which the client (client.py) keeps in the front
end's process: its transcript, the canonical token ids the engine reported for it, where each turn
starts in them, the turn in flight, the engine that holds it, and the front end's names for its turns
(`keys`). Everything else asks the record or is rebuilt from it:
- the engine process builds a working copy (`ChatSession`, below) from the record when the session
  opens, and reports its ids back after each turn (client: `_on_session`); it is gone when the engine
  restarts or loads another model, and the next turn builds it again (`replayed`);
- the block manager pins the KV of the session's last turn (engine/block_manager.py, by session id):
  a cache, dropped under memory pressure least recently used first; that is no transition (the
  session stays OPEN, and its next turn computes what the prefix cache no longer holds);
- a conversation tree's branches find their sessions through `BranchSessions` (below), by the keys
  each session records as its turns end: the front end keeps no copy of what a session holds.

The state machine (`Session.state`, derived from the record: closed, a turn in flight, or held by an
engine that has not ended). Every operation checks TRANSITIONS; any other is refused (SessionStateError):

    open     UNOPENED -> OPEN          the engine builds it from the record: on its first turn, or at
                                       once for a branch whose source's engine holds the cut's ids
    turn     OPEN, UNOPENED -> BUSY    a turn is submitted (an UNOPENED one is opened first, its
                                       history replayed)
    end      BUSY -> OPEN              the turn ended; it joined the history if it made tokens
    branch   OPEN, UNOPENED            the source of a new session holding its first k turns; unchanged
    rewind   OPEN, UNOPENED -> CLOSED  the source of a branch without its last turns, closed
    focus    OPEN, UNOPENED, BUSY      the branch shown: its resident KV is evicted last
    evict    OPEN, UNOPENED -> CLOSED  a tree over its capacity closes its least recently used idle one
    restart  OPEN -> UNOPENED          its engine ended (died, shut down, loaded another model): the
                                       next turn re-opens it (a BUSY one's turn ends with an error first)
    close    any -> CLOSED             its turn cancelled, its KV released; nothing more is allowed
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from nanochat.engine.serve.protocol import EngineError


# ---------------------------------------------------------------------------------- the state machine
class SessionState(enum.Enum):
    UNOPENED = "unopened"   # no engine holds it (new, or its engine ended): its next turn opens it
    OPEN = "open"           # the running engine holds it; idle
    BUSY = "busy"           # a turn in flight
    CLOSED = "closed"       # forgotten


_U, _O, _B, _C = SessionState.UNOPENED, SessionState.OPEN, SessionState.BUSY, SessionState.CLOSED

# operation -> {the state it finds: the state it leaves}; from any other state it is refused.
# "restart" happens to every session of an engine at once, when the engine ends (Incarnation.end).
TRANSITIONS: dict[str, dict[SessionState, SessionState]] = {
    "open": {_U: _O},
    "turn": {_U: _B, _O: _B},
    "end": {_B: _O, _C: _C},              # (_C: the last event of a turn cancelled by its close)
    "branch": {_U: _U, _O: _O},
    "rewind": {_U: _C, _O: _C},
    "focus": {_U: _U, _O: _O, _B: _B},    # only an OPEN (or BUSY) one has KV to keep
    "evict": {_U: _C, _O: _C},
    "restart": {_U: _U, _O: _U, _B: _B},
    "close": {_U: _C, _O: _C, _B: _C, _C: _C},
}
_REFUSALS = {
    ("turn", _B): "the previous reply in this conversation is still being generated",
    ("branch", _B): "wait for the reply before branching the conversation",
    ("rewind", _B): "wait for the reply before branching the conversation",
}


class SessionStateError(EngineError):
    """An operation the session's state does not allow (a turn while one runs, anything once closed)."""


def check(op: str, state: SessionState) -> SessionState:
    """The state `op` leaves a session in that it finds in `state`; SessionStateError if not allowed."""
    after = TRANSITIONS[op].get(state)
    if after is None:
        verb = {"turn": "send a turn to", "end": "end a turn of"}.get(op, op)
        raise SessionStateError(_REFUSALS.get((op, state), f"cannot {verb} a session that is {state.value}"))
    return after


@dataclass(eq=False)
class Incarnation:
    """One engine with one model loaded: the sessions opened in it are OPEN until it ends."""

    epoch: int
    ended: bool = False

    def end(self) -> None:
        """The engine died, was shut down or loaded another model: its sessions restart (see above)."""
        self.ended = True


# ---------------------------------------------------------------------------------- the record
@dataclass(eq=False)
class Session:
    """A chat session's state: enough to rebuild it in any engine (the client makes and changes it)."""

    id: str
    system_prompt: str | None = None
    history: list[dict] = field(default_factory=list)    # finished turns' messages, as the model saw them
    token_ids: list[int] | None = None     # canonical ids of the first len(turn_starts) turns (None: none known)
    turn_starts: list[int] | None = None   # where each of those turns starts in token_ids
    model: str | None = None               # the model the ids belong to
    engine: Incarnation | None = None      # the engine that holds it (None: none)
    request_id: str | None = None          # the turn in flight
    pending: list[dict] | None = None      # its input messages
    pending_key: Hashable = None           # its key, once it joins the history
    template_kwargs: dict | None = None    # template variables of its latest turn (a re-open renders with them)
    keys: list[Hashable] = field(default_factory=list)   # a front end's name for each finished turn (None: none)
    closed: bool = False

    def __post_init__(self):
        self.keys = (list(self.keys) + [None] * self.turns)[:self.turns]

    @property
    def state(self) -> SessionState:
        if self.closed:
            return SessionState.CLOSED
        if self.request_id is not None:
            return SessionState.BUSY
        return SessionState.OPEN if self.resident else SessionState.UNOPENED

    @property
    def resident(self) -> bool:
        """Whether a running engine holds it (its ids, and its KV unless evicted)."""
        return self.engine is not None and not self.engine.ended

    @property
    def epoch(self) -> int:
        """The epoch of the engine that holds or held it (-1: none)."""
        return self.engine.epoch if self.engine is not None else -1

    @property
    def busy(self) -> bool:
        return self.request_id is not None

    @property
    def turns(self) -> int:
        """Finished turns: each is its input messages (a user's, or tool results) and an assistant reply."""
        return sum(m["role"] == "assistant" for m in self.history)

    def turn_end(self, turns: int) -> int:
        """Where the first `turns` turns end in `history`: just after the turns-th assistant message."""
        return turn_end(self.history, turns)

    def end_turn(self, reply) -> None:
        """The turn in flight ended (`reply`: its folded Reply). One that produced tokens joins the
        history (its ids came just before, from the engine; when the engine died they never come, and
        the turn is rendered from its text when the session re-opens); one that did not is forgotten."""
        check("end", self.state)
        if reply.token_ids:
            self.history = self.history + [*self.pending, {"role": "assistant", "content": reply.text}]
            self.keys = self.keys + [self.pending_key]
        self.request_id = self.pending = self.pending_key = None


def turn_end(history: list[dict], turns: int) -> int:
    """Where the first `turns` turns of a transcript end: just after its turns-th assistant message."""
    ends = [at + 1 for at, m in enumerate(history) if m["role"] == "assistant"]
    return ends[turns - 1] if turns else 0


def _shared_turns(a: Sequence, b: Sequence) -> int:
    """Turns two sessions' keys have in common from the start."""
    n = 0
    while n < len(a) and n < len(b) and a[n] is not None and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------------------------- a conversation tree
class BranchSessions:
    """The sessions of one conversation tree's branches: at most `capacity`, least recently used
    first. Each is known by its turns' keys (Session.keys: the front end names a turn when it submits
    it, the session records the name when the turn ends), so a branch is found by asking the sessions.

    A turn on a branch uses the session holding exactly that branch, else a branch of the idle session
    sharing the most turns with it (cut there: their shared KV is found in the prefix cache), else a
    new session. `client`: the EngineClient that makes, branches and closes them."""

    def __init__(self, client, capacity: int):
        self.client, self.capacity = client, capacity
        self._sessions: list[Session] = []

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def recent(self) -> Session | None:
        """The session used last (the branch shown, unless a move to another branch came since)."""
        return self._sessions[-1] if self._sessions else None

    def session_for(self, system_prompt: str | None, keys: Sequence, history: list[dict]) -> Session:
        """A session holding the turns named `keys` (their messages: `history`); it becomes the most
        recently used, and beyond `capacity` the least recently used idle one is evicted."""
        keys = list(keys)
        best, best_turns = None, -1
        for session in self._sessions:
            if session.keys == keys:
                self._sessions.remove(session)
                self._sessions.append(session)
                return session
            turns = _shared_turns(session.keys, keys)
            if not session.busy and turns > best_turns:
                best, best_turns = session, turns
        if best is not None:
            session = self.client.branch_session(best, best_turns, history[turn_end(history, best_turns):])
        else:
            session = self.client.open_session(system_prompt, history)
        session.keys = keys
        self._sessions.append(session)
        while len(self._sessions) > self.capacity:
            idle = next((s for s in self._sessions if not s.busy), None)
            if idle is None:
                break
            check("evict", idle.state)
            self._sessions.remove(idle)
            self.client.close_session(idle)
        return session

    def submit_turn(self, session: Session, key: Hashable, *args, **kwargs):
        """The client's submit_turn(session, *args, **kwargs); the turn, once it joins the session's
        history, is known by `key`."""
        check("turn", session.state)
        session.pending_key = key
        try:
            return self.client.submit_turn(session, *args, **kwargs)
        except BaseException:
            session.pending_key = None
            raise

    def focus(self, keys: Sequence) -> None:
        """The branch named `keys` is the one shown: its session's resident KV is evicted last."""
        keys = list(keys)
        for session in self._sessions:
            if session.keys == keys:
                self.client.focus_session(session)

    def fork_into(self, other: "BranchSessions", keys: Sequence, new_keys: Sequence) -> None:
        """Give `other` (another tree) a session holding the turns `keys`, there named `new_keys`: a
        branch of the session used last that holds them, sharing its KV (none when it is busy)."""
        keys = list(keys)
        source = next((s for s in reversed(self._sessions) if s.keys[:len(keys)] == keys), None)
        if source is not None and not source.busy:
            session = self.client.branch_session(source, len(keys))
            session.keys = list(new_keys)
            other._sessions.append(session)

    def close(self) -> None:
        """Close every session: their KV is released, a turn in flight cancelled."""
        sessions, self._sessions = self._sessions, []
        for session in sessions:
            self.client.close_session(session)


# ---------------------------------------------------------------------------------- the engine's copy
_session_ids = itertools.count()
_MARK = "\u2063nanochat-turn-marker\u2063"   # unlikely text used to find a template's turn boundary


class ChatSession:
    """A session's token history as the engine builds it, canonical so that each turn prefills only its
    new messages.

    A turn is its input messages (a user message, or the tool results that answer the assistant's calls)
    and the assistant's reply. The chat template is rendered for the NEW input messages only, their ids
    appended to the history; after generation the generated ids are appended verbatim (plus the
    end-of-turn token when generation did not end with it). Earlier turns are never re-rendered, so the
    ids match the cached KV blocks exactly, even for templates that rewrite history (Qwen3 strips <think>
    blocks). A reply that calls tools is kept as the model wrote it (its <tool_call> text), which is also
    how Hermes-style templates (Qwen2.5, Qwen3) render an assistant message's tool_calls. A session
    seeded with a transcript (a branch, a model switch, a new engine process) is built the same way, turn
    by turn, optionally after canonical ids of its first turns; so every session knows where each of its
    turns starts in ids (`turn_starts`), which is what lets a client cut a session at any turn and branch
    from there with the shared prefix found in the prefix cache."""

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
        self._effort: str | None = None              # harmony: the reasoning_effort the history was rendered with

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
        other._effort = self._effort
        return other

    # ------------------------------------------------------------------ template helpers
    def _end_of_turn_id(self) -> int | None:
        from nanochat.models.text.chat_template import history_end_token

        tok = history_end_token(self.template, self.tokenizer)
        return self.tokenizer.token_to_id(tok) if tok else self.tokenizer.eos_token_id

    @property
    def _harmony(self) -> bool:
        return bool(getattr(self.template, "harmony", False))

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
        if self._harmony and messages and messages[0]["role"] == "tool":
            return self._render_harmony_results(messages, variables)
        past = self._head() + [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
        full = self.template.render(past + messages, add_generation_prompt=True, **variables)
        at = full.rindex(_MARK) + len(_MARK)
        eot_text = self._eot_text()
        if eot_text and full.startswith(eot_text, at):
            at += len(eot_text)
        return full[at:]

    def _render_harmony_results(self, messages: list[dict], variables: dict) -> str:
        """Tool results after a harmony tool call (which ends with <|call|>, no end-of-turn token): the
        template names the function they answer after the last call's, so the past it renders them after
        is a call to the same function."""
        from nanochat.models.text.harmony import split_harmony

        calls = split_harmony(self.transcript_messages[-1]["content"]).calls if self.transcript_messages else []
        if not calls:
            raise ValueError("tool results must answer a tool call of the previous reply")
        call = {"type": "function", "function": {"name": calls[-1]["function"]["name"], "arguments": {}}}
        past = self._head() + [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "", "tool_calls": [call]}]
        before = self.template.render(past, **variables)
        full = self.template.render(past + messages, add_generation_prompt=True, **variables)
        if not full.startswith(before):
            raise ValueError("the chat template does not render tool results after a call")
        return full[len(before):]

    def _harmony_reply(self, text: str) -> tuple[str, bool]:
        """A harmony reply as the template keeps it in the history: (its text after the generation prompt,
        whether it is a tool call). An answer keeps only its final message (the template drops the
        analysis of answered turns); a tool call is kept as the model wrote it (the template keeps the
        analysis before a call until an answer follows)."""
        from nanochat.models.text.harmony import MESSAGE, split_harmony

        split = split_harmony(text) if MESSAGE in text else None
        if split is not None and split.calls:
            return text, True
        answer = split.answer if split is not None else text
        asked = self._head() + [{"role": "user", "content": _MARK}]
        opened = self.template.render(asked, add_generation_prompt=True)
        answered = self.template.render(asked + [{"role": "assistant", "content": answer},
                                                 {"role": "user", "content": _MARK}])
        eot_text = self._eot_text()
        end = answered.find(eot_text, len(opened)) if eot_text and answered.startswith(opened) else -1
        if end < 0:
            raise ValueError("the chat template does not render an assistant's answer after its prompt")
        return answered[len(opened):end], False

    def _reply_text(self, message: dict) -> str:
        """An assistant message as the model would have written it after the generation prompt: its text,
        or, where its calls come as structured tool_calls (a client built it), the template's own
        rendering of them, cut between the assistant's header and its end of turn."""
        if self._harmony and not message.get("tool_calls"):
            return self._harmony_reply(message["content"])[0]
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
        if self._harmony and self.turn_starts and variables.get("reasoning_effort") != self._effort:
            # Harmony states the reasoning effort in the system message, which opens the history: another
            # effort renders the whole conversation again. The prefix cache serves it up to the effort's
            # word; everything after it is prefilled again.
            again = ChatSession.from_history(self.tokenizer, self.template, self.system_prompt,
                                             self.transcript_messages, template_kwargs=variables)
            self.token_ids, self.turn_starts = again.token_ids, again.turn_starts
        self._effort = variables.get("reasoning_effort")
        text = self._render_next(messages, variables) if self.token_ids else self._render_first(messages, variables)
        self._history_len = len(self.token_ids)
        self.token_ids = self.token_ids + self._encode(text)
        self._pending = messages
        return list(self.token_ids)

    def complete_turn(self, reply_text: str, generated_ids: list[int]) -> None:
        """Record the reply; its ids go into the history verbatim, closed by the end-of-turn token.

        Harmony replies are the exception: the template drops an answered turn's analysis from the
        history, so the reply is kept as the template renders it (its final message) and the next turn's
        prompt diverges from this turn's KV right after the generation prompt (`<|channel|>` is shared,
        `analysis` is not). Reuse is decided by the block manager's prefix cache, which serves the shared
        prefix and re-prefills the rest: the final message, then the new turn. A tool call is kept as
        written and ends with <|call|>, as the template ends it."""
        ids = list(generated_ids)
        if self._harmony:
            ids = self._harmony_ids(reply_text, ids)
        elif self._eot is not None and (not ids or ids[-1] != self._eot):
            ids.append(self._eot)
        self.token_ids.extend(ids)
        self.turn_starts.append(self._history_len)
        self.transcript_messages += [*self._pending, {"role": "assistant", "content": reply_text}]
        self._pending = None

    def _harmony_ids(self, reply_text: str, ids: list[int]) -> list[int]:
        from nanochat.models.text.chat_template import HARMONY_REPLY_ENDS

        text, called = self._harmony_reply(reply_text)
        if called:
            call_id = self.tokenizer.token_to_id(HARMONY_REPLY_ENDS[1])
            return ids if not ids or ids[-1] == call_id or call_id is None else ids + [call_id]
        return self._encode(text) + ([self._eot] if self._eot is not None else [])

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
