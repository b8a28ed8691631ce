"""A tiny ONNX graph builder for tests, and the blocks more than one test module builds
(the attention and norm variants stay with tests/test_subgraphs.py)."""

from __future__ import annotations

import uuid

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["B", "D", "G", "H", "N", "S", "anonymize", "glu_block", "linear"]


B, S, H, N = 1, 16, 32, 4


D = H // N


class G:
    """A tiny graph builder: nodes get their op type as a name until `anonymize`."""

    def __init__(self, seed: int = 0, opset: int = 17):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.opset = opset
        self._n = 0

    def t(self, value, name: str | None = None) -> str:
        self._n += 1
        name = name or f"c{self._n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def w(self, *shape: int, std: float = 0.2) -> str:
        return self.t((self.rng.standard_normal(shape) * std).astype(np.float32))

    def f(self, v: float) -> str:
        return self.t(np.array(v, np.float32))

    def n(self, op: str, *ins: str, **attrs) -> str:
        self._n += 1
        out = f"v{self._n}"
        self.nodes.append(helper.make_node(op, list(ins), [out], name=f"{op}_{self._n}", **attrs))
        return out

    def input(self, name: str, shape, dtype=TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def model(self, out: str, shape=(B, S, H)) -> onnx.ModelProto:
        self.nodes[-1].output[0] = "y"
        for n in self.nodes:  # the last node's output was renamed: rewire its readers
            for i, name in enumerate(n.input):
                if name == out:
                    n.input[i] = "y"
        g = helper.make_graph(
            self.nodes,
            "g",
            self.inputs,
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
            initializer=self.inits,
        )
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = 8
        return m


def anonymize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every node named at random, in no telling order."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        node.name = uuid.uuid4().hex
    return out


def linear(g: G, x: str, k: int, n: int, bias: bool = True) -> str:
    y = g.n("MatMul", x, g.w(k, n))
    return g.n("Add", y, g.w(n, std=0.05)) if bias else y


def glu_block(
    act: str = "silu",
    bias: bool = False,
    silu_order: str = "x_first",
    up_first: bool = False,
    seed: int = 5,
) -> onnx.ModelProto:
    """A LLaMA-style MLP: down(act(x·Wg) · (x·Wu)), act SiLU (as Sigmoid and Mul) or Sigmoid."""
    g = G(seed=seed)
    x = g.input("x", [B, S, H])
    gate, up = linear(g, x, H, 2 * H, bias), linear(g, x, H, 2 * H, bias)
    sig = g.n("Sigmoid", gate)
    a = (
        sig
        if act == "sigmoid"
        else g.n("Mul", gate, sig)
        if silu_order == "x_first"
        else g.n("Mul", sig, gate)
    )
    h = g.n("Mul", up, a) if up_first else g.n("Mul", a, up)
    return g.model(linear(g, h, 2 * H, H, bias))
