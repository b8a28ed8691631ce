"""Graph normalization in pure onnx: the preparation task signatures depend on.

The tuner and every compiler that looks tasks up must see the same graph, or the
signatures they compute differ and no bank entry ever matches. So the one preparation
both run lives here, in the light client, and uses onnx alone (no onnxruntime):

    initializers listed as graph inputs become constants (old exporters; unless kept)
    -> IR version raised to one the opsets need (at least 4)
    -> default-domain opset converted to 13 where older (best effort)
    -> every node gets a unique name (tasks name their nodes)
    -> user shape overrides; a dynamic dimension without one is an error (strict)
       or left dynamic (a compiler's lookup: those tasks simply get no signature)
    -> shape inference with data propagation; where it leaves tensors without a static
       shape (exports that compute shapes at run time from Shape nodes, as torch.onnx
       does for masks and buffers), again on a scratch copy whose shape computations are
       evaluated (onnx.reference), and the shapes found are recorded on the model
    -> an attention mask made once and added to the scores of many layers
       (Where(keep, 0, -inf), as torch's dynamo export writes it) gets one copy of its
       Where per layer, so that each attention block holds its own, as the TorchScript
       exporter writes it, and a fused kernel can read the boolean (onnxruntime's
       common subexpression elimination merges the copies again where nothing fused)

Nothing is folded or fused: weights that nodes compute (a Transpose of an initializer,
a DequantizeLinear, a Reshape) stay as the input has them, and `ModelContext` knows
them as constants by propagation. A tuned model therefore keeps every weight that no
chosen strategy touched exactly as the input had it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, shape_inference, version_converter

from aoe.errors import ModelError, OptionError

__all__ = ["TARGET_OPSET", "Normalized", "default_opset", "name_nodes", "normalize"]

#: Oldest default-domain opset the strategies rely on (per-axis attributes, ReduceSum axes).
TARGET_OPSET = 13


@dataclass
class Normalized:
    model: onnx.ModelProto
    notes: list[str] = field(default_factory=list)


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset; 0 when it imports none."""
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 0


def _fix_legacy(
    model: onnx.ModelProto, keep_initializer_inputs: bool, notes: list[str]
) -> onnx.ModelProto:
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
    opset = default_opset(model)
    if 0 < opset < TARGET_OPSET:
        try:
            converted = version_converter.convert_version(model, TARGET_OPSET)
            notes.append(f"opset {opset} converted to {TARGET_OPSET}")
            model = converted
        except Exception as exc:  # conversion is best effort; strategies check opsets
            notes.append(
                f"opset {opset} kept: conversion to {TARGET_OPSET} failed ({exc})".splitlines()[0]
            )
    return model


