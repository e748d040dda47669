"""The chat store: conversations and their messages in SQLite (stdlib sqlite3).

A user message is committed when it is sent. A reply is committed at its first token, marked partial,
and rewritten as it streams (ChatController decides how often) until it ends, so a kill -9 of the app
mid-reply keeps the reply up to its last save, and a restart shows it marked partial. The file is in
WAL mode with synchronous=NORMAL: a commit is an append, not an fsync of the database, so saving while
streaming is cheap. The schema is versioned with PRAGMA user_version; `migrate`
brings any older file up to SCHEMA_VERSION step by step.

A reply's thinking (schema v5: <think>...</think> of reasoning models) is kept apart from its answer:
`content` is the answer, `reasoning` the thinking's text and `thought` its numbers (JSON, app/reasoning.py's
Thought); replies saved before v5 are split when the file is migrated.

Messages form a tree (schema v4): each has a parent (None for a conversation's first messages), so a
regenerated reply or an edited message is a sibling of the one it replaces, and nothing is ever
overwritten. A conversation records the last message of the path it shows (`leaf_id`) and its own
sampling settings (`settings`, JSON), and, when older turns were dropped to fit the context, the
last message the model no longer sees (`context_after`). One connection is shared by the UI thread and workers
(check_same_thread=False) and every use holds a lock.

Storage faults (a full disk, an I/O error, a file turned read-only) never reach the caller: a write
that fails stays in memory, in order, and is tried again before the next write, at most every
RETRY_SECONDS through `retry()`, and at `close()`, which names what it still could not save.
`on_fault` hears when saving stops working and when it works again. The store gives out the row ids
itself, so a message whose row is not written yet already has the id its replies refer to.

A damaged file is never written to: an existing file is checked read-only (PRAGMA quick_check) before
anything opens it for writing. `open_store` then stands in an in-memory store holding what could be
read of it, and `replace_damaged` (the user's choice) moves the file aside and starts a new one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from contextlib import closing, suppress
from dataclasses import dataclass, field
from pathlib import Path

from nanochat.app.reasoning import Thought, split_reasoning
from nanochat.app.terminal_text import sanitize
from nanochat.engine.output import RequestStats

RETRY_SECONDS = 3.0     # the most often retry() tries the writes a storage fault held back


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
    thought: Thought | None = None   # a reply's thinking (None: it had none)


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


def _v5(conn: sqlite3.Connection) -> None:
    # A reply's thinking apart from its answer. Replies saved before kept it in their text: split them,
    # as the model wrote them (a reply holding </think> but no <think> had the block opened by its prompt).
    conn.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT")
    conn.execute("ALTER TABLE messages ADD COLUMN thought TEXT")
    rows = conn.execute("SELECT id, content FROM messages WHERE role = 'assistant' AND content LIKE ?",
                        ("%</think>%",)).fetchall() + \
        conn.execute("SELECT id, content FROM messages WHERE role = 'assistant' AND content LIKE ? "
                     "AND content NOT LIKE ?", ("%<think>%", "%</think>%")).fetchall()
    for mid, content in rows:
        prompted = "<think>" not in content
        split = split_reasoning(content, prompted)
        if split.reasoning is not None:
            thought = Thought(split.reasoning, closed=split.closed, prompted=prompted)
            conn.execute("UPDATE messages SET content = ?, reasoning = ?, thought = ? WHERE id = ?",
                         (split.answer, thought.text, json.dumps(thought.meta()), mid))


MIGRATIONS = [_v1, _v2, _v3, _v4, _v5]          # MIGRATIONS[k] upgrades user_version k -> k + 1
SCHEMA_VERSION = len(MIGRATIONS)


AFTER_LEAF = object()   # add_message's default parent: the last message of the path shown


class StoreError(RuntimeError):
    """The chat database cannot be used (newer schema, not a database, cannot be opened)."""


class DamagedStore(StoreError):
    """SQLite finds the file damaged (corrupt pages, not a database); nothing has written to it."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"the chat database {path} is damaged ({reason}); nanochat has not changed it")
        self.path = path


def _newer(version: int) -> str:
    return f"chat database schema version {version} is newer than this nanochat ({SCHEMA_VERSION})"


def migrate(conn: sqlite3.Connection) -> int:
    """Upgrade the schema in place to SCHEMA_VERSION; returns the version found before."""
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found > SCHEMA_VERSION:
        raise StoreError(_newer(found))
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


