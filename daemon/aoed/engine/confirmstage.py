"""The confirm stage's work around the confirming A/B (confirm.py): the proposal's files,
and the bank's confirmation when it holds one.

`confirm_proposal` writes the files the A/B measures (the input as it would ship, the
proposal with its session options, and without them), then either runs the A/B
(`confirm.confirm`: its estimate said first, a failed device ships the input), or takes
the figures of the job that confirmed these very choices from the bank, checking its
session options again with one short A/B here, since they won on a machine that may
have been busier. It returns the confirmation, the file that ships and the session
options' rounds (with, without) when a fresh A/B kept them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from aoe.errors import DeviceError
from aoe.figures import Comparison, Figures, interval, pct
from aoed.engine import confirm, stats
from aoed.engine.assemble import tuned_metadata
from aoed.engine.budget import Budget
from aoed.engine.context import JobContext
from aoed.engine.estimates import estimate
from aoed.engine.messages import Build, Candidate, Measurement, MeasurePlan
from aoed.engine.runtimestage import RuntimeChoice
from aoed.engine.verify import Verified

__all__ = ["confirm_proposal"]


def _point_text(p: dict[str, Any]) -> str:
    where = " ".join(f"{n}:{','.join(map(str, d))}" for n, d in p["shapes"].items())
    if "improvement" not in p:
        return f"{where} {p['verdict']}"
    return (
        f"{where} {pct(p['improvement'])} ({interval(tuple(p['improvement_ci95']))}, "
        f"{p['verdict']})"
    )


async def _at_points(
    ctx: JobContext,
    conf: confirm.Confirmation,
    ship: Path,
    proposal: confirm.Proposal,
    seconds: float,
) -> Path:
    """A dynamic model's proposal, confirmed at the searched point, against the input at
    every other point of its profile (confirm.at_points), judged by `hold_at_points`."""
    assert ctx.prep is not None and ctx.prep.profile is not None
    # another runtime's build runs with its compile properties whatever became of
    # onnxruntime's session options
    other = proposal.runtime != "onnxruntime"
    options = proposal.options if conf.options_kept or other else {}
    measured = await confirm.at_points(ctx, ship, options, seconds, proposal.runtime)
    return hold_at_points(conf, ctx.prep.profile.point, measured, ship, proposal.input_copy)


def hold_at_points(
    conf: confirm.Confirmation,
    searched: dict[str, tuple[int, ...]],
    measured: list[dict[str, Any]],
    ship: Path,
    input_copy: Path,
) -> Path:
    """The file to ship once the proposal that `conf` ships at the `searched` point was
    measured at the profile's other points (`measured`, as confirm.at_points gives them):
    `ship`, or `input_copy` when the proposal is slower beyond noise (the whole interval
    above 1) at any point. Fills `conf.points` (the searched point's figures first) and a
    note with every point's figures; when the input ships, its figures (the point that
    kept the proposal out decides) and the proposal's."""
    f = conf.figures
    conf.points = [
        {
            "shapes": {n: list(d) for n, d in searched.items()},
            "verdict": f.verdict,
            "input_ms": f.baseline_ms,
            "result_ms": f.result_ms,
            "improvement": f.improvement,
            "improvement_ci95": list(f.ci95),
            "rounds": f.rounds,
            "searched": True,
        },
        *measured,
    ]
    conf.notes.append(
        "at each point of the shape profile, against the input: "
        + "; ".join(_point_text(p) for p in conf.points)
    )
    lost = [p for p in conf.points if p["verdict"] == "slower"]
    if not lost:
        return ship
    p = lost[0]
    where = " ".join(f"{n}:{','.join(map(str, d))}" for n, d in p["shapes"].items())
    lo, hi = p["improvement_ci95"]
    kind = str(f.shipped)
    conf.proposal = {
        "kind": kind,
        "result_ms": f.result_ms,
        "improvement": f.improvement,
        "improvement_ci95": list(f.ci95),
    }
    conf.figures = Figures.unchanged(
        "slower",
        f.baseline_ms,
        f.rounds,
        Comparison(kind, f"input at {where}", p["improvement"], (lo, hi)),
    )
    conf.options_kept = False
    conf.notes.append(
        f"the {kind} model was faster at the searched shape but slower at {where} "
        f"({pct(p['improvement'])}, 95% interval {interval((lo, hi))}): the input ships"
    )
    return input_copy