def name_nodes(model: onnx.ModelProto, notes: list[str] | None = None) -> None:
    """Give every node without a name, or with a name an earlier node has, a unique one.

    Tasks refer to nodes by name, and onnxruntime refuses two nodes of one name.
    Deterministic: the same graph always gets the same names.
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


def _dims_text(dims) -> str:
    return ",".join(
        str(x.dim_value) if x.HasField("dim_value") and x.dim_value > 0 else "N" for x in dims
    )


def _apply_shapes(
    model: onnx.ModelProto,
    shapes: Mapping[str, tuple[int, ...]],
    source: str,
    strict: bool,
    notes: list[str],
) -> None:
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    for name in shapes:
        if name not in names:
            raise OptionError(
                f"--input-shape: {source} has no input {name!r} (inputs: {', '.join(names)})"
            )
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            if strict:
                raise ModelError(
                    f"{source}: input {vi.name!r} is not a tensor; only tensor inputs are supported"
                )
            continue
        t = vi.type.tensor_type
        dims = t.shape.dim
        want = shapes.get(vi.name)
        if want is not None:
            if t.HasField("shape") and len(dims) != len(want):
                raise OptionError(
                    f"--input-shape {vi.name}: rank {len(want)} given, the model's input has rank {len(dims)}"
                )
            fixed = []
            for i, d in enumerate(dims):
                if d.HasField("dim_value") and d.dim_value > 0:
                    if d.dim_value != want[i]:
                        raise OptionError(
                            f"--input-shape {vi.name}: dimension {i} is fixed at {d.dim_value} in the model, "
                            f"not {want[i]}"
                        )
                else:
                    fixed.append(f"{i} ({d.dim_param or '?'!r}) = {want[i]}")
            if not t.HasField("shape"):
                fixed.append(f"all (no shape in the model) = {list(want)}")
            if fixed:
                notes.append(
                    f"input {vi.name!r}: dynamic dimension {', '.join(fixed)} fixed by --input-shape"
                )
            t.ClearField("shape")
            for size in want:
                t.shape.dim.add().dim_value = size
            continue
        if not strict:
            continue
        if not t.HasField("shape"):
            raise ModelError(
                f"{source}: input {vi.name!r} has no shape; pass --input-shape {vi.name}:D1,D2,..."
            )
        for i, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value <= 0:
                # Stated, not missing: a zero-size input has nothing to compute or time.
                what = "a zero-size tensor" if d.dim_value == 0 else "a negative size"
                raise ModelError(
                    f"{source}: input {vi.name!r} has dimension {i} of size {d.dim_value} ({what}); "
                    f"pass --input-shape {vi.name}:{_dims_text(dims)} if the exporter meant it as dynamic"
                )
            if not d.HasField("dim_value"):
                label = d.dim_param or "?"
                raise ModelError(
                    f"{source}: input {vi.name!r} has dynamic dimension {i} ({label!r}); "
                    f"pass --input-shape {vi.name}:{_dims_text(dims)}"
                )


def _infer(model: onnx.ModelProto, source: str, strict: bool) -> onnx.ModelProto:
    try:
        inferred = shape_inference.infer_shapes(
            model, check_type=strict, strict_mode=strict, data_prop=True
        )
    except Exception as exc:
        if not strict:
            return model  # tasks without static shapes get no signature; nothing else breaks
        raise ModelError(f"{source}: shape inference failed: {exc}".splitlines()[0]) from None
    _fill_shapes(inferred)
    return inferred


#: Shape computations evaluated to fill shapes: only tensors this small are kept.
_FOLD_ELEMENTS = 4096


def _static(vi: onnx.ValueInfoProto) -> list[int] | None:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
    return None if any(d < 0 for d in dims) else dims


def _fill_shapes(model: onnx.ModelProto) -> None:
    """Record static shapes that inference missed because they depend on values computed
    at run time from static shapes (Shape -> Gather -> Concat -> Expand, as exporters
    write for masks and position ids). A scratch copy gets those small computations
    evaluated as initializers and is inferred again; the model itself keeps its nodes and
    only gains value_info. Best effort: what still cannot be inferred stays unknown."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    from aoe.signature import computes_constant

    g = model.graph
    shapes = {
        vi.name: s for vi in [*g.input, *g.value_info, *g.output] if (s := _static(vi)) is not None
    }
    if all(o in shapes for n in g.node for o in n.output if o):
        return
    inputs = {i.name for i in g.input}
    values = {
        t.name: numpy_helper.to_array(t)
        for t in g.initializer
        if t.name not in inputs and _numel(t.dims) <= _FOLD_ELEMENTS
    }
    known = {t.name for t in g.initializer if t.name not in inputs}
    folded: dict[str, object] = {}
    opsets = list(model.opset_import)
    for node in g.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        outs = [o for o in node.output if o]
        if node.op_type == "Shape" and node.input[0] in shapes:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            dims = shapes[node.input[0]]
            start, end = attrs.get("start", 0), attrs.get("end", len(dims))
            values[outs[0]] = folded[outs[0]] = np.array(dims[start:end], np.int64)
            known.add(outs[0])
            continue
        if not computes_constant(node, known) and node.op_type != "Constant":
            continue
        known.update(outs)
        ins = list(dict.fromkeys(i for i in node.input if i))
        if not all(i in values for i in ins):
            continue
        try:
            sub = helper.make_graph(
                [node],
                "fold",
                [
                    helper.make_tensor_value_info(
                        i, helper.np_dtype_to_tensor_dtype(values[i].dtype), values[i].shape
                    )
                    for i in ins
                ],
                [helper.make_empty_tensor_value_info(o) for o in outs],
            )
            got = ReferenceEvaluator(helper.make_model(sub, opset_imports=opsets)).run(
                None, {i: values[i] for i in ins}
            )
        except Exception:  # an op the reference cannot run, a bad value: left unknown
            continue
        for o, v in zip(outs, got, strict=True):
            v = np.asarray(v)
            if v.size <= _FOLD_ELEMENTS:
                values[o] = v
                if node.op_type != "Constant":
                    folded[o] = v
    if not folded:
        return
    scratch = onnx.ModelProto()
    scratch.CopyFrom(model)
    kept = [n for n in scratch.graph.node if not any(o in folded for o in n.output)]
    del scratch.graph.node[:]
    scratch.graph.node.extend(kept)
    scratch.graph.initializer.extend(
        numpy_helper.from_array(np.asarray(v), k) for k, v in folded.items()
    )
    del scratch.graph.value_info[:]  # inferred afresh: a stale partial shape would stay as it is
    try:
        scratch = shape_inference.infer_shapes(scratch, data_prop=True)
    except Exception:
        return
    existing = {vi.name: vi for vi in g.value_info}
    for vi in scratch.graph.value_info:
        if vi.name in shapes or vi.name in folded or _static(vi) is None:
            continue
        if vi.name in existing:
            existing[vi.name].CopyFrom(vi)
        else:
            g.value_info.append(vi)
    for name, v in folded.items():  # the folded tensors' own shapes (a Shape's output, say)
        if name in shapes:
            continue
        vi = helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype), list(np.asarray(v).shape)
        )
        if name in existing:  # inferred before with a dimension unknown (a Range's length)
            existing[name].CopyFrom(vi)
        else:
            g.value_info.append(vi)
    # The graph's outputs too: a KV cache's present is an output whose declared length
    # (`past + seq`) inference fills only where what it concatenates was known at once.
    inferred = {o.name: o for o in scratch.graph.output if _static(o) is not None}
    for out in g.output:
        if out.name not in shapes and out.name in inferred:
            out.type.CopyFrom(inferred[out.name].type)