# ---------------------------------------------------------------------------------- opening a file
def _is_damage(e: BaseException) -> bool:
    # sqlite3 raises the base DatabaseError class only for SQLITE_CORRUPT and SQLITE_NOTADB; its
    # subclasses are the other failures (OperationalError: cannot open, I/O, full, read-only, locked).
    return type(e) is sqlite3.DatabaseError


def _read_only(path: Path) -> sqlite3.Connection:
    """A connection that cannot write `path`: immutable (no lock, no -shm made beside it) unless a WAL
    file is there, whose recent writes only a read-only connection reads."""
    flag = "mode=ro" if Path(f"{path}-wal").exists() else "immutable=1"
    return sqlite3.connect(f"{path.absolute().as_uri()}?{flag}", uri=True, check_same_thread=False)


def _check(path: Path) -> None:
    """Read an existing file before anything opens it for writing (setting WAL mode or the schema version
    writes its header): DamagedStore when SQLite finds it damaged, StoreError when its schema is newer."""
    with closing(_read_only(path)) as conn:
        try:
            problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            if _is_damage(e):
                raise DamagedStore(path, str(e)) from None
            raise
    if problems != ["ok"]:
        lines = [line for p in problems for line in p.splitlines() if not line.startswith("***")]
        raise DamagedStore(path, lines[0] if lines else problems[0])
    if version > SCHEMA_VERSION:
        raise StoreError(f"{path}: {_newer(version)}")


def _prepare(conn: sqlite3.Connection, on_disk: bool) -> None:
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA busy_timeout = 5000")
    if on_disk:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
    migrate(conn)
    _check_writable(conn)


def _open_file(path: Path) -> sqlite3.Connection:
    if path.is_file() and path.stat().st_size:   # an empty file is a new database
        _check(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), check_same_thread=False)
    try:
        _prepare(conn, on_disk=True)
    except BaseException:
        conn.close()
        raise
    return conn


# ---------------------------------------------------------------------------------- salvage
SALVAGE_FAILURES = 1000   # reads that may fail on damaged pages, per table, before the rest is given up


def _readable_rows(conn: sqlite3.Connection, table: str) -> list[dict]:
    """The rows of `table` that can be read, by id: after a read fails on a damaged page, reading starts
    again further on, skipping twice as far each time until a row reads again."""
    rows: list[dict] = []
    after, skip = 0, 1
    for _ in range(SALVAGE_FAILURES):
        try:
            cursor = conn.execute(f"SELECT * FROM {table} WHERE id > ? ORDER BY id", (after,))
            names = [d[0] for d in cursor.description]
            for values in cursor:
                rows.append(dict(zip(names, values)))
                after, skip = rows[-1]["id"], 1
            return rows
        except sqlite3.DatabaseError:
            after, skip = after + skip, skip * 2
    return rows


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [info[1] for info in conn.execute(f"PRAGMA table_info({table})")]


def _insert(conn: sqlite3.Connection, table: str, columns: list[str], row: dict) -> bool:
    """Insert what `table` has columns for; False when SQLite refuses the row (a damaged value)."""
    names = [c for c in columns if c in row]
    try:
        conn.execute(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                     [row[c] for c in names])
    except sqlite3.Error:
        return False
    return True


def _salvage(path: Path) -> sqlite3.Connection:
    """An in-memory database holding what can be read of the damaged file at `path` (read-only), at its
    schema version (migrate brings it up). A message whose conversation was lost is left out; one whose
    parent was lost becomes a first message, so that its text stays."""
    mem = sqlite3.connect(":memory:", check_same_thread=False)
    with suppress(sqlite3.Error), closing(_read_only(path)) as src:
        version = min(src.execute("PRAGMA user_version").fetchone()[0], SCHEMA_VERSION)
        for step in MIGRATIONS[:version]:
            step(mem)
        mem.execute(f"PRAGMA user_version = {version}")
        columns = _columns(mem, "conversations")
        conversations = {row["id"] for row in _readable_rows(src, "conversations")
                         if _insert(mem, "conversations", columns, row)}
        columns, kept = _columns(mem, "messages"), set()
        for row in _readable_rows(src, "messages"):   # by id: a parent comes before its children
            if row.get("conversation_id") not in conversations:
                continue
            if row.get("parent_id") not in kept:
                row["parent_id"] = None
            if _insert(mem, "messages", columns, row):
                kept.add(row["id"])
    mem.commit()
    return mem


