"""The child side of the engine's line protocol (no pickle), and process set-up.

Each request and each reply is one JSON object on one line. A child answers every
request with an object carrying the request's `id`, its `ok`, on failure `error` (one
line) and `error_class` (the `aoe.errors` class, so the engine raises the same one),
and its peak resident memory while it served that request (`maxrss_kb`). The child's own fd 1 is pointed at stderr
before any library loads, so stray prints from native code cannot corrupt the stream.

`child_main()` parses the arguments the engine starts every child with (its parent's
pid, its cores, its memory limit) and applies them before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from aoe.errors import AoedError

__all__ = ["child_main", "serve"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the parent dies: a stopped worker must not outlive a killed engine."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the closed pipe ends us instead
        return
    if parent and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def child_main(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Apply the engine's start-up arguments; returns the rest (e.g. `plugins`)."""
    p = argparse.ArgumentParser()
    p.add_argument("--parent", type=int, default=0)
    p.add_argument("--cpus", default="")
    p.add_argument("--memory-mb", type=int, default=0)
    p.add_argument("--plugins", default="")
    args = p.parse_args(argv)
    _die_with_parent(args.parent)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.memory_mb > 0:
        limit = args.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    args.plugins = [m for m in args.plugins.split(",") if m.strip()]
    return args


def _reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS count (VmHWM), so a long-lived child reports the
    peak of each request rather than of its whole life."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_kb() -> int:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


#: How an allocation refused by the address-space limit reads once a native library
#: (protobuf, onnx, onnxruntime) turned it into its own error; unrecognized, a model too
#: large for the limit is reported as "not a readable ONNX model" or "invalid model".
_ALLOC_FAILED = ("alloc failed", "bad_alloc", "bad allocation", "failed to serialize proto", "cannot allocate memory")


def _limit_mib() -> int | None:
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if limit == resource.RLIM_INFINITY else limit >> 20


def _looks_out_of_memory(error: str) -> bool:
    return _limit_mib() is not None and any(m in error.lower() for m in _ALLOC_FAILED)


def _out_of_memory(error: str) -> dict[str, Any]:
    """The reply for a request that ran out of this child's address space: it names the
    limit and the setting that raises it, and costs the request, not the job."""
    mib = _limit_mib()
    limit = f" of {mib} MiB; raise [engine] worker_memory_mb" if mib is not None else ""
    return {"ok": False, "error": f"out of memory (the worker's memory limit{limit}): {error}",
            "error_class": "CandidateError"}  # fmt: skip


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
        _reset_peak_rss()
        try:
            reply = handle(request)
        except AoedError as exc:  # the request's own failure, e.g. a bad model
            reply = {"ok": False, "error": str(exc), "error_class": type(exc).__name__}
        except MemoryError:
            reply = _out_of_memory("MemoryError")
        except Exception as exc:  # reported to the engine as this request's failure
            # The log is a file in the state dir: on a full disk the traceback cannot be
            # written, and that must not end the worker (the reply says what failed).
            with contextlib.suppress(OSError):
                traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        if reply.get("ok") is False and _looks_out_of_memory(str(reply.get("error", ""))):
            reply = _out_of_memory(reply["error"])
        reply.setdefault("ok", True)
        reply["id"] = request.get("id")
        reply["maxrss_kb"] = _peak_rss_kb()
        try:
            proto.write(json.dumps(reply) + "\n")
        except BrokenPipeError:
            # The engine is gone (killed: our PR_SET_PDEATHSIG is on its way) or gave up on
            # this request: nobody to answer, nothing for the log. No interpreter shutdown,
            # which would flush `proto` again and print the same error.
            os._exit(0)
    return 0
