"""What a task was decided on, kept in its bank entry, so it can be checked again alike.

A signature keeps shapes and dtypes but no values, and a task is decided on its real
input activations (the job's calibration distribution run through the model) with the
model's constants. `aoe bank verify` rebuilds the task from its signature alone; without
more, it would feed N(0, 1) to a task that saw values in [0, 6), and random numbers to
the scalars that make a subgraph what it is (GELU's 1/sqrt(2), 1 and 0.5, a LayerNorm's
epsilon, an attention's scale and Reshape targets): a GELU that is no GELU any more,
judged against the fused kernel that assumes one, or a Reshape that does not fit.

So the tuner records, per task input in signature order (`TaskInputs`):

  Drawn(mean, std, lo, hi)   a variable input: how its values were distributed
  Fixed(values)              a constant of at most MAX_FIXED elements: its values (the
                             scalars and shapes above; never a weight matrix)
  None                       a larger constant (a weight): not kept, rebuilt at random

as strategy params `in.<i>` (one JSON value each, within the record checks' limits:
aoe.recordcheck). Entries written before this have no such params: verify then says
that its inputs are not drawn like the task's (`draw` returns why).

Pure numpy, no onnxruntime: the worker that extracts a task describes it
(`describe`), and the worker that rebuilds one draws from the description (`draw`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_FIXED", "Drawn", "Fixed", "TaskInputs", "describe"]

#: A constant with at most this many elements is kept by value (scalars, shapes, axes).
MAX_FIXED = 16
#: Param name prefix: `in.<i>` describes the task's input number i (signature order).
PREFIX = "in."
#: At most this many inputs are described (the record checks allow 64 params in all).
MAX_INPUTS = 48


@dataclass(frozen=True)
class Drawn:
    """A variable input's values: their mean, standard deviation and range."""

    mean: float
    std: float
    lo: float
    hi: float


@dataclass(frozen=True)
class Fixed:
    """A small constant's values, flattened (its shape is the signature's)."""

    values: tuple[float, ...]


@dataclass(frozen=True)
class TaskInputs:
    """Per task input in signature order: Drawn, Fixed or None (not kept)."""

    inputs: tuple[Drawn | Fixed | None, ...]

    def params(self) -> dict[str, str]:
        """The entry params that spell it (`from_params` reads them back)."""
        out = {}
        for i, d in enumerate(self.inputs[:MAX_INPUTS]):
            if isinstance(d, Drawn):
                out[f"{PREFIX}{i}"] = json.dumps({"draw": [d.mean, d.std, d.lo, d.hi]})
            elif isinstance(d, Fixed):
                out[f"{PREFIX}{i}"] = json.dumps({"value": list(d.values)})
        return out

    def draw(
        self, i: int, dtype: np.dtype, shape: Sequence[int], rng: np.random.Generator
    ) -> np.ndarray | None:
        """Input `i` drawn as described (a Fixed one as it was; a Drawn one normal with
        its mean and deviation, clipped to its range; integers uniform in the range), or
        None when it is not described. ValueError when a Fixed one does not fit `shape`."""
        d = self.inputs[i] if i < len(self.inputs) else None
        if isinstance(d, Fixed):
            if len(d.values) != math.prod(shape):
                raise ValueError(
                    f"strategy.params.{PREFIX}{i}: {len(d.values)} values for shape {list(shape)}"
                )
            return np.array(d.values, dtype=np.float64).astype(dtype).reshape(shape)
        if isinstance(d, Drawn):
            if dtype.kind in "iu":
                lo, hi = math.floor(d.lo), math.floor(d.hi)
                return rng.integers(lo, hi + 1, size=shape).astype(dtype)
            values = rng.normal(d.mean, d.std, size=shape).clip(d.lo, d.hi)
            return values.astype(dtype)
        return None

    @classmethod
    def from_params(cls, params: Mapping[str, str], count: int) -> TaskInputs | None:
        """The description in an entry's `params` for a task of `count` inputs; None
        when the entry has none. ValueError naming the param when one is malformed (a
        bank's records are data from others)."""
        keys = [k for k in params if k.startswith(PREFIX)]
        if not keys:
            return None
        inputs: list[Drawn | Fixed | None] = [None] * count
        for k in keys:
            where = f"strategy.params.{k}"
            index = k[len(PREFIX) :]
            if not index.isdigit() or int(index) >= count:
                raise ValueError(f"{where}: the task has {count} inputs")
            try:
                doc = json.loads(params[k])
            except ValueError:
                raise ValueError(f"{where}: not JSON") from None
            if isinstance(doc, dict) and list(doc) == ["draw"]:
                nums = _numbers(doc["draw"], where)
                if len(nums) != 4 or nums[1] < 0 or nums[2] > nums[3]:
                    raise ValueError(f"{where}: expected [mean, std >= 0, lo, hi <= lo]")
                inputs[int(index)] = Drawn(*nums)
            elif isinstance(doc, dict) and list(doc) == ["value"]:
                nums = _numbers(doc["value"], where)
                if len(nums) > MAX_FIXED:
                    raise ValueError(f"{where}: more than {MAX_FIXED} values")
                inputs[int(index)] = Fixed(tuple(nums))
            else:
                raise ValueError(f"{where}: expected {{'draw': [...]}} or {{'value': [...]}}")
        return cls(tuple(inputs))


def _numbers(value: object, where: str) -> list[float]:
    if not (
        isinstance(value, list) and all(type(v) in (int, float) and math.isfinite(v) for v in value)
    ):
        raise ValueError(f"{where}: not a list of finite numbers")
    return list(value)


def _scalar(x: np.generic) -> float:
    """A value as JSON keeps it exactly: an int for integer dtypes, else the float
    (float32 values survive the round trip through a double)."""
    return int(x) if np.issubdtype(x.dtype, np.integer) else float(x)


def describe(
    names: Sequence[str], values: Mapping[str, np.ndarray], consts: Mapping[str, np.ndarray]
) -> TaskInputs:
    """The description of a task whose inputs are `names` (signature order): the
    variable ones from their `values` (the activations it was decided on), the
    constants from `consts` (name -> value; a missing one is not kept)."""
    out: list[Drawn | Fixed | None] = []
    for name in names:
        if name in consts:
            c = np.asarray(consts[name])
            small = c.size <= MAX_FIXED and c.dtype.kind in "iuf"
            if small and c.dtype.kind == "f":
                small = bool(np.all(np.isfinite(c)))
            out.append(Fixed(tuple(_scalar(x) for x in c.ravel())) if small else None)
            continue
        v = values.get(name)
        if v is None or v.size == 0 or v.dtype.kind not in "iuf":
            out.append(None)
            continue
        v = np.asarray(v, np.float64)
        finite = v[np.isfinite(v)]
        if finite.size == 0:
            out.append(None)
            continue
        stats = (finite.mean(), finite.std(), finite.min(), finite.max())
        out.append(Drawn(*(float(f"{s:.6g}") for s in stats)))
    return TaskInputs(tuple(out))
