"""The chat store: conversations and their messages in SQLite (stdlib sqlite3).

A user message is committed when it is sent. A reply is committed at its first token, marked partial,
and rewritten as it streams (ChatController decides how often) until it ends, so a kill -9 of the app
mid-reply keeps the reply up to its last save, and a restart shows it marked partial. The file is in
WAL mode with synchronous=NORMAL: a commit is an append, not an fsync of the database, so saving while
streaming costs well under a millisecond. The schema is versioned with PRAGMA user_version; `migrate`
brings any older file up to SCHEMA_VERSION step by step.

Messages form a tree (schema v4): each has a parent (None for a conversation's first messages), so a
regenerated reply or an edited message is a sibling of the one it replaces, and nothing is ever
overwritten. A conversation records the last message of the path it shows (`leaf_id`) and its own
sampling settings (`settings`, JSON), and, when older turns were dropped to fit the context, the
last message the model no longer sees (`context_after`). One connection is shared by the UI thread and workers
(check_same_thread=False) and every use holds a lock.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from nanochat.engine.output import RequestStats


@dataclass
class StoredMessage:
    id: int
    role: str
    content: str
    stats: RequestStats | None = None   # an assistant reply's numbers (stored as RequestStats.to_dict())
    created: float = 0.0
    note: str = ""               # e.g. "history re-prefilled", "interrupted: engine stopped"
    partial: bool = False        # saved while streaming and never finished (the app was killed mid-reply)
    parent_id: int | None = None # the message it answers or follows (None: a first message)


@dataclass
class StoredConversation:
    id: int
    title: str
    system_prompt: str | None = None
    model: str | None = None
    created: float = 0.0
    updated: float = 0.0
    leaf_id: int | None = None   # the last message of the path shown (None: the newest message)
    settings: dict = field(default_factory=dict)   # the chat's own sampling settings (/set)
    context_after: int | None = None   # the model sees only what follows this message (older turns dropped)
    messages: list[StoredMessage] = field(default_factory=list)   # every message of the tree, oldest first


def _v1(conn: sqlite3.Connection) -> None:
    conn.executescript("""
        CREATE TABLE conversations (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL,
            system_prompt TEXT,
            model TEXT,
            created REAL NOT NULL,
            updated REAL NOT NULL
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            stats TEXT,
            created REAL NOT NULL
        );
        CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """)


def _v2(conn: sqlite3.Connection) -> None:
    # Per-message notes (history replay after a model switch) shown in the message footer.
    conn.execute("ALTER TABLE messages ADD COLUMN note TEXT NOT NULL DEFAULT ''")


def _v3(conn: sqlite3.Connection) -> None:
    # Replies saved while they stream carry partial = 1 until they end.
    conn.execute("ALTER TABLE messages ADD COLUMN partial INTEGER NOT NULL DEFAULT 0")


def _v4(conn: sqlite3.Connection) -> None:
    # The conversation tree: a linear history becomes one path, each message the child of the one before.
    conn.executescript("""
        ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE;
        UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p
                                         WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id);
        CREATE INDEX messages_by_parent ON messages(parent_id);
        ALTER TABLE conversations ADD COLUMN leaf_id INTEGER;
        ALTER TABLE conversations ADD COLUMN settings TEXT NOT NULL DEFAULT '{}';
        ALTER TABLE conversations ADD COLUMN context_after INTEGER;
        UPDATE conversations SET leaf_id = (SELECT MAX(m.id) FROM messages m
                                            WHERE m.conversation_id = conversations.id);
    """)


MIGRATIONS = [_v1, _v2, _v3, _v4]          # MIGRATIONS[k] upgrades user_version k -> k + 1
SCHEMA_VERSION = len(MIGRATIONS)


AFTER_LEAF = object()   # add_message's default parent: the last message of the path shown


class StoreError(RuntimeError):
    """The chat database cannot be used (newer schema, not a database)."""


def migrate(conn: sqlite3.Connection) -> int:
    """Upgrade the schema in place to SCHEMA_VERSION; returns the version found before."""
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found > SCHEMA_VERSION:
        raise StoreError(f"chat database schema version {found} is newer than this nanochat ({SCHEMA_VERSION})")
    for version in range(found, SCHEMA_VERSION):
        with conn:   # one transaction per step: a failed step leaves the previous version intact
            MIGRATIONS[version](conn)
            conn.execute(f"PRAGMA user_version = {version + 1}")
    return found


def _check_writable(conn: sqlite3.Connection) -> None:
    """Fail now, not at the first message, when the file can be read but not written (a read-only home):
    rewriting the schema version with its own value is a write that changes nothing."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    with conn:
        conn.execute(f"PRAGMA user_version = {int(version)}")


class ChatStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.RLock()
        try:
            if str(path) != ":memory:":
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(path), check_same_thread=False)
            self._conn.execute("PRAGMA foreign_keys = ON")
            self._conn.execute("PRAGMA busy_timeout = 5000")
            if str(path) != ":memory:":
                self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute("PRAGMA synchronous = NORMAL")
            migrate(self._conn)
            _check_writable(self._conn)
        except (sqlite3.DatabaseError, OSError) as e:
            raise StoreError(f"{path}: cannot open the chat database ({e})") from None

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock, self._conn:
            return self._conn.execute(sql, args)

    # ------------------------------------------------------------------ conversations
    def create_conversation(self, title: str, system_prompt: str | None = None, model: str | None = None,
                            created: float | None = None) -> int:
        now = created if created is not None else time.time()
        cur = self._write("INSERT INTO conversations (title, system_prompt, model, created, updated) "
                          "VALUES (?, ?, ?, ?, ?)", (title, system_prompt, model, now, now))
        return cur.lastrowid

    def list_conversations(self) -> list[StoredConversation]:
        """All conversations, most recently updated first, without their messages."""
        with self._lock:
            rows = self._conn.execute(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations "
                                      "ORDER BY updated DESC, id DESC").fetchall()
        return [_conversation(row) for row in rows]

    def load_conversation(self, conversation_id: int) -> StoredConversation:
        with self._lock:
            row = self._conn.execute(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ?",
                                     (conversation_id,)).fetchone()
            if row is None:
                raise KeyError(f"no conversation {conversation_id}")
            conv = _conversation(row)
            conv.messages = self.messages(conversation_id)
        return conv

    def load_all(self) -> list[StoredConversation]:
        convs = self.list_conversations()
        for c in convs:
            c.messages = self.messages(c.id)
        return convs

    def rename(self, conversation_id: int, title: str) -> None:
        self._write("UPDATE conversations SET title = ?, updated = ? WHERE id = ?", (title, time.time(), conversation_id))

    def set_system_prompt(self, conversation_id: int, system_prompt: str | None) -> None:
        self._write("UPDATE conversations SET system_prompt = ?, updated = ? WHERE id = ?",
                    (system_prompt, time.time(), conversation_id))

    def set_model(self, conversation_id: int, model: str | None) -> None:
        self._write("UPDATE conversations SET model = ? WHERE id = ?", (model, conversation_id))

    def set_leaf(self, conversation_id: int, leaf_id: int | None) -> None:
        """Remember the path shown: the message it ends with."""
        self._write("UPDATE conversations SET leaf_id = ? WHERE id = ?", (leaf_id, conversation_id))

    def set_settings(self, conversation_id: int, settings: dict) -> None:
        self._write("UPDATE conversations SET settings = ? WHERE id = ?", (json.dumps(settings), conversation_id))

    def set_context_after(self, conversation_id: int, message_id: int | None) -> None:
        self._write("UPDATE conversations SET context_after = ? WHERE id = ?", (message_id, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        self._write("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ------------------------------------------------------------------ messages
    def add_message(self, conversation_id: int, role: str, content: str, stats: RequestStats | None = None,
                    created: float | None = None, note: str = "", partial: bool = False,
                    parent_id: int | None | object = AFTER_LEAF) -> int:
        """A new message under `parent_id` (None: a first message; by default after the end of the path
        shown); it becomes the end of the path shown."""
        now = created if created is not None else time.time()
        with self._lock, self._conn:
            if parent_id is AFTER_LEAF:
                row = self._conn.execute("SELECT leaf_id FROM conversations WHERE id = ?",
                                         (conversation_id,)).fetchone()
                parent_id = row[0] if row is not None else None
            cur = self._conn.execute(
                "INSERT INTO messages (conversation_id, role, content, stats, created, note, partial, parent_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, _stats_json(stats), now, note, partial, parent_id))
            self._conn.execute("UPDATE conversations SET updated = ?, leaf_id = ? WHERE id = ?",
                               (now, cur.lastrowid, conversation_id))
        return cur.lastrowid

    def update_message(self, message_id: int, content: str, stats: RequestStats | None = None, note: str = "",
                       partial: bool = False) -> None:
        """Rewrite a message saved earlier (a streaming reply: its text so far, then its end)."""
        self._write("UPDATE messages SET content = ?, stats = ?, note = ?, partial = ? WHERE id = ?",
                    (content, _stats_json(stats), note, partial, message_id))

    def delete_message(self, message_id: int) -> None:
        """Delete a message and every message under it."""
        self._write("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        with self._lock:
            rows = self._conn.execute("SELECT id, role, content, stats, created, note, partial, parent_id "
                                      "FROM messages WHERE conversation_id = ? ORDER BY id",
                                      (conversation_id,)).fetchall()
        return [StoredMessage(i, role, content, _read_stats(stats), created, note or "", bool(partial), parent)
                for i, role, content, stats, created, note, partial, parent in rows]

    def clear_messages(self, conversation_id: int) -> None:
        with self._lock, self._conn:
            self._conn.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            self._conn.execute("UPDATE conversations SET leaf_id = NULL, updated = ? WHERE id = ?",
                               (time.time(), conversation_id))


_CONVERSATION_COLUMNS = "id, title, system_prompt, model, created, updated, leaf_id, settings, context_after"


def _conversation(row: tuple) -> StoredConversation:
    *head, settings, context_after = row
    try:
        data = json.loads(settings or "{}")
    except ValueError:
        data = {}
    return StoredConversation(*head, settings=data if isinstance(data, dict) else {}, context_after=context_after)


def _stats_json(stats: RequestStats | None) -> str | None:
    return json.dumps(stats.to_dict()) if stats is not None else None


def _read_stats(raw: str | None) -> RequestStats | None:
    """Stats as stored; keys of older or newer versions are ignored, and a damaged value reads as none."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return RequestStats.from_dict(data) if isinstance(data, dict) else None
