"""Decision rules: when one measured candidate beats another, and which to give up first.

Candidates are measured interleaved, round by round (backends/ort/runner.py), so the
ratio of two candidates within one round is free of the machine's slow drift. A
candidate wins only if, in those paired per-round ratios, it beats the incumbent by more
than `MIN_GAIN` in the median round and in at least 3 rounds of 4, and in the overall
median too (the number reports show). On this class of machine two identical
multi-threaded sessions measured up to 40% apart; comparing medians alone was useless.

Lossy choices that an end-to-end accuracy budget cannot afford are backed off least
gain per unit of error first (`back_off_order`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from aoed.engine.messages import Measurement

__all__ = [
    "MIN_GAIN",
    "best",
    "best_lossy",
    "clearly_faster",
    "clearly_slower",
    "least_gain_per_error",
    "paired_ratio",
]

#: A gain below this fraction is never called a gain, whatever the measured spread.
MIN_GAIN = 0.02


def paired_ratio(a: Measurement, b: Measurement) -> tuple[float, float, float]:
    """Round-by-round ratios of a's to b's medians: (median, lower quartile, upper quartile)."""
    pairs = [x / y for x, y in zip(a.rounds_us, b.rounds_us) if x and y]
    if not pairs:
        r = a.median_us / b.median_us
        return r, r, r
    q25, med, q75 = np.percentile(pairs, [25, 50, 75])
    return float(med), float(q25), float(q75)


def clearly_faster(a: Measurement, b: Measurement) -> bool:
    """a beats b by more than MIN_GAIN in the median round, in at least 3 of 4 rounds, and
    in the overall median."""
    med, _q25, q75 = paired_ratio(a, b)
    return med < 1.0 - MIN_GAIN and q75 < 1.0 and a.median_us < b.median_us


def clearly_slower(a: Measurement, b: Measurement) -> bool:
    """a is slower than b by more than MIN_GAIN in the median round and in 3 of 4 rounds."""
    med, q25, _q75 = paired_ratio(a, b)
    return med > 1.0 + MIN_GAIN and q25 > 1.0


def best(results: Mapping[str, Measurement], incumbent: str, gate: Callable[[Measurement], bool]) -> str:
    """The candidate that clearly beats `incumbent` by the largest margin among those
    the accuracy `gate` passes; `incumbent` when none does. KeyError/ValueError when the
    incumbent itself was not measured."""
    base = results[incumbent]
    if not base.ok:
        raise ValueError(f"{incumbent} could not be measured: {base.error}")
    winners = [
        k for k, r in results.items()
        if k != incumbent and r.ok and not r.dropped and gate(r) and clearly_faster(r, base)
    ]  # fmt: skip
    if not winners:
        return incumbent
    return min(winners, key=lambda k: paired_ratio(results[k], base)[0])


def best_lossy(
    results: Mapping[str, Measurement],
    incumbent: str,
    lossy: set[str],
    gate: Callable[[Measurement], bool],
) -> tuple[str, list[str]]:
    """The lossy candidate that passes `gate` and clearly beats the exact `incumbent`,
    in context (its quantize/dequantize boundaries measured with it); else `incumbent`.
    Also returns why each other lossy candidate lost, each reason built from the figures
    it quotes."""
    base = results[incumbent]
    winners, reasons = [], []
    for name in lossy:
        r = results.get(name)
        if r is None:
            continue
        if not r.ok:
            reasons.append(f"{name}: failed ({r.error})")
        elif not gate(r):
            reasons.append(f"{name}: outside the accuracy budget (cosine {r.cosine:.5f}, max rel error {r.max_rel_error:.3g})")
        elif r.dropped or not clearly_faster(r, base):
            med, _, _ = paired_ratio(r, base)
            reasons.append(
                f"{name}: not clearly faster than {incumbent} ({r.median_us:.1f} us vs {base.median_us:.1f} us, "
                f"median round ratio {med:.3f}; a win needs below {1 - MIN_GAIN:.2f} in 3 rounds of 4)"
            )
        else:
            winners.append(name)
    if not winners:
        return incumbent, reasons
    pick = min(winners, key=lambda k: paired_ratio(results[k], base)[0])
    return pick, reasons


def least_gain_per_error(costs: Mapping[str, tuple[float, float]]) -> str:
    """Of lossy choices with (gain in us, error as 1 - cosine), the one to back off first:
    the least gain per unit of error."""
    return min(costs, key=lambda k: costs[k][0] / max(costs[k][1], 1e-12))
