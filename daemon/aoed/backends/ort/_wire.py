"""The line protocol between the engine and its child processes (no pickle).

Each request and each reply is one JSON object on one line. A child answers every
request with an object carrying the request's `id`. The child's own fd 1 is pointed at
stderr before any library loads, so stray prints from native code cannot corrupt the
protocol stream.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["serve"]


def serve(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """Answer requests from stdin with `handle` until EOF; returns the exit status."""
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError:
            proto.write(json.dumps({"id": None, "ok": False, "error": "malformed request"}) + "\n")
            continue
        try:
            reply = handle(request)
        except Exception as exc:  # reported to the engine as this request's failure
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply["id"] = request.get("id")
        proto.write(json.dumps(reply) + "\n")
    return 0
