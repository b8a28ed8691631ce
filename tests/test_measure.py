"""The measurement procedure's time bound, on a clock the runs advance (no real timing)."""

from __future__ import annotations

from aoed.backends.ort.measure import interleaved
from aoed.engine.messages import MeasurePlan


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _runs(clock: _Clock, seconds: dict[str, float]) -> dict[str, object]:
    def run(s: float):
        def go() -> None:
            clock.now += s

        return go

    return {name: run(s) for name, s in seconds.items()}


def test_no_turn_starts_that_would_end_past_the_budget() -> None:
    # A turn of "b" lasts 50 ms; one begun just before the deadline would end well past
    # it: the measurement stops the round instead.
    clock = _Clock()
    plan = MeasurePlan(
        budget_s=1.0,
        min_rounds=2,
        max_rounds=1000,
        samples=5,
        sample_s=0.001,
        settle_s=0.0,
        warmup_s=0.0,
        race=False,
        until_stable=False,
    )
    t = interleaved(_runs(clock, {"a": 0.0031, "b": 0.0083}), plan, keep="a", clock=clock)
    assert clock.now <= plan.budget_s, clock.now
    rounds = len(t["a"].rounds_us)
    assert rounds >= plan.min_rounds and rounds == len(t["b"].rounds_us)
    assert all(r is not None for r in t["a"].rounds_us + t["b"].rounds_us)


def test_the_first_round_is_measured_even_past_the_budget() -> None:
    # One round is the least a comparison needs: it runs whole, then the measurement ends.
    clock = _Clock()
    plan = MeasurePlan(budget_s=0.01, samples=2, sample_s=0.001, settle_s=0.0, warmup_s=0.0)
    t = interleaved(_runs(clock, {"a": 0.004, "b": 0.004}), plan, keep="a", clock=clock)
    assert len(t["a"].rounds_us) == 1 and t["a"].rounds_us[0] is not None
    assert len(t["b"].rounds_us) == 1 and t["b"].rounds_us[0] is not None
