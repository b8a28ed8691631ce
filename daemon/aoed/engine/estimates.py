"""What a stage the budget does not bound should take, said before it starts.

Preparing and profiling a model, and the confirming A/B's sessions, cost time that grows
with the model and that no budget bounds. Before such a stage starts its estimate is
logged, sent as a job event and kept in the ledger for the result's budget section
(`JobLedger.estimates`, read by `Budget.report`).
"""

from __future__ import annotations

import logging

from aoed.engine.budget import Budget, measure_estimate, model_mib
from aoed.engine.context import JobContext

__all__ = ["ESTIMATE_FLOOR_S", "estimate", "say_estimate"]

log = logging.getLogger(__name__)

#: Estimates shorter than this are not worth a line: the stages of a small model.
ESTIMATE_FLOOR_S = 0.5


def estimate(
    ctx: JobContext,
    stage: str,
    budget: Budget,
    sessions: int,
    rounds: int,
    cap_s: float,
    what: str,
    deployed: bool = False,
) -> None:
    """Say before `stage` starts what it should take (a stage the budget does not bound,
    whose cost grows with the model): logged, sent as a job event and kept for the
    result's budget section. Nothing without a profiled loading rate."""
    if budget.load_s_per_mib is None or ctx.prep is None:
        return
    mib = model_mib([ctx.prep.prepared])
    est = measure_estimate(
        sessions, mib, budget.load_s_per_mib, ctx.model_us, rounds, cap_s, deployed
    )
    say_estimate(
        ctx,
        stage,
        est,
        f"{what}: about {{:.1f}} s, outside the budget ({sessions} sessions of a {mib:.0f} "
        f"MiB model at {budget.load_s_per_mib * 1000:.1f} ms per MiB to load, {rounds} rounds at "
        f"{ctx.model_us / 1000:.2f} ms per run)",
    )


def say_estimate(ctx: JobContext, stage: str, seconds: float, message: str) -> None:
    """Record `seconds` as `stage`'s estimate and say so (`message` formats it): in the
    job's log and as an event, before the stage starts (from `ESTIMATE_FLOOR_S` up)."""
    if seconds < ESTIMATE_FLOOR_S:
        return
    ctx.ledger.estimates[stage] = seconds
    text = message.format(seconds)
    log.info("%s", text)
    ctx.emit("log", text)
