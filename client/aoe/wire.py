"""The API's edge of the job shapes: `JobSpec` <-> `aoe.v1.JobOptions` and `JobOutcome`
<-> `aoe.v1.JobResult`, each written once, as a pair, for the gRPC client and the
daemon's servicers alike.

Proto3 has no "unset" for scalars: 0 (or "") reads as unset where the spec's field is
optional (budget_s, min_cosine, max_rel_error, device, calibration_dir; runtime: auto),
as the API documents. An enum number this side does not know is refused, naming the field (proto3
keeps unknown numbers, which a lookup with a default would quietly map).

Where the wire and the domain name a field differently, this module is the one place
that converts; the proto names stay as they are (renaming a field breaks no number, but
every client's generated code and JSON form), the domain names are the ones the code uses:

    JobResult (proto)                   JobOutcome (aoe.outcome, aoe.figures)
    tuned_ms                            figures.result_ms (derived; never read back)
    improvement_ci95_low / _high        figures.ci95
    confirm_rounds                      figures.rounds
    repo_summary (RepoSummary)          bank (AOE's repo_summary counts, by their names)
    model_path / tuned_model_path       model / tuned_model
    result_json_path                    result_json
    verification                        verified
    details (oneof onnx | gdat)         details (OnnxDetails | GdatDetails); the deprecated
                                        details_json is written too, and read from a
                                        daemon that sends no `details`
    runtime_options_json                runtime_options
    TaskResult.node_names[0]            TaskOutcome.op_name
    TaskResult.not_applied              not TaskOutcome.applied

`JobOptions.parallel` has no field in a spec: the daemon's own compile workers
(`[tuning] parallel`) serve every job. It is still bounded as the setting is (0-32), so
that no count a request carries is taken unchecked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import msgspec
from google.protobuf import json_format

from aoe.bank import LayerStats
from aoe.config import MAX_PARALLEL  # JobOptions.parallel: as many as `[tuning] parallel`
from aoe.errors import OptionError
from aoe.figures import Comparison, Figures, Shipped
from aoe.keys import PRECISION_CODES
from aoe.outcome import (
    BudgetReport,
    Details,
    JobOutcome,
    OnnxDetails,
    StageTime,
    TaskOutcome,
    UpdateMode,
    details_from_dict,
    details_to_dict,
)
from aoe.shapes import ShapeError, ShapeProfile
from aoe.spec import JobSpec, JobType, Precision, Runtime, SpecError, Stage
from aoe.v1 import bank_pb2, tuning_pb2

__all__ = [
    "figures_from_pb",
    "layer_stats_from_pb",
    "layer_stats_to_pb",
    "outcome_from_pb",
    "outcome_to_pb",
    "spec_from_pb",
    "spec_to_pb",
]

#: A job's precisions and their codes: the bank's table (aoe.keys) but for the gradient
#: precision `lowrank`, which no JobOptions or JobResult carries.
_PRECISION = {p: PRECISION_CODES[p] for p in Precision}
_JOB_TYPE = {
    JobType.OPAT: tuning_pb2.JOB_TYPE_OPAT,
    JobType.SGAT: tuning_pb2.JOB_TYPE_SGAT,
    JobType.SGAT_OPAT: tuning_pb2.JOB_TYPE_SGAT_OPAT,
    JobType.GDAT: tuning_pb2.JOB_TYPE_GDAT,
}


def _member_of(table: Mapping[Any, int], code: int, field: str, enum: Any, unset: Any) -> Any:
    """The key of `table` whose number is `code` (`unset` for 0); OptionError naming
    `field` for a number this side does not define."""
    if code == 0:
        return unset
    for key, number in table.items():
        if number == code:
            return key
    names = ", ".join(f"{v.name}={v.number}" for v in enum.DESCRIPTOR.values if v.number)
    raise OptionError(f"{field} {code}: not a known value (known: {names})")


# --------------------------------------------------------------------------- JobSpec


def spec_to_pb(spec: JobSpec) -> tuning_pb2.JobOptions:
    """The JobOptions message of `spec`."""
    return tuning_pb2.JobOptions(
        job_type=_JOB_TYPE[spec.job_type],
        precision=_PRECISION[spec.precision],
        input_shapes=[tuning_pb2.InputShape(name=k, dims=v) for k, v in spec.input_shapes.items()]
        + [tuning_pb2.InputShape(name=k, profile=v) for k, v in spec.shape_profile.dims.items()],
        dynamic_dims=spec.shape_profile.gears,
        repeat_tune=spec.repeat_tune,
        device=spec.device or "",
        accuracy_budget=tuning_pb2.AccuracyBudget(
            min_cosine=spec.min_cosine or 0.0, max_rel_error=spec.max_rel_error or 0.0
        ),
        calibration_dir=str(spec.calibration_dir or ""),
        labels=dict(spec.labels),
        priority=spec.priority,
        budget_s=spec.budget_s or 0.0,
        keep_initializer_inputs=spec.keep_initializer_inputs,
        runtime=str(spec.runtime),
        gdat=tuning_pb2.GdatOptions(
            world_size=spec.world_size or 0,
            backend=spec.backend or "",
            gradient_precision=spec.gradient_precision or "",
            entry=spec.entry or "",
        )
        if spec.job_type == JobType.GDAT
        else None,
    )


def spec_from_pb(o: tuning_pb2.JobOptions) -> JobSpec:
    """The spec a JobOptions message asks for, checked (JobSpec): SpecError, an
    OptionError, naming the field as the message spells it."""
    if o.parallel > MAX_PARALLEL:
        raise SpecError(
            "parallel",
            f"{o.parallel}: at most {MAX_PARALLEL} compile processes (0: the daemon's own "
            "[tuning] parallel, which serves every job)",
        )
    try:
        profile = ShapeProfile(
            {s.name: s.profile for s in o.input_shapes if s.profile}, o.dynamic_dims
        )
    except ShapeError as exc:
        raise SpecError(exc.field, exc.detail) from None
    return JobSpec(
        precision=_member_of(
            _PRECISION, o.precision, "precision", bank_pb2.Precision, Precision.EXACT
        ),
        job_type=_member_of(
            _JOB_TYPE, o.job_type, "job_type", tuning_pb2.JobType, JobType.SGAT_OPAT
        ),
        input_shapes={s.name: tuple(s.dims) for s in o.input_shapes if not s.profile},
        shape_profile=profile,
        repeat_tune=o.repeat_tune,
        device=o.device or None,
        budget_s=o.budget_s or None,
        min_cosine=o.accuracy_budget.min_cosine or None,
        max_rel_error=o.accuracy_budget.max_rel_error or None,
        calibration_dir=Path(o.calibration_dir) if o.calibration_dir else None,
        priority=o.priority,
        labels=dict(o.labels),
        keep_initializer_inputs=o.keep_initializer_inputs,
        # a name JobSpec checks (SpecError naming runtime), as it checks every field
        runtime=cast(Runtime, o.runtime or Runtime.AUTO),
        world_size=o.gdat.world_size or None,
        backend=o.gdat.backend or None,
        gradient_precision=o.gdat.gradient_precision or None,
        entry=o.gdat.entry or None,
    )


# --------------------------------------------------------------------------- JobOutcome


def figures_from_pb(r: tuning_pb2.JobResult) -> Figures:
    """The figures of a JobResult message (by the rule of aoe.figures)."""
    decided = None
    if r.HasField("decided_by"):
        c = r.decided_by
        decided = Comparison(
            c.subject, c.against, c.improvement, (c.improvement_ci95_low, c.improvement_ci95_high)
        )
    shipped = r.shipped
    imp, ci = (
        (0.0, (0.0, 0.0))
        if shipped == "input"
        else (r.improvement, (r.improvement_ci95_low, r.improvement_ci95_high))
    )
    return Figures(
        r.verdict,
        Shipped(shipped),
        r.baseline_ms,
        imp,
        ci,
        r.confirm_rounds,
        r.confirmed_by,
        decided,
    )


def _budget_pb(b: BudgetReport) -> tuning_pb2.JobBudget:
    msg = tuning_pb2.JobBudget(
        budget_s=b.budget_s,
        given=b.given,
        spent_s=b.spent_s,
        search_s=b.search_s,
        session_s=b.session_s,
        verify_s=b.verify_s,
        profile_s=b.profile_s,
        confirm_s=b.confirm_s,
        elapsed_s=b.elapsed_s,
        over_s=b.over_s,
        stages=[
            tuning_pb2.StageBudget(
                stage=str(name),
                given_s=st.given_s,
                spent_s=st.spent_s,
                over_s=st.over_s,
                counted=st.counted,
                device_s=st.device_s,
                estimate_s=st.estimate_s,
            )
            for name, st in b.stages.items()
        ],
    )
    if b.load_s_per_mib is not None:
        msg.load_s_per_mib = b.load_s_per_mib
    return msg


def _budget_from_pb(m: tuning_pb2.JobBudget) -> BudgetReport:
    def opt(msg: Any, name: str) -> float | None:
        return getattr(msg, name) if msg.HasField(name) else None

    return BudgetReport(
        m.budget_s,
        m.given,
        m.spent_s,
        m.search_s,
        m.session_s,
        m.verify_s,
        m.profile_s,
        m.confirm_s,
        opt(m, "load_s_per_mib"),
        m.elapsed_s,
        m.over_s,
        {
            Stage(s.stage): StageTime(
                s.given_s, s.spent_s, s.over_s, s.counted, opt(s, "device_s"), opt(s, "estimate_s")
            )
            for s in m.stages
        },
    )


_ACCURACY = ("max_abs_error", "max_rel_error", "cosine")


def outcome_to_pb(o: JobOutcome) -> tuning_pb2.JobResult:
    """The JobResult message of `o`."""
    f, c = o.figures, o.figures.decided_by
    details = details_to_dict(o.details)
    return tuning_pb2.JobResult(
        baseline_ms=f.baseline_ms,
        tuned_ms=f.result_ms,
        improvement=f.improvement,
        tuned_model_path=o.tuned_model,
        result_json_path=o.result_json,
        repo_summary=tuning_pb2.RepoSummary(
            **{
                k: int(v)
                for k, v in o.bank.items()
                if k in tuning_pb2.RepoSummary.DESCRIPTOR.fields_by_name
            }
        ),
        verdict=f.verdict,
        shipped=str(f.shipped),
        improvement_ci95_low=f.ci95[0],
        improvement_ci95_high=f.ci95[1],
        trials=int(o.resources.get("trials", 0)),
        device_s=float(o.resources.get("device_s", 0.0)),
        tuning_time_s=o.tuning_time_s,
        confirm_rounds=f.rounds,
        confirmed_by=f.confirmed_by,
        decided_by=tuning_pb2.Comparison(
            subject=c.subject,
            against=c.against,
            improvement=c.improvement,
            improvement_ci95_low=c.ci95[0],
            improvement_ci95_high=c.ci95[1],
        )
        if c is not None
        else None,
        tasks=[
            tuning_pb2.TaskResult(
                task_id=t.task_id,
                op_type=t.op_type,
                node_names=[t.op_name],
                before_us=t.before_us,
                after_us=t.after_us,
                improvement=t.improvement,
                update_mode=str(t.update_mode),
                bank_layer=t.bank_layer,
                error=t.error,
                strategy=bank_pb2.Strategy(name=t.strategy) if t.chosen else None,
                accuracy=bank_pb2.Accuracy(**{k: t.accuracy.get(k, 0.0) for k in _ACCURACY})
                if t.accuracy
                else None,
                family=t.family,
                instances=t.instances,
                share=t.share,
                not_applied=not t.applied,
                rejected=list(t.rejected),
                attempt=t.attempt,
            )
            for t in o.tasks
        ],
        precision=_PRECISION[o.precision],
        job_type=_JOB_TYPE[o.job_type],
        device=o.device,
        notes=list(o.notes),
        calibration=o.calibration,
        verification=o.verified,
        resources={k: float(v) for k, v in o.resources.items() if isinstance(v, int | float)},
        accuracy={k: float(v) for k, v in o.accuracy.items() if isinstance(v, int | float)},
        accuracy_budget={
            k: float(v) for k, v in o.accuracy_budget.items() if isinstance(v, int | float)
        },
        session_options_json=json.dumps(dict(o.session_options), sort_keys=True)
        if o.session_options
        else "",
        budget=_budget_pb(o.budget),
        model_path=o.model,
        details_json=json.dumps(details, sort_keys=True) if details else "",
        **_details_pb(o.details),
        runtime=o.runtime,
        runtime_options_json=json.dumps(dict(o.runtime_options), sort_keys=True)
        if o.runtime_options
        else "",
    )


#: GdatDetails' fields that hold a JSON object (a Struct), and those that hold a list of them
_GDAT_OBJECTS = ("ddp_config", "confirmation", "layout")
_GDAT_LISTS = ("configurations", "gates", "broken_turns")


def _details_pb(d: Details) -> dict[str, Any]:
    """JobResult's `details` oneof for `d`, as keyword arguments."""
    if isinstance(d, OnnxDetails):
        return {"onnx": tuning_pb2.OnnxDetails()}
    pb = tuning_pb2.GdatDetails(
        gradient_precision=d.gradient_precision,
        backend=d.backend,
        world_size=d.world_size,
        baseline_tail_ms=d.baseline_tail_ms,
        result_tail_ms=d.result_tail_ms,
        ddp_config_file=d.ddp_config_file,
        update_mode=d.update_mode,
        bank_layer=d.bank_layer,
    )
    for name in _GDAT_OBJECTS:
        getattr(pb, name).update(msgspec.to_builtins(getattr(d, name)))
    for name in _GDAT_LISTS:
        for item in getattr(d, name):
            getattr(pb, name).add().update(msgspec.to_builtins(item))
    return {"gdat": pb}


