"""The SQLite chat store: round trips, ordering, cascade delete, schema migration, threads."""

from __future__ import annotations

import json
import sqlite3
import threading

import pytest

from nanochat.app.store import SCHEMA_VERSION, ChatStore, DamagedStore, StoreError, migrate
from nanochat.engine.output import RequestStats


def test_round_trip_and_reopen(tmp_path):
    db = tmp_path / "chats.sqlite3"
    store = ChatStore(db)
    cid = store.create_conversation("First", system_prompt="Be brief.", model="m.gguf", created=100.0)
    store.add_message(cid, "user", "hi", created=101.0)
    stats = RequestStats(prompt_tokens=12, cached_tokens=0, completion_tokens=3, ttft=0.01, finish_reason="stop")
    store.add_message(cid, "assistant", "hello", stats, created=102.0, note="history re-prefilled")
    store.close()

    again = ChatStore(db)
    [conv] = again.load_all()
    assert (conv.id, conv.title, conv.system_prompt, conv.model, conv.created) == (cid, "First", "Be brief.",
                                                                                 "m.gguf", 100.0)
    assert conv.updated == 102.0
    assert [(m.role, m.content, m.stats, m.note) for m in conv.messages] == [
        ("user", "hi", None, ""), ("assistant", "hello", stats, "history re-prefilled")]
    again.close()


def test_ordering_rename_clear_delete(tmp_path):
    store = ChatStore(tmp_path / "c.db")
    a = store.create_conversation("a", created=1.0)
    b = store.create_conversation("b", created=2.0)
    assert [c.id for c in store.list_conversations()] == [b, a]
    store.add_message(a, "user", "x", created=3.0)       # a is now the most recently updated
    assert [c.id for c in store.list_conversations()] == [a, b]
    store.rename(b, "bee")
    store.set_system_prompt(b, "sys")
    store.set_model(b, "other")
    conv_b = store.load_conversation(b)
    assert (conv_b.title, conv_b.system_prompt, conv_b.model) == ("bee", "sys", "other")
    mid = store.add_message(b, "user", "y")
    last = store.add_message(b, "assistant", "z")           # after y: the end of the path shown
    assert [m.parent_id for m in store.messages(b)] == [None, mid]
    store.delete_message(last)
    assert [m.content for m in store.messages(b)] == ["y"]
    store.add_message(b, "assistant", "z2", parent_id=mid)
    store.delete_message(mid)                               # a message goes with everything under it
    assert store.messages(b) == []
    store.add_message(b, "user", "again", parent_id=None)
    store.clear_messages(b)
    assert store.messages(b) == [] and store.load_conversation(b).leaf_id is None
    store.delete_conversation(a)                          # messages go with it (foreign key cascade)
    assert [c.id for c in store.list_conversations()] == [b]
    assert store._conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    with pytest.raises(KeyError):
        store.load_conversation(a)


def test_stats_are_stored_as_request_stats_dicts(tmp_path):
    """RequestStats go in as to_dict() (with the derived prefilled_tokens, for other readers of the
    file) and come back through from_dict, which ignores keys it does not know."""
    store = ChatStore(tmp_path / "s.db")
    cid = store.create_conversation("stats")
    stats = RequestStats(prompt_tokens=30, cached_tokens=16, completion_tokens=5)
    mid = store.add_message(cid, "assistant", "x", stats)
    raw = json.loads(store._conn.execute("SELECT stats FROM messages WHERE id = ?", (mid,)).fetchone()[0])
    assert raw["prefilled_tokens"] == 14 and raw["finish_reason"] is None
    with store._conn:   # a row from an older version (TurnStats keys) and a damaged one
        store._conn.execute("INSERT INTO messages (conversation_id, role, content, stats, created) VALUES "
                            "(?, 'assistant', 'old', ?, 1.0)", (cid, json.dumps({"completion_tokens": 4,
                                                                                 "finish_reason": "abort",
                                                                                 "turn_seconds": 0.5})))
        store._conn.execute("INSERT INTO messages (conversation_id, role, content, stats, created) VALUES "
                            "(?, 'assistant', 'bad', 'not json', 2.0)", (cid,))
    new, old, bad = store.messages(cid)
    assert new.stats == stats
    assert old.stats == RequestStats(completion_tokens=4, finish_reason="abort")
    assert bad.stats is None


