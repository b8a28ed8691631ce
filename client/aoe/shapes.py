"""A shape profile as a user gives it: where a dynamic model is measured, in AOE's spelling.

ATC and AOE name the shapes a dynamic input takes in two ways, and so does aoe:

    --input-shape  input_ids:1~4,16~256      a range per dimension (lo~hi)
    --input-shape  input_ids:-1,-1           dimensions the gears fill, in order
    --dynamic-dims "1,16;4,64"               the gears: one point per `;`-separated group

A dimension given as a plain number is fixed at that size (what a fully static
`--input-shape x:1,128` gives: one point, which `JobSpec.input_shapes` keeps as it always
has). The daemon derives the rest from the model where the user says nothing
(aoed.engine.shapeprofile): a profile here is only what the user asked for.

`ShapeProfile` holds each input's dimensions as canonical text, so that it travels as
plain data (the job store, the wire, aoed.toml) and reads back equal; `dims_of` gives
the parsed form. Light on purpose: the standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from aoe import sizes
from aoe.errors import OptionError

__all__ = [
    "GEAR",
    "MAX_GEARS",
    "DimRange",
    "ShapeError",
    "ShapeProfile",
    "dims_text",
    "gears_text",
    "is_static",
    "parse_dims",
    "parse_gears",
]

#: A dimension whose sizes the gears (--dynamic-dims) give, as ATC spells it.
GEAR = -1
#: Gears one profile may hold: each is measured, so a long list is a long job.
MAX_GEARS = 64


@dataclass(frozen=True, order=True)
class DimRange:
    """Sizes `lo` to `hi` (both included) of one dimension: `lo~hi`."""

    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.lo}~{self.hi}"


class ShapeError(OptionError):
    """A profile no job can run with. `field` is the spec's name for what is wrong
    (input_shapes or dynamic_dims) and `detail` the rest, as aoe.spec.SpecError has them,
    so that each edge names it its own way (--input-shape, input_shapes)."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field} {detail}")
        self.field, self.detail = field, detail


def _size(text: str, name: str, part: str) -> int:
    try:
        n = int(text.strip())
    except ValueError:
        raise ShapeError(
            "input_shapes",
            f"{name}:{part}: {text.strip()!r} is not a size; write a whole number, "
            f"a range lo~hi, or {GEAR} for a dimension --dynamic-dims fills",
        ) from None
    if n > sizes.MAX_DIM:
        raise ShapeError("input_shapes", f"{name}:{part}: {n} is over the limit of {sizes.MAX_DIM}")
    return n


def parse_dims(text: str, name: str = "input") -> tuple[int | DimRange, ...]:
    """The dimensions of `name` from `1~4,16~256` (also `-1` and plain sizes). ShapeError
    naming the input and the dimension."""
    parts = [p for p in (q.strip() for q in text.split(",")) if p]
    if not parts:
        raise ShapeError("input_shapes", f"{name}: no dimensions given; e.g. {name}:1~4,16~256")
    if len(parts) > sizes.MAX_DIMS:
        raise ShapeError(
            "input_shapes", f"{name}: {len(parts)} dimensions, over the limit of {sizes.MAX_DIMS}"
        )
    out: list[int | DimRange] = []
    for part in parts:
        lo_text, tilde, hi_text = part.partition("~")
        if not tilde:
            n = _size(part, name, part)
            if n != GEAR and n <= 0:
                raise ShapeError(
                    "input_shapes",
                    f"{name}:{part}: sizes are positive ({GEAR} marks a dimension --dynamic-dims "
                    "fills)",
                )
            out.append(n)
            continue
        lo, hi = _size(lo_text, name, part), _size(hi_text, name, part)
        if lo <= 0 or hi < lo:
            raise ShapeError(
                "input_shapes",
                f"{name}:{part}: a range is lo~hi with 0 < lo <= hi, e.g. 16~256",
            )
        out.append(DimRange(lo, hi) if lo < hi else lo)
    return tuple(out)


def dims_text(dims: Iterable[int | DimRange]) -> str:
    """`parse_dims`'s text for `dims`."""
    return ",".join(str(d) for d in dims)


def is_static(dims: Iterable[int | DimRange]) -> bool:
    """Whether `dims` are all fixed sizes (a single point: `JobSpec.input_shapes`)."""
    return all(isinstance(d, int) and d > 0 for d in dims)


