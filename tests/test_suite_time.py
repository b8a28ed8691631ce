"""The suite's time estimate (tests/suite_time.py): its arithmetic, and a real pytest
run that records durations and a second that prints the estimate from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .suite_time import CACHE_KEY, Estimate, describe, estimate, merge


def test_the_estimate_sums_the_records_and_counts_a_test_without_one_at_their_mean() -> None:
    durations = {"a": 3.0, "b": 1.0, "gone": 100.0}
    assert estimate(durations, ["a", "b"]) == Estimate(4.0, 2, 2)
    # "new" has no record: counted at the mean of a and b; "gone" is not selected.
    assert estimate(durations, ["a", "b", "new"]) == Estimate(6.0, 3, 2)
    assert estimate(durations, ["a"]) == Estimate(3.0, 1, 1)
    assert estimate(durations, ["new", "newer"]) is None
    assert estimate({}, ["a"]) is None
    # Side by side: the sum spread over the workers, never below the longest test.
    assert estimate({"a": 3.0, "b": 1.0, "c": 2.0}, ["a", "b", "c"], workers=2) == Estimate(
        3.0, 3, 3, 2
    )
    assert estimate({"a": 5.0, "b": 1.0}, ["a", "b"], workers=2).seconds == 5.0
    assert estimate({"a": 3.0, "b": 3.0}, ["a", "b", "new"], workers=3).seconds == 3.0


def test_the_line_says_minutes_and_seconds_and_what_it_rests_on() -> None:
    assert describe(Estimate(599.6, 1170, 1170), 1170) == (
        "suite time: about 10 min 00 s for 1170 tests by the last recorded durations"
        " (1170 recorded)"
    )
    assert "for 1170 tests on 2 workers by" in describe(Estimate(300.0, 1170, 1170, 2), 1170)
    line = describe(Estimate(61.0, 10, 7), 10)
    assert "about 1 min 01 s for 10 tests" in line and "3 without one" in line, line
    none = describe(None, 5)
    assert "5 tests selected" in none and "no estimate" in none, none


def test_a_run_keeps_the_records_of_tests_it_did_not_run_and_drops_nonsense() -> None:
    old = {"a": 2.0, "b": 5.0, "bad": "slow", "neg": -1.0, 3: 1.0}
    assert merge(old, {"b": 1.5, "c": 0.25}) == {"a": 2.0, "b": 1.5, "c": 0.25}
    assert merge("not a mapping", {"c": 1.0}) == {"c": 1.0}
    assert merge(None, {}) == {}


_CONFTEST = """
from suite_time import SuiteTime


def pytest_configure(config):
    config.pluginmanager.register(SuiteTime(config), "aoed-suite-time")
"""

_TESTS = """
import time


def test_one():
    time.sleep(0.05)


def test_two():
    pass
"""


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    # Only the plugin under test: no third-party plugin loads, so each run starts quickly.
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parent),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *args, str(root)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_a_run_records_each_test_and_the_next_run_prints_their_sum(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_x.py").write_text(_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")

    first = _pytest(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 tests selected, none with a recorded duration yet" in first.stdout, first.stdout
    record = json.loads((tmp_path / ".pytest_cache/v" / CACHE_KEY).read_text())
    assert set(record) == {"test_x.py::test_one", "test_x.py::test_two"}
    assert record["test_x.py::test_one"] >= 0.05  # setup, call and teardown together

    second = _pytest(tmp_path, "-k", "one")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "for 1 tests by the last recorded durations (1 recorded)" in second.stdout
    # Without the cache nothing is read, written or printed.
    third = _pytest(tmp_path, "-p", "no:cacheprovider")
    assert third.returncode == 0 and "suite time" not in third.stdout, third.stdout


@pytest.mark.slow
def test_under_xdist_the_controller_prints_the_estimate_over_its_workers_and_keeps_the_record(
    tmp_path: Path,
) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_x.py").write_text(_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    xdist = ("-p", "xdist", "-n", "2")

    first = _pytest(tmp_path, *xdist)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("none with a recorded duration yet") == 1, first.stdout
    record = json.loads((tmp_path / ".pytest_cache/v" / CACHE_KEY).read_text())
    assert set(record) == {"test_x.py::test_one", "test_x.py::test_two"}
    assert record["test_x.py::test_one"] >= 0.05

    second = _pytest(tmp_path, *xdist)
    assert second.returncode == 0, second.stdout + second.stderr
    lines = [ln for ln in second.stdout.splitlines() if ln.startswith("suite time:")]
    assert len(lines) == 1 and "for 2 tests on 2 workers by" in lines[0], second.stdout
