"""Partition a prepared model into tasks (OPAT: fused operators).

An anchor (MatMul or Gemm with a constant weight, Conv with a constant weight, or a
MatMul of two activations, which stands alone) takes along its epilogue while the chain stays private: a constant bias Add (MatMul only),
then one activation. Only the last node's outputs may escape the task, so a rewrite can
replace the chain without any other node noticing. Tasks with the same signature are
tuned once: the first is the representative, the rest are its `twins`.
"""

from __future__ import annotations

import re
from collections import defaultdict

import onnx

from aoe.signature import ModelContext, task_signature
from aoed.backends.ort.strategies import ACTIVATIONS
from aoed.engine.tasks import Task

__all__ = ["partition"]


def _family(node: onnx.NodeProto, ctx: ModelContext) -> str | None:
    if node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    if node.op_type in ("MatMul", "Gemm") and node.input[1] in ctx.constants:
        return "matmul"
    if node.op_type == "Conv" and node.input[1] in ctx.constants:
        return "conv"
    if node.op_type == "MatMul" and not ({node.input[0], node.input[1]} & ctx.constants):
        return "matmul_act"
    return None


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:48] or "node"


def partition(model: onnx.ModelProto, ctx: ModelContext) -> list[Task]:
    """Return the representative tasks of `model` in graph order, twins attached.

    Every node must have a unique, non-empty name (the prepared model guarantees it).
    """
    g = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in g.node:
        for name in node.input:
            consumers[name].append(node)
    graph_outputs = {o.name for o in g.output}

    def private_successor(node: onnx.NodeProto) -> onnx.NodeProto | None:
        out = node.output[0]
        users = consumers.get(out, [])
        if len(node.output) != 1 or out in graph_outputs or len(users) != 1:
            return None
        return users[0]

    taken: set[str] = set()
    reps: dict[str, Task] = {}
    order: list[Task] = []
    count = 0
    for node in g.node:
        family = _family(node, ctx)
        if family is None or node.name in taken:
            continue
        chain = [node]
        nxt = private_successor(node) if family != "matmul_act" else None
        if family == "matmul" and node.op_type == "MatMul" and nxt is not None and nxt.op_type == "Add":
            other = nxt.input[1] if nxt.input[0] == node.output[0] else nxt.input[0]
            if other in ctx.constants:
                chain.append(nxt)
                nxt = private_successor(nxt)
        if nxt is not None and nxt.op_type in ACTIVATIONS and nxt.domain in ("", "ai.onnx"):
            chain.append(nxt)
        try:
            sig = task_signature(chain, ctx)
        except ValueError:
            continue  # a tensor without a static shape: not tunable
        produced = {o for n in chain for o in n.output}
        inputs = tuple(dict.fromkeys(i for n in chain for i in n.input if i and i not in produced))
        count += 1
        task = Task(
            id=f"t{count:03d}_{_slug(node.name)}",
            family=family,
            node_names=tuple(n.name for n in chain),
            signature=sig,
            inputs=inputs,
            outputs=tuple(o for o in chain[-1].output if o),
        )
        taken.update(task.node_names)
        rep = reps.get(sig.digest)
        if rep is None:
            reps[sig.digest] = task
            order.append(task)
        else:
            rep.twins.append(task)
    return order
