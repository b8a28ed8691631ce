"""A job's data on the engine: one run of it (`JobRun`: the user's `aoe.spec.JobSpec` and
where it runs), each task's result while the job runs (`TaskResult`, which ends as a row
of the job's `aoe.outcome.JobOutcome`), and the handle that cancels it. The pipeline
that turns a run into an outcome is in `pipeline.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from aoe.outcome import TaskOutcome, UpdateMode
from aoe.spec import JobSpec
from aoed.engine.registry import DEFAULT

__all__ = ["JobHandle", "JobRun", "TaskResult"]


@dataclass(frozen=True)
class JobRun:
    """One run of a job on the engine: the user's `spec`, and what only whoever runs it
    knows (where the model and outputs are, which run of the job this is). Apart from
    the spec so that the spec stays the options a user gave, at every edge the same."""

    model: Path
    output: Path
    spec: JobSpec = field(default_factory=JobSpec)
    #: keep the scratch files (task models, candidates, samples) after success
    keep_workspace: bool = False
    #: empty: the engine assigns a unique one
    job_id: str = ""
    #: the id of an interrupted run of this job: what it decided is not measured again,
    #: even with repeat_tune (the daemon's resume after a restart)
    resumes: str = ""
    #: which run of this job this is (the daemon counts them; 1 otherwise)
    attempt: int = 1
    #: (device, inode) of the model file its submitter's checks passed (the daemon's);
    #: the job reads the model only if it is still that file, with one link
    model_file: tuple[int, int] | None = None
    #: the model as its submitter knows it, for messages (a drop-folder job reads a
    #: claimed copy in the daemon's state dir, a path that means nothing to the user);
    #: empty: `model`
    shown: str = ""

    @property
    def shown_model(self) -> str:
        """What messages call the model: `shown`, else `model`."""
        return self.shown or str(self.model)

    @property
    def weight(self) -> int:
        """Scheduling weight among jobs sharing the engine's agents (fair share): 1, or
        one more than a positive priority."""
        return 1 + max(0, self.spec.priority)


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

    def outcome(self) -> TaskOutcome:
        """The task's row of the job's outcome."""
        return TaskOutcome(
            self.task_id,
            self.op_name,
            self.op_type,
            self.family,
            self.instances,
            self.share,
            self.strategy,
            self.before_us,
            self.after_us,
            UpdateMode(self.update_mode),
            self.bank_layer,
            dict(self.accuracy),
            self.error,
            tuple(self.rejected),
            self.applied,
            self.attempt,
        )

    @property
    def improvement(self) -> float:
        return (
            (self.before_us / self.after_us - 1.0)
            if self.after_us > 0 and self.before_us > 0
            else 0.0
        )


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
