"""Storage faults in the app (issue 29): a full disk mid-reply (a real one: a 200 KB tmpfs, where it can
be mounted), writes that fail while the app runs and when it quits, a damaged chat database, and
/export to a path. Driven by Pilot against the real engine on a tiny random model, as tests/test_tui.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest

import nanochat.app.store as store_module
from nanochat.app.paths import get_paths
from nanochat.app.store import ChatStore
from nanochat.app.tui.commands import parse_export
from nanochat.app.tui.recovery import RecoveryScreen
from test_store import Faults, chats_file, damage
from test_tui import (SIZE, home, make_app, notifications, reply_done, send, shared_client,  # noqa: F401 (fixtures)
                      slow_steps, sync, wait_for)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 200 KB tmpfs, mounted for the test (as root; skipped where it cannot be)."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> Path:
    """Fill the disk up to its last byte; returns the filler file's path (delete it to free the space)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (4096, 1):
            try:
                while True:
                    f.write(b"x" * size)
            except OSError:
                pass
    return filler


def saved(path, conv_id: int) -> list[tuple[str, str, bool]]:
    """(role, content, partial) of a chat's rows, read without writing (a full disk refuses a store's
    open, which checks that it can write)."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT role, content, partial FROM messages WHERE conversation_id = ? ORDER BY id",
                            (conv_id,)).fetchall()
    return [(role, content, bool(partial)) for role, content, partial in rows]


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------- a full disk
@sync
async def test_a_full_disk_mid_reply_keeps_the_app_and_the_reply(shared_client, tiny_disk, monkeypatch, slow_steps,
                                                                  capsys):
    """NANOCHAT_HOME on a 200 KB tmpfs that fills up mid-reply: the reply streams on and stays on screen,
    the app says that nothing is saved and is saved once space returns; filled again, quitting says what
    is lost (stderr, exit code 1) instead of a traceback, and the file holds everything saved before."""
    monkeypatch.setenv("NANOCHAT_HOME", str(tiny_disk / "home"))
    monkeypatch.setattr(store_module, "RETRY_SECONDS", 0.2)
    paths = get_paths().ensure()
    app = make_app(shared_client, paths, max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:
        conv = app.chat_screen.current
        await send(pilot, "hello there, tell me about the fox")
        await wait_for(pilot, lambda: len(app.controller.store.messages(conv.id)) == 2, 20, "the reply's first save")
        filler = fill(tiny_disk)
        reply = await reply_done(pilot, conv)
        assert app.is_running and reply.stats.completion_tokens == 16 and conv.path[-1] is reply
        assert any("cannot save chats" in m and "database or disk is full" in m for m in notifications(app))
        assert saved(paths.chat_db, conv.id)[1][2]                        # on disk: still the partial reply
        filler.unlink()
        await wait_for(pilot, lambda: any(m.startswith("Chats are saved again") for m in notifications(app)), 10,
                       "saved again")
        assert saved(paths.chat_db, conv.id) == [("user", "hello there, tell me about the fox", False),
                                                 ("assistant", reply.content, False)]
        fill(tiny_disk)
        await send(pilot, "and what about the dog?")
        last = await reply_done(pilot, conv)
    assert app.return_code == 1
    err = capsys.readouterr().err
    unwrapped = re.sub(r"\s", "", err)                                  # folded to the console's width
    for said in (f"nanochat: could not save to {paths.chat_db} (database or disk is full)",
                 "your message “and what about the dog?”", "the reply “"):
        assert re.sub(r"\s", "", said) in unwrapped
    assert "Traceback" not in err and err.count("nanochat:") == 1
    (tiny_disk / "filler").unlink()
    store = ChatStore(paths.chat_db)
    assert [m.content for m in store.messages(conv.id)] == ["hello there, tell me about the fox", reply.content]
    assert last.content and store.close() is None


@sync
async def test_failing_writes_never_close_the_app(shared_client, home, monkeypatch):
    """Injected: every write raises an I/O error from the first message on. Both turns show, a branch
    of the second works, the parent ids hold, and all of it is saved when writing works again."""
    monkeypatch.setattr(store_module, "RETRY_SECONDS", 0.2)
    app = make_app(shared_client, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        faults = Faults(app.controller.store, monkeypatch)
        faults.error = OSError(5, "Input/output error")
        conv = app.chat_screen.current
        await send(pilot, "first question")
        first = await reply_done(pilot, conv)
        await send(pilot, "second question")
        await reply_done(pilot, conv)
        await send(pilot, "/retry")
        again = await reply_done(pilot, conv)
        assert app.is_running and [m.role for m in conv.path] == ["user", "assistant"] * 2
        warnings = [m for m in notifications(app) if "cannot save chats" in m]
        assert len(warnings) == 1 and "(input/output error)" in warnings[0]
        assert ChatStore(home.chat_db).messages(conv.id) == []
        faults.error = None
        await wait_for(pilot, lambda: any(m.startswith("Chats are saved again") for m in notifications(app)), 10,
                       "saved again")
        stored = {m.id: m for m in ChatStore(home.chat_db).messages(conv.id)}
        assert len(stored) == 5 and stored[again.id].parent_id == conv.path[2].id
        assert stored[conv.path[2].id].parent_id == first.id and stored[again.id].content == again.content


# ---------------------------------------------------------------------------------- a damaged database
@contextlib.asynccontextmanager
async def damaged_app(shared_client, home):
    """The app started on a chat database with random bytes in its pages, showing the recovery dialog;
    yields (app, pilot, the file's hash before)."""
    chats_file(home.chat_db)
    damage(home.chat_db, "random page bytes")
    before = sha256(home.chat_db)
    app = make_app(shared_client, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, RecoveryScreen)
        yield app, pilot, before


@sync
async def test_a_damaged_database_is_left_alone_unless_the_user_chooses(shared_client, home):
    """Random bytes inside the file's pages: the app starts on what could be read, asks, and "not now"
    leaves the file byte for byte as it was, through a chat and a quit."""
    async with damaged_app(shared_client, home) as (app, pilot, before):
        await pilot.press("escape")                                      # not now
        await pilot.pause()
        assert not isinstance(app.screen, RecoveryScreen)
        assert any(f"the chat database {home.chat_db} is damaged" in m for m in notifications(app))
        read = len(app.controller.conversations)
        assert read > 10
        await send(pilot, "a chat in memory")
        await reply_done(pilot, app.chat_screen.current)
    assert sha256(home.chat_db) == before and not app.return_code
    assert not list(home.chat_db.parent.glob("chats.sqlite3-*"))        # not even a -wal or -shm beside it


@sync
async def test_a_damaged_database_can_be_kept_beside_a_new_one(shared_client, home):
    async with damaged_app(shared_client, home) as (app, pilot, before):
        await pilot.press("enter")                                       # keep a copy, start a new one
        await pilot.pause()
        [kept] = home.chat_db.parent.glob("chats.sqlite3.damaged-*[0-9]")
        assert sha256(kept) == before
        assert any(f"the damaged file is kept as {kept}" in m for m in notifications(app))
        titles = {c.title for c in app.controller.conversations.values()}
        await send(pilot, "saved in the new database")
        conv = app.chat_screen.current
        await reply_done(pilot, conv)
    store = ChatStore(home.chat_db)
    assert {c.title for c in store.list_conversations()} == titles
    assert [m.role for m in store.messages(conv.id)][-2:] == ["user", "assistant"]
    store.close()


# ---------------------------------------------------------------------------------- /export PATH
def test_export_argument_grammar():
    assert parse_export("") == (False, "")
    assert parse_export("json") == (True, "")
    assert parse_export("MD") == (False, "")
    assert parse_export("notes.json") == (True, "notes.json")
    assert parse_export("Notes.JSON") == (True, "Notes.JSON")
    assert parse_export("md notes.json") == (False, "notes.json")        # the word wins
    assert parse_export("json ~/chats/") == (True, "~/chats/")
    assert parse_export('"my notes.md"') == (False, "my notes.md")
    assert parse_export("json 'two words/'") == (True, "two words/")
    assert parse_export("jsonl") == (False, "jsonl")                      # a file named jsonl


@sync
async def test_export_to_a_path_in_the_app(shared_client, home, tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    app = make_app(shared_client, home, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await send(pilot, "Show me code")
        await reply_done(pilot, screen.current)
        await send(pilot, "/export ~/notes/")
        export = screen.commands.last_export
        assert export.parent == tmp_path / "user" / "notes" and export.suffix == ".md"
        assert any(m == f"Exported to {export}" for m in notifications(app))
        await send(pilot, "/export tree.json")
        assert json.loads((tmp_path / "tree.json").read_text())["messages"][0]["content"] == "Show me code"
        await send(pilot, "/export tree.json")
        assert notifications(app)[-1] == f"/export: {tmp_path / 'tree.json'} already exists; /export does not " \
                                         "overwrite a file"
        home.exports_dir.write_text("")                                   # the exports folder replaced by a file
        await send(pilot, "/export json")
        assert notifications(app)[-1] == f"/export: exports folder {home.exports_dir} is a file"
        assert app.is_running
