"""The chat session's state machine (engine/serve/session.py): its table, each transition on a real
engine process, refused operations, an engine restart re-opening sessions lazily, and the branches of
a conversation tree found by asking the sessions."""

from __future__ import annotations

import itertools
import threading

import pytest

from nanochat.engine.output import Reply, TokenEvent
from nanochat.engine.sampling_params import SamplingParams
from nanochat.engine.serve.client import (BranchSessions, EngineClient, Session, SessionState,
                                          SessionStateError)
from nanochat.engine.serve.protocol import EngineError
from nanochat.engine.serve.session import TRANSITIONS, Incarnation, check

ENGINE = dict(dtype="float32", max_model_len=256, kvcache_block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
U, O, B, C = SessionState.UNOPENED, SessionState.OPEN, SessionState.BUSY, SessionState.CLOSED


# ---------------------------------------------------------------------------------- the table
def test_the_table_allows_what_it_lists_and_refuses_the_rest():
    assert set(TRANSITIONS) == {"open", "turn", "end", "branch", "rewind", "focus", "evict", "restart", "close"}
    for op, moves in TRANSITIONS.items():
        for state in SessionState:
            if state in moves:
                assert check(op, state) is moves[state]
            else:
                with pytest.raises(SessionStateError):
                    check(op, state)
    assert check("turn", U) is B and check("end", B) is O and check("restart", O) is U
    assert all(check("close", s) is C for s in SessionState)
    with pytest.raises(EngineError, match="still being generated"):   # a SessionStateError is an EngineError
        check("turn", B)
    with pytest.raises(SessionStateError, match="cannot send a turn to a session that is closed"):
        check("turn", C)


def test_a_records_state_is_what_it_says():
    engine = Incarnation(1)
    session = Session("s", history=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert session.state is U and session.epoch == -1 and session.keys == [None]
    session.engine = engine                        # opened
    assert session.state is O and session.epoch == 1
    session.request_id, session.pending, session.pending_key = "r1", [{"role": "user", "content": "more"}], "k"
    assert session.state is B
    engine.end()                                   # its engine died under the turn
    assert session.state is B
    reply = Reply()
    reply.add(TokenEvent("r1", 7, "ok"))
    session.end_turn(reply)                        # the partial reply is kept, under its key
    assert session.state is U and session.turns == 2 and session.keys == [None, "k"]
    with pytest.raises(SessionStateError):
        session.end_turn(reply)                    # no turn to end
    session.closed = True
    assert session.state is C


# ---------------------------------------------------------------------------------- on an engine
@pytest.fixture(scope="module")
def client(tiny_models):
    c = EngineClient()
    c.load_model(str(tiny_models["qwen3"]), **ENGINE)
    yield c
    c.shutdown()


def test_each_transition_on_a_real_engine(client):
    session = client.open_session("Be brief.")                              # open: lazily
    assert session.state is U
    stream = client.submit_turn(session, "hello there", GREEDY)              # turn: opened first
    assert session.state is B and not stream.replayed
    stream.result(30)
    assert session.state is O and session.epoch == client.epoch              # end
    client.submit_turn(session, "and again", GREEDY).result(30)
    branch = client.branch_session(session, 1)                               # branch: opened at once
    assert branch.state is O and session.state is O and branch.turns == 1
    client.focus_session(branch)                                             # focus: stays OPEN
    assert branch.state is O
    back = client.rewind_session(session, 1)                                 # rewind: the source closes
    assert session.state is C and back.state is O and back.turns == 1
    client.close_session(branch)
    client.close_session(back)
    assert branch.state is back.state is C
    client.close_session(back)                                               # closing twice is harmless


def test_refused_transitions_leave_the_session_as_it_was(client):
    session = client.open_session()
    started = threading.Event()
    stream = client.submit_turn(session, "tell me a long story", LONG, on_event=lambda ev: started.set())
    assert started.wait(30) and session.state is B
    with pytest.raises(SessionStateError, match="still being generated"):
        client.submit_turn(session, "another", GREEDY)
    with pytest.raises(SessionStateError, match="wait for the reply"):
        client.branch_session(session, 0)
    stream.cancel()
    stream.result(30)
    assert session.state is O and session.turns == 1                        # the cancelled reply is kept
    client.close_session(session)
    with pytest.raises(SessionStateError, match="closed"):                   # nothing more once closed
        client.submit_turn(session, "hello?", GREEDY)
    with pytest.raises(SessionStateError, match="closed"):
        client.branch_session(session, 0)
    with pytest.raises(SessionStateError, match="closed"):
        client.focus_session(session)
    assert session.state is C and session.turns == 1


def test_an_engine_restart_reopens_sessions_lazily(tiny_models):
    """A model load or a new engine process ends the engine that held the sessions: they become
    UNOPENED at once, and each re-opens on its own next turn, its history replayed."""
    client = EngineClient()
    try:
        client.load_model(str(tiny_models["qwen3"]), **ENGINE)
        a, b = client.open_session(), client.open_session()
        for s in (a, b):
            client.submit_turn(s, "hello there", GREEDY).result(30)
        assert a.state is b.state is O
        client.load_model(str(tiny_models["qwen3"]), **ENGINE)                # a model load: a new engine
        assert a.state is b.state is U and a.epoch < client.epoch
        stream = client.submit_turn(a, "next", GREEDY)
        assert stream.replayed and stream.result(30).stats.cached_tokens == 0
        assert a.state is O and b.state is U                                  # b waits for its own turn
        pid, died = client.pid, threading.Event()
        client.add_death_listener(lambda reason: died.set())
        client.kill()                                                         # the engine process dies
        assert died.wait(30) and a.state is U and not client.alive
        stream = client.submit_turn(a, "still there?", GREEDY)                # a new process, lazily
        assert stream.replayed and stream.result(60).final.finish_reason == "length"
        assert client.pid != pid and a.state is O and a.turns == 3 and b.state is U
        stream = client.submit_turn(b, "and you?", GREEDY)
        assert stream.replayed and stream.result(30).final.finish_reason == "length" and b.turns == 2
    finally:
        client.shutdown()
    assert a.state is U                                                       # a shutdown ends its engine too


# ---------------------------------------------------------------------------------- a conversation tree
class RecordingClient:
    """The session operations BranchSessions uses, recorded; turns end at once with one token."""

    def __init__(self):
        self.calls: list[tuple] = []
        self._ids = itertools.count()

    def open_session(self, system_prompt=None, history=None):
        self.calls.append(("open", len(history or [])))
        return Session(f"s{next(self._ids)}", system_prompt, list(history or []))

    def branch_session(self, session, turns, more=None):
        check("branch", session.state)
        self.calls.append(("branch", session.id, turns, len(more or [])))
        return Session(f"s{next(self._ids)}", session.system_prompt,
                       session.history[:session.turn_end(turns)] + list(more or []), keys=session.keys[:turns])

    def close_session(self, session):
        check("close", session.state)
        self.calls.append(("close", session.id))
        session.closed = True

    def focus_session(self, session):
        self.calls.append(("focus", session.id))

    def submit_turn(self, session, user, sampling=None, **kwargs):
        session.request_id, session.pending = "r", [{"role": "user", "content": user}]
        reply = Reply()
        reply.add(TokenEvent("r", 1, f"re: {user}"))
        session.end_turn(reply)


def history(keys):
    return [m for k in keys for m in ({"role": "user", "content": k}, {"role": "assistant", "content": f"re: {k}"})]


def test_branches_find_their_sessions_by_asking_them():
    client = RecordingClient()
    tree = BranchSessions(client, capacity=2)
    first = tree.session_for(None, [], [])
    assert client.calls == [("open", 0)] and tree.recent is first
    tree.submit_turn(first, "a", "a")
    tree.submit_turn(first, "b", "b")
    assert first.keys == ["a", "b"]                                        # the session named its turns
    assert tree.session_for(None, ["a", "b"], history("ab")) is first      # the exact one
    edited = tree.session_for(None, ["a", "x"], history("ax"))             # an edit of the second turn
    assert client.calls[-1] == ("branch", first.id, 1, 2) and edited.keys == ["a", "x"]
    client.calls.clear()
    tree.focus(["a", "b"])
    assert client.calls == [("focus", first.id)]
    third = tree.session_for(None, ["z"], history("z"))                    # nothing shared: a branch after 0
    assert client.calls[-2:] == [("branch", first.id, 0, 2), ("close", first.id)]    # the oldest evicted
    assert len(tree) == 2 and first.state is C and tree.recent is third
    other = BranchSessions(client, capacity=2)
    tree.fork_into(other, ["a"], ["a-copy"])                                # a fork shares the prefix
    assert client.calls[-1] == ("branch", edited.id, 1, 0) and other.recent.keys == ["a-copy"]
    tree.close()
    assert len(tree) == 0 and edited.state is third.state is C
