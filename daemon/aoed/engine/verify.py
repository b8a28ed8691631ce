"""End-to-end checks of an assembled model: the accuracy budget, then never slower.

`hold_to_budget` (lossy policies): the assembled model is compared with the input model
on the held-back samples; while it misses the end-to-end budget, the lossy choice with
the least gain per unit of error goes back to its best exact strategy.

`verify`: the tuned model is measured against the input model, interleaved with
variants that each revert one changed task. A task whose reversal is clearly faster
than keeping it (or, while the tuned model is slower than the input, any reversal) is
reverted, the first in task order unless another clearly beats it, and the round
repeats. When nothing is left to revert and the model is still slower, session options
alone and then the input model itself are the fallbacks. Verification spends the job's
budget (budget.py); when that runs out, or the device fails, it proposes what it has,
and the confirming A/B (confirm.py) has the last word: its figures, not these, are what
the job reports, and nothing it measures slower ships.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aoe.errors import AoedError, DeviceError
from aoe.outcome import UpdateMode
from aoed.engine import decisions
from aoed.engine.budget import Budget
from aoed.engine.context import JobContext
from aoed.engine.job import TaskResult
from aoed.engine.messages import Accuracy, Build, Candidate, CompareRequest, Measurement
from aoed.engine.registry import DEFAULT

__all__ = ["REVERTED", "Verified", "hold_to_budget", "step_to", "verify"]

#: How a task result's error starts when verification reverted it in the model's context.
REVERTED = "reverted in context"


@dataclass
class Verified:
    choices: dict[str, str]
    options: dict[str, Any]
    outcome: str  # tuned | options only | reverted to input
    #: which model the outcome ships: the assembled one, the prepared one (options only)
    #: or the input itself
    source: str
    #: the last verification round's figures (None when none was measured): decision
    #: figures, reported as such; the job's result comes from the confirming A/B
    baseline: Measurement | None
    final: Measurement | None
    notes: list[str] = field(default_factory=list)
    variants_measured: int = 0


async def hold_to_budget(
    ctx: JobContext,
    choices: dict[str, str],
    fallback: Mapping[str, str],
    lossy_cost: dict[str, tuple[float, float]],
    results: Mapping[str, TaskResult],
    path: Path,
    fallback_us: Mapping[str, float] | None = None,
    alternates: Mapping[str, Sequence[tuple[str, float, float]]] | None = None,
) -> dict[str, float]:
    """Back lossy choices off (in `choices`, in place) until the model at `path` meets
    the end-to-end budget on the held-back samples; returns its accuracy. A choice backs
    off to the fastest of its `alternates` (strategy, median us, 1 - cosine) more
    accurate than it, then to its exact fallback."""
    families = {t.id: t.family for t in ctx.prep.tasks} if ctx.prep else {}
    tried: dict[str, set[str]] = {}
    while True:
        req = CompareRequest(ctx.run.model, path, ctx.held_back, ctx.device.device)
        try:
            reply: Accuracy = await ctx.device.call(req, ctx.ledger, category="verify")
        except DeviceError as exc:
            # Unchecked accuracy is no accuracy: every lossy choice goes back to exact.
            for tid, name in list(choices.items()):
                if ctx.registry.get(families[tid], name).precision != "exact":
                    results[tid].rejected.append(
                        f"{name}: backed off, the end-to-end accuracy could not be measured ({exc})"
                    )
                    choices[tid] = results[tid].strategy = fallback.get(tid, DEFAULT)
            await ctx.assemble([Build(path, dict(choices))])
            ctx.notes.append(f"accuracy check failed ({exc}); lossy choices backed off")
            return {}
        acc = reply.as_dict()
        ctx.accuracy = reply
        lossy = {
            tid: lossy_cost.get(tid, (0.0, 1.0))
            for tid, name in choices.items()
            if ctx.registry.get(families[tid], name).precision != "exact"
        }
        if ctx.policy.e2e_ok(acc) or not lossy:
            return acc
        victim = decisions.least_gain_per_error(lossy)
        r = results[victim]
        r.rejected.append(
            f"{choices[victim]}: backed off, the model together reached cosine {acc['cosine']:.5f} and "
            f"max rel error {acc['max_rel_error']:.3g}, outside the budget of cosine >= "
            f"{ctx.policy.e2e_min_cosine} and max rel error <= {ctx.policy.e2e_max_rel_error}"
        )
        tried.setdefault(victim, set()).add(choices[victim])
        alts = (alternates or {}).get(victim, ())
        alt = decisions.next_alternate(alts, lossy[victim][1], tried[victim])
        if alt is not None:  # a finer form that still beats the exact one
            choices[victim] = step_to(alt, r, victim, fallback_us or {}, lossy_cost)
            r.rejected[-1] += f"; stepped to {alt[0]}"
        else:
            choices[victim] = r.strategy = fallback.get(victim, DEFAULT)
            if fallback_us and victim in fallback_us:
                r.after_us = fallback_us[victim]
        await ctx.assemble([Build(path, dict(choices))])


def step_to(
    alt: tuple[str, float, float],
    r: TaskResult,
    tid: str,
    fallback_us: Mapping[str, float],
    lossy_cost: dict[str, tuple[float, float]],
) -> str:
    """Task `tid`'s result `r` and lossy cost (in place) as its alternate `alt`
    (strategy, median us, 1 - cosine) stands: its strategy and time, never its bank
    entry (`update_mode` unsatisfied), its gain over the exact fallback. Returns the
    strategy."""
    name, median_us, error = alt
    r.strategy, r.after_us = name, median_us
    r.update_mode = UpdateMode.UNSATISFIED
    lossy_cost[tid] = ((fallback_us.get(tid, median_us) - median_us) * max(1, r.instances), error)
    return name


def _revert_target(fallback: Mapping[str, str], tid: str, current: str) -> str:
    target = fallback.get(tid, DEFAULT)
    return target if target != current else DEFAULT


async def verify(
    ctx: JobContext,
    choices: dict[str, str],
    fallback: Mapping[str, str],
    results: Mapping[str, TaskResult],
    path: Path,
    options: dict[str, Any],
    budget: Budget,
    from_bank: bool = False,
) -> Verified:
    """A/B the tuned model at `path` against the input model; revert what does not pay.

    With `from_bank` (every choice came from the bank) the first round is a plain A/B,
    the one end-to-end check of a bank-hit run; reversals are measured only if it fails.
    `choices` is updated in place as tasks are reverted. Spends at most what `budget`
    has left; with nothing left, or a device that fails, it proposes the model as it is
    (the confirming A/B decides whether it ships)."""
    original = ctx.run.model
    scratch = ctx.workspace.scratch
    assert ctx.prep is not None

    def acceptable(fin: Measurement, base: Measurement) -> bool:
        return (
            fin.ok
            and ctx.policy.e2e_ok(fin.accuracy())
            and not decisions.clearly_slower(fin, base)
            and fin.median_us <= base.median_us * (1.0 + decisions.MIN_GAIN)
        )

    if all(name == DEFAULT for name in choices.values()) and not options:
        # Nothing changed: nothing to verify; the confirming A/B measures the input as shipped.
        return Verified(
            {}, {}, "reverted to input", "input", None, None, ["nothing changed: nothing to verify"]
        )
    explore = not from_bank
    fin = base = None
    variants_measured = 0
    while True:
        changed = [tid for tid, name in choices.items() if name != DEFAULT] if explore else []
        # Each variant is a whole model: as costly to load as the assembled one.
        share = min(3.0 if explore else 1.5, budget.for_verify())
        seconds, load = budget.measurable(share, [original, path, *[path] * len(changed)])
        if seconds < 0.3:
            why = (
                f" (loading its {2 + len(changed)} sessions would take about {load:.2f} s)"
                if share >= 0.3
                else ""
            )
            note = f"verification stopped: the budget is spent{why}; the confirming A/B decides"
            return Verified(
                dict(choices), options, "tuned", "assembled", base, fin, [note], variants_measured
            )
        cands = [Candidate("baseline", original), Candidate("final", path, options)]
        variants: dict[str, dict[str, str]] = {}
        builds = []
        for tid in changed:
            alt = {**choices, tid: _revert_target(fallback, tid, choices[tid])}
            alt_path = scratch / f"verify_without_{tid}.onnx"
            builds.append(Build(alt_path, alt))
            variants[f"without:{tid}"] = alt
            cands.append(Candidate(f"without:{tid}", alt_path, options))
        if builds:
            await ctx.assemble(builds)
        try:
            measured = await ctx.measure(cands, "baseline", seconds, category="verify")
        except DeviceError as exc:
            note = f"verification stopped: {exc}; the confirming A/B decides"
            return Verified(
                dict(choices), options, "tuned", "assembled", base, fin, [note], variants_measured
            )
        variants_measured += len(builds)
        base, fin = measured["baseline"], measured["final"]
        if not base.ok:
            raise AoedError(f"{original}: the input model could not be measured: {base.error}")
        if not explore and not acceptable(fin, base):
            explore = True  # the bank's choices do not hold here: find which
            continue
        better = [
            k
            for k in variants
            if measured[k].ok
            and ctx.policy.e2e_ok(measured[k].accuracy())
            and (decisions.clearly_faster(measured[k], fin) or not acceptable(fin, base))
        ]
        if acceptable(fin, base) and not better:
            return Verified(
                dict(choices), options, "tuned", "assembled", base, fin, [], variants_measured
            )
        if not better:
            break
        # The first reversal in task order, unless another clearly beats it: which one a
        # tie reverts must not depend on the run.
        pick = decisions.preferred(measured, better)
        tid = pick.split(":", 1)[1]
        r = results[tid]
        r.applied = False
        without, with_ = measured[pick].median_us, fin.median_us
        r.error = (
            f"{REVERTED}: the model measured {without:.1f} us without {choices[tid]} and {with_:.1f} us with it"
            + (
                ""
                if without < with_
                else " (the tuned model was slower than the input, and no other reversal clearly helped more)"
            )
        )
        choices.update(variants[pick])
        await ctx.assemble([Build(path, dict(choices))])
    notes = [
        f"verification: the tuned model measured {fin.median_us:.1f} us against the input's {base.median_us:.1f} us "
        f"(max rel error {fin.max_rel_error:.3g}); falling back"
    ]
    alone, _ = budget.measurable(min(3.0, budget.for_verify()), [original, ctx.prep.prepared])
    if options and alone >= 0.3:
        try:
            measured = await ctx.measure(
                [Candidate("baseline", original), Candidate("final", ctx.prep.prepared, options)],
                "baseline",
                alone,
                category="verify",
            )
        except DeviceError as exc:
            notes.append(f"options alone not measured: {exc}")
        else:
            if acceptable(measured["final"], measured["baseline"]):
                return Verified(
                    {},
                    options,
                    "options only",
                    "prepared",
                    measured["baseline"],
                    measured["final"],
                    notes,
                    variants_measured,
                )
            base = measured["baseline"]
    return Verified({}, {}, "reverted to input", "input", base, base, notes, variants_measured)
