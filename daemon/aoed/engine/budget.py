"""The job's device budget: seconds for search, session options and verification together.

`--budget S` bounds the device time a job spends deciding: per-task search, the
model-wide session options and end-to-end verification (accuracy and never-slower
rounds). Profiling the model and the confirming A/B that measures the outcome are listed
apart, with their cost reported. Each measurement keeps to the seconds it is given
within a round (backends/ort/measure.py), and a stage starts only while budget is left,
so a small budget gives a smaller search, not an overrun. Without `--budget`, the
budget is derived from the profiled latencies: enough for the planned rounds of every
task, the session options and verification, within [`MIN_S`, `MAX_S`].

Spending order: tasks get `SEARCH_SHARE` of the budget: `TASK_FLOOR_S` each for as many
as fit (most expensive first; the rest are left untuned, and the report says so), and
what remains split by their share of the model's latency; what the search leaves is
split between session options (`SESSION_SHARE` of what remains) and verification.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aoe.errors import OptionError
from aoed.engine.ledger import JobLedger

__all__ = ["COUNTED", "MAX_GIVEN_S", "Budget", "check_budget", "default_budget"]

#: Ledger categories the budget counts; "profile" and "confirm" are listed apart.
COUNTED = ("search", "session", "verify")
SEARCH_SHARE = 0.6
SESSION_SHARE = 0.4
TASK_FLOOR_S = 0.3
TASK_CEILING_S = 10.0
MIN_S = 5.0
MAX_S = 300.0
#: The largest budget a user may give: a week. Past it the per-task split overflows a
#: float (1e308 s is finite, yet its shares are not).
MAX_GIVEN_S = 7 * 86400.0
# What one candidate's measurement costs by default: about 8 rounds of 5 samples of at
# least 2 ms each, plus the settle, warm-up and session creation around them.
_ROUND_SAMPLES = 8 * 5
_SAMPLE_MIN_S = 0.002
_CANDIDATE_OVERHEAD_S = 0.06


def check_budget(seconds: object, where: str = "budget_s") -> float | None:
    """`seconds` as a budget (None stays None: fitted to the model). OptionError naming
    `where` for anything but a finite number of seconds in (0, MAX_GIVEN_S]."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise OptionError(f"{where} {seconds!r}: expected a number of seconds")
    if not math.isfinite(seconds):
        raise OptionError(f"{where} {seconds}: must be a finite number of seconds")
    if not 0 < seconds <= MAX_GIVEN_S:
        raise OptionError(f"{where} {seconds:g}: must be a positive number of seconds, at most {MAX_GIVEN_S:g} (a week)")
    return float(seconds)


def default_budget(task_us: Mapping[str, float], candidates: Mapping[str, int], model_us: float) -> float:
    """A budget that fits the model: per task, its candidates' planned rounds at its
    profiled latency; then four session dimensions of about three candidates and two
    verification rounds of a few candidates, at the model's latency."""

    def cost(n: int, us: float) -> float:
        return n * (_ROUND_SAMPLES * max(_SAMPLE_MIN_S, us * 1e-6) + _CANDIDATE_OVERHEAD_S)

    search = sum(cost(candidates.get(t, 5), us) for t, us in task_us.items())
    rest = 4 * cost(3, model_us) + 2 * cost(4, model_us)  # session options, verification
    # Search gets its share of the total, the rest what search leaves; a fifth more covers
    # the time around each measurement (loading sessions) that no plan controls.
    need = max(search / SEARCH_SHARE, search + rest) * 1.2
    return min(MAX_S, max(MIN_S, need))


@dataclass
class Budget:
    total_s: float
    ledger: JobLedger
    given: bool  # set by the user (--budget) rather than derived

    @property
    def spent_s(self) -> float:
        return sum(self.ledger.device_by.get(c, 0.0) for c in COUNTED)

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.total_s - self.spent_s)

    def for_tasks(self, shares: Mapping[str, float], order: Sequence[str]) -> dict[str, float]:
        """Seconds per task (in `order`, most expensive first): every task that fits gets
        `TASK_FLOOR_S`, and what remains is split by share of the model's latency; the
        tasks that do not fit (the cheapest) get none."""
        pool = self.remaining_s * SEARCH_SHARE
        fit = list(order[: max(1, int(pool // TASK_FLOOR_S))])
        extra = max(0.0, pool - TASK_FLOOR_S * len(fit))
        total = sum(shares.get(t, 0.0) for t in fit) or 1.0
        return {t: min(TASK_CEILING_S, TASK_FLOOR_S + extra * shares.get(t, 0.0) / total) for t in fit}

    def for_session(self) -> float:
        return self.remaining_s * SESSION_SHARE

    def for_verify(self) -> float:
        return self.remaining_s

    def report(self) -> dict[str, float | bool]:
        by = self.ledger.device_by
        return {
            "budget_s": round(self.total_s, 3),
            "given": self.given,
            "spent_s": round(self.spent_s, 3),
            "search_s": round(by.get("search", 0.0), 3),
            "session_s": round(by.get("session", 0.0), 3),
            "verify_s": round(by.get("verify", 0.0), 3),
            "profile_s": round(by.get("profile", 0.0), 3),
            "confirm_s": round(by.get("confirm", 0.0), 3),
        }
