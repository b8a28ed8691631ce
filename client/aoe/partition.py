"""Tasks: how a model splits into the units the tuner measures and the bank keys.

A task is a connected run of nodes: an anchor with its fused epilogue, chosen so that
only the last node's outputs escape and a rewrite can replace the chain unseen:

  matmul      MatMul with a constant weight, then a constant bias Add, then one
              activation; or Gemm with a constant weight, then one activation
  conv        Conv with a constant weight, then an inference BatchNormalization with
              constant statistics, then one activation
  matmul_act  MatMul of two activations (attention's Q·Kᵀ and P·V), alone

SGAT's subgraph tasks (attention, layernorm, gelu) come from `aoe.subgraphs`; a job's
type picks the tasks (`JOB_TYPES`): operators alone (opat), subgraphs alone (sgat), or
subgraphs first and operators over the nodes they left (sgat+opat).

Tasks with the same signature are tuned once: the first is the representative, the
rest are its `twins`. `ModelTasks` indexes a model's tasks by node for bank lookups; it
runs the same normalization (`aoe.graph`) and partition as the tuner, in pure onnx, so a
compiler holding the model the user has finds the tasks the tuner tuned.

This module imports neither trio nor onnxruntime.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection, Mapping

import msgspec
import onnx

from aoe.signature import ModelContext, TaskSignature, task_signature
from aoe.spec import JobType
from aoe.subgraphs import find_subgraphs

__all__ = ["ACTIVATIONS", "FAMILIES", "JOB_TYPES", "ModelTasks", "Task", "partition"]

#: What a job may tune (aoe.spec.JobType).
JOB_TYPES = tuple(JobType)

#: Elementwise activations a task takes along as its epilogue.
ACTIVATIONS = ("Relu", "Sigmoid", "Tanh", "LeakyRelu")
#: Task families, in the order the tuner reports them.
FAMILIES = ("matmul", "conv", "matmul_act")


class Task(msgspec.Struct, forbid_unknown_fields=True):
    """One tunable group of nodes in a normalized model; a msgspec Struct, as it crosses
    into the engine's children inside their messages (aoed.engine.messages)."""

    id: str
    family: str
    node_names: tuple[str, ...]
    signature: TaskSignature
    inputs: tuple[str, ...]  # task inputs in signature order (constants included)
    outputs: tuple[str, ...]
    # Other tasks with the same signature: tuned once, applied to all.
    twins: list[Task] = []

    @property
    def op_type(self) -> str:
        return self.signature.op_type

    @property
    def anchor(self) -> str:
        return self.node_names[0]

    @property
    def instances(self) -> int:
        return 1 + len(self.twins)


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


def _is_inference_bn(node: onnx.NodeProto, ctx: ModelContext) -> bool:
    return (
        node.op_type == "BatchNormalization"
        and node.domain in ("", "ai.onnx")
        and len(node.input) == 5
        and len([o for o in node.output if o]) == 1
        and all(i in ctx.constants for i in node.input[1:])
    )


def partition(
    model: onnx.ModelProto,
    ctx: ModelContext,
    job_type: str = "opat",
    subgraph_families: Collection[str] | None = None,
) -> list[Task]:
    """Return the representative tasks of `model` for `job_type` (`JOB_TYPES`), twins
    attached: subgraph tasks first (in graph order), then operator tasks. Only subgraphs
    of `subgraph_families` (None: every family) are tasks; the nodes of the others are
    left to operator tasks.

    Every node must have a unique, non-empty name (`aoe.graph.normalize` sees to it). A
    chain with a tensor of unknown shape has no signature and is not a task.
    """
    if job_type not in JOB_TYPES:
        raise ValueError(f"job type {job_type!r}: expected one of {', '.join(JOB_TYPES)}")
    reps: dict[str, Task] = {}
    order: list[Task] = []
    taken: set[str] = set()
    if job_type != "opat":
        _subgraph_tasks(model, ctx, reps, order, taken, subgraph_families)
    if job_type != "sgat":
        _operator_tasks(model, ctx, reps, order, taken)
    return order


def _add(task: Task, reps: dict[str, Task], order: list[Task], taken: set[str]) -> None:
    taken.update(task.node_names)
    rep = reps.get(task.signature.digest)
    if rep is None:
        reps[task.signature.digest] = task
        order.append(task)
    else:
        rep.twins.append(task)


