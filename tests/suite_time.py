"""How long the selected tests will take, said before they run.

Each run keeps every test's last duration (setup, call and teardown together) in
pytest's cache (.pytest_cache, key `aoed/durations`); the next run, once it knows which
tests it selected, prints their sum, a test with no record yet counted at the mean of
those with one. Runs without the cache (`-p no:cacheprovider`) neither read nor write it.

The figures are the last run's on whatever machine ran it, busy or idle: an estimate to
plan by, never a check.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pytest

__all__ = ["CACHE_KEY", "Estimate", "SuiteTime", "describe", "estimate", "merge"]

#: Where the durations live in pytest's cache.
CACHE_KEY = "aoed/durations"


@dataclass(frozen=True)
class Estimate:
    seconds: float  #: recorded seconds, plus the mean for each test with no record
    selected: int
    recorded: int  #: how many of the selected tests have a record


def estimate(durations: Mapping[str, float], selected: Iterable[str]) -> Estimate | None:
    """The selected tests' time by `durations` (seconds by node id); None when none of
    them has a record."""
    ids = list(selected)
    known = [durations[i] for i in ids if i in durations]
    if not known:
        return None
    total = sum(known)
    return Estimate(total + (len(ids) - len(known)) * total / len(known), len(ids), len(known))


def describe(est: Estimate | None, selected: int) -> str:
    """One line for the top of the run."""
    if est is None:
        return (
            f"suite time: {selected} tests selected, none with a recorded duration yet:"
            " no estimate (this run records them in .pytest_cache for the next)"
        )
    minutes, seconds = divmod(round(est.seconds), 60)
    unknown = est.selected - est.recorded
    rest = f"; {unknown} without one, counted at their mean" if unknown else ""
    return (
        f"suite time: about {minutes} min {seconds:02d} s for {est.selected} tests"
        f" by the last recorded durations ({est.recorded} recorded{rest})"
    )


def merge(old: object, new: Mapping[str, float]) -> dict[str, float]:
    """The record after a run: `old` (as read from the cache, possibly nonsense) with
    this run's durations over it, so a run of one file keeps every other file's."""
    kept = {}
    if isinstance(old, dict):
        kept = {
            k: float(v)
            for k, v in old.items()
            if isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
        }
    return {**kept, **new}


class SuiteTime:
    """The hooks: collect each test's phases as they are reported, print the estimate
    once collection has settled which tests run, write the record at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.durations: dict[str, float] = {}

    def _cache(self):
        return getattr(self.config, "cache", None)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        cache = self._cache()
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if cache is None or reporter is None or not session.items:
            return
        ids = [item.nodeid for item in session.items]
        reporter.write_line(describe(estimate(merge(cache.get(CACHE_KEY, {}), {}), ids), len(ids)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        cache = self._cache()
        if cache is not None and self.durations:
            cache.set(CACHE_KEY, merge(cache.get(CACHE_KEY, {}), self.durations))