async def confirm_proposal(
    ctx: JobContext,
    v: Verified,
    cached: dict[str, Any] | None,
    budget: Budget,
    runtime: RuntimeChoice | None = None,
) -> tuple[confirm.Confirmation, Path, tuple[Measurement, Measurement] | None]:
    """Write the proposal's files, run the confirming A/B (or take the bank's, checking
    session options with one short A/B), and return the confirmation, the file to ship
    and the evidence for the session options (with, without). When another runtime's
    artifact won (`runtime`, runtimestage.py), it is the proposal, confirmed afresh."""
    assert ctx.prep is not None
    scratch = ctx.workspace.scratch
    digest = ctx.fingerprint.digest
    kind = {"tuned": "tuned", "options only": "options only", "reverted to input": "input"}[
        v.outcome
    ]
    source = ctx.run.model if v.source == "input" else ctx.prep.prepared

    def meta(options: dict[str, Any]) -> dict[str, str]:
        return tuned_metadata(options, ctx.spec.precision, digest, ctx.device.device)

    builds = [Build(scratch / "input_copy.onnx", {}, meta({}))]
    if runtime is not None and runtime.other and runtime.model is not None:
        await ctx.assemble(builds, source=ctx.run.model)
        if cached is not None:  # the bank's confirmation of this very build
            figures = dataclasses.replace(
                Figures.from_dict(cached), confirmed_by=str(cached.get("job", ""))
            )
            return confirm.Confirmation(figures), runtime.model, None
        other = confirm.Proposal(
            "tuned",
            runtime.model,
            dict(runtime.options),
            None,
            scratch / "input_copy.onnx",
            runtime=runtime.runtime,
        )
        return await _fresh(ctx, other, budget, sessions=3)
    if kind != "input":
        builds.append(Build(scratch / "proposal.onnx", dict(v.choices), meta(v.options)))
        if v.options:
            builds.append(Build(scratch / "plain.onnx", dict(v.choices), meta({})))
    await ctx.assemble([b for b in builds if b.out.name == "input_copy.onnx"], source=ctx.run.model)
    if kind != "input":
        await ctx.assemble([b for b in builds if b.out.name != "input_copy.onnx"], source=source)
    proposal = confirm.Proposal(
        kind,
        scratch / "proposal.onnx",
        v.options,
        scratch / "plain.onnx" if v.options else None,
        scratch / "input_copy.onnx",
    )
    if cached is None:
        sessions = 2 + (kind != "input") + (kind != "input" and bool(v.options))
        return await _fresh(ctx, proposal, budget, sessions)
    # From the bank: the figures of the job that confirmed these very choices (read by the
    # rule of aoe.figures, whenever they were stored).
    figures = dataclasses.replace(
        Figures.from_dict(cached), confirmed_by=str(cached.get("job", ""))
    )
    conf = confirm.Confirmation(figures, options_kept=bool(cached.get("options_kept")))
    ship = proposal.model if conf.shipped != "input" else proposal.input_copy
    if conf.shipped != "input" and v.options and conf.options_kept:
        assert proposal.plain is not None  # written whenever there are options
        plain = proposal.plain
        # Options won on a machine that may have been busier: one short A/B here.
        try:
            m = await ctx.measure(
                [
                    Candidate("with", proposal.model, v.options),
                    Candidate("without", plain),
                ],
                "without",
                5.0,
                plan=MeasurePlan.fixed(9, 5.0, deployed=True),
                category="confirm",
            )
            verdict, med, ci = confirm.verdict_of(
                stats.paired_ratios(m["with"].rounds_us, m["without"].rounds_us)
            )
            recheck: Comparison | None = Comparison.of_ratio(
                "options only", "without options", med, ci
            )
        except DeviceError as exc:
            verdict, recheck = f"not measured ({exc})", None
        if verdict != "faster":
            conf.options_kept = False
            conf.notes.append(
                f"session options {v.options} from the bank dropped: re-checked here, "
                + (
                    f"{pct(recheck.improvement)} with 95% interval {interval(recheck.ci95)} against the "
                    "same model without them"
                    if recheck
                    else verdict
                )
            )
            ship = plain if conf.shipped == "tuned" else proposal.input_copy
            if conf.shipped == "options only":
                # Nothing of the proposal ships: its figures move to `proposal`, as a fresh
                # confirmation reports a proposal that did not ship.
                f = conf.figures
                conf.proposal = {
                    "kind": "options only",
                    "result_ms": f.result_ms,
                    "improvement": f.improvement,
                    "improvement_ci95": list(f.ci95),
                }
                conf.figures = Figures.unchanged(
                    "slower" if verdict == "slower" else "no significant change",
                    f.baseline_ms,
                    f.rounds,
                    recheck,
                    f.confirmed_by,
                )
    return conf, ship, None


#: Seconds the confirming A/B may take.
CONFIRM_S = 30.0


async def _fresh(
    ctx: JobContext, proposal: confirm.Proposal, budget: Budget, sessions: int
) -> tuple[confirm.Confirmation, Path, tuple[Measurement, Measurement] | None]:
    """The confirming A/B of `proposal` run here, its estimate said first; a failed
    device ships the input."""
    estimate(
        ctx,
        "confirm",
        budget,
        sessions,
        confirm.ROUNDS,
        CONFIRM_S,
        "the confirming A/B, a process per model",
        deployed=True,
    )
    try:
        conf, ship, measured = await confirm.confirm(ctx, proposal, CONFIRM_S)
        if ctx.prep is not None and ctx.prep.profile is not None and conf.shipped != "input":
            ship = await _at_points(ctx, conf, ship, proposal, CONFIRM_S)
    except DeviceError as exc:
        conf = confirm.Confirmation(
            Figures.unchanged("no significant change", 0.0, 0),
            notes=[f"the confirming A/B failed ({exc}); the input model ships"],
        )
        return conf, proposal.input_copy, None
    evidence = (
        (measured["proposal"], measured["plain"])
        if conf.options_kept and "plain" in measured
        else None
    )
    return conf, ship, evidence
