"""Tasks: the units the tuner measures, and the graph surgery that moves them around.

A `Task` is a connected run of nodes in a prepared model (an anchor such as MatMul or
Conv plus its fused epilogue) whose only escaping tensors are the last node's outputs.
A `TaskView` is what a strategy sees of a task: its nodes, the values of its constant
inputs and the static infos of every tensor it touches. A strategy turns a view into a
`Rewrite`: replacement nodes and initializers that read the same task inputs and write
the same task outputs, so one rewrite serves both the isolated task model (compile and
measure) and the whole model (assemble).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from aoe.signature import TaskSignature, TensorInfo

__all__ = [
    "CONTRIB_DOMAIN",
    "Rewrite",
    "Task",
    "TaskView",
    "apply_rewrites",
    "constant_values",
    "task_model",
]

CONTRIB_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Rewrite:
    nodes: tuple[onnx.NodeProto, ...]
    initializers: tuple[onnx.TensorProto, ...] = ()


@dataclass
class Task:
    """One tunable group of nodes in the prepared model."""

    id: str
    family: str
    node_names: tuple[str, ...]
    signature: TaskSignature
    inputs: tuple[str, ...]  # task inputs in signature order (constants included)
    outputs: tuple[str, ...]
    share: float = 0.0  # fraction of baseline latency (from the profile)
    time_us: float = 0.0
    # Other tasks with the same signature: tuned once, applied to all.
    twins: list[Task] = field(default_factory=list)

    @property
    def op_type(self) -> str:
        return self.signature.op_type


@dataclass
class TaskView:
    nodes: Sequence[onnx.NodeProto]
    consts: Mapping[str, np.ndarray]
    infos: Mapping[str, TensorInfo]
    opset: int
    prefix: str
    #: calibrated (min, max) of activation tensors, for static quantization
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def anchor(self) -> onnx.NodeProto:
        return self.nodes[0]

    @property
    def output(self) -> str:
        return self.nodes[-1].output[0]

    def const(self, name: str) -> np.ndarray | None:
        return self.consts.get(name)

    def info(self, name: str) -> TensorInfo | None:
        return self.infos.get(name)

    def name(self, suffix: str) -> str:
        return f"{self.prefix}/{suffix}"

    def epilogue(self, *op_types: str) -> onnx.NodeProto | None:
        for node in self.nodes[1:]:
            if node.op_type in op_types:
                return node
        return None


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Return every constant tensor of `graph` (initializers and Constant nodes) by name."""
    inputs = {i.name for i in graph.input}  # an initializer that is also an input is a default
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.name not in inputs}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(a.t)
    return values


def _value_info(name: str, info: TensorInfo) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
    return helper.make_tensor_value_info(name, elem, list(info.shape))


def task_model(
    model: onnx.ModelProto,
    task: Task,
    consts: Mapping[str, np.ndarray],
    infos: Mapping[str, TensorInfo],
) -> onnx.ModelProto:
    """Return a standalone model that runs `task` alone, constants as initializers."""
    by_name = {n.name: n for n in model.graph.node}
    nodes = [by_name[n] for n in task.node_names]
    inits = [numpy_helper.from_array(consts[n], n) for n in task.inputs if n in consts]
    inner = [o for n in nodes for o in n.output if o and o not in task.outputs and o in infos]
    graph = helper.make_graph(
        nodes,
        f"task_{task.id}",
        [_value_info(n, infos[n]) for n in task.inputs if n not in consts],
        [_value_info(n, infos[n]) for n in task.outputs],
        initializer=inits,
        value_info=[_value_info(n, infos[n]) for n in inner],
    )
    opsets = {o.domain: o.version for o in model.opset_import}
    opsets.setdefault(CONTRIB_DOMAIN, 1)
    out = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
        producer_name="aoed",
    )
    out.ir_version = model.ir_version
    return out


def _read_names(nodes: Sequence[onnx.NodeProto]) -> set[str]:
    """Names `nodes` read, including those their subgraphs (If, Loop, Scan) read."""
    names: set[str] = set()
    for node in nodes:
        names.update(node.input)
        for a in node.attribute:
            for g in (*([a.g] if a.HasField("g") else []), *a.graphs):
                names |= _read_names(g.node) | {o.name for o in g.output}
    return names


def apply_rewrites(model: onnx.ModelProto, rewrites: Mapping[tuple[str, ...], Rewrite]) -> onnx.ModelProto:
    """Return a copy of `model` with each task (keyed by its node names) replaced.

    Replacement nodes take the position of the task's first node, which keeps the
    graph topologically sorted because task inputs are produced before the anchor and
    only the last node's outputs escape. Initializers nobody reads any more are dropped.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if not rewrites:
        return out
    first: dict[str, tuple[str, ...]] = {names[0]: names for names in rewrites}
    dropped = {n for names in rewrites for n in names}
    nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    for node in model.graph.node:
        if node.name in first:
            rw = rewrites[first[node.name]]
            nodes.extend(rw.nodes)
            new_inits.extend(rw.initializers)
        elif node.name not in dropped:
            nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(new_inits)
    used = _read_names(out.graph.node) | {o.name for o in out.graph.output}
    keep = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    if any(n.domain == CONTRIB_DOMAIN for n in nodes) and not any(
        o.domain == CONTRIB_DOMAIN for o in out.opset_import
    ):
        out.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return out