def test_migrates_a_version_1_database(tmp_path):
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, system_prompt TEXT,
            model TEXT, created REAL NOT NULL, updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id INTEGER NOT NULL
            REFERENCES conversations(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL, stats TEXT,
            created REAL NOT NULL);
        INSERT INTO conversations VALUES (1, 'old chat', NULL, NULL, 5.0, 6.0);
        INSERT INTO messages VALUES (1, 1, 'user', 'from v1', NULL, 6.0);
        PRAGMA user_version = 1;
    """)
    conn.commit()
    conn.close()
    store = ChatStore(db)
    assert store._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    [conv] = store.load_all()
    assert conv.title == "old chat" and [(m.content, m.note) for m in conv.messages] == [("from v1", "")]
    store.close()


def test_migrates_linear_chats_to_the_tree(tmp_path):
    """A version 3 file (linear histories): each message becomes the child of the one before it, the
    last one is the end of the path shown, and the tree then grows branches that survive a reopen."""
    from nanochat.app.store import MIGRATIONS

    db = tmp_path / "v3.db"
    conn = sqlite3.connect(db)
    for step in MIGRATIONS[:3]:
        step(conn)
    conn.executescript("""
        INSERT INTO conversations VALUES (1, 'a', NULL, NULL, 1.0, 2.0), (2, 'b', NULL, NULL, 1.0, 2.0),
                                         (3, 'empty', NULL, NULL, 1.0, 2.0);
        INSERT INTO messages (id, conversation_id, role, content, created) VALUES
            (1, 1, 'user', 'a1', 1.0), (2, 2, 'user', 'b1', 1.0), (3, 1, 'assistant', 'a2', 1.0),
            (4, 2, 'assistant', 'b2', 1.0), (5, 1, 'user', 'a3', 1.0);
        PRAGMA user_version = 3;
    """)
    conn.commit()
    conn.close()
    store = ChatStore(db)
    convs = {c.title: c for c in store.load_all()}
    assert [(m.id, m.parent_id) for m in convs["a"].messages] == [(1, None), (3, 1), (5, 3)]
    assert [(m.id, m.parent_id) for m in convs["b"].messages] == [(2, None), (4, 2)]
    assert (convs["a"].leaf_id, convs["b"].leaf_id, convs["empty"].leaf_id) == (5, 4, None)
    assert convs["a"].settings == {}
    other = store.add_message(1, "assistant", "a2, again", parent_id=1)    # a second version of a2
    store.set_leaf(1, 3)
    store.set_settings(1, {"temperature": 0.2})
    store.close()
    store = ChatStore(db)
    conv = store.load_conversation(1)
    assert [(m.id, m.parent_id) for m in conv.messages] == [(1, None), (3, 1), (5, 3), (other, 1)]
    assert conv.leaf_id == 3 and conv.settings == {"temperature": 0.2}
    store.delete_message(3)                                                 # a branch goes with its subtree
    assert [m.id for m in store.messages(1)] == [1, other]
    store.close()


def test_fresh_schema_and_newer_schema_refused(tmp_path):
    conn = sqlite3.connect(":memory:")
    assert migrate(conn) == 0
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db = tmp_path / "future.db"
    c = sqlite3.connect(db)
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    c.commit()
    c.close()
    with pytest.raises(StoreError, match="newer"):
        ChatStore(db)


def test_not_a_database(tmp_path):
    bad = tmp_path / "chats.sqlite3"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(DamagedStore, match=f"{bad} is damaged .file is not a database.") as e:
        ChatStore(bad)
    assert e.value.path == bad and bad.read_bytes() == b"this is not sqlite" * 100


def test_usable_from_several_threads(tmp_path):
    store = ChatStore(tmp_path / "t.db")
    cid = store.create_conversation("threads")

    def writer(k):
        for i in range(20):
            store.add_message(cid, "user", f"{k}-{i}")

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.messages(cid)) == 80


def test_a_second_app_on_one_home_is_refused(tmp_path, monkeypatch):
    """Two apps on one home would interleave their turns in the same conversations (issue #14 item 4):
    the second is told the home is in use, before it starts anything; closing the first frees it."""
    from nanochat.app.paths import HomeInUse, get_paths
    from nanochat.app.tui import main

    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    paths = get_paths().ensure()
    first = paths.lock_chats()
    with pytest.raises(HomeInUse, match="NANOCHAT_HOME") as e:
        main(None)
    assert "\n" not in str(e.value)
    first.close()
    paths.lock_chats().close()     # free again


def test_a_store_that_cannot_be_written_fails_at_open(tmp_path):
    """A read-only home (issue #14): the app learns at start that nothing will be saved (it then keeps
    an in-memory store and says so) instead of failing at the first message."""
    import sqlite3

    from nanochat.app.store import StoreError, _check_writable

    path = tmp_path / "chats.sqlite3"
    ChatStore(path).close()
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        _check_writable(conn)
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="cannot open"):
        ChatStore(tmp_path / "file" / "chats.sqlite3")       # its folder cannot be made


def test_a_streaming_reply_is_rewritten_in_place_and_marked_partial(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    cid = store.create_conversation("c")
    store.add_message(cid, "user", "hi")
    mid = store.add_message(cid, "assistant", "Hel", partial=True)
    other = ChatStore(tmp_path / "chats.db")          # another process's view, as after a kill -9
    assert [(m.content, m.partial) for m in other.messages(cid)] == [("hi", False), ("Hel", True)]
    store.update_message(mid, "Hello there", RequestStats(completion_tokens=3, finish_reason="stop"), note="n")
    [_, reply] = other.messages(cid)
    assert (reply.content, reply.partial, reply.note, reply.stats.completion_tokens) == ("Hello there", False, "n", 3)
    other.close()
    store.close()


# ---------------------------------------------------------------------------------- storage faults
class Faults:
    """Makes a store's writes fail with `error` while it is set (what SQLite raises on a full disk, an
    OSError, ...), as the storage would."""

    def __init__(self, store: ChatStore, monkeypatch):
        self.error: Exception | None = None
        run = store._run

        def failing(statements):
            if self.error is not None:
                raise self.error
            return run(statements)

        monkeypatch.setattr(store, "_run", failing)


def test_writes_the_storage_refuses_are_kept_in_order_and_saved_later(tmp_path, monkeypatch):
    """A full disk mid-chat: every write still returns (ids included, so a reply can name its question
    before either row exists), the owner hears once that saving fails, and once it works again every
    write is saved in order, a streaming reply's rewrites as its last one."""
    import nanochat.app.store as store_module

    store = ChatStore(tmp_path / "chats.db")
    faults, warnings = Faults(store, monkeypatch), []
    store.on_fault = warnings.append
    cid = store.create_conversation("chat")
    first = store.add_message(cid, "user", "saved before the fault")
    faults.error = sqlite3.OperationalError("database or disk is full")
    question = store.add_message(cid, "user", "what is the capital of France?", parent_id=first)
    reply = store.add_message(cid, "assistant", "Par", parent_id=question, partial=True)
    store.update_message(reply, "Paris is", partial=True)
    store.update_message(reply, "Paris is the capital.")
    other = store.create_conversation("second")
    store.add_message(other, "user", "in a chat made during the fault")
    store.set_leaf(cid, reply)
    assert (question, reply) == (first + 1, first + 2)
    assert warnings == [f"cannot save chats to {store.path} (database or disk is full); they are kept in "
                               "memory and saved when writing works again"]
    assert [m.content for m in store.messages(cid)] == ["saved before the fault"]
    assert len(store._pending) == 6                        # the reply's first rewrite was superseded
    monkeypatch.setattr(store_module, "RETRY_SECONDS", 0.0)
    store.retry()                                          # still failing: nothing changes, nothing said
    assert warnings[1:] == [] and store.fault == "database or disk is full"
    faults.error = None
    store.retry()
    assert warnings[1:] == [None] and store.fault is None and not store._pending
    stored = store.load_conversation(cid)
    assert [(m.id, m.parent_id, m.content, m.partial) for m in stored.messages] == [
        (first, None, "saved before the fault", False), (question, first, "what is the capital of France?", False),
        (reply, question, "Paris is the capital.", False)]
    assert stored.leaf_id == reply
    assert [m.content for m in store.messages(other)] == ["in a chat made during the fault"]
    store.close()
    again = ChatStore(tmp_path / "chats.db")              # ids go on after the ones given out
    assert again.create_conversation("third") == other + 1
    assert again.add_message(other, "user", "x") == reply + 2
    again.close()


