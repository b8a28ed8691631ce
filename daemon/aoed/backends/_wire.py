"""The child side of the engine's line protocol (no pickle), and process set-up.

Each request and each reply is one JSON object on one line (aoed.engine.messages): the
engine sends a `Call` (the request and its number), the child answers with an `Answer`
carrying the request's number, its `ok`, the reply, on failure `error` (one line) and
`error_class` (the `aoe.errors` class, so the engine raises the same one), and its peak
resident memory while it served that request (`maxrss_kb`). A request is read strictly:
one with an unknown field or a value of the wrong type is answered as failed, naming the
request type and the field. The child's own fd 1 is pointed at stderr before any library
loads, so stray prints from native code cannot corrupt the stream.

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
from typing import Any, Union

import msgspec

from aoe.errors import AoedError
from aoed.engine.protocol import Answer, Call, MessageError, Request, decode, encode

__all__ = ["child_main", "line_server", "serve"]

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
_ALLOC_FAILED = (
    "alloc failed",
    "bad_alloc",
    "bad allocation",
    "failed to serialize proto",
    "cannot allocate memory",
)


def _limit_mib() -> int | None:
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if limit == resource.RLIM_INFINITY else limit >> 20


def _looks_out_of_memory(error: str) -> bool:
    return _limit_mib() is not None and any(m in error.lower() for m in _ALLOC_FAILED)


def _out_of_memory(error: str) -> Answer:
    """The answer to a request that ran out of this child's address space: it names the
    limit and the setting that raises it, and costs the request, not the job."""
    mib = _limit_mib()
    limit = f" of {mib} MiB; raise [engine] worker_memory_mb" if mib is not None else ""
    return Answer(
        None,
        False,
        error=f"out of memory (the worker's memory limit{limit}): {error}",
        error_class="CandidateError",
    )


def _read(
    line: bytes, requests: Sequence[type[Request]], union: Any
) -> tuple[int | None, Request | Answer]:
    """The request on `line` and its number, or the answer refusing it (the number is
    None when the line does not even say which request it is)."""
    try:
        data = json.loads(line)
        call: Call[Any] = decode(Call[Any], data, "request line")
    except (ValueError, MessageError) as exc:
        return None, Answer(None, False, error=f"malformed request: {exc}")
    op = call.request.get("op") if isinstance(call.request, dict) else None
    kind = next((r.__name__ for r in requests if r.__struct_config__.tag == op), "request")
    try:
        return call.id, decode(union, call.request, kind)
    except MessageError as exc:
        return call.id, Answer(call.id, False, error=f"malformed request: {exc}")


def line_server(
    handle: Callable[[Any], Any], requests: Sequence[type[Request]]
) -> Callable[[bytes], bytes]:
    """The protocol for one line: a function that takes a request line (a `Call`, as
    JSON) and returns its answer line (an `Answer`, as JSON, newline-terminated), its
    reply made by `handle` for requests of the types `requests`. It never raises for a
    request's own failure: that is the answer's. Used by `serve` over a pipe, and by an
    executor that carries the same lines another way (aoed.engine.rayexec)."""
    union: Any = Union[tuple(requests)]  # noqa: UP007 (a union of a tuple of types)

    def answer_line(line: bytes) -> bytes:
        ident, request = _read(line, requests, union)
        _reset_peak_rss()
        if isinstance(request, Answer):
            answer = request
        else:
            try:
                answer = Answer(ident, True, reply=encode(handle(request)))
            except AoedError as exc:  # the request's own failure, e.g. a bad model
                answer = Answer(ident, False, error=str(exc), error_class=type(exc).__name__)
            except MemoryError:
                answer = _out_of_memory("MemoryError")
            except Exception as exc:  # reported to the engine as this request's failure
                # The log is a file in the state dir: on a full disk the traceback cannot be
                # written, and that must not end the worker (the reply says what failed).
                with contextlib.suppress(OSError):
                    traceback.print_exc()
                answer = Answer(ident, False, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
            if not answer.ok and _looks_out_of_memory(answer.error):
                answer = _out_of_memory(answer.error)
        answer = msgspec.structs.replace(answer, id=ident, maxrss_kb=_peak_rss_kb())
        return (json.dumps(encode(answer)) + "\n").encode()

    return answer_line


def serve(handle: Callable[[Any], Any], requests: Sequence[type[Request]]) -> int:
    """Answer requests (of the types `requests`) from stdin with `handle`, which returns
    each one's reply, until EOF; returns the exit status."""
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    answer_line = line_server(handle, requests)
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        out = answer_line(line).decode()
        try:
            proto.write(out)
        except BrokenPipeError:
            # The engine is gone (killed: our PR_SET_PDEATHSIG is on its way) or gave up on
            # this request: nobody to answer, nothing for the log. No interpreter shutdown,
            # which would flush `proto` again and print the same error.
            os._exit(0)
    return 0
