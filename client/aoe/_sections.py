"""One table of the TOML file read into a typed struct, its errors in the file's words.

A section is a msgspec `Section` whose fields carry their types and limits
(`Annotated[int, Meta(ge=1, le=32, description="a number of compile processes")]`) and
default to UNSET, so that what the file gave is told from what it did not; the
configuration's own dataclass holds the defaults. `read_section` converts one table
strictly (a TOML integer is no bool, a string no number) and translates msgspec's
ValidationError, which names the value's path (`$.max_nodes`), into the project's
message: the file, `[section] key`, the value given and what is expected, e.g.

    /etc/aoed/aoed.toml [engine] max_nodes = 'many': expected a whole number of nodes from 1 to 1000000000
    /etc/aoed/aoed.toml [engine] max_nodes = 0: must be between 1 and 1000000000

A bad key is reported and left at its default and the table converted again without
it, so that one read reports every problem in the table (`Problems`), not only the
first. `aoe.config` and `aoed.config` both read their sections through here.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from aoe.errors import OptionError

__all__ = ["Problems", "Section", "given", "read_section", "section"]

S = TypeVar("S", bound="Section")


class Problems:
    """Collects the OptionErrors of a check that goes on past the first, so that a
    configuration reports every problem at once."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def add(self, message: str) -> None:
        self.found.append(message)

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        """Record an OptionError raised in the block (all of its problems) and go on."""
        try:
            yield
        except OptionError as exc:
            self.found.extend(exc.problems)

    def raise_any(self) -> None:
        """OptionError listing every problem recorded, if there is one."""
        if self.found:
            raise OptionError(problems=self.found)


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A table of the TOML file: every field optional (UNSET when not given)."""


def section(name: str, rename: Mapping[str, str] | None = None, **fields: Any) -> type[Section]:
    """A Section named `name` whose attributes are `fields` (attribute=type), each UNSET
    unless given; `rename` maps an attribute to its key in the file, where they differ."""
    cls = msgspec.defstruct(
        name,
        [(key, tp | msgspec.UnsetType, msgspec.UNSET) for key, tp in fields.items()],
        bases=(Section,),
        rename=rename,
        module=__name__,
    )
    assert issubclass(cls, Section)
    return cls


def given(section: Section) -> dict[str, Any]:
    """The fields `section` was given, by attribute name."""
    return {
        f: v for f in section.__struct_fields__ if (v := getattr(section, f)) is not msgspec.UNSET
    }


#: msgspec's message: what went wrong, then where (absent for the table itself).
_MESSAGE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]+)`")


def read_section(
    table: Mapping[str, Any],
    cls: type[S],
    where: str,
    problems: Problems,
) -> S:
    """`table` as a `cls`, strictly converted (a Path from a string, `~` expanded). Each
    problem (an unknown key, a value of the wrong type or out of bounds) is added to
    `problems` as "`where` KEY = VALUE: expected ...", and that key left at its default."""
    table = dict(table)
    while True:
        try:
            return msgspec.convert(table, cls, strict=True, dec_hook=_path)
        except msgspec.ValidationError as exc:
            match = _MESSAGE.match(str(exc))
            assert match is not None  # the pattern matches any text
            what, path = match["what"], match["path"] or ""
            if unknown := _UNKNOWN.match(what):
                key = unknown["key"]
                known = ", ".join(sorted(f.encode_name for f in _fields(cls)))
                problems.add(f"{where} {key}: unknown setting (known: {known})")
            else:
                # `$.key`, `$.key[2]`: the table itself is a dict, and every key optional
                key = re.split(r"[.\[]", path.removeprefix("."), maxsplit=1)[0]
                problems.add(f"{where} {key} = {table[key]!r}: {_said(cls, key, what)}")
            del table[key]


def _path(tp: type, obj: Any) -> Any:
    if tp is not Path:
        raise NotImplementedError(tp)
    if not isinstance(obj, str):
        raise TypeError(f"Expected a path, got {type(obj).__name__}")
    return Path(obj).expanduser()


def _fields(cls: type[Section]) -> tuple[mi.Field, ...]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info.fields


#: msgspec's words for a number of the right type out of its bounds.
_OUT_OF_BOUNDS = re.compile(r"Expected `(int|float)` [<>]")


def _said(cls: type[Section], key: str, what: str) -> str:
    """What is wrong with `cls`'s field `key`, msgspec having said `what`: out of its
    bounds, else what it holds in words (its description, else its type's name, and its
    bounds)."""
    (field,) = (f for f in _fields(cls) if f.encode_name == key)
    tp = field.type.type if isinstance(field.type, mi.Metadata) else field.type
    if _OUT_OF_BOUNDS.match(what):
        lo, hi = getattr(tp, "ge", None), getattr(tp, "le", None)
        if lo is not None and hi is not None:
            return f"must be between {_number(lo)} and {_number(hi)}"
    return f"expected {_words(field.type)}"


def _words(tp: mi.Type) -> str:
    if isinstance(tp, mi.Metadata):
        said = (tp.extra_json_schema or {}).get("description")
        return said + _bounds(tp.type) if said else _words(tp.type)
    if isinstance(tp, mi.UnionType):
        return " or ".join(_words(t) for t in tp.types)  # UNSET is never listed
    if isinstance(tp, mi.LiteralType):
        if len(tp.values) == 1:
            return f'"{tp.values[0]}"'
        return "one of " + ", ".join(map(str, tp.values))
    if isinstance(tp, mi.CustomType):  # a Path
        return f"a {tp.cls.__name__.lower()}"
    if isinstance(tp, mi.ListType | mi.VarTupleType):
        return f"a list of {_words(tp.item_type)}"
    names = {mi.IntType: "an integer", mi.FloatType: "a number", mi.BoolType: "true or false"}
    return names.get(type(tp), "a string") + _bounds(tp)


def _bounds(tp: mi.Type) -> str:
    lo, hi = getattr(tp, "ge", None), getattr(tp, "le", None)
    if lo is not None and hi is not None:
        return f" from {_number(lo)} to {_number(hi)}"
    if lo is not None:
        return f" of at least {_number(lo)}"
    return ""


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
