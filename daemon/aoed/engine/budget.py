"""The job's device budget: seconds for search, session options, verification and the
runtime comparison together.

`--budget S` bounds the device time a job spends deciding: per-task search, the
model-wide session options, end-to-end verification (accuracy and never-slower rounds)
and the comparison with another runtime's builds of the model. Profiling the model and the confirming A/B that measures the outcome are listed
apart, with their cost reported. Each measurement keeps to the seconds it is given
within a round (backends/ort/measure.py), and a stage starts only while budget is left,
so a small budget gives a smaller search, not an overrun. Without `--budget`, the
budget is derived from the profiled latencies: enough for the planned rounds of every
task, the session options, verification and the runtime comparison, within [`MIN_S`,
`MAX_S`].

Spending order: tasks get `SEARCH_SHARE` of the budget: `TASK_FLOOR_S` each for as many
as fit (most expensive first; the rest are left untuned, and the report says so), and
what remains split by their share of the model's latency; what the search leaves is
split between session options (`SESSION_SHARE` of what remains) and verification, and
what verification leaves pays for the comparison with another runtime's builds
(runtimestage.py), which is not started when too little is left. Where another runtime
is there to compete, the comparison's own seconds are kept for it from the start
(`reserved_s`: its rounds and its sessions' loading), so the search cannot spend them:
a fitted budget adds them; a given one keeps them only while they are at most
`RUNTIME_MAX_SHARE` of it (on less, the comparison takes what verification leaves).

Loading: a measurement first makes a session of every candidate, and on a big model that
takes longer than the rounds (a session of a 192 MiB model: about a second). The profile
measures how long a session of the whole model took to load; from then on a counted
measurement is given its seconds less the estimated loading of its candidates
(`load_estimate`: their files' MiB at the profile's rate), and one whose loading alone
does not fit is not started. So a small budget bounds the search on a big model too.

What the budget does not cover (preparing the model, profiling, extracting and
assembling models, the confirming A/B, writing the outputs) is timed by stage, and the
result's `budget` section lists every stage with what it was given and what it took
(`report`). Stages whose cost grows with the model and that the budget does not bound
are estimated before they start (`JobLedger.estimates`).

What `report` calls given and over (docs/tuning.md, "The budget"):
- A counted stage's `given_s` is the device seconds it kept of the budget: a stage that
  ends under its share passes the rest on to the stages after it, so the given seconds
  of the stages never add up to more than the budget. Its `over_s` is the device seconds
  it spent beyond that.
- A stage the budget does not cover is given nothing and is never over: its time is
  outside the budget, reported (and estimated), not an overrun.
- The job is over its budget only by the device seconds the budget counts beyond it
  (`over_s`); its wall time outside the budget is the uncounted stages' (`outside_s` of
  aoe.outcome.BudgetReport).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aoe.outcome import BudgetReport, StageTime
from aoe.spec import Stage
from aoed.engine.ledger import JobLedger

__all__ = [
    "COUNTED",
    "MIN_MEASURE_S",
    "PREPARE_S_PER_MIB",
    "RUNTIME_MAX_SHARE",
    "Budget",
    "default_budget",
    "loading_s",
    "measure_estimate",
    "model_mib",
]

#: Ledger categories the budget counts (the runtime comparison: runtimestage.py);
#: "profile" and "confirm" are listed apart.
COUNTED = ("search", "session", "verify", "runtime")
SEARCH_SHARE = 0.6
SESSION_SHARE = 0.4
TASK_FLOOR_S = 0.3
#: Seconds to prepare (read, check, normalize and save) one MiB of model, before the job
#: has measured anything of its own: `aoe tune` on a 2-core machine took 2.4 s for a 48
#: MiB MLP and 10.4 s for a 192 MiB one. Only an estimate made before the stage starts.
PREPARE_S_PER_MIB = 0.05
#: A counted measurement left less than this for its rounds, once its loading is
#: estimated, is not started: a round of a few candidates takes about this long.
MIN_MEASURE_S = 0.05
TASK_CEILING_S = 10.0
#: The most of a given budget kept for the runtime comparison from the start.
RUNTIME_MAX_SHARE = 0.4
MIN_S = 5.0
MAX_S = 300.0
# What one candidate's measurement costs by default: about 8 rounds of 5 samples of at
# least 2 ms each, plus the settle, warm-up and session creation around them.
_ROUND_SAMPLES = 8 * 5
_SAMPLE_MIN_S = 0.002
_CANDIDATE_OVERHEAD_S = 0.06


def default_budget(
    task_us: Mapping[str, float],
    candidates: Mapping[str, int],
    model_us: float,
    runtime_s: float = 0.0,
) -> float:
    """A budget that fits the model: per task, its candidates' planned rounds at its
    profiled latency; then four session dimensions of about three candidates and two
    verification rounds of a few candidates, at the model's latency; and `runtime_s`,
    the comparison with another runtime's builds where one competes."""

    def cost(n: int, us: float) -> float:
        return n * (_ROUND_SAMPLES * max(_SAMPLE_MIN_S, us * 1e-6) + _CANDIDATE_OVERHEAD_S)

    search = sum(cost(candidates.get(t, 5), us) for t, us in task_us.items())
    # session options, verification, the runtime comparison (runtimestage.py)
    rest = 4 * cost(3, model_us) + 3 * cost(4, model_us)
    # Search gets its share of the total, the rest what search leaves; a fifth more covers
    # the time around each measurement (loading sessions) that no plan controls.
    need = max(search / SEARCH_SHARE, search + rest) * 1.2 + runtime_s
    return min(MAX_S, max(MIN_S, need))