def _json_of(value: Any) -> Any:
    """A Struct's value as JSON types, its integral numbers as integers (a Struct holds
    every number as a double)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _json_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_of(v) for v in value]
    return value


def _details_from_pb(r: tuning_pb2.JobResult, job_type: JobType) -> Details:
    """JobResult's details: the typed oneof, else (a daemon from before it) the JSON."""
    which = r.WhichOneof("details")
    if which is None:
        return details_from_dict(job_type, json.loads(r.details_json or "{}"))
    if which == "onnx":
        return details_from_dict(job_type, {})
    g = r.gdat
    doc: dict[str, Any] = {
        "gradient_precision": g.gradient_precision,
        "backend": g.backend,
        "world_size": g.world_size,
        "baseline_tail_ms": g.baseline_tail_ms,
        "result_tail_ms": g.result_tail_ms,
        "ddp_config_file": g.ddp_config_file,
        "update_mode": g.update_mode,
        "bank_layer": g.bank_layer,
    }
    for name in _GDAT_OBJECTS:
        doc[name] = _json_of(json_format.MessageToDict(getattr(g, name)))
    for name in _GDAT_LISTS:
        doc[name] = [_json_of(json_format.MessageToDict(s)) for s in getattr(g, name)]
    return details_from_dict(job_type, doc)


