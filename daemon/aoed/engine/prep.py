"""Graph preparation: from a user's .onnx file to a static, folded, checked model.

Steps, each failing with a `ModelError` or `OptionError` that names the file, input or
node at fault:
  load (external data only from the model's own directory) -> initializers listed as
  graph inputs become constants (old exporters) -> opset conversion to 13 where older ->
  every node gets a unique name (tasks name their nodes) -> user shape overrides (a
  dynamic dimension without one is an error) -> check -> shape inference ->
  onnxruntime's basic-level optimizer (constant folding, redundant node elimination and
  its semantics-preserving fusions; standard ONNX ops only) -> shape inference again so
  every tensor a task touches has a static shape.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, shape_inference, version_converter

from aoe.errors import ModelError, OptionError
from aoe.signature import ModelContext, TensorInfo

__all__ = ["Prepared", "make_inputs", "parse_input_shapes", "prepare"]

#: Oldest default-domain opset the strategies rely on (per-axis attributes, ReduceSum axes).
TARGET_OPSET = 13


@dataclass
class Prepared:
    source: Path
    model: onnx.ModelProto  # prepared: static shapes, folded constants
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


def _load(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise ModelError(f"{path}: no such model file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.graph.node:
        raise ModelError(f"{path}: the model's graph has no nodes")
    base = path.parent.resolve()
    for tensor in external_data_helper._get_all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = external_data_helper.ExternalDataInfo(tensor)
        target = (base / info.location).resolve()
        if os.path.isabs(info.location) or not target.is_relative_to(base):
            raise ModelError(
                f"{path}: tensor {tensor.name!r} points outside the model's directory "
                f"({info.location!r}); external data must sit beside the model"
            )
        if not target.is_file():
            raise ModelError(f"{path}: external data file {info.location!r} of {tensor.name!r} is missing")
    try:
        external_data_helper.load_external_data_for_model(model, str(base))
    except Exception as exc:
        raise ModelError(f"{path}: cannot load external data ({exc})") from None
    return model


def _default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 0


def _fix_legacy(model: onnx.ModelProto, keep_initializer_inputs: bool, notes: list[str]) -> onnx.ModelProto:
    inits = {t.name for t in model.graph.initializer}
    listed = [i for i in model.graph.input if i.name in inits]
    if listed and not keep_initializer_inputs:
        keep = [i for i in model.graph.input if i.name not in inits]
        del model.graph.input[:]
        model.graph.input.extend(keep)
        notes.append(f"{len(listed)} initializers listed as graph inputs are treated as constants")
    min_ir = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    if model.ir_version < max(min_ir, 4):
        notes.append(f"IR version {model.ir_version} raised to {max(min_ir, 4)}")
        model.ir_version = max(min_ir, 4)
    opset = _default_opset(model)
    if 0 < opset < TARGET_OPSET:
        try:
            converted = version_converter.convert_version(model, TARGET_OPSET)
            notes.append(f"opset {opset} converted to {TARGET_OPSET}")
            model = converted
        except Exception as exc:  # conversion is best effort; strategies check opsets
            notes.append(f"opset {opset} kept: conversion to {TARGET_OPSET} failed ({exc})")
    return model


def _apply_shapes(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]], source: Path) -> None:
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    for name in shapes:
        if name not in names:
            raise OptionError(f"--input-shape: {source.name} has no input {name!r} (inputs: {', '.join(names)})")
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise ModelError(f"{source}: input {vi.name!r} is not a tensor; only tensor inputs are supported")
        dims = t.shape.dim
        want = shapes.get(vi.name)
        if want is not None:
            if t.HasField("shape") and len(dims) != len(want):
                raise OptionError(
                    f"--input-shape {vi.name}: rank {len(want)} given, the model's input has rank {len(dims)}"
                )
            for i, d in enumerate(dims):
                if d.HasField("dim_value") and d.dim_value != want[i]:
                    raise OptionError(
                        f"--input-shape {vi.name}: dimension {i} is fixed at {d.dim_value} in the model, "
                        f"not {want[i]}"
                    )
            t.ClearField("shape")
            for d in want:
                t.shape.dim.add().dim_value = d
            continue
        if not t.HasField("shape"):
            raise ModelError(f"{source}: input {vi.name!r} has no shape; pass --input-shape {vi.name}:D1,D2,...")
        for i, d in enumerate(dims):
            if not d.HasField("dim_value") or d.dim_value <= 0:
                label = d.dim_param or "?"
                raise ModelError(
                    f"{source}: input {vi.name!r} has dynamic dimension {i} ({label!r}); "
                    f"pass --input-shape {vi.name}:" + ",".join(
                        str(x.dim_value) if x.HasField("dim_value") and x.dim_value > 0 else "N" for x in dims
                    )
                )


def _name_nodes(model: onnx.ModelProto, notes: list[str] | None = None) -> None:
    """Give every node without a name, or with a name an earlier node has, a unique one.

    Tasks refer to nodes by name, and onnxruntime refuses two nodes of one name.
    """
    taken = {n.name for n in model.graph.node if n.name}
    seen: set[str] = set()
    renamed = 0
    for i, node in enumerate(model.graph.node):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        base = f"{node.name or node.op_type}_{i}"
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        node.name = name
        taken.add(name)
        seen.add(name)
        renamed += 1
    if renamed and notes is not None:
        notes.append(f"{renamed} nodes without a unique name were named")


def _infer(model: onnx.ModelProto, source: Path) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:
        raise ModelError(f"{source}: shape inference failed: {exc}".splitlines()[0]) from None


def _ort_basic(model: onnx.ModelProto, out: Path, source: Path) -> onnx.ModelProto:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(out)
    so.log_severity_level = 3
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelError(f"{source}: onnxruntime cannot load the model: {exc}".splitlines()[0]) from None
    return onnx.load(str(out))


def prepare(
    source: str | os.PathLike[str],
    workdir: str | os.PathLike[str],
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    keep_initializer_inputs: bool = False,
) -> Prepared:
    """Load, check and prepare the model at `source`; save it as `workdir/prepared.onnx`.

    Raises ModelError (the model is at fault) or OptionError (an override is wrong).
    Blocking: call it from a worker thread.
    """
    src = Path(source)
    notes: list[str] = []
    model = _load(src)
    model = _fix_legacy(model, keep_initializer_inputs, notes)
    _name_nodes(model, notes)
    _apply_shapes(model, dict(input_shapes or {}), src)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"{src}: invalid model: {exc}".splitlines()[0]) from None
    model = _infer(model, src)
    out = Path(workdir) / "prepared.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    model = _infer(_ort_basic(model, out, src), src)
    _name_nodes(model)
    onnx.save(model, str(out))
    inits = {t.name for t in model.graph.initializer}
    ctx = ModelContext(model)
    inputs = {i.name: ctx.tensors[i.name] for i in model.graph.input if i.name not in inits}
    return Prepared(
        source=src,
        model=model,
        path=out,
        inputs=inputs,
        outputs=[o.name for o in model.graph.output],
        ctx=ctx,
        notes=notes,
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
