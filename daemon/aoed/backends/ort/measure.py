"""The one measurement procedure, used by the runner and by the benchmarks alike.

Every candidate gets the same inputs. After a warm-up that also sizes a batch (runs per
timed sample, so that a sample lasts about `sample_s` and the clock's resolution does not
matter), rounds follow: in each, every surviving candidate takes its turn, in an order
that rotates from round to round, so slow drift of the machine hits all alike. Before
each turn the process sleeps briefly and runs the session once untimed, so cold caches
stay out of the timed samples. That does not keep idle sessions' spinning intra-op
threads out once there are several: sessions must be made with spinning off (the
runner's `quiet`), or each runs slower beside the others (2.5x for a ResNet-18 beside
four sessions on 2 cores).

Time is bounded by the plan's budget (warm-up and rounds together): after the first
round, no turn starts that would end past it, by the length of that candidate's last
turn (or its warm-up's estimate before it has one), so a measurement ends within its
budget however slow a turn is on a busy machine; a round cut short by it is discarded,
so every kept round has every survivor in it; samples per turn shrink so that the
minimum rounds fit when they can. A candidate whose single run takes longer than the
whole budget is dropped with that reason (the reference is measured for one round all
the same). After `min_rounds`, with racing, a candidate whose lower quartile is clearly
above the best's upper quartile is dropped; rounds stop early once every survivor's
median is stable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from aoed.engine.messages import MeasurePlan

__all__ = ["LocalTurns", "Timing", "Turns", "interleaved", "rounds"]


@dataclass
class Timing:
    median_us: float = 0.0
    spread: float = 0.0  # (q75 - q25) / median of the samples
    repeats: int = 0  # timed runs
    min_us: float = 0.0
    q25_us: float = 0.0
    q75_us: float = 0.0
    #: per-round medians in us, None where the candidate was not measured (dropped)
    rounds_us: list[float | None] = field(default_factory=list)
    dropped: bool = False
    reason: str = ""
    batch: int = 1  # runs per timed sample

    def summary(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "batch"}


def _fill(t: Timing, samples: list[float]) -> None:
    if not samples:
        return
    a = np.asarray(samples) * 1e6
    q25, med, q75 = np.percentile(a, [25, 50, 75])
    t.median_us, t.q25_us, t.q75_us = float(med), float(q25), float(q75)
    t.spread = float((q75 - q25) / med) if med > 0 else 0.0
    t.repeats = len(samples) * t.batch
    t.min_us = float(a.min())


class Turns(Protocol):
    """Where the candidates run: in this process (`LocalTurns`), or each in a process of
    its own (deployed.py). The procedure drives both alike."""

    def warm(self, name: str, warmup_s: float) -> float:
        """Run `name` for about `warmup_s` (at least once, at most 200 runs); seconds per run."""
        ...

    def turn(self, name: str, samples: int, batch: int) -> list[float]:
        """One untimed run of `name`, then `samples` timed batches of `batch` runs; the
        seconds per run of each batch."""
        ...


class LocalTurns:
    """Turns of callables in this process (a session run on its inputs)."""

    def __init__(self, runs: Mapping[str, Callable[[], object]], clock: Callable[[], float]):
        self.runs, self.clock = runs, clock

    def warm(self, name: str, warmup_s: float) -> float:
        run, clock = self.runs[name], self.clock
        t0 = clock()
        n = 0
        while n < 1 or (clock() - t0 < warmup_s and n < 200):
            run()
            n += 1
        return (clock() - t0) / n

    def turn(self, name: str, samples: int, batch: int) -> list[float]:
        run, clock = self.runs[name], self.clock
        run()
        got = []
        for _ in range(samples):
            t0 = clock()
            for _ in range(batch):
                run()
            got.append((clock() - t0) / batch)
        return got


def interleaved(
    runs: Mapping[str, Callable[[], object]],
    plan: MeasurePlan,
    keep: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Time every callable in `runs` (a session run on its inputs) per `plan`; `keep`
    (the reference) is never dropped by racing. Returns a Timing per name."""
    return rounds(LocalTurns(runs, clock), list(runs), plan, keep, clock)


