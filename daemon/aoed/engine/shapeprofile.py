"""The shape profile of a dynamic model: the points it is tuned and checked at.

A model whose inputs have dynamic dimensions (a `batch`, a `seq`) serves many shapes,
and its tuned model must serve all of them. The profile names the points that stand for
them: what the user gave (aoe.shapes: fixed sizes, ranges lo~hi, ATC's gears), and for
every dimension the user left alone, sizes derived from the model:

    batch-like (dimension 0, or named batch/N/B)   1 and BATCH_POINTS[-1]
    any other dynamic dimension (sequence-like)    spread up to what the model's position
                                                   table allows (a Gather from an [N, d]
                                                   initializer indexed by positions bounds
                                                   it at N, less the positions a token
                                                   input's fixed length takes, shared by
                                                   the derived ones), else up to
                                                   DEFAULT_MAX_DIM (DEFAULT_MAX_PAST for a
                                                   KV cache's past)
    the new tokens of a step over a KV cache       1 (a decode step) at every point; a
                                                   prompt as long as the shortest past at
                                                   one point more, where they are dynamic
    one named as a sum of others (`past + seq`)    their sum at each point

A decoder with a KV cache takes an attention mask as long as the past and the new
tokens together; exporters name that length the sum of the two (Optimum writes
`past_sequence_length + sequence_length`, torch.onnx's dynamo exporter `past + seq` for
the presents), and sizes derived for it alone would be a mask no step can take.

Dimensions that share a name (`seq` of input_ids and of attention_mask) take one size at
each point. Point k gives each dimension the k-th of its sizes (its last when it has
fewer), so the points grow together from the smallest to the largest; a decoder's
prompt point comes last. Search measures at the `representative` point (the middle one;
for a decoder, the middle decode step: generation spends its time decoding); the
assembled model keeps the input's own dynamic inputs and outputs (`restore_io`) and is
checked at every point.

Pure onnx: no onnxruntime (the worker runs the points: backends/ort/shapecheck.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import onnx

from aoe.errors import OptionError
from aoe.shapes import GEAR, DimRange, ShapeProfile

__all__ = [
    "BATCH_POINTS",
    "DEFAULT_MAX_DIM",
    "DEFAULT_MAX_PAST",
    "Profile",
    "position_bound",
    "resolve",
    "restore_io",
]

#: The batch sizes a derived profile measures: one request, and a small batch.
BATCH_POINTS = (1, 4)
#: Where a sequence-like dimension's derived points stop when no position table bounds it.
DEFAULT_MAX_DIM = 256
#: Where a KV cache's derived past stops when no position table bounds it: decode steps
#: are cheap to run at long pasts, and generation reaches them.
DEFAULT_MAX_PAST = 1024
#: How a derived sequence-like dimension spreads below its bound: bound/16, bound/4, bound.
_SPREAD = (16, 4, 1)
_SUM_TERM = re.compile(r"\s*\+\s*")
_BATCH_NAME = re.compile(r"(?i)^(n|b|bs|batch.*|.*_batch|.*batch_size)$")
#: An input that holds a KV cache, as exporters name it (past_key_0, past_key_values.0.key,
#: cache_v).
_CACHE_NAME = re.compile(r"(?i)past|cache")

#: An input's or output's dimensions as the input model declares them: a size, or the
#: name of a dynamic one ("" where it has none).
Dims = tuple[int | str, ...]


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The points a dynamic model is tuned and checked at. A msgspec Struct: it crosses
    into the compile pool (PrepareReply, AssembleRequest)."""

    #: every input's shape at each point
    points: tuple[dict[str, tuple[int, ...]], ...]
    #: the point search measures at
    representative: int
    #: each dynamic dimension: its sizes, and where they come from (for the report)
    axes: dict[str, str]
    #: the input model's inputs and outputs as it declares them (None: no shape)
    inputs: dict[str, Dims | None]
    outputs: dict[str, Dims | None]
    #: points only checked (the tuned model runs there and matches the input), never
    #: measured: the derived points of a model the user fixed at one shape
    checks: tuple[dict[str, tuple[int, ...]], ...] = ()
    #: every size was derived from the model (the user gave none)
    derived: bool = True

    @property
    def checked(self) -> tuple[dict[str, tuple[int, ...]], ...]:
        """Every point the tuned model must run at: the profile's, then the checks."""
        return self.points + self.checks

    @property
    def point(self) -> dict[str, tuple[int, ...]]:
        """The representative point."""
        return self.points[self.representative]

    def describe(self) -> str:
        """One line for the job's notes."""
        pts = "; ".join(_point_text(p) for p in self.points)
        axes = ", ".join(f"{k}: {v}" for k, v in self.axes.items())
        return (
            f"shape profile: {len(self.points)} points ({pts}); searched at "
            f"{_point_text(self.point)}; {axes}"
        )

    def report(self) -> dict[str, object]:
        """The profile as the result document holds it."""
        return {
            "points": [{k: list(v) for k, v in p.items()} for p in self.points],
            "representative": self.representative,
            "axes": dict(self.axes),
            "inputs": {k: list(v) if v is not None else None for k, v in self.inputs.items()},
            "checked_only": [{k: list(v) for k, v in p.items()} for p in self.checks],
        }