#: A measurement as deployed (MeasurePlan.deployed) starts a process per session when the
#: runner has none left from the last one: about 0.2-0.3 s each on a 2-core machine (an
#: interpreter with numpy and onnxruntime), taken here as 0.15 s, half of them reused.
_WORKER_START_S = 0.15


def measure_estimate(
    sessions: int,
    mib: float,
    load_s_per_mib: float,
    latency_us: float,
    rounds: int,
    cap_s: float,
    deployed: bool = False,
) -> float:
    """Seconds a fixed-rounds measurement of `sessions` sessions of a `mib` MiB model
    running in `latency_us` should take: loading them, then warm-up and `rounds` rounds
    of the default plan's turns (settle, one untimed run, 5 samples of at least 2 ms),
    the rounds capped at `cap_s` (the measurement's own budget). `deployed`: a process per
    session, and a longer settle (backends/ort/deployed.py)."""
    run = latency_us * 1e-6
    settle, start = (0.02, _WORKER_START_S) if deployed else (0.005, 0.0)
    turn = settle + run + 5 * max(0.002, run)
    return sessions * (mib * load_s_per_mib + start) + min(cap_s, sessions * (0.02 + rounds * turn))


def model_mib(paths: Iterable[Path]) -> float:
    """MiB of the model files at `paths`, with their external data (`NAME.data`)."""
    total = 0
    for p in paths:
        for f in (p, p.with_name(p.name + ".data")):
            try:
                total += os.stat(f).st_size
            except OSError:
                pass
    return total / (1 << 20)


def loading_s(load_s_per_mib: float | None, models: Iterable[Path]) -> float:
    """Seconds to load a session of each model file in `models` at `load_s_per_mib` (the
    profile's rate; 0 when it is unknown)."""
    return 0.0 if load_s_per_mib is None else load_s_per_mib * model_mib(models)