def _older_resources(r: tuning_pb2.JobResult) -> dict[str, float]:
    """What a result from a daemon without the resources map says of them."""
    return {"trials": float(r.trials), "device_s": r.device_s} if r.trials or r.device_s else {}


def outcome_from_pb(r: tuning_pb2.JobResult, job_id: str = "") -> JobOutcome:
    """The outcome a JobResult message describes (`job_id`: the Job's, which the result
    itself does not repeat). A result from an older daemon reads with defaults where it
    has no field."""
    tasks = tuple(
        TaskOutcome(
            t.task_id,
            t.node_names[0] if t.node_names else t.task_id,
            t.op_type,
            t.family,
            t.instances or 1,
            t.share,
            t.strategy.name or "default",
            t.before_us,
            t.after_us,
            UpdateMode(t.update_mode),
            t.bank_layer,
            {k: getattr(t.accuracy, k) for k in _ACCURACY} if t.HasField("accuracy") else {},
            t.error,
            tuple(t.rejected),
            not t.not_applied,
            t.attempt,
        )
        for t in r.tasks
    )
    job_type = _member_of(_JOB_TYPE, r.job_type, "job_type", tuning_pb2.JobType, JobType.SGAT_OPAT)
    return JobOutcome(
        job_id=job_id,
        model=r.model_path,
        tuned_model=r.tuned_model_path,
        result_json=r.result_json_path,
        precision=_member_of(
            _PRECISION, r.precision, "precision", bank_pb2.Precision, Precision.EXACT
        ),
        job_type=job_type,
        device=r.device,
        tuning_time_s=r.tuning_time_s,
        figures=figures_from_pb(r),
        tasks=tasks,
        bank={fd.name: getattr(r.repo_summary, fd.name) for fd in r.repo_summary.DESCRIPTOR.fields},
        resources=dict(r.resources) or _older_resources(r),
        budget=_budget_from_pb(r.budget),
        session_options=json.loads(r.session_options_json or "{}"),
        accuracy=dict(r.accuracy),
        accuracy_budget=dict(r.accuracy_budget),
        calibration=r.calibration,
        verified=r.verification,
        runtime=r.runtime or "onnxruntime",
        runtime_options=json.loads(r.runtime_options_json or "{}"),
        notes=tuple(r.notes),
        details=_details_from_pb(r, job_type),
    )


def layer_stats_to_pb(s: LayerStats) -> bank_pb2.BankLayerStats:
    """One bank layer's counts and sizes (aoe.bank.LayerStats) as GetBankStats sends them."""
    return bank_pb2.BankLayerStats(
        name=s.name,
        path=s.path,
        entries=s.entries,
        defaults=s.defaults,
        history_trials=s.history,
        map_size_bytes=s.map_size,
        used_bytes=s.used_bytes,
        schema_version=s.schema_version,
    )


def layer_stats_from_pb(m: bank_pb2.BankLayerStats) -> LayerStats:
    """`layer_stats_to_pb` read back: what `aoe bank stats` prints, through a daemon as
    locally."""
    return LayerStats(
        m.name,
        m.path,
        m.entries,
        m.defaults,
        m.history_trials,
        m.map_size_bytes,
        m.used_bytes,
        m.schema_version,
    )