def _last_ids(conn: sqlite3.Connection) -> dict[str, int]:
    """The highest id given out so far in each table (AUTOINCREMENT's record, or the rows')."""
    seq = dict(conn.execute("SELECT name, seq FROM sqlite_sequence"))
    return {t: max(seq.get(t, 0), conn.execute(f"SELECT COALESCE(MAX(id), 0) FROM {t}").fetchone()[0])
            for t in ("conversations", "messages")}


# ---------------------------------------------------------------------------------- the store
@dataclass
class _Write:
    """One write (a transaction), kept until it is saved."""

    statements: list[tuple[str, tuple]]
    key: tuple | None = None      # a later write with the same key makes this one needless
    message: int | None = None    # the message whose text it saves, named if it is never saved
    text: str | None = None       # that text (None: the write deletes the message)
    role: str = ""                # the message's role, where the write adds it


def _is_fault(e: BaseException) -> bool:
    """A failure of the storage, which may pass (full, I/O, read-only, locked, damaged), not of the write."""
    return isinstance(e, (sqlite3.OperationalError, OSError)) or _is_damage(e)


def _excerpt(text: str, most: int = 40) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= most else flat[:most - 1] + "…"


def warn_on_stderr(warning: str | None) -> None:
    """A store's on_fault where no front end shows it otherwise."""
    print(sanitize(f"nanochat: warning: {warning}") if warning else "nanochat: chats are saved again",
          file=sys.stderr)