def test_close_names_what_it_could_not_save(tmp_path, monkeypatch):
    store = ChatStore(tmp_path / "chats.db")
    faults, warnings = Faults(store, monkeypatch), []
    store.on_fault = warnings.append
    cid = store.create_conversation("chat")
    faults.error = OSError(28, "No space left on device")
    question = store.add_message(cid, "user", "a question\nover two lines")
    reply = store.add_message(cid, "assistant", "An", parent_id=question)
    store.update_message(reply, "An answer that is long enough to be cut short in the report")
    forgotten = store.add_message(cid, "user", "sent, then forgotten")
    store.delete_message(forgotten)
    store.rename(cid, "renamed")
    lost = store.close()
    assert lost == (f"could not save to {store.path} (no space left on device); not saved: your message “a "
                    "question over two lines”, the reply “An answer that is long enough to be cut…”, 2 other "
                    "changes (titles, settings, the branch shown)")
    assert warnings and "no space left on device" in warnings[0]


def test_a_failure_of_the_write_itself_is_raised_not_retried(tmp_path):
    """A write SQLite refuses for what it is (a bug: here a message of no conversation) is not held back
    for later, where it would block every write after it."""
    store = ChatStore(tmp_path / "chats.db")
    warnings = []
    store.on_fault = warnings.append
    with pytest.raises(sqlite3.IntegrityError):
        store.add_message(12345, "user", "no such conversation")
    assert not store._pending and warnings == []
    cid = store.create_conversation("still works")
    assert [c.id for c in store.list_conversations()] == [cid]
    assert store.close() is None


