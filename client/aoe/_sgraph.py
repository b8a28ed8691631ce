"""The graph view subgraph recognition works on: producers, consumers, readable
constants and axes of one normalized model (`aoe.subgraphs`, `aoe._attention`).

This module imports neither trio nor onnxruntime.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from aoe.signature import ModelContext

__all__ = ["STD", "Graph", "Match", "last_axis", "reduce_axes"]

#: The standard ONNX domain, as either spelling.
STD = ("", "ai.onnx")


class Match:
    """One recognized subgraph: its family and its nodes in graph order (last = output)."""

    def __init__(self, family: str, nodes: list[onnx.NodeProto]):
        self.family = family
        self.nodes = nodes


class Graph:
    """Producers, consumers and readable constant values of one graph."""

    def __init__(self, model: onnx.ModelProto, ctx: ModelContext):
        g = model.graph
        self.ctx = ctx
        self.order = {n.name: i for i, n in enumerate(g.node)}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in g.node:
            for o in node.output:
                if o:
                    self.producer[o] = node
            for i in dict.fromkeys(node.input):  # a node reading a tensor twice is one reader
                if i:
                    self.consumers[i].append(node)
        self.outputs = {o.name for o in g.output}
        inputs = {i.name for i in g.input}
        self._stored = {t.name: t for t in g.initializer if t.name not in inputs}
        self._constant_nodes = {
            n.output[0]: a.t
            for n in g.node
            if n.op_type == "Constant" and n.domain in STD
            for a in n.attribute
            if a.name == "value"
        }

    def node(self, tensor: str, *op_types: str) -> onnx.NodeProto | None:
        n = self.producer.get(tensor)
        return n if n is not None and n.domain in STD and n.op_type in op_types else None

    def is_const(self, tensor: str) -> bool:
        return tensor in self.ctx.constants

    def value(self, tensor: str) -> np.ndarray | None:
        """A stored constant's value (an initializer or a Constant node); None otherwise."""
        t = self._stored.get(tensor) or self._constant_nodes.get(tensor)
        if t is None:
            return None
        try:
            return numpy_helper.to_array(t)
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

    def closed(self, nodes: Sequence[onnx.NodeProto]) -> bool:
        """True when only the last node's outputs leave `nodes` (no other output is a
        graph output or read by a node outside)."""
        names = {n.name for n in nodes}
        last = nodes[-1]
        for n in nodes:
            if n is last:
                continue
            for o in n.output:
                if not o:
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
    info = g.ctx.tensors.get(tensor)
    if axes is None or len(axes) != 1 or info is None:
        return False
    return axes[0] in (-1, len(info.shape) - 1)
