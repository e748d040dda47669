"""EngineClient <-> the engine process: streaming, cancellation, sessions, typed errors, crashes.

A real engine process on tiny random models (their text is gibberish: these tests check plumbing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import gone
from nanochat.engine import LLM, SamplingParams
from nanochat.engine.serve.client import EngineClient
from nanochat.engine.serve.protocol import EngineDied, EngineError
from nanochat.models.errors import ModelLoadError

ENGINE = dict(dtype="float32", max_model_len=256, kvcache_block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def slow_session(client, session, text):
    """Submit a long turn and wait until its first tokens arrived."""
    started = threading.Event()
    stream = client.submit_turn(session, text, LONG, on_event=lambda ev: started.set())
    assert started.wait(30)
    return stream


@pytest.fixture(scope="module")
def client(tiny_models):
    c = EngineClient()
    c.load_model(str(tiny_models["qwen3"]), **ENGINE)
    yield c
    pid = c.pid
    c.shutdown()
    assert gone(pid), "the engine process outlived shutdown()"


def test_the_front_end_does_not_load_torch(tiny_models):
    code = textwrap.dedent(f"""
        import sys
        from nanochat.engine.serve.client import EngineClient
        from nanochat.engine import SamplingParams
        c = EngineClient()
        c.load_model({str(tiny_models["qwen3"])!r}, dtype="float32", max_model_len=128)
        s = c.open_session()
        print(len(c.submit_turn(s, "hi", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)).result(60).token_ids))
        c.shutdown()
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "False"]


def test_stream_matches_the_in_process_engine(client, tiny_models):
    prompt = [5, 6, 7, 8, 9, 10]
    ref = LLM(str(tiny_models["qwen3"]), **ENGINE).generate([prompt], GREEDY)[0]
    stream = client.submit(prompt, GREEDY)
    events = list(stream)
    assert [e.token_id for e in events if e.token_id is not None] == ref.token_ids
    assert events[-1].finished and [e.finished for e in events[:-1]] == [False] * (len(events) - 1)
    assert stream.reply.text == ref.text and stream.reply.stats.completion_tokens == 8
    assert stream.reply.stats.finish_reason == "length"


def test_turns_reuse_the_sessions_cache_and_fork_shares_it(client):
    session = client.open_session("Be brief.")
    first = client.submit_turn(session, "hello there, how are you?", GREEDY).result(30)
    second = client.submit_turn(session, "what is the capital of France?", GREEDY).result(30)
    assert first.stats.cached_tokens == 0 and second.stats.cached_tokens > 0
    assert [m["role"] for m in session.history] == ["user", "assistant"] * 2
    assert session.history[-1]["content"] == second.text
    assert len(session.token_ids) == second.stats.prompt_tokens + 8 + 1     # + the end-of-turn token
    fork = client.fork_session(session)
    branch = client.submit_turn(fork, "something else", GREEDY).result(30)
    assert branch.stats.cached_tokens >= len(session.token_ids) - 16        # the shared prefix is cached
    assert len(session.history) == 4 and len(fork.history) == 6
    client.close_session(fork)
    client.close_session(session)


def test_cancel_frees_every_block(client):
    session = client.open_session()
    stream = slow_session(client, session, "tell me a long story")
    stream.cancel()
    reply = stream.result(30)
    assert reply.final.finish_reason == "abort" and 0 < len(reply.token_ids) < 200
    assert session.history[-1]["content"] == reply.text          # a cancelled reply is kept
    client.close_session(session)
    stats = client.stats(fresh=True)
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0


def test_two_sessions_from_threads_are_batched(client):
    sessions = [client.open_session() for _ in range(3)]
    order, errors = [], []      # the session of every event, in the order the reader thread got them

    def chat(session):
        try:
            for text in ("hello there", "and again"):
                reply = client.submit_turn(session, text, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                                           on_event=lambda ev: order.append(session.id)).result(60)
                assert reply.final.finish_reason == "length"
        except Exception as e:   # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=chat, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert all(len(s.history) == 4 for s in sessions)
    # Batched steps deliver one event per running request in each message: the sessions interleave.
    switches = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert switches > 20, f"the sessions ran one after another ({switches} switches)"
    for s in sessions:
        client.close_session(s)


def test_refused_request_ends_with_an_error_event(client):
    session = client.open_session()
    reply = client.submit_turn(session, "x " * 600, GREEDY).result(30)   # longer than max_model_len
    assert reply.final.finish_reason == "error" and "max_model_len" in reply.final.error
    assert session.history == [] and not session.busy
    again = client.submit_turn(session, "short", GREEDY).result(30)      # the session still works
    assert again.final.finish_reason == "length"


