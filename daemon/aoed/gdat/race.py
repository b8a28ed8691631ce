"""Interleaved rounds of DDP configurations over one or more worlds, with racing.

A race measures its configurations round by round. In each round every configuration
still in the race runs once (a fresh DDP, warm-up steps, measured steps), in an order
that rotates from round to round, in the world its options need; where a race spans
several worlds, they take turns within the round. So the ratio of two configurations
within one round is free of the machine's slow drift, and `aoed.engine.decisions`
judges them on those paired ratios, as OPAT judges its candidates.

A round's figure for a configuration is the median over its measured steps of the
slowest rank's step (ranks wait for each other at every reduction, so the slowest is
the world's step), and likewise for the communication tail. Per-rank figures are kept.

After `decisions.MIN_ROUNDS` rounds, a configuration clearly slower than the leader is
dropped (unless protected: the incumbent and DDP's defaults stay to the end). When the
planned rounds leave configurations that look faster than the incumbent but are not yet
clearly so (the caller's `settle` names them), those and the incumbent alone get more
rounds, up to a cap: a noisy machine spends its extra turns on the close calls, not on
the configurations already told apart.

Each configuration's turn is one request to the world, so a world that breaks (a rank
killed, hung or failed) costs one turn: that configuration's figure for that round. The
failure is recorded and the next turn starts a fresh world. A configuration whose turns
broke the world twice is measured no more; `MAX_FAILURES` broken turns in a row (nothing
works any more) fail the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from aoe.errors import DeviceError
from aoe.gdat import DDPConfig
from aoed.engine import stats
from aoed.engine.decisions import MIN_ROUNDS, clearly_slower, paired_ratio
from aoed.engine.messages import Measurement
from aoed.engine.rankmessages import RankMeasureRequest
from aoed.engine.world import World, WorldError

__all__ = ["MAX_FAILURES", "Entrant", "Meter", "RaceFigures", "race"]

log = logging.getLogger(__name__)

#: Broken turns in a row (worlds torn down) a job survives; the next one fails it.
MAX_FAILURES = 3
#: How long the first turn of a job may take before its world is called hung: nothing is
#: known of the model's speed yet (afterwards, 20 times the average turn).
FIRST_TURN_LIMIT_S = 600.0


@dataclass(frozen=True)
class Entrant:
    name: str
    config: DDPConfig
    world: str = ""  # the key of its world ("" the job's main world)


@dataclass
class RaceFigures:
    """One configuration's measurement in one race."""

    stage: str
    name: str
    config: DDPConfig
    world: str = ""
    rounds_us: list[float | None] = field(default_factory=list)
    tails_us: list[float | None] = field(default_factory=list)
    rank_steps_us: list[list[float]] = field(default_factory=list)
    rank_tails_us: list[list[float]] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)
    error: str = ""
    dropped: str = ""
    breaks: int = 0  # turns of this configuration during which the world broke

    def to_json(self) -> dict[str, Any]:
        """Everything measured, for a resumed job to take over (`from_json`)."""
        return {
            "stage": self.stage,
            "name": self.name,
            "params": self.config.to_params(),
            "world": self.world,
            "rounds_us": self.rounds_us,
            "tails_us": self.tails_us,
            "rank_steps_us": self.rank_steps_us,
            "rank_tails_us": self.rank_tails_us,
            "buckets": self.buckets,
            "error": self.error,
            "dropped": self.dropped,
            "breaks": self.breaks,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RaceFigures:
        return cls(
            stage=str(d["stage"]),
            name=str(d["name"]),
            config=DDPConfig.from_params(d["params"]),
            world=str(d.get("world", "")),
            rounds_us=[None if v is None else float(v) for v in d.get("rounds_us", [])],
            tails_us=[None if v is None else float(v) for v in d.get("tails_us", [])],
            rank_steps_us=[[float(v) for v in r] for r in d.get("rank_steps_us", [])],
            rank_tails_us=[[float(v) for v in r] for r in d.get("rank_tails_us", [])],
            buckets=[int(b) for b in d.get("buckets", [])],
            error=str(d.get("error", "")),
            dropped=str(d.get("dropped", "")),
            breaks=int(d.get("breaks", 0)),
        )

    def measurement(self) -> Measurement:
        values = [v for v in self.rounds_us if v]
        if not values:
            return Measurement(
                ok=False, error=self.error or "not measured", rounds_us=tuple(self.rounds_us)
            )
        q25, q75 = stats.quantile(values, 0.25), stats.quantile(values, 0.75)
        med = stats.median(values)
        return Measurement(
            ok=True,
            median_us=med,
            spread=(q75 - q25) / med if med else 0.0,
            repeats=sum(map(len, self.rank_steps_us[:1])),
            min_us=min(values),
            q25_us=q25,
            q75_us=q75,
            dropped=bool(self.dropped),
            reason=self.dropped,
            rounds_us=tuple(self.rounds_us),
        )

    @property
    def tail_us(self) -> float:
        values = [v for v in self.tails_us if v is not None]
        return stats.median(values) if values else 0.0

    def per_rank(self) -> list[dict[str, float]]:
        """Median step and tail of each rank over every measured step, in ms."""
        out = []
        for steps, tails in zip(self.rank_steps_us, self.rank_tails_us, strict=False):
            if steps:
                out.append(
                    {
                        "step_ms": round(stats.median(steps) / 1e3, 4),
                        "tail_ms": round(stats.median(tails) / 1e3, 4) if tails else 0.0,
                    }
                )
        return out


@dataclass
class Meter:
    """What the races share in one job: the worlds, the request settings, the device-time
    accounting and the record of broken turns."""

    worlds: dict[str, World]
    charge: Callable[[float, str], None]  # (device seconds, category)
    remaining_s: Callable[[], float]
    emit: Callable[[str, str, int, int], None] = lambda kind, message, done, total: None
    warmup: int = 2
    steps: int = 5
    failures: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: seconds one configuration's turn in a round took, on average (the cost model)
    turn_s: float = 0.0
    _turns: int = 0
    #: broken turns since the last good one
    broken_in_a_row: int = 0

    def limit_s(self, turns: int = 1) -> float:
        """How long a request of `turns` configuration turns may take before its world is
        called hung: generous, a safety net rather than a schedule."""
        if not self._turns:
            return FIRST_TURN_LIMIT_S * turns
        return max(120.0, 20 * self.turn_s * turns)

    def observe(self, seconds: float, turns: int) -> None:
        if turns:
            self.turn_s = (self.turn_s * self._turns + seconds) / (self._turns + turns)
            self._turns += turns


async def _turn(
    meter: Meter, stage: str, category: str, n: int, world_key: str, e: Entrant, f: RaceFigures
) -> None:
    """One configuration's turn in round `n`: its figure for the round, or None."""
    request = RankMeasureRequest(
        configs={e.name: e.config.to_params()},
        order=[e.name],
        warmup=meter.warmup,
        steps=meter.steps,
    )
    started = time.monotonic()
    try:
        replies = await meter.worlds[world_key].call(request, meter.limit_s())
    except WorldError as exc:
        meter.charge(time.monotonic() - started, category)
        meter.failures.append(
            {
                "stage": stage,
                "round": n,
                "world": world_key or "main",
                "configuration": e.name,
                "error": str(exc),
            }
        )
        log.warning("%s round %d, %s: %s", stage, n, e.name, exc)
        meter.broken_in_a_row += 1
        if meter.broken_in_a_row >= MAX_FAILURES:
            raise DeviceError(
                f"GDAT worlds broke {meter.broken_in_a_row} times in a row; the last: {exc}"
            ) from None
        f.breaks += 1
        if f.breaks >= 2:
            f.error = f"its world broke during two of its turns; the last: {exc}"
        f.rounds_us.append(None)
        f.tails_us.append(None)
        return
    seconds = time.monotonic() - started
    meter.charge(seconds, category)
    meter.observe(seconds, 1)
    meter.broken_in_a_row = 0
    results = [rep["results"].get(e.name, {}) for rep in replies]
    err = next((r["error"] for r in results if r.get("error")), "")
    if err:
        f.error = err
        f.rounds_us.append(None)
        f.tails_us.append(None)
        return
    steps = [r["step_us"] for r in results]
    tails = [r["tail_us"] for r in results]
    if not f.rank_steps_us:
        f.rank_steps_us = [[] for _ in replies]
        f.rank_tails_us = [[] for _ in replies]
    for rank, (s, t) in enumerate(zip(steps, tails, strict=True)):
        f.rank_steps_us[rank] += s
        f.rank_tails_us[rank] += t
    f.rounds_us.append(stats.median([max(vals) for vals in zip(*steps, strict=True)]))
    f.tails_us.append(stats.median([max(vals) for vals in zip(*tails, strict=True)]))
    f.buckets = list(results[0].get("buckets") or [])


async def race(
    meter: Meter,
    stage: str,
    entrants: Sequence[Entrant],
    rounds: int,
    *,
    category: str = "search",
    protect: frozenset[str] = frozenset(),
    drop: bool = True,
    min_rounds: int = MIN_ROUNDS,
    settle: Callable[[dict[str, RaceFigures]], Collection[str]] | None = None,
    max_rounds: int = 0,
) -> dict[str, RaceFigures]:
    """Measure `entrants` in up to `rounds` interleaved rounds (fewer when the budget
    runs out: a round starts only while its estimated cost fits); returns their figures
    by name. After `rounds`, while `settle` names two or more entrants still to be told
    apart, those alone get further rounds, up to `max_rounds` in all. Raises DeviceError
    after MAX_FAILURES broken turns in a row, and the job's own errors (ModelError,
    OptionError) as the world raises them."""
    figs = {e.name: RaceFigures(stage, e.name, e.config, e.world) for e in entrants}
    worlds = sorted({e.world for e in entrants})
    for n in range(max(rounds, max_rounds)):
        alive = [e for e in entrants if not figs[e.name].dropped and not figs[e.name].error]
        total = rounds
        if n >= rounds:
            focus = set(settle(figs)) if settle is not None else set()
            alive = [e for e in alive if e.name in focus]
            if len(alive) < 2:
                break
            total = max_rounds
        if not alive:
            break
        cost = meter.turn_s * len(alive)
        if n >= min_rounds and cost > meter.remaining_s():
            meter.notes.append(f"{stage}: {n} of {total} rounds; the device budget allowed no more")
            break
        meter.emit(
            "progress",
            f"{stage}: round {n + 1} of {total}, {len(alive)} configurations",
            n,
            total,
        )
        shift = n % len(alive)
        order = alive[shift:] + alive[:shift]
        for w in worlds[n % len(worlds) :] + worlds[: n % len(worlds)]:
            for e in order:
                if e.world == w:
                    await _turn(meter, stage, category, n, w, e, figs[e.name])
        for e in entrants:  # every figure list has one entry per round, measured or not
            f = figs[e.name]
            while len(f.rounds_us) < n + 1:
                f.rounds_us.append(None)
                f.tails_us.append(None)
        if drop and n + 1 >= min_rounds:
            _drop(figs, protect)
    return figs


def _drop(figs: dict[str, RaceFigures], protect: frozenset[str]) -> None:
    live = {k: f.measurement() for k, f in figs.items() if not f.dropped and not f.error}
    ok = {k: m for k, m in live.items() if m.ok}
    if len(ok) < 2:
        return
    leader = min(ok, key=lambda k: ok[k].median_us)
    for k, m in ok.items():
        if k == leader or k in protect:
            continue
        if clearly_slower(m, ok[leader]):
            med, lo, hi = paired_ratio(m, ok[leader])
            figs[k].dropped = (
                f"clearly slower than {leader} (median round ratio {med:.3f}, 90% interval "
                f"[{lo:.3f}, {hi:.3f}])"
            )
