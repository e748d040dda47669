"""The chat store: conversations and their messages in SQLite (stdlib sqlite3).

A user message is committed when it is sent. A reply is committed at its first token, marked partial,
and rewritten as it streams (ChatController decides how often) until it ends, so a kill -9 of the app
mid-reply keeps the reply up to its last save, and a restart shows it marked partial. The file is in
WAL mode with synchronous=NORMAL: a commit is an append, not an fsync of the database, so saving while
streaming costs well under a millisecond. The schema is versioned with PRAGMA user_version; `migrate`
brings any older file up to SCHEMA_VERSION step by step. One connection is shared by the UI thread and workers
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


@dataclass
class StoredConversation:
    id: int
    title: str
    system_prompt: str | None = None
    model: str | None = None
    created: float = 0.0
    updated: float = 0.0
    messages: list[StoredMessage] = field(default_factory=list)


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


MIGRATIONS = [_v1, _v2, _v3]          # MIGRATIONS[k] upgrades user_version k -> k + 1
SCHEMA_VERSION = len(MIGRATIONS)


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

    def _touch(self, conversation_id: int, now: float | None = None) -> None:
        self._write("UPDATE conversations SET updated = ? WHERE id = ?", (now or time.time(), conversation_id))

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
            rows = self._conn.execute("SELECT id, title, system_prompt, model, created, updated FROM conversations "
                                      "ORDER BY updated DESC, id DESC").fetchall()
        return [StoredConversation(*row) for row in rows]

    def load_conversation(self, conversation_id: int) -> StoredConversation:
        with self._lock:
            row = self._conn.execute("SELECT id, title, system_prompt, model, created, updated FROM conversations "
                                     "WHERE id = ?", (conversation_id,)).fetchone()
            if row is None:
                raise KeyError(f"no conversation {conversation_id}")
            conv = StoredConversation(*row)
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

    def delete_conversation(self, conversation_id: int) -> None:
        self._write("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ------------------------------------------------------------------ messages
    def add_message(self, conversation_id: int, role: str, content: str, stats: RequestStats | None = None,
                    created: float | None = None, note: str = "", partial: bool = False) -> int:
        now = created if created is not None else time.time()
        with self._lock, self._conn:
            cur = self._conn.execute(
                "INSERT INTO messages (conversation_id, role, content, stats, created, note, partial) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, _stats_json(stats), now, note, partial))
            self._conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return cur.lastrowid

    def update_message(self, message_id: int, content: str, stats: RequestStats | None = None, note: str = "",
                       partial: bool = False) -> None:
        """Rewrite a message saved earlier (a streaming reply: its text so far, then its end)."""
        self._write("UPDATE messages SET content = ?, stats = ?, note = ?, partial = ? WHERE id = ?",
                    (content, _stats_json(stats), note, partial, message_id))

    def delete_message(self, message_id: int) -> None:
        self._write("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        with self._lock:
            rows = self._conn.execute("SELECT id, role, content, stats, created, note, partial FROM messages "
                                      "WHERE conversation_id = ? ORDER BY id", (conversation_id,)).fetchall()
        return [StoredMessage(i, role, content, _read_stats(stats), created, note or "", bool(partial))
                for i, role, content, stats, created, note, partial in rows]

    def clear_messages(self, conversation_id: int) -> None:
        self._write("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
        self._touch(conversation_id)


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
