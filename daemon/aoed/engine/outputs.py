"""The result document: AOE's `aoe_result_opat_{ts}_{pid}.json` fields plus our own, from
the job's `aoe.outcome.JobOutcome` and the details only this document holds
(`ResultDetails`).

    basic{tuning_name, tuning_time(s), job_id, precision, device}
    OPAT{model_baseline_performance(ms), model_result_performance(ms),
         model_performance_improvement, model_performance_verdict,
         model_performance_summary, opat_tuning_result, repo_modified_operators,
         repo_summary{repo_add_num, repo_hit_num, repo_reserved_num,
                      repo_unsatisfied_num, repo_update_num, total_num}}
    confirmation{verdict, shipped, baseline_ms, result_ms, improvement, improvement_ci95,
                 rounds, decided_by, from_bank, device_s, options_kept, notes, proposal}:
                 the A/B the OPAT figures come from
    decision{...}: the verification rounds that chose what was proposed (decision figures)
    budget{budget_s, spent_s, search_s, session_s, verify_s, profile_s, confirm_s,
           load_s_per_mib, elapsed_s, over_s, stages{STAGE: {given_s, spent_s, over_s,
           counted, device_s, estimate_s}}}: the device seconds the budget counts, then
           every stage's wall time against what the budget gave it (budget.py)
    device_info{device, provider, providers, hardware, accelerator, versions, fingerprint}:
           what was measured on (a GPU's model, compute capability, driver; onnxruntime,
           CUDA, cuDNN, TensorRT versions)
    tuned_model, session_options, verification, accuracy, accuracy_budget, calibration,
    resources{device_s, duty_cycle, trials, failed_candidates, compile_s, memory ...,
              attempt, attempts[{attempt, tasks, trials}]}: trials count every run of
              the job (a resumed job's earlier, interrupted ones too); device and compile
              seconds are this run's
    notes, tasks[...] (per task: strategy, update_mode, before/after, candidates, why,
                       attempt: the run that measured it, 0 when the bank answered)

An SGAT job (`aoe_result_sgat_...`) has an SGAT section instead, shaped alike, with
`sgat_tuning_result` and `repo_modified_subgraphs{add_repo_subgraphs,
update_repo_subgraphs}` ({subgraph_name, subgraph_type, task_id}); a sgat+opat job
(`aoe_result_sgat_opat_...`) has both, each counting its own tasks.

The OPAT (SGAT) section's baseline, result and improvement are the confirming A/B's,
measured after every decision on rounds no decision used, by the rule aoe.figures states
(result = baseline / (1 + improvement); the input shipped: result = baseline, 0), and the
summary is the verdict as every other surface words it.

Written atomically (temp file + rename), so a reader never sees half a document.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aoe.errors import AoedError
from aoe.figures import verdict_text
from aoe.outcome import JobOutcome, TaskOutcome, bank_tally
from aoe.spec import JobType
from aoe.subgraphs import SUBGRAPH_FAMILIES
from aoed import safefs

__all__ = ["ResultDetails", "result_json", "write_json"]


def _json_safe(obj: object) -> object:
    """`obj` with non-finite floats as None (JSON has no inf/nan)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


