"""The line protocol of the peer workers (llamacpp_worker.py, transformers_worker.py): one JSON request
per line on stdin, one JSON reply per line on stdout, errors as {"error": "..."}, {"cmd": "quit"} ends.
Plain standard library: the workers run in other interpreters, without nanochat."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable


def serve(commands: dict[str, Callable[[dict], dict]]) -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        try:
            reply = commands[req["cmd"]](req)
        except Exception as e:   # reported to the parent, which prints one line
            reply = {"error": f"{e.__class__.__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0
