"""Graph preparation: from a user's .onnx file to the normalized model the tuner works on.

    load (external data only from beside the model; modelio) -> normalize (aoe.graph:
    legacy fixes, unique node names, shape overrides, check, shape inference) -> save

The normalization is the one compilers run before a bank lookup, so the signatures the
tuner stores are the ones they compute. Nothing is folded: the prepared model keeps
every weight as the input had it. Runs in a compile worker (see backends/ort/worker.py),
never in the engine's own process; the worker also loads the result into onnxruntime
once, so a model the runtime refuses fails here with a clear error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from aoe.errors import ModelError, OptionError
from aoe.graph import normalize
from aoe.signature import ModelContext, TensorInfo
from aoed.engine.modelio import load_model, save_model

__all__ = ["Prepared", "make_inputs", "parse_input_shapes", "prepare"]


@dataclass
class Prepared:
    source: Path
    model: onnx.ModelProto  # normalized: static shapes, unique names
    path: Path  # where the prepared model is saved
    inputs: dict[str, TensorInfo]  # what a caller feeds (true graph inputs)
    outputs: list[str]
    ctx: ModelContext
    notes: list[str] = field(default_factory=list)


def parse_input_shapes(spec: str | list[str] | None) -> dict[str, tuple[int, ...]]:
    """Parse `name:1,3,224,224` items (also `;`-joined, AOE style) into a dict."""
    if not spec:
        return {}
    items = [spec] if isinstance(spec, str) else list(spec)
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(";"))):
            name, sep, dims = part.rpartition(":")
            if not sep or not name:
                raise OptionError(f"--input-shape {part!r}: expected NAME:D1,D2,... e.g. x:1,3,224,224")
            try:
                shape = tuple(int(d) for d in dims.split(",") if d.strip())
            except ValueError:
                raise OptionError(f"--input-shape {part!r}: dimensions must be integers") from None
            if not shape or any(d <= 0 for d in shape):
                raise OptionError(f"--input-shape {part!r}: dimensions must be positive integers")
            out[name] = shape
    return out


def prepare(
    source: str | os.PathLike[str],
    workdir: str | os.PathLike[str],
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    keep_initializer_inputs: bool = False,
) -> Prepared:
    """Load, check and normalize the model at `source`; save it as `workdir/prepared.onnx`.

    Raises ModelError (the model is at fault) or OptionError (an override is wrong).
    Blocking and CPU-bound.
    """
    src = Path(source)
    model = load_model(src)
    norm = normalize(
        model, input_shapes, keep_initializer_inputs=keep_initializer_inputs, strict=True, source=str(src)
    )
    model = norm.model
    out = Path(workdir) / "prepared.onnx"
    save_model(model, out)
    inits = {t.name for t in model.graph.initializer}
    ctx = ModelContext(model)
    inputs = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        if i.name not in ctx.tensors:
            raise ModelError(f"{src}: input {i.name!r} has no static shape and type after inference")
        inputs[i.name] = ctx.tensors[i.name]
    return Prepared(
        source=src,
        model=model,
        path=out,
        inputs=inputs,
        outputs=[o.name for o in model.graph.output],
        ctx=ctx,
        notes=norm.notes,
    )


def make_inputs(
    inputs: Mapping[str, TensorInfo], seed: int = 0, int_high: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Deterministic inputs for every model input: normal floats, non-negative ints below
    `int_high[name]` (default 8)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, info in inputs.items():
        dt = np.dtype(info.dtype)
        if dt.kind == "f":
            feeds[name] = rng.standard_normal(info.shape).astype(dt)
        elif dt.kind in "iu":
            high = (int_high or {}).get(name, 8)
            feeds[name] = rng.integers(0, high, size=info.shape).astype(dt)
        elif dt.kind == "b":
            feeds[name] = rng.integers(0, 2, size=info.shape).astype(bool)
        else:
            raise ModelError(f"input {name!r} has dtype {dt}, which the tuner cannot generate data for")
    return feeds
