"""Graph surgery on tasks: what a strategy sees, and how its rewrite replaces a task.

A `TaskView` is what a strategy sees of a task (`aoe.partition.Task`): its nodes, the
values of its constant inputs and the static infos of every tensor it touches. A
strategy turns a view into a `Rewrite`: replacement nodes and initializers that read
the same task inputs and write the same task outputs, so one rewrite serves both the
isolated task model (compile and measure) and the whole model (assemble).

Constant values come from a `Constants` resolver: stored initializers as they are, and
weights that nodes compute from constants (the graph is not folded, see `aoe.graph`)
evaluated on demand with onnx's reference evaluator, so only what a strategy reads is
ever materialised.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from aoe.partition import Task
from aoe.signature import TensorInfo, computes_constant

__all__ = [
    "CONTRIB_DOMAIN",
    "Constants",
    "Rewrite",
    "TaskView",
    "apply_rewrites",
    "read_names",
    "task_model",
]

CONTRIB_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Rewrite:
    nodes: tuple[onnx.NodeProto, ...]
    initializers: tuple[onnx.TensorProto, ...] = ()


class Constants(Mapping[str, np.ndarray]):
    """The constant tensors of one graph by name, evaluated lazily and cached.

    Initializers (not listed as graph inputs) and Constant node outputs are read as
    stored; a tensor a standard deterministic node computes from constants is evaluated
    with `onnx.reference` over just the nodes that produce it.
    """

    def __init__(self, graph: onnx.GraphProto, opsets: Sequence[onnx.OperatorSetIdProto] = ()):
        inputs = {i.name for i in graph.input}  # an initializer that is also an input is a default
        self._stored = {t.name: t for t in graph.initializer if t.name not in inputs}
        self._producer: dict[str, onnx.NodeProto] = {}
        self._opsets = list(opsets)
        known = set(self._stored)
        for node in graph.node:
            if (
                node.op_type == "Constant"
                and node.domain in ("", "ai.onnx")
                or computes_constant(node, known)
            ):
                for o in node.output:
                    if o:
                        self._producer[o] = node
                        known.add(o)
        self._names = known
        self._cache: dict[str, np.ndarray] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        value = self._cache.get(name)
        if value is None:
            value = self._cache[name] = self._evaluate(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def stored(self, name: str) -> bool:
        """True when `name` is an initializer (not computed by a node)."""
        return name in self._stored

    def _evaluate(self, name: str) -> np.ndarray:
        if name in self._stored:
            return numpy_helper.to_array(self._stored[name])
        nodes: list[onnx.NodeProto] = []
        inits: dict[str, onnx.TensorProto] = {}
        seen: set[str] = set()

        def visit(tensor: str) -> None:
            if tensor in seen or not tensor:
                return
            seen.add(tensor)
            if tensor in self._stored:
                inits[tensor] = self._stored[tensor]
                return
            node = self._producer[tensor]
            for i in node.input:
                visit(i)
            if node not in nodes:
                nodes.append(node)

        visit(name)
        from onnx.reference import ReferenceEvaluator

        graph = helper.make_graph(
            nodes,
            "constant",
            [],
            [helper.make_empty_tensor_value_info(name)],
            initializer=list(inits.values()),
        )
        model = helper.make_model(
            graph, opset_imports=self._opsets or [helper.make_opsetid("", 13)]
        )
        (value,) = ReferenceEvaluator(model).run([name], {})
        return np.asarray(value)


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
        return self.consts[name] if name in self.consts else None

    def info(self, name: str) -> TensorInfo | None:
        return self.infos.get(name)

    def name(self, suffix: str) -> str:
        return f"{self.prefix}/{suffix}"

    def epilogue(self, *op_types: str) -> onnx.NodeProto | None:
        for node in self.nodes[1:]:
            if node.op_type in op_types:
                return node
        return None


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


def read_names(nodes: Sequence[onnx.NodeProto]) -> set[str]:
    """Names `nodes` read, including those their subgraphs (If, Loop, Scan) read."""
    names: set[str] = set()
    for node in nodes:
        names.update(node.input)
        for a in node.attribute:
            for g in (*([a.g] if a.HasField("g") else []), *a.graphs):
                names |= read_names(g.node) | {o.name for o in g.output}
    return names


def apply_rewrites(
    model: onnx.ModelProto, rewrites: Mapping[tuple[str, ...], Rewrite]
) -> onnx.ModelProto:
    """Return a copy of `model` with each task (keyed by its node names) replaced.

    Replacement nodes take the position of the task's first node, which keeps the
    graph topologically sorted where task inputs are produced before the anchor. Where
    one is produced after it (a mask, or rotary tables, computed between the anchor and
    where the block reads them), the nodes are sorted again, each as early as its
    inputs allow and otherwise in their order. What the replaced tasks alone read
    (nodes that computed a weight, initializers) goes too; everything else is left as it
    was.
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
    outputs = {o.name for o in model.graph.output}
    was_read = read_names(model.graph.node) | outputs
    # Nodes whose outputs were read before and are read by nobody now only fed the
    # replaced tasks (e.g. a Transpose computing a weight): drop them, repeatedly.
    while True:
        now_read = read_names(nodes) | outputs
        dead = [
            n
            for n in nodes
            if not any(o in now_read for o in n.output if o)
            and any(o in was_read for o in n.output if o)
        ]
        if not dead:
            break
        nodes = [n for n in nodes if n not in dead]
    nodes = _topological(nodes)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    now_read = read_names(nodes) | outputs
    new_names = {t.name for t in new_inits}
    keep = [
        t
        for t in [*out.graph.initializer, *new_inits]
        if t.name in now_read or (t.name not in was_read and t.name not in new_names)
    ]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    if any(n.domain == CONTRIB_DOMAIN for n in nodes) and not any(
        o.domain == CONTRIB_DOMAIN for o in out.opset_import
    ):
        out.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return out


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` in an order where each comes after the nodes that make what it reads (its
    subgraphs' reads included), keeping their order where it already is one; `nodes`
    as they are where none exists (a cycle)."""
    made = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps = [{made[t] for t in read_names([n]) if t in made} - {i} for i, n in enumerate(nodes)]
    if all(j < i for i, d in enumerate(deps) for j in d):
        return nodes
    users: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            users.setdefault(j, []).append(i)
    left = [len(d) for d in deps]
    ready = [i for i, n in enumerate(left) if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users.get(i, ()):
            left[u] -= 1
            if left[u] == 0:
                heapq.heappush(ready, u)
    return [nodes[i] for i in order] if len(order) == len(nodes) else nodes
