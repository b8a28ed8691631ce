"""The confirming A/B: what the job reports is measured after everything is decided.

Once verification has proposed a model (tuned, options only, or the input), one more
measurement, used for no decision, runs fresh sessions of: the input model; the proposed
model with its session options; the proposed model without them (when it has options);
and the input model as it would be shipped (a copy carrying the tuned-model metadata),
in `ROUNDS` rounds with a rotating order, each in a process of its own as a user deploys
it (MeasurePlan.deployed), so the figures are what the deployed model does. Every figure the job prints or
writes as its result comes from these rounds, by the one rule `aoe.figures` states:
the improvement is 1/r - 1 for r the median of the round-by-round time ratios against
the input, its 95% interval comes from the same ratios (engine/stats.py), and the result
is the input's median time scaled by r, so the result, the improvement and the verdict
agree in sign and size.

- session options are kept only if the proposed model with them is faster than without
  them with the whole interval below 1 (an option that won under transient load, such
  as spinning, does not survive a quiet round here);
- the proposal ships only if it is faster than the input with the whole interval below
  1 ("faster"), and faster in the same way than the input's second session (its shipped
  copy: two sessions of one model show the noise floor of these rounds); otherwise the
  input ships ("no significant change", or "slower"): nothing changed, so the result is
  the baseline and the improvement 0, and the comparison whose interval kept the
  proposal out is reported as the reason (`Figures.decided_by`). Nothing measured
  slower ships.
- a dynamic model's proposal that ships is then measured against the input at every
  other point of its shape profile (`at_points`, POINT_ROUNDS rounds each, on inputs of
  that shape): one point where it is slower with the whole interval above 1 keeps it
  out, and the input ships. The searched point's A/B gives the job's figures; each
  point's are in the confirmation's `points`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import trio

from aoe.figures import Comparison, Figures, improvement_of, interval, pct
from aoe.signature import TensorInfo
from aoed.engine import stats
from aoed.engine.context import JobContext
from aoed.engine.messages import Candidate, Measurement, MeasurePlan
from aoed.engine.prep import make_inputs

__all__ = [
    "POINT_ROUNDS",
    "ROUNDS",
    "Confirmation",
    "Proposal",
    "at_points",
    "confirm",
    "judge",
    "verdict_of",
]

#: Rounds of the confirming A/B: enough for a 95% interval of the median from ranks 6..16.
ROUNDS = 21
#: Rounds at each other point of a dynamic model's profile: enough for a 95% interval of
#: the median (ranks 2..10), which is all a point needs to say "slower beyond noise".
POINT_ROUNDS = 11
CONFIDENCE = 0.95


@dataclass
class Proposal:
    """What verification proposes to ship, as model files already written."""

    kind: str  # tuned | options only | input
    model: Path  # the proposed model, with its session options in its metadata
    options: dict[str, Any]
    plain: Path | None  # the same graph without session options (when there are some)
    input_copy: Path  # the input model as it would be shipped
    #: the runtime the proposal runs on (runtimestage.py); for another runtime than
    #: onnxruntime `options` are what it runs with (compile properties), not session
    #: options, and there is no `plain`
    runtime: str = "onnxruntime"


@dataclass
class Confirmation:
    """The confirming A/B's outcome: the job's figures and what else it found."""

    figures: Figures
    device_s: float = 0.0
    options_kept: bool = False
    notes: list[str] = field(default_factory=list)
    #: the proposal against the input, by the same rule, when it did not ship
    proposal: dict[str, Any] = field(default_factory=dict)
    #: a dynamic model's proposal against the input at each point of its shape profile
    #: (`at_points`); empty for a static model or one whose input ships at once
    points: list[dict[str, Any]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return self.figures.verdict

    @property
    def shipped(self) -> str:
        return self.figures.shipped

    @property
    def baseline_ms(self) -> float:
        return self.figures.baseline_ms

    @property
    def result_ms(self) -> float:
        return self.figures.result_ms

    def to_json(self) -> dict[str, Any]:
        """The result JSON's `confirmation` section: the figures (`Figures.to_dict`, the
        confirming job as `from_bank`), then device_s, options_kept, notes, proposal."""
        d = self.figures.to_dict()
        d["from_bank"] = d.pop("confirmed_by")
        return {
            **d,
            "device_s": self.device_s,
            "options_kept": self.options_kept,
            "notes": list(self.notes),
            "proposal": dict(self.proposal),
            **({"points": list(self.points)} if self.points else {}),
        }

    def params(
        self, choices_digest: str, job_id: str, job_type: str, runtime: str = "onnxruntime"
    ) -> str:
        """The confirmation as stored with the model-level bank record: valid for the
        choices `choices_digest` names (bankrules.choices_digest) applied to the tasks a
        job of `job_type` forms, measured by `job_id`, of the build of `runtime` that
        ran them (another runtime's is named: its figures are not onnxruntime's)."""
        d = {
            k: v
            for k, v in self.to_json().items()
            if k not in ("notes", "from_bank", "proposal", "points")
        }
        doc = {**d, "choices": choices_digest, "job": job_id, "job_type": job_type}
        if runtime != "onnxruntime":
            doc["runtime"] = runtime
        return json.dumps(doc, sort_keys=True)


def verdict_of(ratios: list[float]) -> tuple[str, float, tuple[float, float]]:
    """(verdict, median ratio, 95% interval) of candidate/input round ratios."""
    med = stats.median(ratios)
    lo, hi = stats.median_ci(ratios, CONFIDENCE)
    verdict = "faster" if hi < 1.0 else "slower" if lo > 1.0 else "no significant change"
    return verdict, med, (lo, hi)


def _round_median_ms(m: Measurement) -> float:
    """The median of a measurement's per-round times, in ms (its overall median when it
    has no rounds)."""
    rounds = [r for r in m.rounds_us if r]
    return (stats.median(rounds) if rounds else m.median_us) / 1000


async def confirm(
    ctx: JobContext, proposal: Proposal, budget_s: float
) -> tuple[Confirmation, Path, dict[str, Measurement]]:
    """Measure the proposal against the input (see the module doc); returns the
    confirmation, the file to ship and the measurements. Raises DeviceError when the
    device fails."""
    cands = [Candidate("input", ctx.run.model), Candidate("input_copy", proposal.input_copy)]
    if proposal.kind != "input":
        cands.append(
            Candidate("proposal", proposal.model, proposal.options, runtime=proposal.runtime)
        )
        if proposal.options and proposal.plain is not None:
            cands.append(Candidate("plain", proposal.plain))
    before = ctx.ledger.device_by.get("confirm", 0.0)
    measured = await ctx.measure(
        cands,
        "input",
        budget_s,
        plan=MeasurePlan.fixed(ROUNDS, budget_s, deployed=True),
        category="confirm",
    )
    conf, ship_path = judge(measured, proposal)
    conf.device_s = ctx.ledger.device_by.get("confirm", 0.0) - before
    return conf, ship_path, measured


def _point_inputs(ctx: JobContext, k: int, point: Mapping[str, tuple[int, ...]]) -> Path:
    """The inputs of profile point `k` (the job's synthetic ones, at its shapes), saved."""
    assert ctx.prep is not None
    infos = {n: TensorInfo(i.dtype, tuple(point[n])) for n, i in ctx.prep.inputs.items()}
    path = ctx.workspace.scratch / f"point{k}.npz"
    arrays: dict[str, Any] = make_inputs(infos, seed=k, int_high=ctx.prep.int_high)
    np.savez(path, **arrays)
    return path


async def at_points(
    ctx: JobContext,
    model: Path,
    options: Mapping[str, Any],
    budget_s: float,
    runtime: str = "onnxruntime",
) -> list[dict[str, Any]]:
    """`model` (with `options`) against the input at each point of the job's shape
    profile but the searched one, POINT_ROUNDS rounds each, deployed: per point its
    shapes, verdict (aoe.figures' VERDICTS, or "not measured"), the input's time and the
    model's, and the improvement with its 95% interval. `runtime`: what `model` runs on
    (an OpenVINO build is timed as such). Raises DeviceError when the device fails."""
    assert ctx.prep is not None and ctx.prep.profile is not None
    profile = ctx.prep.profile
    out: list[dict[str, Any]] = []
    for k, point in enumerate(profile.points):
        if k == profile.representative:
            continue
        inputs = await trio.to_thread.run_sync(_point_inputs, ctx, k, point)
        measured = await ctx.measure(
            [
                Candidate("input", ctx.run.model),
                Candidate("tuned", model, dict(options), runtime=runtime),
            ],
            "input",
            budget_s,
            inputs=inputs,
            plan=MeasurePlan.fixed(POINT_ROUNDS, budget_s, deployed=True),
            category="confirm",
        )
        base, tuned = measured["input"], measured["tuned"]
        shapes = {n: list(d) for n, d in point.items()}
        ratios = stats.paired_ratios(tuned.rounds_us, base.rounds_us) if tuned.ok else []
        if not base.ok or not ratios:
            out.append(
                {"shapes": shapes, "verdict": "not measured", "error": tuned.error or base.error}
            )
            continue
        verdict, med, ci = verdict_of(ratios)
        c = Comparison.of_ratio("tuned", "input", med, ci)
        input_ms = _round_median_ms(base)
        out.append(
            {
                "shapes": shapes,
                "verdict": verdict,
                "input_ms": input_ms,
                "result_ms": input_ms * med if math.isfinite(med) else math.inf,
                "improvement": c.improvement,
                "improvement_ci95": list(c.ci95),
                "rounds": len(ratios),
            }
        )
    return out


def judge(measured: Mapping[str, Measurement], proposal: Proposal) -> tuple[Confirmation, Path]:
    """The confirmation of the confirming A/B's measurements (by candidate: "input",
    "input_copy", and "proposal" and "plain" as `confirm` measures them for `proposal`)
    and the file to ship; see the module doc."""
    base = measured["input"]
    base_ms = _round_median_ms(base)
    notes: list[str] = []

    def ratios(m: Measurement) -> list[float]:
        return stats.paired_ratios(m.rounds_us, base.rounds_us)

    ship_path, options_kept = proposal.input_copy, False
    figures: Figures | None = None
    verdict, proposal_figures = "no significant change", {}
    decided: Comparison | None = None
    if proposal.kind != "input":
        prop = measured["proposal"]
        name, path, kind = "proposal", proposal.model, proposal.kind
        if proposal.plain is not None and "plain" in measured and prop.ok and measured["plain"].ok:
            o_verdict, o_med, o_ci = verdict_of(
                stats.paired_ratios(prop.rounds_us, measured["plain"].rounds_us)
            )
            options_kept = o_verdict == "faster"
            if not options_kept:
                o = Comparison.of_ratio("options only", "without options", o_med, o_ci)
                notes.append(
                    f"session options {proposal.options} dropped: against the same model without them "
                    f"{pct(o.improvement)}, 95% interval {interval(o.ci95)}, not wholly above zero"
                )
                name, path = "plain", proposal.plain
                kind = "tuned" if proposal.kind == "tuned" else "input"
                if kind == "input":  # the options were all the proposal had: this kept it out
                    verdict, decided = o_verdict, o
        elif proposal.options and proposal.runtime == "onnxruntime":
            options_kept = True
        cand = measured[name]
        if kind != "input" and cand.ok and ratios(cand):
            verdict, med, ci = verdict_of(ratios(cand))
            against_input = Comparison.of_ratio(kind, "input", med, ci)
            proposal_figures = {
                "kind": kind,
                "result_ms": base_ms * med,
                "improvement": against_input.improvement,
                "improvement_ci95": list(against_input.ci95),
            }
            decided = against_input
            # Two sessions of the input model (the file itself and its shipped copy) are
            # the noise floor of these rounds: the proposal must beat both, so a session
            # that happened to run slow in every round cannot make a gain.
            copy = measured["input_copy"]
            copy_ratios = stats.paired_ratios(cand.rounds_us, copy.rounds_us) if copy.ok else []
            if verdict == "faster" and not copy_ratios:
                verdict = "no significant change"
                notes.append(
                    f"{kind} model not shipped: the input's second session, its noise floor, could not be "
                    f"measured ({copy.error or 'no rounds'})"
                )
            elif verdict == "faster":
                c_verdict, c_med, c_ci = verdict_of(copy_ratios)
                if c_verdict == "faster":
                    ship_path = path
                    figures = Figures.shipping(kind, base_ms, med, ci, len(ratios(cand)))
                else:
                    verdict = "no significant change"
                    decided = Comparison.of_ratio(kind, "second session", c_med, c_ci)
                    notes.append(
                        f"{kind} model not shipped: against the input alone its interval was "
                        f"{interval(against_input.ci95)}, but against a second session of the input in the same "
                        f"rounds it was {interval(decided.ci95)}: within the noise of these rounds"
                    )
        elif not cand.ok:
            notes.append(
                f"the proposed model could not be measured ({cand.error}); the input ships"
            )
    copy = measured["input_copy"]
    if figures is None:
        figures = Figures.unchanged(verdict, base_ms, len(ratios(copy)) if copy.ok else 0, decided)
        if copy.ok and ratios(copy):
            c_verdict, _med, c_ci = verdict_of(ratios(copy))
            if c_verdict != "no significant change":
                notes.append(
                    "two sessions of the input model differed beyond their interval in these rounds (the second "
                    f"against the first: 95% interval {interval(improvement_of(1.0, c_ci)[1])}): the machine was noisy"
                )
    conf = Confirmation(
        figures=figures,
        options_kept=options_kept and figures.changed,
        notes=notes,
        proposal=proposal_figures if not figures.changed else {},
    )
    return conf, ship_path