def _subgraph_tasks(
    model: onnx.ModelProto,
    ctx: ModelContext,
    reps: dict[str, Task],
    order: list[Task],
    taken: set[str],
    families: Collection[str] | None,
) -> None:
    # Ids count every match, taken or not, so that they stay put.
    for count, m in enumerate(find_subgraphs(model, ctx), 1):
        if families is not None and m.family not in families:
            continue
        try:
            sig = task_signature(m.nodes, ctx)
        except ValueError:
            continue  # a tensor without a static shape: not tunable
        produced = {o for n in m.nodes for o in n.output}
        last = m.nodes[-1]
        _add(
            Task(
                id=f"s{count:03d}_{m.family}_{_slug(last.name)}",
                family=m.family,
                node_names=tuple(n.name for n in m.nodes),
                signature=sig,
                inputs=tuple(
                    dict.fromkeys(i for n in m.nodes for i in n.input if i and i not in produced)
                ),
                outputs=tuple(m.outputs),
            ),
            reps,
            order,
            taken,
        )


def _operator_tasks(
    model: onnx.ModelProto,
    ctx: ModelContext,
    reps: dict[str, Task],
    order: list[Task],
    taken: set[str],
) -> None:
    g = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in g.node:
        for name in node.input:
            consumers[name].append(node)
    graph_outputs = {o.name for o in g.output}

    def private_successor(node: onnx.NodeProto) -> onnx.NodeProto | None:
        out = node.output[0]
        users = consumers.get(out, [])
        if len([o for o in node.output if o]) != 1 or out in graph_outputs or len(users) != 1:
            return None
        return users[0]

    count = 0
    for node in g.node:
        family = _family(node, ctx)
        if family is None or node.name in taken:
            continue
        chain = [node]
        nxt = private_successor(node) if family != "matmul_act" else None
        if (
            family == "matmul"
            and node.op_type == "MatMul"
            and nxt is not None
            and nxt.op_type == "Add"
        ):
            other = nxt.input[1] if nxt.input[0] == node.output[0] else nxt.input[0]
            if other in ctx.constants:
                chain.append(nxt)
                nxt = private_successor(nxt)
        if (
            family == "conv"
            and nxt is not None
            and _is_inference_bn(nxt, ctx)
            and nxt.input[0] == node.output[0]
        ):
            chain.append(nxt)
            nxt = private_successor(nxt)
        if nxt is not None and nxt.op_type in ACTIVATIONS and nxt.domain in ("", "ai.onnx"):
            chain.append(nxt)
        if any(n.name in taken for n in chain):
            continue
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
        _add(task, reps, order, taken)


class ModelTasks:
    """The tasks of one model as the tuner forms them, for lookups by node.

    Built once per model: the model is normalized as the tuner normalizes it
    (`aoe.graph.normalize`, leniently) and split by the tuner's partition, so the model
    a user has, not only the tuner's prepared copy, finds its tasks. Give the shapes the
    model was tuned for (`input_shapes`, as `aoe tune --input-shape`) when its inputs
    have dynamic dimensions; tasks whose shapes stay unknown get no signature. Pass
    `keep_initializer_inputs` if the tuning run did, and the `job_type` it ran (an SGAT
    run's subgraph tasks are found by their first node in graph order; "sgat+opat" finds
    both kinds, subgraphs first). Nodes are matched by their first output, which is
    unique in any valid graph and survives normalization.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        input_shapes: Mapping[str, tuple[int, ...]] | None = None,
        *,
        keep_initializer_inputs: bool = False,
        job_type: str = "opat",
    ):
        from aoe.graph import normalize

        norm = normalize(
            model, input_shapes, keep_initializer_inputs=keep_initializer_inputs, strict=False
        )
        self.model = norm.model
        self.notes = norm.notes
        self.ctx = ModelContext(norm.model)
        by_name = {n.name: n for n in norm.model.graph.node}
        self._by_output: dict[str, TaskSignature] = {}
        self.tasks = partition(norm.model, self.ctx, job_type)
        for task in self.tasks:
            for t in (task, *task.twins):
                anchor = by_name[t.node_names[0]]
                if anchor.output:
                    self._by_output[anchor.output[0]] = task.signature

    def signature(self, node: onnx.NodeProto) -> TaskSignature | None:
        """The signature of the task `node` anchors; None when it anchors none."""
        if not node.output:
            return None
        return self._by_output.get(node.output[0])

    def __len__(self) -> int:
        return len(self.tasks)