@dataclass(frozen=True)
class ResultDetails:
    """What the result JSON holds beyond the job's outcome: the engine's own record of
    how it decided (each task's candidates, the confirming A/B's and verification's
    documents, the device's facts, every device interval and run)."""

    #: per task id, the candidates measured and their figures
    candidates: Mapping[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: the whole resources section (the outcome keeps its scalars)
    resources: Mapping[str, Any] = field(default_factory=dict)
    #: [seconds into the job, estimated gain in us] after each task decision
    timeline: list[tuple[float, float]] = field(default_factory=list)
    #: the confirming A/B (confirm.py): where the outcome's figures come from
    confirmation: Mapping[str, Any] = field(default_factory=dict)
    #: the verification rounds that chose what was proposed: decision figures
    decision: Mapping[str, Any] = field(default_factory=dict)
    #: what the job measured on: device, provider, hardware, accelerator, versions
    device_info: Mapping[str, Any] = field(default_factory=dict)
    #: a dynamic model's shape profile and the shipped model at each of its points
    #: (empty for a static model)
    shapes: Mapping[str, Any] = field(default_factory=dict)
    #: every runtime's candidate of the whole model (runtimestage.py): name, runtime,
    #: options, median, accuracy, and why it did not win
    runtimes: list[dict[str, Any]] = field(default_factory=list)


def _section(o: JobOutcome, part: JobType, tasks: list[TaskOutcome], whole: bool) -> dict[str, Any]:
    """AOE's section for one job type (OPAT or SGAT) over its `tasks`. The model figures
    are the job's (one model was measured); the repo summary is the bank tally of this
    part's tasks (aoe.outcome: the job's whole tally when the part is the whole job)."""
    if part == JobType.SGAT:

        def name(t: TaskOutcome) -> dict[str, str]:
            return {"subgraph_name": t.op_name, "subgraph_type": t.family, "task_id": t.task_id}

        modified = {
            "add_repo_subgraphs": [name(t) for t in tasks if t.update_mode == "add"],
            "update_repo_subgraphs": [name(t) for t in tasks if t.update_mode == "update"],
        }
    else:
        modified = {
            "add_repo_operators": [
                {"op_name": t.op_name, "op_type": t.op_type}
                for t in tasks
                if t.update_mode == "add"
            ],
            "update_repo_operators": [
                {"op_name": t.op_name, "op_type": t.op_type}
                for t in tasks
                if t.update_mode == "update"
            ],
        }
    f = o.figures
    return {
        "model_baseline_performance(ms)": round(f.baseline_ms, 6),
        "model_result_performance(ms)": round(f.result_ms, 6),
        "model_performance_improvement": round(f.improvement, 4),
        f"{part}_tuning_result": "tuning successful",
        "model_performance_verdict": f.verdict,
        "model_performance_summary": verdict_text(f),
        f"repo_modified_{'subgraphs' if part == JobType.SGAT else 'operators'}": modified,
        "repo_summary": dict(o.bank) if whole else bank_tally(t.update_mode for t in tasks),
    }


def result_json(o: JobOutcome, details: ResultDetails = ResultDetails()) -> dict[str, Any]:
    """The AOE-shaped result document of a finished job: its outcome, and the details
    only this document holds."""
    tasks = []
    for t in o.tasks:
        tasks.append(
            {
                "task_id": t.task_id,
                "op_name": t.op_name,
                "op_type": t.op_type,
                "family": t.family,
                "instances": t.instances,
                "latency_share": round(t.share, 4),
                "strategy": t.strategy,
                "applied": t.applied,
                "performance_before_tune(us)": round(t.before_us, 3),
                "performance_after_tune(us)": round(t.after_us, 3),
                "performance_improvement": round(t.improvement, 4),
                "update_mode": str(t.update_mode),
                "bank_layer": t.bank_layer,
                "attempt": t.attempt,
                "accuracy": dict(t.accuracy),
                "candidates": details.candidates.get(t.task_id, []),
                "error": t.error,
                "rejected": list(t.rejected),
            }
        )
    sections = {}
    for part in o.job_type.parts:  # sgat+opat: an SGAT section, then an OPAT one
        mine = [t for t in o.tasks if (t.family in SUBGRAPH_FAMILIES) == (part == JobType.SGAT)]
        sections[part.upper()] = _section(o, part, mine, whole=part == o.job_type)
    return {
        "basic": {
            "tuning_name": Path(o.model).stem,
            "tuning_time(s)": round(o.tuning_time_s, 3),
            "job_id": o.job_id,
            "precision": str(o.precision),
            "device": o.device,
        },
        **sections,
        "confirmation": dict(details.confirmation),
        "decision": dict(details.decision),
        "budget": o.budget.to_dict(),
        "device_info": dict(details.device_info),
        **({"shape_profile": dict(details.shapes)} if details.shapes else {}),
        "tuned_model": o.tuned_model,
        "runtime": o.runtime,
        "runtime_options": dict(o.runtime_options),
        "runtimes": list(details.runtimes),
        "workspace": o.workspace,
        "session_options": dict(o.session_options),
        "verification": o.verified,
        "accuracy": dict(o.accuracy),
        "accuracy_budget": dict(o.accuracy_budget),
        "calibration": o.calibration,
        "resources": dict(details.resources or o.resources),
        # [seconds into the job, estimated gain in us] after each task decision
        "gain_timeline": list(details.timeline),
        "notes": list(o.notes),
        "tasks": tasks,
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write `doc` at `path` atomically (safefs.write_file: a link at the name is replaced,
    never written through). AoedError naming the file when it cannot."""
    text = json.dumps(_json_safe(doc), indent=2, allow_nan=False) + "\n"
    try:
        with safefs.opened_dir(path.parent.resolve()) as d:
            safefs.write_file(path.name, lambda f: f.write(text.encode()), dir_fd=d)
    except OSError as exc:
        raise AoedError(f"{path}: cannot write the result ({exc.strerror or exc})") from None
