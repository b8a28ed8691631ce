"""The confirming A/B: what the job reports is measured after everything is decided.

Once verification has proposed a model (tuned, options only, or the input), one more
measurement, used for no decision, runs fresh sessions of: the input model; the proposed
model with its session options; the proposed model without them (when it has options);
and the input model as it would be shipped (a copy carrying the tuned-model metadata),
interleaved in `ROUNDS` rounds with a rotating order. Every figure the job prints or
writes as its result comes from these rounds:

- ratios are taken round by round against the input, and their median gets a 95%
  distribution-free interval (engine/stats.py);
- session options are kept only if the proposed model with them is faster than without
  them with the whole interval below 1 (an option that won under transient load, such
  as spinning, does not survive a quiet round here);
- the proposal ships only if it is faster than the input with the whole interval below
  1 ("faster"), and faster in the same way than the input's second session (its shipped
  copy: two sessions of one model show the noise floor of these rounds); otherwise the
  input ships ("no significant change", or "slower"), and its own figures, measured in
  the same rounds, are the result. Nothing measured slower ships.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aoed.engine import stats
from aoed.engine.context import JobContext
from aoed.engine.messages import Candidate, MeasurePlan, Measurement

__all__ = ["ROUNDS", "Confirmation", "Proposal", "confirm", "verdict_of"]

#: Rounds of the confirming A/B: enough for a 95% interval of the median from ranks 6..16.
ROUNDS = 21
CONFIDENCE = 0.95


@dataclass
class Proposal:
    """What verification proposes to ship, as model files already written."""

    kind: str  # tuned | options only | input
    model: Path  # the proposed model, with its session options in its metadata
    options: dict[str, Any]
    plain: Path | None  # the same graph without session options (when there are some)
    input_copy: Path  # the input model as it would be shipped


@dataclass
class Confirmation:
    verdict: str  # faster | no significant change | slower (of the proposal vs the input)
    shipped: str  # tuned | options only | input
    baseline_ms: float
    result_ms: float
    improvement: float  # input / shipped - 1, from the median round ratio
    improvement_ci95: tuple[float, float]
    rounds: int
    device_s: float = 0.0
    options_kept: bool = False
    notes: list[str] = field(default_factory=list)
    #: the proposal's own figures when it did not ship
    proposal: dict[str, Any] = field(default_factory=dict)
    from_bank: str = ""  # the job whose confirmation the bank answered with, if any

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["improvement_ci95"] = list(self.improvement_ci95)
        return d

    def params(self, choices_digest: str, job_id: str) -> str:
        """The confirmation as stored with the model-level bank record: valid for the
        choices `choices_digest` names (bankrules.choices_digest), measured by `job_id`."""
        d = {k: v for k, v in self.to_json().items() if k not in ("notes", "from_bank", "proposal")}
        return json.dumps({**d, "choices": choices_digest, "job": job_id}, sort_keys=True)


def verdict_of(ratios: list[float]) -> tuple[str, float, tuple[float, float]]:
    """(verdict, median ratio, 95% interval) of candidate/input round ratios."""
    med = stats.median(ratios)
    lo, hi = stats.median_ci(ratios, CONFIDENCE)
    verdict = "faster" if hi < 1.0 else "slower" if lo > 1.0 else "no significant change"
    return verdict, med, (lo, hi)


def _improvement(med: float, ci: tuple[float, float]) -> tuple[float, tuple[float, float]]:
    return 1.0 / med - 1.0, (1.0 / ci[1] - 1.0, 1.0 / ci[0] - 1.0)


async def confirm(
    ctx: JobContext, proposal: Proposal, budget_s: float
) -> tuple[Confirmation, Path, dict[str, Measurement]]:
    """Measure the proposal against the input (see the module doc); returns the
    confirmation, the file to ship and the measurements. Raises DeviceError when the
    device fails."""
    cands = [Candidate("input", ctx.opts.model), Candidate("input_copy", proposal.input_copy)]
    if proposal.kind != "input":
        cands.append(Candidate("proposal", proposal.model, proposal.options))
        if proposal.options and proposal.plain is not None:
            cands.append(Candidate("plain", proposal.plain))
    before = ctx.ledger.device_by.get("confirm", 0.0)
    measured = await ctx.measure(cands, "input", budget_s, plan=MeasurePlan.fixed(ROUNDS, budget_s), category="confirm")
    device_s = ctx.ledger.device_by.get("confirm", 0.0) - before
    base = measured["input"]
    notes: list[str] = []

    def ratios(m: Measurement) -> list[float]:
        return stats.paired_ratios(m.rounds_us, base.rounds_us)

    ship, ship_kind, ship_path, options_kept = "input_copy", "input", proposal.input_copy, False
    verdict, proposal_figures = "no significant change", {}
    if proposal.kind != "input":
        prop = measured["proposal"]
        name, path, kind = "proposal", proposal.model, proposal.kind
        if "plain" in measured and prop.ok and measured["plain"].ok:
            o_verdict, o_med, o_ci = verdict_of(stats.paired_ratios(prop.rounds_us, measured["plain"].rounds_us))
            options_kept = o_verdict == "faster"
            if not options_kept:
                notes.append(
                    f"session options {proposal.options} dropped: with them {prop.median_us / 1000:.4f} ms, without "
                    f"{measured['plain'].median_us / 1000:.4f} ms (ratio {o_med:.3f}, 95% interval "
                    f"[{o_ci[0]:.3f}, {o_ci[1]:.3f}], not entirely below 1)"
                )
                name, path = "plain", proposal.plain
                kind = "tuned" if proposal.kind == "tuned" else "input"
        elif proposal.options:
            options_kept = True
        cand = measured[name]
        if kind != "input" and cand.ok and ratios(cand):
            verdict, med, ci = verdict_of(ratios(cand))
            imp, imp_ci = _improvement(med, ci)
            proposal_figures = {"kind": kind, "result_ms": cand.median_us / 1000, "improvement": imp,
                                "improvement_ci95": list(imp_ci)}  # fmt: skip
            # Two sessions of the input model (the file itself and its shipped copy) are
            # the noise floor of these rounds: the proposal must beat both, so a session
            # that happened to run slow in every round cannot make a gain.
            copy = measured["input_copy"]
            c_verdict, c_med, c_ci = verdict_of(stats.paired_ratios(cand.rounds_us, copy.rounds_us)) \
                if copy.ok else ("not measured", 1.0, (1.0, 1.0))  # fmt: skip
            if verdict == "faster" and c_verdict != "faster":
                verdict = "no significant change"
                notes.append(
                    f"{kind} model not shipped: faster than the input ({imp:+.1%}) but not than the input's "
                    f"second session in the same rounds (ratio {c_med:.3f}, 95% interval "
                    f"[{c_ci[0]:.3f}, {c_ci[1]:.3f}]): within the noise of these rounds"
                )
            elif verdict == "faster":
                ship, ship_kind, ship_path = name, kind, path
            else:
                notes.append(
                    f"{kind} model not shipped: {cand.median_us / 1000:.4f} ms against the input's "
                    f"{base.median_us / 1000:.4f} ms, improvement {imp:+.1%} with 95% interval "
                    f"[{imp_ci[0]:+.1%}, {imp_ci[1]:+.1%}]: {verdict}"
                )
        elif not cand.ok:
            notes.append(f"the proposed model could not be measured ({cand.error}); the input ships")
    shipped = measured[ship]
    s_verdict, s_med, s_ci = verdict_of(ratios(shipped)) if ratios(shipped) else ("no significant change", 1.0, (1.0, 1.0))
    imp, imp_ci = _improvement(s_med, s_ci)
    conf = Confirmation(
        verdict=verdict,
        shipped=ship_kind,
        baseline_ms=base.median_us / 1000,
        result_ms=shipped.median_us / 1000,
        improvement=imp,
        improvement_ci95=imp_ci,
        rounds=len(ratios(shipped)),
        device_s=device_s,
        options_kept=options_kept and ship_kind != "input",
        notes=notes,
        proposal=proposal_figures if ship_kind == "input" else {},
    )
    if ship_kind == "input" and s_verdict != "no significant change":
        conf.notes.append(
            f"the shipped copy of the input measured {s_verdict} than the input itself "
            f"({imp:+.1%}, 95% interval [{imp_ci[0]:+.1%}, {imp_ci[1]:+.1%}]): the machine's noise in these rounds"
        )
    return conf, ship_path, measured
