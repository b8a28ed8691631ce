"""The graph view subgraph recognition works on: producers, consumers, readable
constants and axes of one normalized model (`aoe.subgraphs`, `aoe.attention`), or of one
task's nodes alone (`Graph.of_task`: what a strategy reads its block from).

This module imports neither trio nor onnxruntime.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from aoe.signature import ModelContext, TensorInfo

__all__ = ["STD", "Graph", "Match", "last_axis", "reduce_axes"]

#: The standard ONNX domain, as either spelling.
STD = ("", "ai.onnx")


class Match:
    """One recognized subgraph: its family, its nodes in graph order (last = output) and
    the tensors that leave it: the last node's output, then any `also` (an attention
    block's KV cache, its present keys and values)."""

    def __init__(self, family: str, nodes: list[onnx.NodeProto], also: Sequence[str] = ()):
        self.family = family
        self.nodes = nodes
        self.outputs = (*(o for o in nodes[-1].output if o), *also)


class Graph:
    """Producers, consumers and readable constant values of one graph."""

    def __init__(self, model: onnx.ModelProto, ctx: ModelContext):
        g = model.graph
        inputs = {i.name for i in g.input}
        stored = {t.name: t for t in g.initializer if t.name not in inputs}
        constant_nodes = {
            n.output[0]: a.t
            for n in g.node
            if n.op_type == "Constant" and n.domain in STD
            for a in n.attribute
            if a.name == "value"
        }

        def value(tensor: str) -> np.ndarray | None:
            t = stored.get(tensor) or constant_nodes.get(tensor)
            return None if t is None else numpy_helper.to_array(t)

        self._index(g.node, {o.name for o in g.output}, ctx.tensors, ctx.constants, value)
        #: a task's nodes alone (`of_task`): what computes its inputs is not here to see
        self.partial = False

    @classmethod
    def of_task(
        cls,
        nodes: Sequence[onnx.NodeProto],
        tensors: Mapping[str, TensorInfo],
        constants: Container[str],
        value: Callable[[str], np.ndarray | None],
    ) -> Graph:
        """The graph of one task's `nodes` alone: its last node's output is its one output,
        `constants` and `value` say which tensors are constant and what they hold."""
        g = cls.__new__(cls)
        outputs = {o for o in nodes[-1].output if o} if nodes else set()
        g._index(nodes, outputs, tensors, constants, value)
        g.partial = True
        return g

    def _index(
        self,
        nodes: Iterable[onnx.NodeProto],
        outputs: set[str],
        tensors: Mapping[str, TensorInfo],
        constants: Container[str],
        value: Callable[[str], np.ndarray | None],
    ) -> None:
        self.tensors = tensors
        self._constants = constants
        self._value = value
        self.order: dict[str, int] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for i, node in enumerate(nodes):
            self.order[node.name] = i
            for o in node.output:
                if o:
                    self.producer[o] = node
            for t in dict.fromkeys(node.input):  # a node reading a tensor twice is one reader
                if t:
                    self.consumers[t].append(node)
        self.outputs = outputs

    def node(self, tensor: str, *op_types: str) -> onnx.NodeProto | None:
        n = self.producer.get(tensor)
        return n if n is not None and n.domain in STD and n.op_type in op_types else None

    def is_const(self, tensor: str) -> bool:
        return tensor in self._constants

    def value(self, tensor: str) -> np.ndarray | None:
        """A constant's readable value (of a model: an initializer or a Constant node);
        None otherwise."""
        try:
            return self._value(tensor)
        except Exception:  # external data not loaded, an odd type: not readable here
            return None

    def scalar(self, tensor: str) -> float | None:
        v = self.value(tensor)
        if v is None or v.size != 1 or v.dtype.kind not in "fiu":
            return None
        return float(v.reshape(()))

    def is_scalar(self, tensor: str, want: float, rel: float = 1e-3) -> bool:
        got = self.scalar(tensor)
        return got is not None and math.isclose(got, want, rel_tol=rel)

    def users(self, tensor: str) -> list[onnx.NodeProto]:
        return self.consumers.get(tensor, [])

    def attr(self, node: onnx.NodeProto, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def other(self, node: onnx.NodeProto, tensor: str) -> str | None:
        """The other input of a two-input node that reads `tensor`."""
        if len(node.input) != 2:
            return None
        a, b = node.input
        return b if a == tensor else a if b == tensor else None

    def closed(self, nodes: Sequence[onnx.NodeProto], also: Container[str] = ()) -> bool:
        """True when only the last node's outputs, and the tensors in `also`, leave
        `nodes` (no other output is a graph output or read by a node outside)."""
        names = {n.name for n in nodes}
        last = nodes[-1]
        for n in nodes:
            if n is last:
                continue
            for o in n.output:
                if not o or o in also:
                    continue
                if o in self.outputs or any(u.name not in names for u in self.users(o)):
                    return False
        return bool([o for o in last.output if o]) and len([o for o in last.output if o]) == 1

    def sorted(self, nodes: Iterable[onnx.NodeProto]) -> list[onnx.NodeProto]:
        uniq = {n.name: n for n in nodes}
        return sorted(uniq.values(), key=lambda n: self.order[n.name])


def reduce_axes(g: Graph, node: onnx.NodeProto) -> list[int] | None:
    axes = g.attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        v = g.value(node.input[1])
        axes = None if v is None else [int(a) for a in v.reshape(-1)]
    return None if axes is None else list(axes)


def last_axis(g: Graph, node: onnx.NodeProto, tensor: str) -> bool:
    axes = reduce_axes(g, node)
    info = g.tensors.get(tensor)
    if axes is None or len(axes) != 1 or info is None:
        return False
    return axes[0] in (-1, len(info.shape) - 1)
