"""Small statistics for timings: paired ratios and distribution-free median intervals.

Timings on a shared machine are neither normal nor independent of the machine's drift.
Two things hold anyway: a ratio of two candidates measured in the same interleaved round
cancels the drift, and the median of such ratios has an exact confidence interval from
order statistics (the number of ratios below the true median is binomial(n, 1/2)),
whatever their distribution. Everything that calls one measurement faster than another
goes through here: the tuner's decisions, its confirming A/B and the benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["median", "median_ci", "paired_ratios", "quantile"]


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (linear interpolation, as numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def paired_ratios(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
    """Round-by-round ratios a/b where both were measured in the round (rounds past the
    shorter series were not)."""
    return [x / y for x, y in zip(a, b, strict=False) if x and y]


def median_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of the population `values` came from,
    covering it with at least `confidence`: the order statistics (k, n + 1 - k) with the
    largest k such that P(k <= Binomial(n, 1/2) <= n - k) >= confidence. With too few
    values for that confidence it is the whole range."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")
    best = 1
    for k in range(1, n // 2 + 1):
        # P(at least k values below and at least k above the median)
        tail = sum(math.comb(n, i) for i in range(k)) / 2**n
        if 1 - 2 * tail >= confidence:
            best = k
        else:
            break
    return xs[best - 1], xs[n - best]