def _own_masks(model: onnx.ModelProto, notes: list[str]) -> None:
    """One copy of a shared mask Where per Add that reads it (see the module doc): a
    Where(cond, 0, fill) or Where(cond, fill, 0) of a 4-D boolean activation
    (`aoe.attention.mask_fill`), read by Adds alone, two or more."""
    from onnx import numpy_helper

    from aoe.attention import mask_fill

    g = model.graph
    consts = {t.name for t in g.initializer}
    scalars: dict[str, float] = {}
    for t in g.initializer:
        v = numpy_helper.to_array(t) if _numel(t.dims) == 1 else None
        if v is not None and v.dtype.kind in "fiub":
            scalars[t.name] = float(v.reshape(-1)[0])
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in dict.fromkeys(n.input):
            readers.setdefault(i, []).append(n)
    ranks = {
        vi.name: len(vi.type.tensor_type.shape.dim)
        for vi in [*g.input, *g.value_info]
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
    }
    outputs = {o.name for o in g.output}
    infos = {vi.name: vi for vi in g.value_info}
    copies: dict[int, list[onnx.NodeProto]] = {}
    for idx, w in enumerate(g.node):
        if w.op_type != "Where" or w.domain not in ("", "ai.onnx") or w.output[0] in outputs:
            continue
        users = readers.get(w.output[0], [])
        if len(users) < 2 or any(u.op_type != "Add" for u in users):
            continue
        if w.input[0] in consts or ranks.get(w.input[0]) != 4:
            continue
        if mask_fill(scalars.get(w.input[1]), scalars.get(w.input[2])) is None:
            continue
        for k, user in enumerate(users[1:], 1):
            out = f"{w.output[0]}/own{k}"
            copy = helper.make_node("Where", list(w.input), [out], name=f"{w.name}/own{k}")
            for j, i in enumerate(user.input):
                if i == w.output[0]:
                    user.input[j] = out
            if w.output[0] in infos:
                vi = onnx.ValueInfoProto()
                vi.CopyFrom(infos[w.output[0]])
                vi.name = out
                g.value_info.append(vi)
            copies.setdefault(idx, []).append(copy)
    if not copies:
        return
    nodes = []
    for idx, n in enumerate(g.node):
        nodes.append(n)
        nodes.extend(copies.get(idx, []))
    del g.node[:]
    g.node.extend(nodes)
    notes.append(
        f"{len(copies)} attention mask(s) shared by several layers: each layer got its own copy of the Where"
    )


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def normalize(
    model: onnx.ModelProto,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    *,
    keep_initializer_inputs: bool = False,
    strict: bool = True,
    source: str = "model",
) -> Normalized:
    """Return a normalized copy of `model` and notes on what changed (see module doc).

    `strict` (the tuner) checks the model and makes every dimension static or raises
    ModelError/OptionError naming `source`, the input and what to pass; without it (a
    compiler's lookup) problems leave tensors without static shapes instead. The
    transformations are the same either way, so signatures agree. Blocking, CPU-bound.
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    notes: list[str] = []
    if strict and not m.graph.node:
        raise ModelError(f"{source}: the model's graph has no nodes")
    m = _fix_legacy(m, keep_initializer_inputs, notes)
    name_nodes(m, notes)
    _apply_shapes(m, dict(input_shapes or {}), source, strict, notes)
    if strict:
        try:
            onnx.checker.check_model(m)
        except Exception as exc:
            raise ModelError(f"{source}: invalid model: {exc}".splitlines()[0]) from None
    m = _infer(m, source, strict)
    _own_masks(m, notes)
    return Normalized(m, notes)
