"""Assembly: a model with chosen strategies applied, and the bank read for a whole model.

`apply_choices` is how every tuned model is built, by the tuner (in a worker) and by
`aoe compile`: the prepared model with each task's chosen strategy applied to it and to
each of its twins. `from_bank` reads what the bank knows for a prepared model (through
`bankrules`, as tuning does) and turns it into choices and session options, over the
tasks the job that wrote the bank formed (its job type, which its confirmation names).
Pure: no measurement, no writes, no onnxruntime.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np
import onnx
from onnx import helper

from aoe.bankrecord import BankRecord
from aoe.device import CPU, Device
from aoe.errors import AoedError, OptionError
from aoe.ovartifact import RuntimeDecision
from aoe.partition import Task, partition
from aoe.recordcheck import Vocabulary
from aoe.sessionopts import METADATA_KEY
from aoe.signature import (
    DeviceFingerprint,
    ModelContext,
    TaskSignature,
    canonical_json,
    normalized_attributes,
)
from aoe.spec import DEFAULT_JOB_TYPE
from aoe.subgraphs import SUBGRAPH_FAMILIES
from aoed import __version__
from aoed.engine import bankrules
from aoed.engine.registry import DEFAULT, StrategyRegistry
from aoed.engine.shapeprofile import Profile
from aoed.engine.tasks import Rewrite, TaskView, apply_rewrites

__all__ = [
    "Assembly",
    "TaskOutcome",
    "apply_choices",
    "from_bank",
    "model_signature",
    "task_rewrites",
    "tunable_tasks",
    "tuned_metadata",
]


def model_signature(model: onnx.ModelProto, profile: Profile | None = None) -> TaskSignature:
    """The signature of model-wide choices (session options): the graph's structure,
    shapes and dtypes. Keyed like a task; its entry's strategy is the options' JSON.
    A dynamic model's key holds the points of its shape profile (`profile`) when there
    are several: what its confirmation was measured at, so that another profile of the
    same model is confirmed again (one point keeps the key a fixed shape always had)."""
    ctx = ModelContext(model)
    nodes = []
    for n in model.graph.node:
        domain = n.domain if n.domain != "ai.onnx" else ""
        nodes.append(
            {
                "op": n.op_type,
                "domain": domain,
                "attrs": normalized_attributes(n, ctx.opset(domain)),
                "in": [
                    msgspec.structs.asdict(ctx.tensors[i]) if i in ctx.tensors else None
                    for i in n.input
                ],
                "out": [
                    msgspec.structs.asdict(ctx.tensors[o]) if o in ctx.tensors else None
                    for o in n.output
                ],
            }
        )
    doc: dict[str, Any] = {"v": 1, "model": nodes, "opsets": ctx.opsets}
    if profile is not None and len(profile.points) > 1:
        doc["profile"] = [
            {name: list(dims) for name, dims in sorted(point.items())} for point in profile.points
        ]
    text = canonical_json(doc)
    return TaskSignature(
        "SessionOptions", "", ctx.opset(""), text, hashlib.sha256(text.encode()).hexdigest()
    )


def tuned_metadata(
    options: Mapping[str, Any], precision: str, device_digest: str, device: Device = CPU
) -> dict[str, str]:
    """The metadata a tuned model carries: session options, precision, device, version.
    The options of a model tuned on an accelerator always name its providers, so that
    aoe.session() runs it where it was measured."""
    options = dict(options)
    if not device.is_cpu and not options.get("providers"):
        options["providers"] = device.default_providers()
    return {
        METADATA_KEY: canonical_json(options),
        "aoe.precision": precision,
        "aoe.device": device_digest[:32],
        "aoe.version": __version__,
    }


def set_metadata(model: onnx.ModelProto, meta: Mapping[str, str]) -> None:
    """Set `meta` in `model`'s metadata_props, keeping its other entries."""
    props = {p.key: p.value for p in model.metadata_props}
    props.update(meta)
    del model.metadata_props[:]
    helper.set_model_props(model, props)


def tunable_tasks(
    model: onnx.ModelProto,
    ctx: ModelContext,
    registry: StrategyRegistry,
    precision: str,
    job_type: str = "opat",
    kind: str = "cpu",
) -> list[Task]:
    """The tasks a job of `job_type` tunes: those with a choice of strategy under
    `precision` on a device of `kind`. A subgraph with no choice there (a CNN region at
    exact) takes no nodes, so sgat+opat tunes every operator task OPAT would."""
    families = [f for f in SUBGRAPH_FAMILIES if registry.has_choice(f, precision, kind)]
    return [
        t
        for t in partition(model, ctx, job_type, families)
        if registry.has_choice(t.family, precision, kind)
    ]