class ChatStore:
    def __init__(self, path: str | Path, damaged: DamagedStore | None = None):
        """The chat database at `path` (":memory:": in memory). With `damaged`, an in-memory store holding
        what can be read of that damaged file, which stays as it is. StoreError (DamagedStore when SQLite
        finds the file damaged) when the file cannot be used."""
        self.path = Path(path)
        self.damaged = damaged             # the damaged file this in-memory store stands in for
        self.fault: str | None = None      # why the pending writes could not be saved (None: all saved)
        # told a warning when saving starts to fail, and None when it works again
        self.on_fault: Callable[[str | None], None] = warn_on_stderr
        self._lock = threading.RLock()
        self._pending: list[_Write] = []   # writes a storage fault held back, oldest first
        self._tried_at = 0.0               # monotonic time they were last tried
        try:
            if str(path) != ":memory:":
                self._conn = _open_file(self.path)
            else:
                self._conn = _salvage(damaged.path) if damaged is not None else \
                    sqlite3.connect(":memory:", check_same_thread=False)
                _prepare(self._conn, on_disk=False)
            self._last_id = _last_ids(self._conn)
        except DamagedStore:
            raise
        except (sqlite3.DatabaseError, OSError) as e:
            raise StoreError(f"{path}: cannot open the chat database ({e})") from None

    def close(self) -> str | None:
        """Try the writes not saved yet one last time, and close. Returns what could still not be saved,
        one line that names its text (None: everything is saved)."""
        with self._lock:
            lost = None if self._flush() else self._lost()
            self._conn.close()
        return lost

    # ------------------------------------------------------------------ writes
    def _new_id(self, table: str) -> int:
        self._last_id[table] += 1
        return self._last_id[table]

    def _submit(self, statements: list[tuple[str, tuple]], **about) -> None:
        """Save a write after the pending ones; a storage fault keeps them all for later."""
        write = _Write(statements, **about)
        with self._lock:
            if write.key is not None:
                self._pending = [w for w in self._pending if w.key != write.key]
            self._pending.append(write)
            self._flush()

    def retry(self) -> None:
        """Try the writes a storage fault held back again, at most once every RETRY_SECONDS."""
        with self._lock:
            if self._pending and time.monotonic() - self._tried_at >= RETRY_SECONDS:
                self._flush()

    def _flush(self) -> bool:
        """Run the pending writes in order until one fails; whether they are all saved."""
        self._tried_at = time.monotonic()
        while self._pending:
            try:
                self._run(self._pending[0].statements)
            except (sqlite3.Error, OSError) as e:
                if not _is_fault(e):
                    self._pending.pop(0)   # a fault of the write itself: trying again cannot help
                    raise
                self._set_fault(str(e) if isinstance(e, sqlite3.Error) else (e.strerror or str(e)).lower())
                return False
            self._pending.pop(0)
        self._set_fault(None)
        return True

    def _run(self, statements: list[tuple[str, tuple]]) -> None:
        try:
            for sql, args in statements:
                self._conn.execute(sql, args)
            self._conn.commit()
        except BaseException:
            with suppress(sqlite3.Error):
                self._conn.rollback()
            raise

    def _set_fault(self, reason: str | None) -> None:
        was, self.fault = self.fault, reason
        if (was is None) != (reason is None):
            self.on_fault(None if reason is None else
                          f"cannot save chats to {self.path} ({reason}); they are kept in memory and saved "
                          "when writing works again")

    def _lost(self) -> str:
        texts: dict[int, str | None] = {}
        roles: dict[int, str] = {}
        for w in self._pending:
            if w.message is not None:
                texts[w.message] = w.text
                roles[w.message] = w.role or roles.get(w.message, "")
        named = [f"{_ROLE_NAMES.get(roles[m], 'the message')} “{_excerpt(t)}”" for m, t in texts.items()
                 if t is not None]
        others = sum(w.message is None or w.text is None for w in self._pending)
        if others:
            named.append(f"{others} {'other ' if named else ''}change{'s' if others > 1 else ''} "
                         "(titles, settings, the branch shown)")
        return f"could not save to {self.path} ({self.fault}); not saved: {', '.join(named)}"

    # ------------------------------------------------------------------ a damaged file
    def replace_damaged(self) -> Path:
        """Move the damaged file this store stands in for aside (renamed beside it, with its -wal and
        -shm) and start a new database in its place, holding this store's chats. Returns where the
        damaged file is now; StoreError when it cannot be done (everything is then as it was)."""
        old = self.damaged.path
        stamp = time.strftime("%Y%m%d-%H%M%S")
        kept, n = old.with_name(f"{old.name}.damaged-{stamp}"), 1
        while kept.exists():
            n += 1
            kept = old.with_name(f"{old.name}.damaged-{stamp}-{n}")
        moved: list[tuple[Path, Path]] = []
        made = False
        with self._lock:
            try:
                for suffix in ("", "-wal", "-shm"):
                    src, dst = Path(f"{old}{suffix}"), Path(f"{kept}{suffix}")
                    if not suffix or src.exists():
                        os.rename(src, dst)
                        moved.append((src, dst))
                made = True
                with closing(sqlite3.connect(old)) as fresh:
                    self._conn.backup(fresh)
                conn = _open_file(old)
            except (sqlite3.Error, OSError) as e:
                _put_back(old, moved, made)
                raise StoreError(f"cannot start a new chat database at {old} ({e})") from None
            self._conn.close()
            self._conn, self.path, self.damaged = conn, old, None
        return kept

    # ------------------------------------------------------------------ conversations
    def create_conversation(self, title: str, system_prompt: str | None = None, model: str | None = None,
                            created: float | None = None) -> int:
        now = created if created is not None else time.time()
        with self._lock:   # rows are written in the order of their ids
            cid = self._new_id("conversations")
            self._submit([("INSERT INTO conversations (id, title, system_prompt, model, created, updated) "
                           "VALUES (?, ?, ?, ?, ?, ?)", (cid, title, system_prompt, model, now, now))])
        return cid

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
        self._submit([("UPDATE conversations SET title = ?, updated = ? WHERE id = ?",
                       (title, time.time(), conversation_id))])

    def set_system_prompt(self, conversation_id: int, system_prompt: str | None) -> None:
        self._submit([("UPDATE conversations SET system_prompt = ?, updated = ? WHERE id = ?",
                       (system_prompt, time.time(), conversation_id))])

    def set_model(self, conversation_id: int, model: str | None) -> None:
        self._submit([("UPDATE conversations SET model = ? WHERE id = ?", (model, conversation_id))])

    def set_leaf(self, conversation_id: int, leaf_id: int | None) -> None:
        """Remember the path shown: the message it ends with."""
        self._submit([("UPDATE conversations SET leaf_id = ? WHERE id = ?", (leaf_id, conversation_id))])

    def set_settings(self, conversation_id: int, settings: dict) -> None:
        self._submit([("UPDATE conversations SET settings = ? WHERE id = ?", (json.dumps(settings), conversation_id))])

    def set_context_after(self, conversation_id: int, message_id: int | None) -> None:
        self._submit([("UPDATE conversations SET context_after = ? WHERE id = ?", (message_id, conversation_id))])

    def delete_conversation(self, conversation_id: int) -> None:
        self._submit([("DELETE FROM conversations WHERE id = ?", (conversation_id,))])

    # ------------------------------------------------------------------ messages
    def add_message(self, conversation_id: int, role: str, content: str, stats: RequestStats | None = None,
                    created: float | None = None, note: str = "", partial: bool = False,
                    parent_id: int | None | object = AFTER_LEAF, thought: Thought | None = None) -> int:
        """A new message under `parent_id` (None: a first message; by default after the end of the path
        shown); it becomes the end of the path shown. `content` is a reply's answer, `thought` its thinking."""
        now = created if created is not None else time.time()
        # the end of the path shown is read when the write runs: after the writes still pending
        parent, parent_arg = (("(SELECT leaf_id FROM conversations WHERE id = ?)", conversation_id)
                              if parent_id is AFTER_LEAF else ("?", parent_id))
        with self._lock:   # rows are written in the order of their ids: a parent's is the lower
            mid = self._new_id("messages")
            self._submit([
                ("INSERT INTO messages (id, conversation_id, role, content, stats, created, note, partial, "
                 f"reasoning, thought, parent_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {parent})",
                 (mid, conversation_id, role, content, _stats_json(stats), now, note, partial,
                  *_thought_columns(thought), parent_arg)),
                ("UPDATE conversations SET updated = ?, leaf_id = ? WHERE id = ?", (now, mid, conversation_id)),
            ], message=mid, text=content, role=role)
        return mid

    def update_message(self, message_id: int, content: str, stats: RequestStats | None = None, note: str = "",
                       partial: bool = False, thought: Thought | None = None) -> None:
        """Rewrite a message saved earlier (a streaming reply: its text so far, then its end)."""
        self._submit([("UPDATE messages SET content = ?, stats = ?, note = ?, partial = ?, reasoning = ?, "
                       "thought = ? WHERE id = ?",
                       (content, _stats_json(stats), note, partial, *_thought_columns(thought), message_id))],
                     key=("update", message_id), message=message_id, text=content)

    def delete_message(self, message_id: int) -> None:
        """Delete a message and every message under it."""
        self._submit([("DELETE FROM messages WHERE id = ?", (message_id,))], message=message_id)

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        """The messages saved (not those a storage fault holds back), oldest first."""
        with self._lock:
            rows = self._conn.execute("SELECT id, role, content, stats, created, note, partial, parent_id, "
                                      "reasoning, thought FROM messages WHERE conversation_id = ? ORDER BY id",
                                      (conversation_id,)).fetchall()
        return [StoredMessage(i, role, content, _read_stats(stats), created, note or "", bool(partial), parent,
                              _read_thought(reasoning, thought))
                for i, role, content, stats, created, note, partial, parent, reasoning, thought in rows]

    def clear_messages(self, conversation_id: int) -> None:
        self._submit([("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,)),
                      ("UPDATE conversations SET leaf_id = NULL, updated = ? WHERE id = ?",
                       (time.time(), conversation_id))])


def _put_back(old: Path, moved: list[tuple[Path, Path]], made: bool) -> None:
    """Undo a replace_damaged that failed: remove the new database it began, rename the damaged one back."""
    if made:
        for suffix in ("", "-wal", "-shm"):
            with suppress(OSError):
                Path(f"{old}{suffix}").unlink()
    for src, dst in reversed(moved):
        with suppress(OSError):
            os.rename(dst, src)


def open_store(path: Path) -> tuple[ChatStore, str | None]:
    """The chat database, or an in-memory one and a warning when the file cannot be used. For a damaged
    file, the in-memory store holds what could be read of it (`store.damaged` says so; the file is
    left as it is)."""
    try:
        return ChatStore(path), None
    except DamagedStore as e:
        store = ChatStore(":memory:", damaged=e)
        read = len(store.list_conversations())
        return store, (f"{e}; {read} conversation{'' if read == 1 else 's'} could be read from it, and nothing "
                       "is saved this session unless you start a new database")
    except StoreError as e:
        return ChatStore(":memory:"), f"{e}; conversations will NOT be saved this session"


_ROLE_NAMES = {"user": "your message", "assistant": "the reply"}
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


def _thought_columns(thought: Thought | None) -> tuple[str | None, str | None]:
    return (thought.text, json.dumps(thought.meta())) if thought is not None else (None, None)


def _read_thought(text: str | None, raw: str | None) -> Thought | None:
    """A reply's thinking as stored; damaged numbers read as unknown, the text stays."""
    if text is None:
        return None
    try:
        meta = json.loads(raw or "{}")
        return Thought.from_meta(text, meta if isinstance(meta, dict) else None)
    except (ValueError, TypeError):
        return Thought(text)


def _read_stats(raw: str | None) -> RequestStats | None:
    """Stats as stored; keys of older or newer versions are ignored, and a damaged value reads as none."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return RequestStats.from_dict(data) if isinstance(data, dict) else None
