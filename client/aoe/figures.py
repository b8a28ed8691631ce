"""A job's figures and their wording: one rule, one set of words, for every surface.

The rule. Every whole-model figure a job reports comes from one measurement, the
confirming A/B (aoed.engine.confirm): fresh sessions of the input and of the proposal,
interleaved round by round. In each round the proposal's time over the input's is a
ratio; r is the median of those ratios and [r_lo, r_hi] its 95% distribution-free
interval, from the same ratios. Then

    baseline_ms  = the median of the input's per-round times
    improvement  = 1 / r - 1                     (0.25: 25% faster; below 0: slower)
    interval     = [1 / r_hi - 1, 1 / r_lo - 1]  (the improvement lies inside it)
    result_ms    = baseline_ms * r = baseline_ms / (1 + improvement)

so the result is below the baseline exactly when the improvement is above zero, and by
the same factor. Why not the two medians, result = median of the proposal's times: each
side's median carries the machine's drift from round to round, which the paired ratio
cancels, and the two disagreed even in sign (a 0.5999 ms baseline, a 0.6071 ms result
and a paired +3.5%).

The verdict is read from an interval of these rounds: "faster" only when it lies wholly
above zero, against the input and against a second session of the input (two sessions of
one model are the noise floor of these rounds); "slower" when the interval against the
input lies wholly below zero; else "no significant change". What ships follows the
verdict: the proposal only when it is faster. When the input ships, nothing changed, so
result_ms = baseline_ms and the improvement is 0; the comparison that kept the proposal
out (`Figures.decided_by`, its interval the one that decided) is given as the reason,
"no change shipped (within noise: ...)", and never as the job's improvement.

Every renderer (the CLI, `aoe jobs`/`aoe status`/`aoe watch`, the drop-folder report)
words figures through the functions here; the daemon builds its figures with `Figures`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from aoe.plain import from_plain, to_plain

__all__ = [
    "AGAINST",
    "SHIPPED",
    "VERDICTS",
    "Comparison",
    "Figures",
    "ONNX_WORDS",
    "Shipped",
    "Words",
    "bank_text",
    "changed_text",
    "event_text",
    "improvement_of",
    "interval",
    "pct",
    "result_text",
    "shipped_text",
    "short_text",
    "verdict_text",
]


class Shipped(enum.StrEnum):
    """What a job ships: the tuned model, the input with session options, or the input."""

    TUNED = "tuned"
    OPTIONS_ONLY = "options only"
    INPUT = "input"
    NONE = ""  # not known


#: What a job can ship, and how each is said.
SHIPPED = {
    "tuned": "the tuned model",
    "options only": "the input model with session options",
    "input": "the input model, unchanged",
}
#: The confirming A/B's verdicts on the proposal against the input.
VERDICTS = ("faster", "no significant change", "slower")
#: What a comparison measured its subject against (`Comparison.against`), as said.
AGAINST = {
    "input": "the input",
    "second session": "a second session of the input in the same rounds",
    "without options": "the same model without them",
}
_SUBJECT = {"tuned": "the tuned model", "options only": "the session options"}


@dataclass(frozen=True)
class Words:
    """How a kind of job names what it measures in the sentences here: its input, what
    the input shipping unchanged is called, its tuned output, the noise floor's second
    run of the input, and why nothing was proposed. An ONNX job's are the defaults
    (ONNX_WORDS); a GDAT job's input is DDP's defaults (aoe.outcome.GDAT_WORDS)."""

    input: str = AGAINST["input"]
    unchanged: str = SHIPPED["input"]
    tuned: str = SHIPPED["tuned"]
    second: str = AGAINST["second session"]
    nothing_passed: str = "no change passed the search and verification"

    def shipped(self, kind: str) -> str:
        """What shipped (a key of SHIPPED), in these words."""
        if kind == "input":
            return self.unchanged
        return self.tuned if kind == "tuned" else SHIPPED.get(kind, kind)

    def subject(self, subject: str) -> str:
        """A comparison's subject (tuned | options only), in these words."""
        return self.tuned if subject == "tuned" else _SUBJECT.get(subject, subject)

    def against(self, against: str) -> str:
        """What a comparison measured against (a key of AGAINST), in these words."""
        said = {"input": self.input, "second session": self.second}
        return said.get(against) or AGAINST.get(against, against)


#: An ONNX job's words: the model it was given and the model it tuned.
ONNX_WORDS = Words()


def improvement_of(
    ratio: float, ratio_ci: tuple[float, float]
) -> tuple[float, tuple[float, float]]:
    """(improvement, its interval) from a median time ratio (subject / reference) and
    that median's interval: 1/r - 1, and [1/r_hi - 1, 1/r_lo - 1]."""
    return 1.0 / ratio - 1.0, (1.0 / ratio_ci[1] - 1.0, 1.0 / ratio_ci[0] - 1.0)


