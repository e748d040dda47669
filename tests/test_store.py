"""The SQLite chat store: round trips, ordering, cascade delete, schema migration, threads."""

from __future__ import annotations

import json
import sqlite3
import threading

import pytest

from nanochat.app.store import SCHEMA_VERSION, ChatStore, StoreError, migrate
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
    with pytest.raises(StoreError, match="cannot open"):
        ChatStore(bad)


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