def test_typed_errors_cross_the_boundary_and_the_model_stays(client, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    before = client.model
    with pytest.raises(ModelLoadError) as e:
        client.load_model(str(bad))
    assert "\n" not in str(e.value) and str(e.value)
    with pytest.raises(ValueError, match="max_num_seqs"):
        client.load_model(before.model, max_num_seqs=0)
    assert client.model is before
    assert client.submit([1, 2, 3], GREEDY).result(30).final.finish_reason == "length"
    assert client.describe()[0][0] == "model"


def test_rewind_cuts_the_canonical_ids_and_regenerates_from_the_cache(client):
    session = client.open_session("Be brief.")
    texts = ["hello there, how are you?", "what is the capital of France?", "and of Spain?"]
    replies = [client.submit_turn(session, t, GREEDY).result(30) for t in texts]
    with pytest.raises(ValueError):
        client.rewind_session(session, 4)
    back = client.rewind_session(session, 2)
    assert session.epoch == -1 and back.history == session.history[:2]
    assert back.token_ids == session.token_ids[:len(back.token_ids)]
    assert replies[0].stats.prompt_tokens < len(back.token_ids) < replies[1].stats.prompt_tokens
    stream = client.submit_turn(back, texts[1], GREEDY)
    again = stream.result(30)
    assert not stream.replayed and again.token_ids == replies[1].token_ids      # greedy: the same reply
    assert again.stats.prompt_tokens == replies[1].stats.prompt_tokens
    assert again.stats.prompt_tokens - again.stats.cached_tokens < 16            # all but the last block cached
    client.close_session(back)
    # A session seeded with a transcript is rendered turn by turn: its cuts are known in ids too.
    seeded = client.open_session("Be brief.", back.history[:2])
    first = client.submit_turn(seeded, texts[1], GREEDY).result(30)
    assert seeded.turn_starts is not None and len(seeded.turn_starts) == 2
    again = client.rewind_session(seeded, 1)
    assert again.token_ids == seeded.token_ids[:seeded.turn_starts[1]] and again.epoch == client.epoch
    stream = client.submit_turn(again, texts[1], GREEDY)
    assert stream.result(30).token_ids == first.token_ids and not stream.replayed
    client.close_session(again)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def expected_cached(shared: int, other_computed: int, prompt: int, block: int) -> int:
    """Cached tokens of a prompt sharing `shared` ids with a resident sequence whose first
    `other_computed` ids have KV: whole blocks, then the matching start of the block where they part
    (copied) when that block of the other sequence is full; never the prompt's last token."""
    whole = shared // block * block
    copied = shared if whole + block <= other_computed else whole
    return min(copied, prompt - 1)


def branch_point_cached(client, session, edited: str, at: int):
    """Branch `session` after `at` turns and send `edited` there; returns the branch, its reply and
    the length of the prompt ids the branch shares with `session`. The two stay resident, their
    shared prefix's blocks pinned once."""
    block = ENGINE["kvcache_block_size"]
    used = client.stats(fresh=True).kv_blocks_used
    branch = client.branch_session(session, at)
    reply = client.submit_turn(branch, edited, GREEDY).result(30)
    shared = common_prefix(branch.token_ids, session.token_ids)
    added = client.stats(fresh=True).kv_blocks_used - used
    assert added <= -(-len(branch.token_ids) // block) - shared // block
    return branch, reply, shared


def test_branches_share_their_prefix_and_match_a_from_scratch_run(client, tiny_models):
    """An edit at turn k (a branch after k turns) prefills only what follows the prefix it shares, and
    answers as a from-scratch run (no prefix cache) of the same prompt does; the first branch stays."""
    block = ENGINE["kvcache_block_size"]
    scratch = LLM(str(tiny_models["qwen3"]), enable_prefix_caching=False, **ENGINE)
    session = client.open_session("Be brief.")
    for t in ["hello there, how are you?", "what is the capital of France?", "and of Spain?"]:
        client.submit_turn(session, t, GREEDY).result(30)
    for at in (0, 1, 2):
        branch, reply, shared = branch_point_cached(client, session, f"branch {at}: tell me about owls", at)
        assert branch.history[:2 * at] == session.history[:2 * at] and len(branch.history) == 2 * at + 2
        assert branch.token_ids[:branch.turn_starts[at]] == session.token_ids[:session.turn_starts[at]]
        # the shared prefix: all of it (the session's last sampled token and end-of-turn were never computed)
        assert reply.stats.cached_tokens == expected_cached(shared, len(session.token_ids) - 2,
                                                            reply.stats.prompt_tokens, block)
        prompt = branch.token_ids[:reply.stats.prompt_tokens]
        assert scratch.generate([prompt], GREEDY)[0].token_ids == reply.token_ids
        client.close_session(branch)
    # The first branch is untouched: its next turn finds its whole history resident.
    held = len(session.token_ids)
    reply = client.submit_turn(session, "one more", GREEDY).result(30)
    assert reply.stats.cached_tokens >= held - block    # all but its last, partly computed block
    # A branch with turns of its own after the cut (moving to another branch of the tree): the cut is
    # found in the cache and only the branch's own turns are prefilled.
    more = [{"role": "user", "content": "an edited question"}, {"role": "assistant", "content": "an answer"}]
    branch = client.branch_session(session, 1, more)
    assert branch.token_ids == session.token_ids[:session.turn_starts[1]]
    reply = client.submit_turn(branch, "go on", GREEDY).result(30)
    shared = common_prefix(branch.token_ids, session.token_ids)
    assert reply.stats.cached_tokens == expected_cached(shared, len(session.token_ids) - 2,
                                                        reply.stats.prompt_tokens, block)
    seeded = client.open_session("Be brief.", session.history[:2] + more)   # the same, rendered from text
    client.submit_turn(seeded, "go on", GREEDY).result(30)
    a, b = seeded.turn_starts, branch.turn_starts     # the branch's own turn, rendered as a seeded one is
    assert seeded.token_ids[a[1]:a[2]] == branch.token_ids[b[1]:b[2]]
    for s in (seeded, branch, session):
        client.close_session(s)


def test_a_model_switch_replays_the_sessions(client, tiny_models):
    session = client.open_session()
    client.submit_turn(session, "hello there", GREEDY).result(30)
    try:
        info = client.load_model(str(tiny_models["llama"]), **ENGINE)
        assert info.arch == "llama"
        stream = client.submit_turn(session, "next", GREEDY)
        reply = stream.result(30)
        assert stream.replayed and reply.stats.cached_tokens == 0 and reply.final.finish_reason == "length"
        assert len(session.history) == 4
    finally:
        client.load_model(str(tiny_models["qwen3"]), **ENGINE)


def test_kill_9_mid_reply_keeps_the_partial_reply_and_restarts(tiny_models, tmp_path, monkeypatch):
    from test_controller import install_step_delay_hook

    delay = install_step_delay_hook(tmp_path / "engine-hook", monkeypatch)   # the kill lands mid-reply, however fast
    client = EngineClient()
    deaths = []
    client.add_death_listener(deaths.append)
    try:
        client.load_model(str(tiny_models["qwen3"]), **ENGINE)
        session = client.open_session("sys")
        client.submit_turn(session, "hello there", GREEDY).result(30)
        delay.set(0.02)
        stream = slow_session(client, session, "tell me a long story")
        pid = client.pid
        os.kill(pid, signal.SIGKILL)
        reply = stream.result(30)
        assert reply.final.finish_reason == "error" and "SIGKILL" in reply.final.error
        assert "\n" not in reply.final.error
        assert deaths == [reply.final.error] and not client.alive
        assert 0 < len(reply.token_ids) < 200
        assert session.history[-1] == {"role": "assistant", "content": reply.text}    # kept
        # the next message starts a new engine process and re-prefills the whole history
        stream = client.submit_turn(session, "go on", GREEDY)
        again = stream.result(60)
        assert client.pid != pid and again.final.finish_reason == "length"
        assert stream.replayed and again.stats.cached_tokens == 0
        assert len(session.history) == 6
    finally:
        pid = client.pid
        client.shutdown()
    assert gone(pid)


def test_engine_exits_when_its_front_end_is_killed(tiny_models, tmp_path):
    code = textwrap.dedent(f"""
        import time
        from nanochat.engine.serve.client import EngineClient
        c = EngineClient()
        c.load_model({str(tiny_models["qwen3"])!r}, dtype="float32", max_model_len=128)
        print(c.pid, flush=True)
        time.sleep(600)
    """)
    front = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(front.stdout.readline())
        front.send_signal(signal.SIGKILL)
        front.wait(10)
        assert gone(engine_pid), "the engine process was left behind"
    finally:
        front.kill()


def test_an_engine_that_cannot_start_says_why(monkeypatch):
    client = EngineClient()
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(EngineDied, match="exited"):
        client.load_model("whatever")
    with pytest.raises(EngineError, match="no model"):
        client.submit([1], GREEDY)


def test_the_engine_core_batches_token_events_but_sends_an_end_at_once(monkeypatch):
    from nanochat.engine.output import TokenEvent
    from nanochat.engine.serve import core
    from nanochat.engine.serve.protocol import EVENTS_INTERVAL

    class Conn:
        def __init__(self):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

    class Engine:
        unfinished = True

        def has_unfinished(self):
            return self.unfinished

    now = [100.0]
    monkeypatch.setattr(core.time, "monotonic", lambda: now[0])
    conn, engine = Conn(), Engine()
    engine_core = core.EngineCore(conn)
    engine_core.engine = engine
    step = EVENTS_INTERVAL / 3.5                           # the 4th step is past the interval

    def token(request_id, i, finished=False):
        return TokenEvent(request_id, i, f"<{i}>", finished, "length" if finished else None)

    engine_core._publish([token("a", 0)])                 # the first events go at once
    assert [len(m[1]) for m in conn.sent] == [1]
    for i in range(1, 4):                                 # then they wait for EVENTS_INTERVAL
        now[0] += step
        engine_core._publish([token("a", i), token("b", i)])
    assert len(conn.sent) == 1
    now[0] += step
    engine_core._publish([token("a", 4)])
    assert [len(m[1]) for m in conn.sent] == [1, 7]
    now[0] += step
    engine_core._publish([token("b", 5, finished=True)])  # an end is not held back, nor what came before it
    now[0] += step
    engine_core._publish([token("a", 6)])
    engine.unfinished = False                              # nor anything once the engine has no work left
    engine_core._publish([token("a", 7, finished=True)])
    sent = [e for m in conn.sent for e in m[1]]
    assert [len(m[1]) for m in conn.sent] == [1, 7, 1, 2]
    assert [e.token_id for e in sent if e.request_id == "a"] == [0, 1, 2, 3, 4, 6, 7]
    assert sent[-1].finished and not engine_core._events


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have their own nice value on Linux")
def test_the_engine_keeps_the_priority_of_the_thread_that_made_the_client():
    """The TUI lowers its drawing thread's priority; an engine (re)started from that thread, or from a
    worker thread it made, must not inherit it (an unprivileged process can never raise it again)."""
    client = EngineClient()
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        def start_from_a_low_priority_thread():
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice + 5)
            client.start()
        thread = threading.Thread(target=start_from_a_low_priority_thread)
        thread.start()
        thread.join(60)
        assert client.alive and os.getpriority(os.PRIO_PROCESS, client.pid) == nice
    finally:
        client.shutdown()


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_engine_process_sets_its_own_environment_defaults(monkeypatch, given, expected):
    """OMP_WAIT_POLICY=PASSIVE is the engine process's default (importing nanochat sets nothing); a value
    the user set wins."""
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    client = EngineClient()
    try:
        client.start()
        environ = open(f"/proc/{client.pid}/environ", "rb").read().split(b"\0")
        assert f"OMP_WAIT_POLICY={expected}".encode() in environ
        assert os.environ.get("OMP_WAIT_POLICY") == given   # the front end's own environment is untouched
    finally:
        client.shutdown()


@pytest.mark.parametrize("last_words, reason", [
    (b"terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\n",
     "the engine process was killed by SIGABRT (out of memory: an allocation failed)"),
    (b"", "the engine process was killed by SIGABRT"),
])
def test_an_engine_abort_names_memory_when_an_allocation_failed(tiny_models, last_words, reason):
    """A `ulimit -v` makes a large prompt end the engine with std::bad_alloc and SIGABRT: the message
    names memory then, and only then. The engine's own stderr pipe gets the words an abort leaves."""
    c = EngineClient()
    c.load_model(str(tiny_models["qwen3"]), **ENGINE)
    pid = c.pid
    died = threading.Event()
    reasons = []
    c.add_death_listener(lambda why: (reasons.append(why), died.set()))
    with open(f"/proc/{pid}/fd/2", "wb") as stderr:
        stderr.write(last_words)
    os.kill(pid, signal.SIGABRT)
    assert died.wait(30)
    assert reasons == [reason]
    c.shutdown()
    assert gone(pid)


def test_a_client_started_again_at_once_keeps_its_connection(monkeypatch):
    """shutdown() and a new client at once, many times over (a one-shot's lean engine starts right after the full
    one), with a reader thread slow to come back for the next message (a busy machine): the old reader neither
    dies on its closed connection nor reads from the next engine's socket, which may reuse its descriptor's
    number; every new client's first round trip answers."""
    on_done = EngineClient._on_done

    def slow_on_done(self, call_id, value):
        on_done(self, call_id, value)
        time.sleep(0.002)   # the caller woken by this answer runs on first

    monkeypatch.setattr(EngineClient, "_on_done", slow_on_done)
    errors = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda args: errors.append(f"{args.thread.name}: {args.exc_type.__name__}: {args.exc_value}"))
    for _ in range(40):
        client = EngineClient(in_process=True)
        client.start()
        with pytest.raises(ValueError, match="no model is loaded"):   # a round trip, answered
            client.stats(fresh=True)
        client.shutdown()
    assert not errors, errors[:3]