def _point_text(point: Mapping[str, tuple[int, ...]]) -> str:
    return " ".join(f"{k}:{','.join(map(str, v))}" for k, v in point.items())


def _dims(vi: onnx.ValueInfoProto) -> Dims | None:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    # A size the model states (0 or negative included, which prep refuses by name) is
    # not dynamic: only a missing one is.
    return tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim)


@dataclass(frozen=True)
class _Sequences:
    """The derived sequence-like dimensions of a model the user left alone: those of its
    KV cache (`cache`: an input named past or cache holds them) and those of its token
    inputs besides (`tokens`: the new tokens of a step over a cache), and the longest
    fixed length of a token input (`fixed`: a decode step's one new token)."""

    derived: frozenset[str]
    cache: frozenset[str]
    tokens: frozenset[str]
    fixed: int

    def top(self, bound: int) -> int:
        """Where a derived sequence-like dimension stops: DEFAULT_MAX_DIM without a
        position table; else the table's positions less those the new tokens take,
        so that the positions a point reads fit the table (a step at past 2048 reads
        position 2048, one past a table of 2048). Over a cache, each decode point
        takes one new token and the past the rest; otherwise the derived dimensions
        share what is left."""
        if not bound:
            return DEFAULT_MAX_PAST if self.cache else DEFAULT_MAX_DIM
        if self.cache:
            return max(1, bound - max(1, self.fixed))
        return max(1, (bound - self.fixed) // max(1, len(self.derived)))


def _sequences(
    declared: Mapping[str, Dims | None],
    model: onnx.ModelProto,
    static: Mapping[str, object],
    wanted: Mapping[str, object],
) -> _Sequences:
    ints = {
        i.name
        for i in _true_inputs(model)
        if i.type.tensor_type.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    }
    fixed, derived, cache, tokens = 0, set(), set(), set()
    for name, dims in declared.items():
        if dims is None or name in static or name in wanted:
            continue
        for i, d in enumerate(dims):
            if isinstance(d, int):
                if name in ints and i > 0:
                    fixed = max(fixed, d)
            elif not (i == 0 or _BATCH_NAME.match(d or "") or _SUM_TERM.search(d or "")):
                symbol = d or f"{name}[{i}]"  # a sum of others takes theirs
                derived.add(symbol)
                if _CACHE_NAME.search(name):
                    cache.add(symbol)
                elif name in ints:
                    tokens.add(symbol)
    return _Sequences(frozenset(derived), frozenset(cache), frozenset(tokens - cache), fixed)


def _true_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def position_bound(model: onnx.ModelProto) -> int | None:
    """The longest sequence the model's position table holds: the least N of the [N, d]
    initializers a Gather reads with positions (indices computed by a Range, or read
    from an input or a constant named like position_ids, as torch exports a buffer),
    not with the token ids a caller feeds. None when there is none."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    inputs = {i.name for i in g.input if i.name not in inits}
    producer = {o: n for n in g.node for o in n.output}
    bounds = []
    for node in g.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in inits:
            continue
        table = inits[node.input[0]]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if len(table.dims) == 2 and axis == 0 and _positional(node.input[1], producer, inputs):
            bounds.append(int(table.dims[0]))
    return min(bounds) if bounds else None


def _positional(name: str, producer: Mapping[str, onnx.NodeProto], inputs: set[str]) -> bool:
    """Whether the indices `name` count positions: a Range is among what computes them,
    or an input or constant named for positions, and no other input's values are."""
    seen: set[str] = set()
    todo, positions = [name], False
    while todo and len(seen) < 256:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in inputs:
            if "pos" not in t.lower():
                return False
            positions = True
            continue
        node = producer.get(t)
        if node is None:
            # a constant named for positions: the position_ids buffer torch exports slice
            positions = positions or "pos" in t.lower()
            continue
        if node.op_type == "Range":
            positions = True
        if node.op_type in ("Shape", "Size"):
            continue  # reads a shape, never values
        todo.extend(i for i in node.input if i)
    return positions


def _spread(lo: int, hi: int) -> list[int]:
    """lo, their geometric middle, hi."""
    return sorted({lo, round(math.sqrt(lo * hi)), hi})


def resolve(
    model: onnx.ModelProto,
    static: Mapping[str, tuple[int, ...]],
    given: ShapeProfile,
    source: str,
) -> Profile | None:
    """The profile of `model` (as loaded, before its shapes are fixed): the user's fixed
    shapes (`static`) and profile (`given`), the rest derived. None when no input has a
    dynamic dimension. OptionError naming the input (`source` names the model) when what
    the user gave does not fit it: an input it lacks, another rank, a size the model fixes
    differently, or two sizes for one named dimension."""
    inputs = _true_inputs(model)
    names = [i.name for i in inputs]
    for name in (*static, *given.dims):
        if name not in names:
            raise OptionError(
                f"--input-shape: {source} has no input {name!r} (inputs: {', '.join(names)})"
            )
    declared = {i.name: _dims(i) for i in inputs}
    wanted = given.dims_of()
    gears = given.gear_list()
    slots = {slot: j for j, slot in enumerate(given.gear_slots())}
    sizes: dict[str, list[int]] = {}  # symbol -> sizes at the points
    why: dict[str, str] = {}
    given_any = False
    order: dict[str, list[str]] = {}  # input -> the symbol of each dimension (or "")
    bound = None
    seqs = _sequences(declared, model, static, wanted)
    for name, dims in declared.items():
        if dims is None:
            continue  # no shape at all: prep says what to pass
        spec: tuple[int | DimRange, ...] | None = static.get(name) or wanted.get(name)
        if spec is not None and len(spec) != len(dims):
            raise OptionError(
                f"--input-shape {name}: rank {len(spec)} given, the model's input has rank "
                f"{len(dims)}"
            )
        order[name] = []
        for i, d in enumerate(dims):
            want = spec[i] if spec is not None else None
            if isinstance(d, int):
                if isinstance(want, int) and want not in (d, GEAR):
                    raise OptionError(
                        f"--input-shape {name}: dimension {i} is fixed at {d} in the model, "
                        f"not {want}"
                    )
                order[name].append("")
                continue
            symbol = d or f"{name}[{i}]"
            order[name].append(symbol)
            if want == GEAR:
                got, how = [g[slots[(name, i)]] for g in gears], "given (--dynamic-dims)"
            elif isinstance(want, DimRange):
                got, how = _spread(want.lo, want.hi), f"given: {want}"
            elif isinstance(want, int):
                got, how = [want], "given"
            else:
                if symbol in sizes:
                    continue  # another input named it; a derived size never overrides
                if i == 0 or _BATCH_NAME.match(d or ""):
                    got, how = list(BATCH_POINTS), "batch, derived"
                elif symbol in seqs.tokens and seqs.cache:
                    got, how = [1], "derived: one new token per decode step over the cache"
                else:
                    bound = bound if bound is not None else (position_bound(model) or 0)
                    top = seqs.top(bound)
                    got = sorted({max(1, top // k) for k in _SPREAD})
                    how = (
                        f"derived up to {top} of the position table's {bound}"
                        if bound and top != bound
                        else f"derived up to the position table's {bound}"
                        if bound
                        else f"derived up to {top} (no position table bounds it)"
                    )
            if symbol in sizes and not why[symbol].startswith(("batch, derived", "derived")):
                if sizes[symbol] != got:
                    raise OptionError(
                        f"--input-shape {name}: dimension {i} ({symbol!r}) is shared with "
                        f"another input, which was given {sizes[symbol]}, not {got}"
                    )
                continue
            sizes[symbol], why[symbol] = got, how
            given_any = given_any or want is not None
    if not sizes:
        return None
    # A step over a cache whose new tokens are dynamic also runs a prompt: one point
    # more, the prompt as long as the shortest past, over that past.
    prompt = {
        t: min(sizes[c][0] for c in seqs.cache if c in sizes)
        for t in seqs.tokens
        if seqs.cache and t in sizes and sizes[t] == [1] and why[t].startswith("derived")
    }
    prefill = {k: v[:1] for k, v in sizes.items()} | {t: [n] for t, n in prompt.items()}
    _sum_sizes(prefill, dict(why))
    _sum_sizes(sizes, why)
    points = _points(declared, order, sizes)
    decode = len(points)
    if prompt:
        points += [p for p in _points(declared, order, prefill) if p not in points]
        why |= {t: f"{why[t]}; {n} at the prompt's point" for t, n in prompt.items()}
    axes = {s: f"{', '.join(map(str, v))} ({why[s]})" for s, v in sizes.items()}
    return Profile(
        points=tuple(points),
        representative=decode // 2,
        axes=axes,
        inputs=declared,
        outputs={o.name: _dims(o) for o in model.graph.output},
        derived=not given_any,
    )


def _points(
    declared: Mapping[str, Dims | None],
    order: Mapping[str, list[str]],
    sizes: Mapping[str, list[int]],
) -> list[dict[str, tuple[int, ...]]]:
    """Point k: every dimension at the k-th of its sizes (its last when it has fewer)."""
    points: list[dict[str, tuple[int, ...]]] = []
    for k in range(max(len(v) for v in sizes.values())):
        point = {}
        for name, dims in declared.items():
            if dims is None:
                continue
            point[name] = tuple(
                d
                if isinstance(d, int)
                else sizes[order[name][i]][min(k, len(sizes[order[name][i]]) - 1)]
                for i, d in enumerate(dims)
            )
        if point not in points:
            points.append(point)
    return points


def _sum_sizes(sizes: dict[str, list[int]], why: dict[str, str]) -> None:
    """Give each derived dimension named as a sum of other dimensions (`past + seq`) or
    sizes (`seq + 1`) their sum at each point, in place. A name with any other term is
    left as it was derived."""
    for symbol in list(sizes):
        terms = _SUM_TERM.split(symbol.strip())
        if len(terms) < 2 or not why[symbol].startswith("derived"):
            continue
        parts: list[list[int]] = []
        for term in terms:
            if term.isdigit():
                parts.append([int(term)])
            elif term in sizes and term != symbol:
                parts.append(sizes[term])
            else:
                break
        else:
            n = max(len(p) for p in parts)
            sizes[symbol] = [sum(p[min(k, len(p) - 1)] for p in parts) for k in range(n)]
            why[symbol] = f"the sum of {', '.join(terms)} at each point"


def restore_io(model: onnx.ModelProto, profile: Profile) -> None:
    """Give `model`'s inputs and outputs the input model's own dimensions (dynamic ones
    by name) and drop the shapes recorded inside the graph, which hold the point it was
    prepared at: the runtime infers them again at each shape it is fed. In place."""
    for values, declared in (
        (model.graph.input, profile.inputs),
        (model.graph.output, profile.outputs),
    ):
        for vi in values:
            if vi.name not in declared or not vi.type.HasField("tensor_type"):
                continue
            dims = declared[vi.name]
            t = vi.type.tensor_type
            t.ClearField("shape")
            if dims is None:
                continue
            shape = t.shape  # touching it makes an empty (rank 0) shape: set it for every rank
            shape.ClearField("dim")
            for d in dims:
                if isinstance(d, int):
                    shape.dim.add().dim_value = d
                else:
                    dim = shape.dim.add()
                    if d:
                        dim.dim_param = d
    del model.graph.value_info[:]
