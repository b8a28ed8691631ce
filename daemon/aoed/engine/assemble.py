"""Assemble a tuned model from the bank alone: what `aoe compile` does, with no measurement.

    prepare (as tuning does) -> partition -> for every task: bank lookup on this device
    -> rewrites of the strategies found -> model-wide session options from the bank
    -> the tuned model, with the metadata the tuner writes

A task's entry is applied only when it was measured on this device fingerprint and its
strategy still applies to the task (and to each of its twins); anything else is a miss,
and the report says why. The result equals the tuning run's model when the bank holds
what that run chose.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from aoe._session import METADATA_KEY
from aoe.bank import BankReader
from aoe.errors import AoedError
from aoe.signature import ModelContext, TaskSignature, bank_key, canonical_json, normalized_attributes
from aoed import __version__
from aoed.backends.ort import strategies
from aoed.engine.calibration import activation_ranges, load_samples
from aoed.engine.partition import partition
from aoed.engine.policy import policy
from aoed.engine.prep import Prepared, prepare
from aoed.engine.tasks import Rewrite, Task, TaskView, apply_rewrites, constant_values

__all__ = [
    "Assembly",
    "TaskOutcome",
    "assemble",
    "compile_model",
    "model_signature",
    "task_rewrites",
    "tunable_tasks",
    "tuned_metadata",
]

#: The family of the model-wide session-options entry.
SESSION_FAMILY = "session"


@dataclass
class TaskOutcome:
    task_id: str
    op_name: str
    op_type: str
    instances: int
    status: str  # hit | default | miss | ignored | reverted
    strategy: str = strategies.DEFAULT
    layer: str = ""
    reason: str = ""
    before_us: float = 0.0
    after_us: float = 0.0
    key: str = ""


@dataclass
class Assembly:
    model: onnx.ModelProto
    session_options: dict[str, Any]
    tasks: list[TaskOutcome]
    session: TaskOutcome
    notes: list[str] = field(default_factory=list)

    @property
    def hits(self) -> int:
        """Tasks (and session options) the bank answered, with a strategy or the default."""
        return sum(t.status in ("hit", "default", "reverted") for t in (*self.tasks, self.session))

    @property
    def misses(self) -> int:
        return sum(t.status in ("miss", "ignored") for t in (*self.tasks, self.session))


def model_signature(model: onnx.ModelProto) -> TaskSignature:
    """The signature of model-wide choices (session options): the graph's structure,
    shapes and dtypes. Keyed like a task; its entry's strategy is the options' JSON."""
    ctx = ModelContext(model)
    nodes = []
    for n in model.graph.node:
        domain = n.domain if n.domain != "ai.onnx" else ""
        nodes.append(
            {
                "op": n.op_type,
                "domain": domain,
                "attrs": normalized_attributes(n, ctx.opset(domain)),
                "in": [asdict(ctx.tensors[i]) if i in ctx.tensors else None for i in n.input],
                "out": [asdict(ctx.tensors[o]) if o in ctx.tensors else None for o in n.output],
            }
        )
    text = canonical_json({"v": 1, "model": nodes, "opsets": ctx.opsets})
    return TaskSignature("SessionOptions", "", ctx.opset(""), text, hashlib.sha256(text.encode()).hexdigest())


def tuned_metadata(model: onnx.ModelProto, options: Mapping[str, Any], precision: str, device_digest: str) -> None:
    """Set the metadata a tuned model carries (session options, precision, device,
    version) on `model`, keeping its other metadata."""
    meta = {p.key: p.value for p in model.metadata_props}
    meta.update(
        {
            METADATA_KEY: canonical_json(dict(options)),
            "aoe.precision": precision,
            "aoe.device": device_digest[:32],
            "aoe.version": __version__,
        }
    )
    del model.metadata_props[:]
    helper.set_model_props(model, meta)


def task_rewrites(
    prep: Prepared,
    consts: Mapping[str, np.ndarray],
    task: Task,
    strategy_name: str,
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> dict[tuple[str, ...], Rewrite]:
    """The rewrite of `task` and of each of its twins under one strategy ({} for the
    default); `ranges` are calibrated activation ranges (static quantization needs them).
    Raises KeyError (unknown strategy) or AoedError (it does not apply)."""
    if strategy_name == strategies.DEFAULT:
        return {}
    strat = strategies.get(task.family, strategy_name)
    by_name = {n.name: n for n in prep.model.graph.node}
    out = {}
    for t in (task, *task.twins):
        view = TaskView(
            nodes=[by_name[n] for n in t.node_names],
            consts=consts,
            infos=prep.ctx.tensors,
            opset=prep.ctx.opset(""),
            prefix=f"aoe/{t.id}",
            ranges=ranges or {},
        )
        rw = strat.apply(view)
        if rw is None:
            raise AoedError(f"strategy {strategy_name} does not apply to {t.id}")
        out[t.node_names] = rw
    return out


def _outcome(reader: BankReader, key: bytes, base: TaskOutcome, digest: str) -> tuple[TaskOutcome, Any]:
    entry, layer = reader.lookup(key)
    if entry is not None:
        if entry.device.digest != digest:
            base.status, base.reason = "ignored", f"entry in {layer} was measured on another device"
            return base, None
        base.status, base.layer, base.strategy = "hit", layer, entry.strategy.name
        base.before_us, base.after_us = entry.baseline.median_us, entry.winner.median_us
        return base, entry
    default, layer = reader.lookup_default(key)
    if default is not None:
        base.status, base.layer = "default", layer
        base.before_us = base.after_us = float(default.get("default_us", 0.0))
        return base, None
    base.status, base.reason = "miss", reader.lookup_explain(key).reason
    return base, None


def tunable_tasks(prep: Prepared, precision: str) -> list[Task]:
    """The tasks a job tunes: those with a choice of strategy under `precision`."""
    return [
        t for t in partition(prep.model, prep.ctx)
        if sum(1 for _ in strategies.strategies_for(t.family, precision)) > 1
    ]  # fmt: skip


def assemble(
    prep: Prepared,
    reader: BankReader,
    precision: str = "exact",
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> Assembly:
    """Apply what `reader` knows for this device to the prepared model. Pure: no
    measurement, no writes. `ranges`: calibrated activation ranges (lossy policies)."""
    digest = reader.device.digest
    consts = constant_values(prep.model.graph)

    # The model-level record first: its session options, and the tasks a verification
    # of this model reverted in context (the tuner left them unchanged; so do we).
    sig = model_signature(prep.model)
    key = bank_key(sig.digest, digest, precision)
    session, entry = _outcome(reader, key, TaskOutcome("session", "", "SessionOptions", 1, "miss", key=key.decode()), digest)
    options: dict[str, Any] = {}
    reverted: set[str] = set()
    if entry is not None:
        reverted = {d for d in entry.strategy.params.get("reverted", "").split(",") if d}
        try:
            options = json.loads(entry.strategy.name)
            if not isinstance(options, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            session.status, session.reason, options = "ignored", f"unreadable session options ({exc})", {}
    elif session.status == "default":
        doc, _layer = reader.lookup_default(key)
        reverted = set((doc or {}).get("reverted", []))

    tasks = tunable_tasks(prep, precision)
    outcomes: list[TaskOutcome] = []
    rewrites: dict[tuple[str, ...], Rewrite] = {}
    for t in tasks:
        key = bank_key(t.signature.digest, digest, precision)
        base = TaskOutcome(t.id, t.node_names[0], t.op_type, 1 + len(t.twins), "miss", key=key.decode())
        out, entry = _outcome(reader, key, base, digest)
        if entry is not None and t.signature.digest in reverted:
            out.status, out.strategy = "reverted", strategies.DEFAULT
            out.reason = "reverted in this model's context by the tuning run's verification"
        elif entry is not None:
            try:
                rewrites.update(task_rewrites(prep, consts, t, entry.strategy.name, ranges))
            except (KeyError, AoedError) as exc:
                out.status, out.reason = "ignored", f"bank entry not applied: {exc}"
                out.strategy = strategies.DEFAULT
        outcomes.append(out)
    model = apply_rewrites(prep.model, rewrites)
    return Assembly(model, options, outcomes, session, list(prep.notes))


def compile_model(
    model_path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    reader: BankReader,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    precision: str = "exact",
    keep_initializer_inputs: bool = False,
    calibration: Path | None = None,
) -> Assembly:
    """Prepare `model_path` as tuning does, apply the bank, save the tuned model at
    `output` (with the tuner's metadata); returns the assembly with its per-task report.
    Under a lossy policy the activations are calibrated as tuning does (`calibration`:
    the same sample folder the tuning run used; None: the same synthetic samples).

    Raises ModelError/OptionError from preparation, AoedError when `output` cannot be
    written. Blocking.
    """
    out = Path(output)
    with tempfile.TemporaryDirectory(prefix="aoe-compile-") as work:
        prep = prepare(model_path, work, dict(input_shapes or {}), keep_initializer_inputs)
        ranges = None
        if policy(precision).lossy:
            samples = load_samples(prep.model, prep.inputs, calibration)
            ranges = activation_ranges(prep, samples.calibrate)
        asm = assemble(prep, reader, precision, ranges)
    tuned_metadata(asm.model, asm.session_options, precision, reader.device.digest)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(asm.model, str(out))
    except OSError as exc:
        raise AoedError(f"{out}: cannot write the tuned model ({exc.strerror or exc})") from None
    return asm