@dataclass
class Budget:
    total_s: float
    ledger: JobLedger
    given: bool  # set by the user (--budget) rather than derived
    #: seconds a session takes to load per MiB of model on this device, as the profile
    #: measured; None: unknown (no profile), and measurements are not charged for loading
    load_s_per_mib: float | None = None
    #: what each counted stage was given when it started (seconds)
    allotted: dict[str, float] = field(default_factory=dict)
    #: seconds kept for the runtime comparison until it starts (`for_runtime`)
    reserved_s: float = 0.0

    @property
    def spent_s(self) -> float:
        return sum(self.ledger.device_by.get(c, 0.0) for c in COUNTED)

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.total_s - self.spent_s)

    @property
    def open_s(self) -> float:
        """What the stages before the runtime comparison may still spend: the remaining
        seconds less those kept for it."""
        return max(0.0, self.remaining_s - self.reserved_s)

    def reserve_runtime(self, seconds: float) -> float:
        """Keep `seconds` for the runtime comparison (module doc): all of them on a
        fitted budget, none on a given one they would take more than RUNTIME_MAX_SHARE
        of. Returns the seconds kept."""
        if self.given and seconds > RUNTIME_MAX_SHARE * self.total_s:
            seconds = 0.0
        self.reserved_s = max(0.0, seconds)
        return self.reserved_s

    def for_tasks(self, shares: Mapping[str, float], order: Sequence[str]) -> dict[str, float]:
        """Seconds per task (in `order`, most expensive first): every task that fits gets
        `TASK_FLOOR_S`, and what remains is split by share of the model's latency; the
        tasks that do not fit (the cheapest) get none."""
        pool = self.open_s * SEARCH_SHARE
        fit = list(order[: int(pool // TASK_FLOOR_S)])  # none when not even one task's floor fits
        extra = max(0.0, pool - TASK_FLOOR_S * len(fit))
        total = sum(shares.get(t, 0.0) for t in fit) or 1.0
        slices = {
            t: min(TASK_CEILING_S, TASK_FLOOR_S + extra * shares.get(t, 0.0) / total) for t in fit
        }
        self.allotted.setdefault("search", sum(slices.values()))
        return slices

    def for_session(self) -> float:
        seconds = self.open_s * SESSION_SHARE
        self.allotted.setdefault("session", seconds)
        return seconds

    def for_verify(self) -> float:
        self.allotted.setdefault("verify", self.open_s)
        return self.open_s

    def for_runtime(self) -> float:
        """Everything left, the seconds kept for this stage included."""
        self.reserved_s = 0.0
        self.allotted.setdefault("runtime", self.remaining_s)
        return self.remaining_s

    def load_estimate(self, models: Iterable[Path]) -> float:
        """Seconds to load a session of each model file in `models` (0 when the rate is
        unknown)."""
        return loading_s(self.load_s_per_mib, models)

    def measurable(self, seconds: float, models: Iterable[Path]) -> tuple[float, float]:
        """(seconds a measurement of `models` given `seconds` has for its rounds once its
        sessions are loaded, or 0 when fewer than MIN_MEASURE_S would be left; the
        loading estimate)."""
        load = self.load_estimate(models)
        left = seconds - load
        return (left if left >= MIN_MEASURE_S else 0.0), load

    def given_by_stage(self) -> dict[str, float]:
        """Device seconds each counted stage kept of the budget (see the module doc): the
        share it was allotted when it started, less what it passed on unspent to a later
        stage; together never more than the budget."""
        by = self.ledger.device_by
        started = [c for c in COUNTED if c in self.allotted]
        out: dict[str, float] = {}
        for i, name in enumerate(started):
            share = self.allotted[name]
            if i + 1 < len(started):  # a later stage was offered what this one left
                share = min(share, by.get(name, 0.0))
            out[name] = max(0.0, min(share, self.total_s - sum(out.values())))
        return out

    def report(self) -> BudgetReport:
        """The result's `budget` section (aoe.outcome.BudgetReport): the device seconds
        the budget counts (`spent_s`, by category), then every stage in the order run
        with the device seconds it was given (`given_s`; 0 for what the budget does not
        cover), the wall-clock seconds it took, the device seconds spent while it ran and
        beyond what it was given, and the estimate made before it started where there was
        one; `elapsed_s` is the stages' total and `over_s` the device seconds spent beyond
        the budget (BudgetReport derives the wall time outside it from the stages)."""
        by, led = self.ledger.device_by, self.ledger
        given_by = self.given_by_stage()
        stages: dict[Stage, StageTime] = {}
        for name, wall in led.stage_s.items():
            given = given_by.get(name, 0.0)
            counted = name in COUNTED
            stages[Stage(name)] = StageTime(
                given_s=round(given, 3),
                spent_s=round(wall, 3),
                over_s=round(max(0.0, by.get(name, 0.0) - given), 3) if counted else 0.0,
                counted=counted,
                device_s=round(led.stage_device_s[name], 3) if name in led.stage_device_s else None,
                estimate_s=round(led.estimates[name], 3) if name in led.estimates else None,
            )
        elapsed = sum(led.stage_s.values())
        return BudgetReport(
            budget_s=round(self.total_s, 3),
            given=self.given,
            spent_s=round(self.spent_s, 3),
            search_s=round(by.get("search", 0.0), 3),
            session_s=round(by.get("session", 0.0), 3),
            verify_s=round(by.get("verify", 0.0), 3),
            profile_s=round(by.get("profile", 0.0), 3),
            confirm_s=round(by.get("confirm", 0.0), 3),
            load_s_per_mib=None if self.load_s_per_mib is None else round(self.load_s_per_mib, 5),
            elapsed_s=round(elapsed, 3),
            over_s=round(max(0.0, self.spent_s - self.total_s), 3),
            stages=stages,
        )

    def report_doc(self) -> dict[str, Any]:
        """`report` as a GDAT result keeps it (its `budget`, stored and written as is):
        the section without `outside_s`, which BudgetReport derives when it is read."""
        doc = self.report().to_dict()
        del doc["outside_s"]
        return doc
