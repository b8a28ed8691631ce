"""How long the selected tests will take, said before they run.

Each run keeps every test's last duration (setup, call and teardown together) in
pytest's cache (.pytest_cache, key `aoed/durations`); the next run, once it knows which
tests it selected, prints their sum, a test with no record yet counted at the mean of
those with one. Runs without the cache (`-p no:cacheprovider`) neither read nor write it.

Under pytest-xdist (`make test` runs `-n 2`), the controller prints the line once the
first worker has collected, spreading the tests over the workers (`Estimate.workers`);
each test's record is then its duration beside the other workers, so it plans the next
parallel run. Workers neither print nor write the record: the controller does.

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
    #: recorded seconds (a test with no record counted at the mean), over the workers
    seconds: float
    selected: int
    recorded: int  #: how many of the selected tests have a record
    workers: int = 1


def estimate(
    durations: Mapping[str, float], selected: Iterable[str], workers: int = 1
) -> Estimate | None:
    """The selected tests' time by `durations` (seconds by node id) when `workers` run
    them side by side: their sum spread evenly, but never less than the longest test;
    None when none of them has a record."""
    ids = list(selected)
    known = [durations[i] for i in ids if i in durations]
    if not known:
        return None
    total = sum(known)
    total += (len(ids) - len(known)) * total / len(known)
    workers = max(1, workers)
    return Estimate(max(total / workers, max(known)), len(ids), len(known), workers)


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
    on = f" on {est.workers} workers" if est.workers > 1 else ""
    return (
        f"suite time: about {minutes} min {seconds:02d} s for {est.selected} tests{on}"
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
        self.worker = hasattr(config, "workerinput")  # an xdist worker: the controller reports
        self.said = False

    def _cache(self):
        return None if self.worker else getattr(self.config, "cache", None)

    def _say(self, ids: list[str]) -> None:
        cache = self._cache()
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if self.said or cache is None or reporter is None or not ids:
            return
        self.said = True
        workers = len(getattr(self.config.option, "tx", None) or ()) or 1
        est = estimate(merge(cache.get(CACHE_KEY, {}), {}), ids, workers)
        reporter.write_line(describe(est, len(ids)))

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._say([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        self._say(list(ids))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        cache = self._cache()
        if cache is not None and self.durations:
            cache.set(CACHE_KEY, merge(cache.get(CACHE_KEY, {}), self.durations))
