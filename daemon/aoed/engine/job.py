"""A job's data: what was asked (`JobOptions`), what came out (`JobResult`, `TaskResult`),
and the handle that cancels it. The pipeline that turns one into the other is in
`pipeline.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from aoe.device import CPU, Device
from aoe.figures import Figures
from aoe.jobtypes import DEFAULT_JOB_TYPE
from aoed.engine.registry import DEFAULT

__all__ = ["JobHandle", "JobOptions", "JobResult", "TaskResult"]


@dataclass(frozen=True)
class JobOptions:
    model: Path
    output: Path
    precision: str = "exact"
    job_type: str = DEFAULT_JOB_TYPE
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    repeat_tune: bool = False
    keep_initializer_inputs: bool = False
    device: Device = CPU
    calibration: Path | None = None
    min_cosine: float | None = None  # end-to-end budget of a lossy policy
    max_rel_error: float | None = None
    #: device seconds for search, session options and verification together (budget.py);
    #: None: derived from the model's profiled latency
    budget_s: float | None = None
    #: keep the scratch files (task models, candidates, samples) after success
    keep_workspace: bool = False
    #: empty: the engine assigns a unique one
    job_id: str = ""
    #: the id of an interrupted run of this job: what it decided is not measured again,
    #: even with repeat_tune (the daemon's resume after a restart)
    resumes: str = ""
    #: which run of this job this is (the daemon counts them; 1 otherwise)
    attempt: int = 1
    #: scheduling weight among jobs sharing the engine's agents (fair share); >= 1
    weight: int = 1
    #: (device, inode) of the model file its submitter's checks passed (the daemon's);
    #: the job reads the model only if it is still that file, with one link
    model_file: tuple[int, int] | None = None


@dataclass
class TaskResult:
    task_id: str
    op_name: str
    op_type: str
    instances: int
    family: str = ""  # matmul, conv, ... or a subgraph family (attention, layernorm, gelu)
    share: float = 0.0
    strategy: str = DEFAULT
    before_us: float = 0.0
    after_us: float = 0.0
    update_mode: str = ""  # add | update | reserved | hit | unsatisfied | failed
    bank_layer: str = ""
    accuracy: dict[str, float] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    rejected: list[str] = field(default_factory=list)  # lossy candidates not taken, and why
    applied: bool = True  # False when end-to-end verification reverted the choice
    #: the run of this job that measured the task (an earlier one, for a task an
    #: interrupted run decided); 0 when the bank answered without this job measuring
    attempt: int = 0

    @property
    def improvement(self) -> float:
        return (self.before_us / self.after_us - 1.0) if self.after_us > 0 and self.before_us > 0 else 0.0


@dataclass
class JobResult:
    job_id: str
    model: str
    tuned_model: str
    result_json: str
    workspace: str
    baseline_ms: float
    tuned_ms: float
    tuning_time_s: float
    precision: str
    device: str
    session_options: dict[str, Any]
    tasks: list[TaskResult]
    repo: dict[str, int]
    accuracy: dict[str, float]
    verified: str
    notes: list[str]
    calibration: str = ""
    budget: dict[str, float] = field(default_factory=dict)
    #: what the job cost: device seconds, duty cycle, trials, failed candidates, memory
    resources: dict[str, Any] = field(default_factory=dict)
    timeline: list[tuple[float, float]] = field(default_factory=list)
    #: the confirming A/B (confirm.py): where baseline_ms and tuned_ms come from (`figures`)
    confirmation: dict[str, Any] = field(default_factory=dict)
    #: the verification rounds that chose what was proposed: decision figures
    decision: dict[str, Any] = field(default_factory=dict)
    #: the device budget and what was spent, by stage (budget.py)
    device_budget: dict[str, Any] = field(default_factory=dict)
    #: what the job measured on: device, provider, hardware, accelerator, versions
    device_info: dict[str, Any] = field(default_factory=dict)

    @property
    def figures(self) -> Figures:
        """The whole-model figures, by the rule of aoe.figures (from the confirmation)."""
        return Figures.from_dict(self.confirmation)

    @property
    def improvement(self) -> float:
        """From the confirming A/B's median round ratio (not a ratio of the two medians);
        0 when the input shipped."""
        return self.figures.improvement

    @property
    def duty_cycle(self) -> float:
        return float(self.resources.get("duty_cycle", 0.0))


class JobHandle:
    """Cancels one running job from outside it (an RPC, a signal handler, a test).

    `cancel()` before the job starts cancels it as soon as it does. The job then stops
    where it is: its queued compile and device requests are dropped, the ones in flight
    abandoned (their child processes killed), and `run_job` raises JobCancelledError.
    """

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None
        self.reason = ""
        self.cancelled = False
        self.resumable = False

    def cancel(self, reason: str = "", *, resumable: bool = False) -> None:
        """Cancel the job; `resumable`: it runs again later (a daemon's shutdown), so its
        workspace is left for that run (workspace.py)."""
        self.reason = reason
        self.cancelled = True
        self.resumable = resumable
        if self._scope is not None:
            self._scope.cancel()

    def attach(self, scope: trio.CancelScope) -> None:
        self._scope = scope
        if self.cancelled:
            scope.cancel()