def rounds(
    turns: Turns,
    names: list[str],
    plan: MeasurePlan,
    keep: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Time the candidates `names` that `turns` runs, per `plan` (see the module doc);
    `keep` (the reference) is never dropped by racing. Returns a Timing per name."""
    start = clock()
    deadline = start + plan.budget_s
    timings = {name: Timing() for name in names}
    per_run: dict[str, float] = {}
    for name in names:
        per_run[name] = turns.warm(name, plan.warmup_s)
        timings[name].batch = max(1, min(1000, math.ceil(plan.sample_s / max(per_run[name], 1e-7))))
    alive = []
    for name in names:
        if per_run[name] > plan.budget_s and name != keep:
            timings[name].dropped = True
            timings[name].reason = (
                f"overran: one run took {per_run[name]:.3g} s, longer than the measurement's "
                f"whole budget of {plan.budget_s:.3g} s"
            )
        else:
            alive.append(name)

    def turn_estimate(name: str, samples: int) -> float:
        """A turn of `name` by its warm-up: the settle, the untimed run, the samples."""
        return plan.settle_s + per_run[name] * (1 + samples * timings[name].batch)

    # Samples per turn: as planned, fewer when the minimum rounds would not fit.
    turn_s = sum(turn_estimate(n, plan.samples) for n in alive)
    remaining = max(0.0, deadline - clock())
    samples = plan.samples
    if turn_s > 0 and turn_s * plan.min_rounds > remaining:
        one = sum(timings[n].batch * per_run[n] for n in alive) or 1e-9
        fixed = sum(plan.settle_s + per_run[n] for n in alive)
        samples = max(1, int((remaining / plan.min_rounds - fixed) / one))
        samples = min(samples, plan.samples)
    collected: dict[str, list[float]] = {n: [] for n in names}
    # How long each candidate's turn takes: estimated from its warm-up, then as measured.
    turn_len = {n: turn_estimate(n, samples) for n in alive}
    for rnd in range(plan.max_rounds):
        if not alive:
            break
        prev = {n: float(np.median(collected[n])) for n in alive if collected[n]}
        k = rnd % len(alive)
        order = alive[k:] + alive[:k]
        turn: dict[str, list[float]] = {}
        cut = False
        for name in order:
            if rnd > 0 and clock() + turn_len[name] > deadline:
                cut = True  # the budget would be passed: this round would be partial
                break
            began = clock()
            time.sleep(plan.settle_s)
            turn[name] = turns.turn(name, samples, timings[name].batch)
            turn_len[name] = clock() - began
        if cut:
            break
        for name in names:
            if name in turn:
                collected[name].extend(turn[name])
                timings[name].rounds_us.append(float(np.median(turn[name])) * 1e6)
            else:
                timings[name].rounds_us.append(None)
        for name in alive:
            _fill(timings[name], collected[name])
        if clock() > deadline:
            break
        if rnd + 1 < plan.min_rounds:
            continue
        if plan.race and len(alive) > 1:
            best = min(alive, key=lambda n: timings[n].median_us)
            for name in list(alive):
                if name in (best, keep):
                    continue
                if timings[name].q25_us > timings[best].q75_us * (1 + plan.drop_margin):
                    alive.remove(name)
                    timings[name].dropped = True
                    timings[name].reason = (
                        f"dropped after {rnd + 1} rounds: lower quartile {timings[name].q25_us:.1f} us above "
                        f"{best}'s upper quartile {timings[best].q75_us:.1f} us by more than {plan.drop_margin:.0%}"
                    )
        if plan.until_stable and all(
            n in prev
            and abs(timings[n].median_us - prev[n] * 1e6) <= plan.rel_tol * timings[n].median_us
            for n in alive
        ):
            break
    return timings
