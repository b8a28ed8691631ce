"""A job's state machine: its states, the transitions allowed between them, and `apply`,
which moves a job on by one typed event.

    QUEUED --Start--> PREPARING --Entered(stage)--> TUNING --Entered(stage)--> VERIFYING
      |                  |  (forward only; a stage may skip a state)            |
      +--Cancel/Fail-->  +-- Succeed / Fail / Cancel --> SUCCEEDED | FAILED | CANCELLED
                         +-- Requeue (the daemon stops or restarts) --> QUEUED

A queued job fails without starting when it may no longer start: over a limit of the
configuration it is started under, or interrupted too often (jobs/limits.py).

Invariants: a running job's state only moves forward through PREPARING, TUNING and
VERIFYING, and which of them a stage belongs to is `STAGE_STATE`, by the engine's typed
`Stage`, never by the words of its message; a final state is never left. Anything else
is a bug, and `apply` raises TransitionError rather than record it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from aoe.errors import AoedError
from aoe.spec import Stage

__all__ = [
    "ACTIVE",
    "FINAL",
    "RUNNING",
    "STAGE_STATE",
    "TRANSITIONS",
    "Cancel",
    "Entered",
    "Event",
    "Fail",
    "JobState",
    "Requeue",
    "Start",
    "Succeed",
    "TransitionError",
    "apply",
]


class JobState(enum.StrEnum):
    """The proto's JobState without its prefix, lower case."""

    QUEUED = "queued"
    PREPARING = "preparing"
    TUNING = "tuning"
    VERIFYING = "verifying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


RUNNING = (JobState.PREPARING, JobState.TUNING, JobState.VERIFYING)
ACTIVE = (JobState.QUEUED, *RUNNING)
FINAL = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

#: The state each stage of the engine runs in. Checking lossy accuracy comes before the
#: session options are tuned, so it counts as tuning: the state never moves back.
STAGE_STATE = {
    Stage.PREPARE: JobState.PREPARING,
    Stage.CALIBRATE: JobState.PREPARING,
    Stage.BANK: JobState.PREPARING,
    Stage.PROFILE: JobState.TUNING,
    Stage.SEARCH: JobState.TUNING,
    Stage.ASSEMBLE: JobState.TUNING,
    Stage.ACCURACY: JobState.TUNING,
    Stage.SESSION: JobState.TUNING,
    Stage.VERIFY: JobState.VERIFYING,
    Stage.RUNTIME: JobState.VERIFYING,
    Stage.CONFIRM: JobState.VERIFYING,
    Stage.OUTPUTS: JobState.VERIFYING,
}

_ENDS = frozenset({*FINAL, JobState.QUEUED})
#: Every transition there is.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.PREPARING, JobState.CANCELLED, JobState.FAILED}),
    JobState.PREPARING: frozenset({JobState.TUNING, JobState.VERIFYING, *_ENDS}),
    JobState.TUNING: frozenset({JobState.VERIFYING, *_ENDS}),
    JobState.VERIFYING: _ENDS,
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class TransitionError(AoedError):
    """An event that no transition from the job's state allows: a bug, reported loudly."""


@dataclass(frozen=True)
class Start:
    """The scheduler starts (or resumes) a queued job."""


@dataclass(frozen=True)
class Entered:
    """The engine entered `stage` of the job."""

    stage: Stage


@dataclass(frozen=True)
class Succeed:
    pass


@dataclass(frozen=True)
class Fail:
    pass


@dataclass(frozen=True)
class Cancel:
    pass


@dataclass(frozen=True)
class Requeue:
    """A running job goes back to the queue: the daemon stopped or restarted under it."""


Event = Start | Entered | Succeed | Fail | Cancel | Requeue

_TARGET = {
    Start: JobState.PREPARING,
    Succeed: JobState.SUCCEEDED,
    Fail: JobState.FAILED,
    Cancel: JobState.CANCELLED,
    Requeue: JobState.QUEUED,
}


def apply(state: JobState, event: Event) -> JobState:
    """The state after `event` in `state`. A stage of the state the job is in already
    leaves it there. TransitionError for a transition TRANSITIONS does not have."""
    target = STAGE_STATE[event.stage] if isinstance(event, Entered) else _TARGET[type(event)]
    if isinstance(event, Entered) and target == state:
        return state
    if target not in TRANSITIONS[state]:
        raise TransitionError(f"a job {state} cannot take {event}: no transition to {target}")
    return target
