"""The envelope of the line protocol between the engine and its children: the base
classes of every message, the `Call` that carries a request and the `Answer` that
carries its reply, and the conversions to and from JSON data.

It lives apart from the messages themselves (messages.py, rankmessages.py,
tfmessages.py) so that a child which speaks only its own messages loads none of the
others' parts: a GDAT rank process (aoed.backends.torch.rank) starts with every world
and after every broken turn, and the ONNX jobs' messages would bring onnx and their
graph preparation into each rank.

`encode` turns a message into plain data (paths as strings) and the stdlib writes the
line, not msgspec's JSON encoder: that one writes an infinite float as null, and an
infinite error is a real measurement (a candidate whose outputs are not finite).
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import msgspec
from msgspec import Struct

from aoe import errors
from aoe.plain import from_plain, to_plain

__all__ = [
    "Answer",
    "Call",
    "Message",
    "MessageError",
    "Request",
    "decode",
    "encode",
    "error_of",
    "op_of",
]

T = TypeVar("T")


class Message(Struct, frozen=True, forbid_unknown_fields=True):
    """A reply, or a value inside a message."""


class Request(Message, tag_field="op", frozen=True):
    """A request to a child; `op` (its tag) names it, `reply` is what answers it."""

    reply: ClassVar[type]


class MessageError(ValueError):
    """Data that is not the message it should be; the text names the message type and
    the field. Translated at each edge: a child answers it as the request's failure, the
    engine takes a reply that raises it as a broken child."""


def encode(msg: Any) -> Any:
    """`msg` as JSON data: Structs as objects (requests with their `op`), paths as
    strings (aoe.plain)."""
    return to_plain(msg)


def decode(tp: type[T] | Any, data: Any, what: str = "") -> T:
    """`data` (JSON data) checked into `tp`. Raises MessageError naming `what` (default:
    the type's name) and the field when a field is unknown, missing or of the wrong type."""
    name = what or getattr(tp, "__name__", str(tp))
    try:
        checked: T = from_plain(tp, data)  # `tp` may be a union, which type[T] cannot say
    except msgspec.ValidationError as exc:
        raise MessageError(f"{name}: {exc}") from None
    return checked


def op_of(request: Request) -> str:
    """The request's `op`: what kind of request it is."""
    return str(type(request).__struct_config__.tag)


R = TypeVar("R")


class Call(Message, Generic[R], frozen=True):
    """One request line: the request, and the number its answer carries."""

    id: int
    request: R


class Answer(Message, frozen=True):
    """One reply line: its request's number (None when the child could not read the
    request), whether it was served, the reply (JSON data until the reader, who knows
    the request, decodes it) or why not, and the child's peak memory while serving."""

    id: int | None
    ok: bool
    reply: Any = None
    #: one line; `error_class` names the `aoe.errors` class the child raised, if one of ours
    error: str = ""
    error_class: str = ""
    maxrss_kb: int = 0


_ERRORS = {
    cls.__name__: cls
    for cls in (
        errors.OptionError,
        errors.ModelError,
        errors.BankError,
        errors.DeviceError,
        errors.CandidateError,
    )
}


def error_of(answer: Answer, default: type[errors.AoedError], prefix: str = "") -> errors.AoedError:
    """The error a failed answer reports: the class the child raised when it is one of
    ours, else `default`; its text after `prefix`."""
    cls = _ERRORS.get(answer.error_class, default)
    return cls(prefix + (answer.error or "failed without a message"))