class Comparison(msgspec.Struct, frozen=True):
    """One paired comparison of the confirming A/B: `subject` (tuned | options only)
    timed against `against` (a key of AGAINST) in the same rounds, as an improvement
    with its 95% interval (`improvement_ci95` in the result JSON)."""

    subject: str
    against: str
    improvement: float
    ci95: tuple[float, float] = msgspec.field(name="improvement_ci95")

    @classmethod
    def of_ratio(
        cls, subject: str, against: str, ratio: float, ratio_ci: tuple[float, float]
    ) -> Comparison:
        imp, ci = improvement_of(ratio, ratio_ci)
        return cls(subject, against, imp, ci)

    def to_dict(self) -> dict[str, Any]:
        """As the result JSON writes it (aoe.plain); `from_dict` reads it back."""
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Comparison:
        """From `to_dict`'s object; ValueError naming the field that does not fit."""
        return from_plain(cls, d)


@dataclass(frozen=True)
class Figures:
    """A job's whole-model figures under the rule of this module. `result_ms` is derived,
    so that it cannot disagree with `improvement`."""

    verdict: str  # one of VERDICTS ("" when unknown)
    shipped: Shipped
    baseline_ms: float
    improvement: float = 0.0  # of what shipped against the input; 0 when the input ships
    ci95: tuple[float, float] = (0.0, 0.0)
    rounds: int = 0  # paired rounds of the confirming A/B; 0: none ran
    confirmed_by: str = ""  # the job whose confirming A/B the bank answered with
    #: when the input ships: the comparison whose interval kept the proposal out
    decided_by: Comparison | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shipped", Shipped(self.shipped))
        if self.shipped == "input" and (self.improvement or self.ci95 != (0.0, 0.0)):
            raise ValueError("the input shipped: nothing changed, so its improvement is 0")

    @property
    def result_ms(self) -> float:
        return (
            self.baseline_ms / (1.0 + self.improvement) if self.improvement > -1.0 else float("inf")
        )

    @property
    def changed(self) -> bool:
        return self.shipped not in ("input", "")

    @classmethod
    def shipping(
        cls, kind: str, baseline_ms: float, ratio: float, ratio_ci: tuple[float, float], rounds: int
    ) -> Figures:
        """The figures of a proposal that ships, from its median time ratio to the input."""
        imp, ci = improvement_of(ratio, ratio_ci)
        return cls("faster", Shipped(kind), baseline_ms, imp, ci, rounds)

    @classmethod
    def unchanged(
        cls,
        verdict: str,
        baseline_ms: float,
        rounds: int,
        decided_by: Comparison | None = None,
        confirmed_by: str = "",
    ) -> Figures:
        """The figures of a job that ships its input: the proposal was `verdict`."""
        return cls(
            verdict, Shipped.INPUT, baseline_ms, 0.0, (0.0, 0.0), rounds, confirmed_by, decided_by
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON types; `from_dict` reads it back."""
        return {
            "verdict": self.verdict,
            "shipped": str(self.shipped),
            "baseline_ms": self.baseline_ms,
            "result_ms": self.result_ms,
            "improvement": self.improvement,
            "improvement_ci95": list(self.ci95),
            "rounds": self.rounds,
            "confirmed_by": self.confirmed_by,
            "decided_by": self.decided_by.to_dict() if self.decided_by else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Figures:
        """From `to_dict`'s keys, or from a result JSON's `confirmation` section or a
        job's stored result, which spell two of them `from_bank` and `confirm_rounds`.
        `result_ms` is not read: it follows from the rule. Figures stored before the rule
        held (an input that shipped with the noise of its second session as its
        improvement) read as the rule says."""
        shipped = str(d.get("shipped") or "")
        lo, hi = (list(d.get("improvement_ci95") or (0.0, 0.0)) + [0.0, 0.0])[:2]
        imp, ci = (
            (0.0, (0.0, 0.0))
            if shipped == "input"
            else (float(d.get("improvement") or 0.0), (float(lo), float(hi)))
        )
        rounds = d.get("rounds", d.get("confirm_rounds", 0))
        decided = d.get("decided_by")
        return cls(
            verdict=str(d.get("verdict") or ""),
            shipped=Shipped(shipped),
            baseline_ms=float(d.get("baseline_ms") or 0.0),
            improvement=imp,
            ci95=ci,
            rounds=int(rounds or 0),
            confirmed_by=str(d.get("confirmed_by") or d.get("from_bank") or ""),
            decided_by=Comparison.from_dict(decided) if isinstance(decided, Mapping) else None,
        )


# --------------------------------------------------------------------------- wording


def pct(x: float) -> str:
    """A signed percentage with one decimal ("+12.3%", "-4.0%"); a value that rounds to
    zero is "0.0%", never "-0.0%"."""
    s = f"{x:+.1%}"
    return "0.0%" if s in ("+0.0%", "-0.0%") else s


def interval(ci: tuple[float, float]) -> str:
    """A 95% interval of an improvement: "-4.2% to +6.3%"."""
    return f"{pct(ci[0])} to {pct(ci[1])}"


def shipped_text(f: Figures, words: Words = ONNX_WORDS) -> str:
    """What shipped, as a noun phrase in `words`."""
    return words.shipped(f.shipped) if f.shipped else "-"


def _reason(f: Figures, words: Words) -> str:
    """Why the input shipped, from the comparison that decided it."""
    c = f.decided_by
    if c is not None:
        said = "slower" if f.verdict == "slower" else "within noise"
        return (
            f"{said}: {words.subject(c.subject)} against {words.against(c.against)}, "
            f"95% interval {interval(c.ci95)}"
        )
    if f.confirmed_by:
        return f"{f.verdict or 'no significant change'}, as job {f.confirmed_by} confirmed"
    if not f.rounds:
        return "not confirmed: the confirming A/B did not measure; see the notes"
    return f"nothing was proposed: {words.nothing_passed}"


def verdict_text(f: Figures, words: Words = ONNX_WORDS) -> str:
    """The verdict and what shipped, in one phrase in `words`: "faster: the tuned model
    ships", or "no change shipped (within noise: the tuned model against the input, 95%
    interval -23.1% to +18.3%)"."""
    if f.changed:
        return f"{f.verdict}: {shipped_text(f, words)} ships"
    if f.shipped == "input":
        return f"no change shipped ({_reason(f, words)})"
    return f.verdict or "-"


def result_text(f: Figures, digits: int = 4, words: Words = ONNX_WORDS) -> str:
    """The result figure with what it is: "0.5420 ms   (improvement +9.6%: the median of
    the paired round ratios, 95% interval +2.0% to +15.1%)", or "0.5999 ms   (the input
    model, unchanged)"; milliseconds with `digits` decimals, what shipped in `words`."""
    if f.changed:
        return (
            f"{f.result_ms:.{digits}f} ms   (improvement {pct(f.improvement)}: the median of the paired round "
            f"ratios, 95% interval {interval(f.ci95)})"
        )
    return f"{f.result_ms:.{digits}f} ms   ({words.unchanged})"


def short_text(f: Figures) -> str:
    """A few words for a table cell: "+9.6% (tuned)", or "no change shipped"."""
    if f.changed:
        return f"{pct(f.improvement)} ({f.shipped})"
    return "no change shipped" if f.shipped == "input" else "-"


def event_text(f: Figures) -> str:
    """One line for an event stream: "0.6000 ms -> 0.5420 ms (+10.7%, 95% interval ...):
    faster: the tuned model ships", or "0.6000 ms: no change shipped (...)"."""
    if f.changed:
        return (
            f"{f.baseline_ms:.4f} ms -> {f.result_ms:.4f} ms ({pct(f.improvement)}, 95% interval "
            f"{interval(f.ci95)}): {verdict_text(f)}"
        )
    return f"{f.baseline_ms:.4f} ms: {verdict_text(f)}"


def changed_text(changed: int, chosen: int, shipped: str) -> str:
    """How many tasks the shipped model changes: "3 changed", or "0 changed (3 chosen by
    the search, not in what shipped: the input model, unchanged)"."""
    if chosen <= changed:
        return f"{changed} changed"
    return f"{changed} changed ({chosen} chosen by the search, not in what shipped: {SHIPPED.get(shipped, shipped)})"


def bank_text(repo: Mapping[str, Any], unshipped: int = 0) -> str:
    """AOE's repo summary in one line; the bank counts task decisions, so when some of
    them are not in what shipped (the confirming A/B kept the model out, or verification
    reverted them) the line says so, lest "add 2" read as two changes shipped."""
    text = (
        f"add {repo.get('repo_add_num', 0)}, hit {repo.get('repo_hit_num', 0)}, reserved "
        f"{repo.get('repo_reserved_num', 0)}, unsatisfied {repo.get('repo_unsatisfied_num', 0)}, update "
        f"{repo.get('repo_update_num', 0)}, total {repo.get('total_num', 0)}"
    )
    if unshipped:
        text += (
            f" (counts task decisions: {unshipped} of them {'is' if unshipped == 1 else 'are'} kept in the bank "
            "but not in what shipped)"
        )
    return text
