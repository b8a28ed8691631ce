"""Decision rules: when one measured candidate beats another, and which to give up first.

Candidates are measured interleaved, round by round (backends/ort/measure.py), so the
ratio of two candidates within one round is free of the machine's slow drift. A
candidate wins only if the median of those paired per-round ratios is below
1 - `MIN_GAIN`, the whole 90% interval of that median is below 1 (engine/stats.py:
distribution-free, so a few lucky rounds do not make a winner), and its overall median
is lower too (the number reports show). A candidate that clearly beats the winner on
their own paired rounds takes its place. On this class of machine two identical
multi-threaded sessions measured up to 40% apart; comparing medians alone was useless,
and a looser rule made the same model tune differently twice.

Ties go to the order of preference, never to the luck of a run: `results` is a mapping
in that order (the registry's: the task's default first, then its strategies as they
were registered, the simpler forms first), and of candidates that all win, the first
stands unless another clearly beats it. Two int8 forms that run the same kernel once
onnxruntime has fused them (QDQ around a Conv and an explicit QLinearConv) then give the
same choice in every run, where "the lowest measured ratio" picked either one.

Lossy choices that an end-to-end accuracy budget cannot afford are backed off least
gain per unit of error first (`back_off_order`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from aoed.engine import stats
from aoed.engine.messages import Measurement

__all__ = [
    "MIN_GAIN",
    "best",
    "best_lossy",
    "faster_outside_gate",
    "clearly_faster",
    "clearly_slower",
    "least_gain_per_error",
    "lossy_alternates",
    "next_alternate",
    "paired_ratio",
    "preferred",
    "ranked",
    "why_not_faster",
]

#: A gain below this fraction is never called a gain, whatever the measured spread.
MIN_GAIN = 0.02
#: Confidence of the interval a decision's ratio must lie within.
CONFIDENCE = 0.90
#: Fewer paired rounds than this decide nothing.
MIN_ROUNDS = 3


def paired_ratio(a: Measurement, b: Measurement) -> tuple[float, float, float]:
    """The median of a's per-round medians over b's and its 90% interval: (median, low,
    high); (inf, inf, inf) when fewer than MIN_ROUNDS rounds measured both."""
    pairs = stats.paired_ratios(a.rounds_us, b.rounds_us)
    if len(pairs) < MIN_ROUNDS:
        return float("inf"), float("inf"), float("inf")
    lo, hi = stats.median_ci(pairs, CONFIDENCE)
    return stats.median(pairs), lo, hi


def clearly_faster(a: Measurement, b: Measurement) -> bool:
    """a beats b: the median round ratio is below 1 - MIN_GAIN, its 90% interval lies
    below 1, and a's overall median is lower."""
    med, _lo, hi = paired_ratio(a, b)
    return med < 1.0 - MIN_GAIN and hi < 1.0 and a.median_us < b.median_us


def clearly_slower(a: Measurement, b: Measurement) -> bool:
    """a is slower than b: the median round ratio is above 1 + MIN_GAIN and its 90%
    interval lies above 1."""
    med, lo, _hi = paired_ratio(a, b)
    return med != float("inf") and med > 1.0 + MIN_GAIN and lo > 1.0


def best(
    results: Mapping[str, Measurement], incumbent: str, gate: Callable[[Measurement], bool]
) -> str:
    """Of the candidates that clearly beat `incumbent` and pass the accuracy `gate`, the
    `preferred` one (`results` in order of preference); `incumbent` when none does.
    KeyError/ValueError when the incumbent itself was not measured."""
    base = results[incumbent]
    if not base.ok:
        raise ValueError(f"{incumbent} could not be measured: {base.error}")
    pool = [k for k, r in results.items() if k != incumbent and r.ok and not r.dropped and gate(r)]
    winners = [k for k in pool if clearly_faster(results[k], base)]
    if not winners:
        return incumbent
    return _climb(results, winners[0], pool)


def preferred(results: Mapping[str, Measurement], names: Sequence[str]) -> str:
    """Of `names` (in order of preference, at least one), the first, or the one that the
    chain of clear wins leads to from it (`_climb`): a later name takes the place only by
    clearly beating the one in it, so a tie goes to the earlier name in every run."""
    return _climb(results, names[0], list(names))


def ranked(results: Mapping[str, Measurement], names: Sequence[str]) -> list[str]:
    """`names` (in order of preference) fastest first as far as the measurements tell:
    each place goes to the `preferred` of those left, so candidates that tie keep the
    order of preference."""
    left, out = list(names), []
    while left:
        out.append(preferred(results, left))
        left.remove(out[-1])
    return out