# ---------------------------------------------------------------------------------- a damaged file
def sha256(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def chats_file(path, conversations: int = 30, messages: int = 12) -> None:
    """A chat database of several pages: each conversation a question-and-answer path."""
    store = ChatStore(path)
    for c in range(conversations):
        cid = store.create_conversation(f"chat {c}")
        for i in range(messages):
            store.add_message(cid, "user" if i % 2 == 0 else "assistant", f"chat {c} message {i} " + "words " * 30)
    assert store.close() is None


def damage(path, kind: str) -> None:
    import random

    rng = random.Random(kind)
    data = bytearray(path.read_bytes())
    if kind == "random page bytes":              # inside the page area, the header intact
        at = len(data) // 2
        data[at:at + 3000] = rng.randbytes(3000)
    elif kind == "random header":
        data[:100] = rng.randbytes(100)
    elif kind == "truncated":
        del data[len(data) * 2 // 3:]
    path.write_bytes(bytes(data))


DAMAGE = ["random page bytes", "random header", "truncated"]


@pytest.mark.parametrize("kind", DAMAGE + ["schema 99", "a directory"])
def test_a_file_that_cannot_be_used_is_never_written(tmp_path, kind):
    """Each kind of damage, and the files that are not damaged but not ours to write (a newer schema, a
    directory): open_store falls back to memory and names the file, and the file is unchanged byte for
    byte, with nothing made beside it. Damage is told apart: only it offers a new database."""
    from nanochat.app.store import open_store

    path = tmp_path / "home" / "chats.sqlite3"
    if kind == "a directory":
        path.mkdir(parents=True)
    else:
        chats_file(path)
        if kind == "schema 99":       # as a newer nanochat would leave it, in rollback-journal mode
            conn = sqlite3.connect(path)
            conn.execute("PRAGMA journal_mode = DELETE")
            conn.execute("PRAGMA user_version = 99")
            conn.close()
        else:
            damage(path, kind)
    before = sha256(path) if path.is_file() else None
    beside = sorted(p.name for p in path.parent.iterdir())
    store, warning = open_store(path)
    assert store.path.name == ":memory:" and str(path) in warning
    assert ("nothing is saved this session" if kind in DAMAGE else "will NOT be saved") in warning
    assert (store.damaged is not None) == (kind in DAMAGE)
    cid = store.create_conversation("in memory")
    store.add_message(cid, "user", "hello")
    assert store.close() is None
    assert (sha256(path) if path.is_file() else None) == before
    assert sorted(p.name for p in path.parent.iterdir()) == beside


def test_a_damaged_file_is_read_as_far_as_it_can_be(tmp_path):
    """Random bytes over a few pages in the middle: the conversations and messages on sound pages are
    read into memory; a reply whose question was lost becomes a first message, so its text stays."""
    from nanochat.app.store import open_store

    path = tmp_path / "chats.sqlite3"
    chats_file(path)
    damage(path, "random page bytes")
    store, warning = open_store(path)
    read = store.load_all()
    assert store.damaged is not None and store.damaged.path == path and f"{len(read)} conversations could" in warning
    messages = [m for c in read for m in c.messages]
    assert 10 < len(read) <= 30 and 100 < len(messages) < 30 * 12
    ids = {m.id for m in messages}
    assert all(m.parent_id is None or m.parent_id in ids for m in messages)
    assert all(m.content.startswith(f"{c.title} message ") for c in read for m in c.messages)
    store.close()


def test_a_damaged_file_is_kept_beside_a_new_database_when_the_user_chooses(tmp_path, monkeypatch):
    from nanochat.app.store import open_store

    path = tmp_path / "chats.sqlite3"
    chats_file(path)
    damage(path, "random page bytes")
    before = sha256(path)
    store, _ = open_store(path)
    read = {c.title for c in store.list_conversations()}
    cid = store.create_conversation("made before the choice")

    def refuse(*a):    # the new database cannot be made: everything stays as it was
        raise sqlite3.OperationalError("unable to open database file")

    with monkeypatch.context() as mp:
        mp.setattr("nanochat.app.store._open_file", refuse)
        with pytest.raises(StoreError, match="cannot start a new chat database"):
            store.replace_damaged()
    assert sha256(path) == before and sorted(tmp_path.iterdir()) == [path]
    assert store.damaged is not None and store.path.name == ":memory:"

    kept = store.replace_damaged()
    assert kept.parent == tmp_path and kept.name.startswith("chats.sqlite3.damaged-") and sha256(kept) == before
    assert store.path == path and store.damaged is None
    store.add_message(cid, "user", "saved in the new file")
    assert store.close() is None
    new = ChatStore(path)
    assert {c.title for c in new.list_conversations()} == read | {"made before the choice"}
    assert [m.content for m in new.messages(cid)] == ["saved in the new file"]
    new.close()
