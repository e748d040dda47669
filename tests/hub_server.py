"""A Hugging Face hub on loopback for the pull tests: the API and file routes huggingface_hub and
models/formats/hub_gguf.py use (model info, file tree, HEAD/GET resolve with Range), and ways to fail as networks do."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from dataclasses import dataclass, field


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False             # its routes answer 403 GatedRepo (terms not accepted)


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    cut_after: int | None = None    # drop the connection after this many body bytes ...
    cuts_left: int = 0              # ... on this many GETs
    gets: list[tuple[str, int]] = field(default_factory=list)   # (file, first byte asked) per GET
    sent: int = 0                   # body bytes sent in all

    def __enter__(self) -> "FakeHub":
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, h, body: bool) -> None:
        path = h.path.split("?", 1)[0]
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
            if (repo := self._repo(h, m[1])) is None:
                return
            info = {"id": m[1], "modelId": m[1], "sha": repo.commit, "private": False,
                    "siblings": [{"rfilename": name} for name in repo.files]}
            return self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+", path):   # snapshot_download's file list
            if (repo := self._repo(h, m[1])) is None:
                return
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in repo.files.items()]
            return self._send(h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            if (repo := self._repo(h, m[1])) is None:
                return
            data = repo.files.get(m[3])
            if data is None:
                return self._error(h, 404, "EntryNotFound")
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Accept-Ranges": "bytes"}
            start = 0
            if body and (r := re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))):
                start = int(r[1])
            if body:
                self.gets.append((m[3], start))
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(h, 206 if start else 200, data[start:], headers, body, cut=body)
        self._error(h, 404, "RepoNotFound")

    def _repo(self, h, name: str) -> Repo | None:
        """The repo a route names, or None once the error the hub gives for it is sent."""
        repo = self.repos.get(name)
        if repo is None or repo.gated:
            self._error(h, *((404, "RepoNotFound") if repo is None else (403, "GatedRepo")))
            return None
        return repo

    def _error(self, h, status: int, code: str) -> None:
        self._send(h, status, json.dumps({"error": code}).encode(), {"X-Error-Code": code,
                                                                     "Content-Type": "application/json"}, True)

    def _send(self, h, status: int, data: bytes, headers: dict, body: bool, cut: bool = False) -> None:
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if not body:
            return
        if cut and self.cut_after is not None and self.cuts_left > 0 and len(data) > self.cut_after:
            self.cuts_left -= 1
            h.wfile.write(data[:self.cut_after])
            h.wfile.flush()
            self.sent += self.cut_after
            h.close_connection = True
            h.connection.shutdown(2)   # the network goes away mid-file
            return
        h.wfile.write(data)
        self.sent += len(data)