def _climb(results: Mapping[str, Measurement], pick: str, pool: Sequence[str]) -> str:
    """From `pick`, on to the first candidate of `pool` (in order of preference) that
    clearly beats it, as long as one does. A candidate's rounds against the incumbent can
    be too noisy to call a win while its rounds against the winner are not (racing leaves
    them measured in different rounds): without this, the slower of two winners could
    stand. Each candidate holds the place once at most, so the climb ends."""
    seen = {pick}
    while True:
        better = next(
            (k for k in pool if k not in seen and clearly_faster(results[k], results[pick])), None
        )
        if better is None:
            return pick
        pick = better
        seen.add(pick)


def best_lossy(
    results: Mapping[str, Measurement],
    incumbent: str,
    lossy: Collection[str],
    gate: Callable[[Measurement], bool],
) -> tuple[str, list[str]]:
    """The `preferred` lossy candidate (`results` in order of preference) of those that
    pass `gate` and clearly beat the exact `incumbent`, in context (its
    quantize/dequantize boundaries measured with it); else `incumbent`. Also returns why
    each other lossy candidate lost, each reason built from the figures it quotes."""
    base = results[incumbent]
    winners, reasons, pool = [], [], []
    for name, r in results.items():
        if name not in lossy:
            continue
        if not r.ok:
            reasons.append(f"{name}: failed ({r.error})")
        elif not gate(r):
            reasons.append(
                f"{name}: outside the accuracy budget (cosine {r.cosine:.5f}, max rel error {r.max_rel_error:.3g})"
            )
        elif r.dropped or not clearly_faster(r, base):
            reasons.append(f"{name}: {why_not_faster(r, base, incumbent)}")
        else:
            winners.append(name)
        if r.ok and not r.dropped and gate(r):
            pool.append(name)
    if not winners:
        return incumbent, reasons
    pick = _climb(results, winners[0], pool)
    return pick, [why for why in reasons if not why.startswith(f"{pick}: ")]


def lossy_alternates(
    results: Mapping[str, Measurement],
    incumbent: str,
    lossy: Collection[str],
    gate: Callable[[Measurement], bool],
    chosen: str,
) -> list[tuple[str, float, float]]:
    """The lossy candidates other than `chosen` that pass `gate` and ran faster than the
    exact `incumbent` (by the median: one dropped early, behind `chosen`, has too few
    rounds to be clearly faster, and the verification in context reverts one that is
    not), as (name, median us, error as 1 - cosine), fastest first: what a lossy choice
    refused or backed off for accuracy steps down to before the exact form."""
    base = results[incumbent]
    out = [
        (name, r.median_us, 1.0 - r.cosine)
        for name, r in results.items()
        if name in lossy and name != chosen and r.ok and gate(r) and r.median_us < base.median_us
    ]
    return sorted(out, key=lambda a: a[1])


def next_alternate(
    alternates: Sequence[tuple[str, float, float]], error: float, tried: Collection[str]
) -> tuple[str, float, float] | None:
    """The fastest of `alternates` more accurate than `error` and not in `tried`."""
    return next((a for a in alternates if a[2] < error and a[0] not in tried), None)


def faster_outside_gate(
    results: Mapping[str, Measurement],
    incumbent: str,
    lossy: Collection[str],
    gate: Callable[[Measurement], bool],
) -> list[str]:
    """The lossy candidates that clearly beat the exact `incumbent` and failed only the
    accuracy `gate` on the task's own outputs, fastest first (`ranked`: ties in order of
    preference): the ones worth judging in the model's context (incontext.py)."""
    base = results[incumbent]
    out = [
        name
        for name, r in results.items()
        if name in lossy and r.ok and not gate(r) and not r.dropped and clearly_faster(r, base)
    ]
    return ranked(results, out)


def why_not_faster(r: Measurement, base: Measurement, incumbent: str) -> str:
    """Why `r` did not beat `base` (the incumbent), in the figures the rule reads."""
    if r.dropped:
        return f"not clearly faster than {incumbent}: {r.reason}"
    med, lo, hi = paired_ratio(r, base)
    if med == float("inf"):
        return f"not clearly faster than {incumbent}: fewer than {MIN_ROUNDS} rounds measured both"
    return (
        f"not clearly faster than {incumbent} ({r.median_us:.1f} us vs {base.median_us:.1f} us; median round "
        f"ratio {med:.3f}, 90% interval [{lo:.3f}, {hi:.3f}]; a win needs a ratio below {1 - MIN_GAIN:.2f} "
        "and the whole interval below 1)"
    )


def least_gain_per_error(costs: Mapping[str, tuple[float, float]]) -> str:
    """Of lossy choices with (gain in us, error as 1 - cosine), the one to back off first:
    the least gain per unit of error."""
    return min(costs, key=lambda k: costs[k][0] / max(costs[k][1], 1e-12))
