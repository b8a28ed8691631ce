"""Plain data: a value as JSON types (dicts, lists, text, numbers, booleans, None) and
back, by msgspec, for every value that crosses a process, the job store or the wire.

msgspec converts Structs, dataclasses, enums, tuples and mappings itself, and names the
field's path when a value does not fit its type; the one type of ours it does not know
is `pathlib.Path`, which travels as its text. What a shape spells differently from its
fields (a renamed key, a derived one) is said on the type, never by a walk of our own.

Light on purpose: msgspec and the standard library only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import msgspec

__all__ = ["dec_hook", "enc_hook", "from_plain", "to_plain"]

T = TypeVar("T")


def enc_hook(obj: Any) -> Any:
    """A path as its text; NotImplementedError for any other type msgspec does not know."""
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"{type(obj).__name__} cannot travel as plain data")


def dec_hook(tp: type, obj: Any) -> Any:
    """A path from its text; ValueError (msgspec names the field) for anything else."""
    if tp is Path:
        if isinstance(obj, str):
            return Path(obj)
        raise ValueError(f"Expected `str` (a path), got `{type(obj).__name__}`")
    raise NotImplementedError


def to_plain(obj: Any) -> Any:
    """`obj` as JSON types: Structs and dataclasses as objects, enums as their values,
    paths as text. Tuples stay tuples (a JSON writer writes them as arrays, and reading
    back gives lists); infinite floats stay infinite (msgspec's own JSON encoder would
    write null, so the line protocol writes with the stdlib's)."""
    return msgspec.to_builtins(obj, enc_hook=enc_hook)


def from_plain(tp: type[T] | Any, data: Any) -> T:
    """`data` (JSON types) converted into `tp`, checked against its annotations.
    msgspec.ValidationError naming the field's path when it does not fit."""
    return msgspec.convert(data, tp, dec_hook=dec_hook)