def parse_gears(text: str) -> tuple[tuple[int, ...], ...]:
    """The gears of `--dynamic-dims "1,16;4,64"`: one tuple of positive sizes per group.
    ShapeError naming the gear."""
    gears: list[tuple[int, ...]] = []
    for group in filter(None, (g.strip() for g in text.split(";"))):
        try:
            gear = tuple(int(d) for d in group.split(",") if d.strip())
        except ValueError:
            raise ShapeError(
                "dynamic_dims", f'{group!r}: sizes are whole numbers, e.g. "1,16;4,64"'
            ) from None
        if not gear or any(d <= 0 or d > sizes.MAX_DIM for d in gear):
            raise ShapeError("dynamic_dims", f"{group!r}: sizes are positive whole numbers")
        gears.append(gear)
    if len(gears) > MAX_GEARS:
        raise ShapeError(
            "dynamic_dims",
            f": {len(gears)} gears, over the limit of {MAX_GEARS} (each is measured)",
        )
    return tuple(gears)


def gears_text(gears: Iterable[Iterable[int]]) -> str:
    """`parse_gears`'s text for `gears`."""
    return ";".join(",".join(map(str, g)) for g in gears)


@dataclass(frozen=True)
class ShapeProfile:
    """What a user asked of a dynamic model's shapes: per input, its dimensions as text
    (`1~4,16~256`, `-1,-1`: `parse_dims`), and the gears that fill the `-1` dimensions
    (`1,16;4,64`), taken in the order the inputs are listed, then by position. Checked
    and normalized on construction; ShapeError names the input or the gear."""

    dims: Mapping[str, str] = field(default_factory=dict)
    gears: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.dims, Mapping):
            raise ShapeError("input_shapes", f"{self.dims!r}: expected a table of name = dims")
        if len(self.dims) > sizes.MAX_INPUT_SHAPES:
            raise ShapeError(
                "input_shapes",
                f": {len(self.dims)} inputs, over the limit of {sizes.MAX_INPUT_SHAPES}",
            )
        dims = {}
        for name, text in self.dims.items():
            sizes.check_text("input_shapes: an input name", str(name), sizes.MAX_NAME_BYTES)
            if isinstance(text, list | tuple):
                text = ",".join(str(d) for d in text)
            dims[str(name)] = dims_text(parse_dims(str(text), str(name)))
        object.__setattr__(self, "dims", dims)
        gears = parse_gears(str(self.gears or ""))
        object.__setattr__(self, "gears", gears_text(gears))
        slots = self.gear_slots()
        if gears and not slots:
            raise ShapeError(
                "dynamic_dims",
                f"{self.gears}: no input has a dimension of {GEAR} for the gears to fill; "
                f'write the dynamic ones as {GEAR}, e.g. --input-shape "input_ids:{GEAR},{GEAR}"',
            )
        if slots and not gears:
            name = slots[0][0]
            raise ShapeError(
                "input_shapes",
                f"{name}:{self.dims[name]}: a dimension of {GEAR} takes its sizes from "
                '--dynamic-dims (e.g. --dynamic-dims "1,16;4,64"); give them, or a range lo~hi',
            )
        for gear in gears:
            if len(gear) != len(slots):
                where = ", ".join(f"{n}[{i}]" for n, i in slots)
                raise ShapeError(
                    "dynamic_dims",
                    f"{','.join(map(str, gear))}: {len(gear)} sizes, but {len(slots)} dimensions "
                    f"are {GEAR} ({where}); give one size for each, in that order",
                )

    def __bool__(self) -> bool:
        return bool(self.dims)

    def dims_of(self) -> dict[str, tuple[int | DimRange, ...]]:
        """Each input's dimensions, parsed."""
        return {name: parse_dims(text, name) for name, text in self.dims.items()}

    def gear_slots(self) -> list[tuple[str, int]]:
        """(input, dimension) of each `-1`, in the order a gear's sizes fill them."""
        return [
            (name, i)
            for name, dims in self.dims_of().items()
            for i, d in enumerate(dims)
            if d == GEAR
        ]

    def gear_list(self) -> tuple[tuple[int, ...], ...]:
        """The gears, parsed."""
        return parse_gears(self.gears)

    @classmethod
    def parse(cls, items: Iterable[str], gears: str | None = None) -> ShapeProfile:
        """A profile from `NAME:DIMS` items (`;`-joined too, AOE style) and the gears'
        text. ShapeError naming the item."""
        dims: dict[str, str] = {}
        for item in items:
            for part in filter(None, (p.strip() for p in item.split(";"))):
                name, sep, text = part.rpartition(":")
                if not sep or not name:
                    raise ShapeError(
                        "input_shapes", f"{part!r}: expected NAME:DIMS, e.g. input_ids:1~4,16~256"
                    )
                dims[name] = text
        return cls(dims, gears or "")

    def argv_items(self) -> list[str]:
        """`NAME:DIMS` per input, as `parse` reads them."""
        return [f"{name}:{text}" for name, text in self.dims.items()]