def task_rewrites(
    model: onnx.ModelProto,
    ctx: ModelContext,
    consts: Mapping[str, np.ndarray],
    task: Task,
    strategy_name: str,
    registry: StrategyRegistry,
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> dict[tuple[str, ...], Rewrite]:
    """The rewrite of `task` and of each of its twins under one strategy ({} for the
    default); `ranges` are calibrated activation ranges (static quantization needs them).
    Raises KeyError (unknown strategy) or AoedError (it does not apply)."""
    if strategy_name == DEFAULT:
        return {}
    strat = registry.get(task.family, strategy_name)
    by_name = {n.name: n for n in model.graph.node}
    out = {}
    for t in (task, *task.twins):
        view = TaskView(
            nodes=[by_name[n] for n in t.node_names],
            consts=consts,
            infos=ctx.tensors,
            opset=ctx.opset(""),
            prefix=f"aoe/{t.id}",
            ranges=ranges or {},
        )
        rw = strat.apply(view)
        if rw is None:
            raise AoedError(f"strategy {strategy_name} does not apply to {t.id}")
        out[t.node_names] = rw
    return out


def apply_choices(
    model: onnx.ModelProto,
    ctx: ModelContext,
    consts: Mapping[str, np.ndarray],
    tasks: Sequence[Task],
    choices: Mapping[str, str],
    registry: StrategyRegistry,
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> onnx.ModelProto:
    """`model` with each task's chosen strategy (task id -> name; absent: default)."""
    rewrites: dict[tuple[str, ...], Rewrite] = {}
    for t in tasks:
        rewrites.update(
            task_rewrites(model, ctx, consts, t, choices.get(t.id, DEFAULT), registry, ranges)
        )
    return apply_rewrites(model, rewrites)


# --------------------------------------------------------------------------- from the bank


class Lookup(Protocol):
    """Where `from_bank` reads: the custom bank and its layers, one key at a time."""

    def record(self, key: bytes) -> tuple[BankRecord | None, str]: ...

    def default(self, key: bytes) -> tuple[dict[str, Any] | None, str]: ...

    def explain(self, key: bytes) -> str: ...


@dataclass
class TaskOutcome:
    task_id: str
    op_name: str
    op_type: str
    instances: int
    status: str  # hit | default | miss | ignored | reverted
    strategy: str = DEFAULT
    layer: str = ""
    reason: str = ""
    before_us: float = 0.0
    after_us: float = 0.0
    key: str = ""


@dataclass
class Assembly:
    choices: dict[str, str]
    session_options: dict[str, Any]
    tasks: list[TaskOutcome]
    session: TaskOutcome
    notes: list[str] = field(default_factory=list)
    #: the job type whose tasks `tasks` are (aoe.spec.JobType): the one that wrote the bank
    job_type: str = str(DEFAULT_JOB_TYPE)
    #: the tuning run's confirming A/B found these choices no faster than the input: the
    #: input model is what that run shipped, and what compiling it gives
    ship_input: bool = False
    #: the tuning run shipped another runtime's build of the model (OpenVINO's), which
    #: compiling it rebuilds; None: the ONNX model with these choices
    runtime: RuntimeDecision | None = None
    #: where the compiled model was written (an OpenVINO IR's .xml beside `output`)
    output: str = ""

    @property
    def hits(self) -> int:
        """Tasks (and session options) the bank answered, with a strategy or the default."""
        return sum(t.status in ("hit", "default", "reverted") for t in (*self.tasks, self.session))

    @property
    def misses(self) -> int:
        return sum(t.status in ("miss", "ignored") for t in (*self.tasks, self.session))


def _outcome(
    bank: Lookup,
    key: bytes,
    base: TaskOutcome,
    device: DeviceFingerprint,
    vocabulary: Vocabulary | None = None,
) -> bankrules.BankAnswer:
    rec, layer = bank.record(key)
    default, dlayer = bank.default(key) if rec is None else (None, "")
    ans = bankrules.answer(rec, layer, default, dlayer, device, vocabulary)
    base.status, base.layer, base.reason = ans.kind, ans.layer, ans.reason
    if ans.kind == "hit":
        assert ans.record is not None
        base.strategy = ans.record.strategy
        base.before_us, base.after_us = ans.record.baseline.median_us, ans.record.winner.median_us
    elif ans.kind == "default":
        base.before_us = base.after_us = ans.default_us
    elif ans.kind == "miss":
        base.reason = bank.explain(key)
    return ans


def from_bank(
    model: onnx.ModelProto,
    ctx: ModelContext,
    consts: Mapping[str, np.ndarray],
    bank: Lookup,
    device: DeviceFingerprint,
    registry: StrategyRegistry,
    precision: str = "exact",
    ranges: Mapping[str, tuple[float, float]] | None = None,
    job_type: str | None = None,
    profile: Profile | None = None,
) -> tuple[Assembly, list[Task]]:
    """What `bank` knows for the prepared `model` on `device`: the choices to apply (each
    checked to apply to its task and twins), the session options, and a report per task.
    The tasks are those a job of `job_type` tunes (None: the job type the bank's
    confirmation for this model names, else the default), so the choices rebuild what
    that job shipped; `profile` is a dynamic model's shape profile, which its model-level
    key holds (model_signature). Returns (assembly, the tunable tasks); raises
    OptionError for a `job_type` that forms no ONNX model's tasks (gdat)."""
    sig = model_signature(model, profile)
    key = bankrules.key_for(sig, device, precision)
    session = TaskOutcome("session", "", "SessionOptions", 1, "miss", key=key.decode())
    vocabulary = registry.vocabulary()
    ans = ans_model = _outcome(bank, key, session, device, vocabulary)
    options: dict[str, Any] = {}
    notes: list[str] = []
    reverted = bankrules.reverted_digests(ans)
    if ans.kind == "hit":
        assert ans.record is not None
        try:
            options = json.loads(ans.record.strategy)
            if not isinstance(options, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            session.status, session.reason, options = (
                "ignored",
                f"unreadable session options ({exc})",
                {},
            )

    # The tasks of the job that wrote this model's record, formed as that job formed
    # them: its entries (each keyed by a signature) then apply to the same nodes and
    # twins, and a subgraph's nodes are never looked up as operators a second time.
    confirmed = bankrules.confirmed(ans_model)
    named = bankrules.confirmed_job_type(confirmed or {})
    if job_type is None:
        job_type = named or str(DEFAULT_JOB_TYPE)
        if named is None:
            notes.append(
                f"the bank does not say which job type tuned this model: its tasks are formed "
                f"as a {job_type} job forms them (the default of aoe tune)"
            )
    elif job_type not in bankrules.CONFIRMED_JOB_TYPES:
        raise OptionError(
            f"job type {job_type!r}: a model's tasks are formed as one of "
            f"{', '.join(bankrules.CONFIRMED_JOB_TYPES)} forms them; name one of those"
        )
    tasks = tunable_tasks(model, ctx, registry, precision, job_type)
    outcomes: list[TaskOutcome] = []
    choices: dict[str, str] = {}
    for t in tasks:
        key = bankrules.key_for(t.signature, device, precision)
        base = TaskOutcome(t.id, t.anchor, t.op_type, t.instances, "miss", key=key.decode())
        ans = _outcome(bank, key, base, device, vocabulary)
        if ans.kind == "hit" and t.signature.digest in reverted:
            base.status, base.strategy = "reverted", DEFAULT
            base.reason = "reverted in this model's context by the tuning run's verification"
        elif ans.kind == "hit":
            try:
                task_rewrites(model, ctx, consts, t, base.strategy, registry, ranges)
                choices[t.id] = base.strategy
            except (KeyError, AoedError) as exc:
                base.status, base.reason = "ignored", f"bank entry not applied: {exc}".strip()
                base.strategy = DEFAULT
        outcomes.append(base)
    asm = Assembly(choices, options, outcomes, session, notes, job_type=job_type)
    key_now = bankrules.choices_digest(tasks, choices, options)
    if confirmed is not None and confirmed.get("choices") == key_now and named in (None, job_type):
        job = confirmed.get("job", "the tuning run")
        if confirmed.get("shipped") == "input":
            asm.ship_input = True
            asm.notes.append(
                f"the confirming A/B of {job} found these choices no faster than the input "
                f"({confirmed.get('verdict')}): the input model is kept"
            )
        elif confirmed.get("shipped") == "options only" and choices:
            asm.choices = {}
            asm.notes.append(
                f"the confirming A/B of {job} shipped these session options alone: the "
                "tasks' entries are not applied"
            )
        if confirmed.get("runtime") == "openvino" and confirmed.get("shipped") == "tuned":
            asm.runtime = bankrules.runtime_of(ans_model)
            asm.notes.append(
                f"the confirming A/B of {job} shipped OpenVINO's "
                f"{asm.runtime.variant if asm.runtime else 'unreadable'} build of the model"
            )
        if options and not confirmed.get("options_kept"):
            asm.session_options = {}
            asm.notes.append(
                f"session options {options} left out: the confirming A/B of {job} did not keep them"
            )
    return asm, tasks
