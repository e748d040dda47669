"""A conversation written out: the path shown as Markdown, every branch as JSON, and the one-line
reply footer (stats and notes) the TUI and the export share."""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import suppress
from pathlib import Path

from nanochat.app.conversation import INTERRUPTED_NOTE, ChatError, Conversation, Message
from nanochat.app.reasoning import describe_thought
from nanochat.engine.output import RequestStats


def model_name(model: str | None) -> str:
    """How every front end names a model: the built-in one by its name, a file or folder by its own name,
    a hub id as given."""
    if not model:
        return "no model"
    from nanochat.models.formats.catalog import EMBEDDED_FILE, EMBEDDED_NAME

    p = Path(model)
    if p.name == EMBEDDED_FILE:
        return EMBEDDED_NAME
    return p.name if (p.suffix or p.exists()) else model


def format_stats(stats: RequestStats | None, note: str = "") -> str:
    """One footer line: tokens, TTFT, decode speed, speculation's accepted proposals, cached prompt tokens, how
    it ended, and any note."""
    parts: list[str] = []
    if stats is not None:
        parts.append(f"{stats.completion_tokens} tok")
        if stats.ttft is not None:
            parts.append(f"TTFT {stats.ttft * 1000:.0f} ms")
        if stats.decode_tok_s:
            parts.append(f"{stats.decode_tok_s:.1f} tok/s")
        if stats.spec_proposed:   # speculative decoding: of the tokens proposed, how many the model kept
            parts.append(f"spec {stats.spec_accepted}/{stats.spec_proposed} accepted")
        if stats.prompt_tokens:
            parts.append(f"cached {stats.cached_tokens}/{stats.prompt_tokens}")
        full = f"context full ({stats.prompt_tokens + stats.completion_tokens} tokens)"
        ending = {"abort": "cancelled", "length": full if stats.context_full else "max tokens",
                  "error": "error"}.get(stats.finish_reason or "")
        if ending and not (ending == "error" and INTERRUPTED_NOTE in note):   # the note says it better
            parts.append(ending)
    if note:
        parts.append(note)
    return " · ".join(parts)


def slugify(text: str) -> str:
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", text).strip("-").lower()
    return slug[:40] or "chat"


def export_markdown(conv: Conversation, model_label: str | None = None) -> str:
    lines = [f"# {conv.title}", ""]
    meta = [f"model: {conv.model or model_label or 'unknown'}",
            f"created: {time.strftime('%Y-%m-%d %H:%M', time.localtime(conv.created))}"]
    lines += ["_" + " · ".join(meta) + "_", ""]
    if conv.system_prompt:
        lines += ["## System", "", conv.system_prompt, ""]
    for m in conv.path:
        lines += ["## You" if m.role == "user" else "## Assistant", ""]
        if m.thought is not None and m.thought.text:   # collapsed where Markdown renders HTML, quoted elsewhere
            quoted = [f"> {line}".rstrip() for line in m.thought.text.splitlines()]
            lines += [f"<details><summary>{describe_thought(m.thought)}</summary>", "", *quoted, "", "</details>", ""]
        lines += [m.content, ""]
        footer = format_stats(m.stats, m.note)
        if footer:
            lines += [f"<sub>{footer}</sub>", ""]
    return "\n".join(lines).rstrip() + "\n"


def tree_json(conv: Conversation, model_label: str | None = None) -> dict:
    """Every branch of a conversation: nested messages, each with its versions' order and the path shown."""
    shown = set(map(id, conv.path))

    def node(m: Message) -> dict:
        out = {"role": m.role, "content": m.content, "created": m.created, "shown": id(m) in shown,
               "children": [node(c) for c in m.children]}
        if m.stats is not None:
            out["stats"] = m.stats.to_dict()
        if m.note:
            out["note"] = m.note
        if m.thought is not None:
            out["reasoning"], out["thought"] = m.thought.text, m.thought.meta()
        return out

    return {"title": conv.title, "model": conv.model or model_label, "system_prompt": conv.system_prompt,
            "settings": conv.settings, "created": conv.created, "messages": [node(m) for m in conv.roots]}


def _why(e: OSError) -> str:
    """An OSError's reason, lowercase ("permission denied", "no space left on device")."""
    reason = e.strerror or str(e)
    return reason[:1].lower() + reason[1:]


def _make_folder(folder: Path, what: str) -> None:
    """Make `folder` and its parents; ChatError naming the file in the way, if a file is."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), folder)
        raise ChatError(f"{what} {folder} is a file" if blocker == folder
                        else f"{blocker} is a file, not a folder") from None
    except OSError as e:
        raise ChatError(f"cannot make the {what} {folder}: {_why(e)}") from None


def _export_path(conv: Conversation, folder: Path, target: str, suffix: str) -> Path:
    """Where an export goes: `target` itself, or a new file in the folder it names (or `folder`)."""
    what = "exports folder"
    if target:
        path = Path(os.path.abspath(os.path.expanduser(target)))   # as a shell's cd reads "..": by name
        if not (path.is_dir() or target.endswith(("/", os.sep))):
            _make_folder(path.parent, "folder")
            return path
        folder, what = path, "folder"
    _make_folder(folder, what)
    name = f"{slugify(conv.title)}-{conv.id}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = folder / f"{name}{suffix}", 1
    while path.exists():
        n += 1
        path = folder / f"{name}-{n}{suffix}"
    return path


def write_export(conv: Conversation, folder: Path, model_label: str | None = None, tree: bool = False,
                 target: str = "") -> Path:
    """Write the path shown as Markdown, or (`tree`) every branch as JSON, to `target`: a file, or a folder
    (one that exists, or a name ending in /) for a new file named after the chat; "" is `folder`, the
    exports folder. `~` is expanded, relative paths start at the working folder, and a file that exists
    is never overwritten. Returns the file written; ChatError (one line) when it cannot be written."""
    text = (json.dumps(tree_json(conv, model_label), indent=2, ensure_ascii=False) + "\n" if tree
            else export_markdown(conv, model_label))
    try:
        path = _export_path(conv, folder, target, ".json" if tree else ".md")
        file = open(path, "x", encoding="utf-8")
    except FileExistsError:
        raise ChatError(f"{path} already exists; /export does not overwrite a file") from None
    except OSError as e:
        raise ChatError(f"cannot write {e.filename or target}: {_why(e)}") from None
    except ValueError as e:   # a NUL in the path
        raise ChatError(f"cannot write {target!r}: {e}") from None
    try:
        with file:
            file.write(text)
    except (OSError, ValueError) as e:
        with suppress(OSError):
            path.unlink()   # not half an export
        raise ChatError(f"cannot write {path}: {_why(e) if isinstance(e, OSError) else e}") from None
    return path
