"""The decision rules, the statistics under them, and the reasons they give: every reason
string quotes figures that bear out the comparison it states."""

from __future__ import annotations

import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aoed.engine import decisions, stats
from aoed.engine.confirm import verdict_of
from aoed.engine.messages import Measurement


def _m(rounds: list[float], **kw) -> Measurement:
    return Measurement(True, median_us=stats.median(rounds), rounds_us=tuple(rounds), **kw)


def test_median_interval_uses_the_binomial_ranks() -> None:
    xs = list(range(1, 22))  # 21 values: 95% from ranks 6 and 16
    assert stats.median_ci(xs, 0.95) == (6, 16)
    assert stats.median_ci(xs, 0.90) == (7, 15)
    assert stats.median_ci([3.0, 1.0, 2.0], 0.95) == (1.0, 3.0)  # too few: the whole range
    with pytest.raises(ValueError):
        stats.median_ci([], 0.95)


def test_median_interval_covers_as_promised() -> None:
    rng = random.Random(3)
    misses = 0
    for _ in range(2000):
        sample = [rng.lognormvariate(0.0, 0.5) for _ in range(21)]  # true median 1.0
        lo, hi = stats.median_ci(sample, 0.95)
        misses += not lo <= 1.0 <= hi
    assert misses / 2000 <= 0.05 + 0.015


def test_a_win_needs_the_whole_interval_below_one() -> None:
    base = _m([100.0] * 10)
    clear = _m([90.0, 91, 89, 92, 90, 88, 91, 90, 89, 90])
    assert decisions.clearly_faster(clear, base) and not decisions.clearly_slower(clear, base)
    # Faster in the median round, but two rounds of ten slower: the 90% interval reaches 1.
    lucky = _m([90.0, 91, 89, 92, 90, 88, 91, 90, 110, 112])
    assert not decisions.clearly_faster(lucky, base)
    slow = _m([120.0, 118, 121, 119, 122, 120, 117, 121, 120, 119])
    assert decisions.clearly_slower(slow, base) and not decisions.clearly_faster(slow, base)
    few = _m([80.0, 80.0])  # two rounds decide nothing
    assert not decisions.clearly_faster(few, _m([100.0, 100.0]))


def test_a_candidate_that_clearly_beats_the_winner_takes_its_place() -> None:
    """Raced candidates are measured in different rounds: here `a` was measured in ten
    rounds, two of them when the default ran fast, so its win over the default is not
    clear, while `b` won over twenty rounds; but `a` beats `b` in every round both ran."""
    nothing = [None] * 10
    base = _m([50.0, 50.0] + [100.0] * 18)
    b = _m([60.0, 60.0] + [80.0] * 18)
    a = Measurement(True, median_us=60.0, rounds_us=(55.0, 55.0, *[60.0] * 8, *nothing))
    assert decisions.clearly_faster(b, base) and not decisions.clearly_faster(a, base)
    assert decisions.clearly_faster(a, b)
    results = {"default": base, "a": a, "b": b}
    assert decisions.best(results, "default", lambda m: True) == "a"
    assert decisions.best(results, "default", lambda m: m is not a) == "b"  # the gate still rules
    pick, reasons = decisions.best_lossy(results, "default", {"a", "b"}, lambda m: True)
    assert pick == "a" and not any(r.startswith("a: ") for r in reasons)
    dropped = {**results, "a": Measurement(True, median_us=60.0, rounds_us=a.rounds_us, dropped=True)}
    assert decisions.best_lossy(dropped, "default", {"a", "b"}, lambda m: True)[0] == "b"


def test_best_takes_the_largest_clear_win_that_passes_the_gate() -> None:
    results = {
        "default": _m([100.0] * 10),
        "a": _m([90.0] * 10),
        "b": _m([80.0] * 10, cosine=0.5),  # faster, but the gate refuses it
        "c": _m([95.0] * 10),
    }
    assert decisions.best(results, "default", lambda m: m.cosine > 0.9) == "a"
    assert decisions.best(results, "default", lambda m: False) == "default"


NUMBERS = re.compile(
    r"\((?P<x>[\d.]+) us vs (?P<y>[\d.]+) us; median round ratio (?P<r>[\d.]+), "
    r"90% interval \[(?P<lo>[\d.]+), (?P<hi>[\d.]+)\]"
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(50, 200), min_size=3, max_size=25),
    st.floats(0.7, 1.3),
    st.floats(0.0, 0.2),
)
def test_a_reason_for_not_winning_states_figures_that_bear_it_out(base_rounds, factor, jitter) -> None:
    rng = random.Random(len(base_rounds))
    cand_rounds = [b * factor * (1 + rng.uniform(-jitter, jitter)) for b in base_rounds]
    base, cand = _m(base_rounds), _m(cand_rounds)
    if decisions.clearly_faster(cand, base):
        return
    why = decisions.why_not_faster(cand, base, "default")
    m = NUMBERS.search(why)
    assert m, why
    x, y, r, lo, hi = (float(m[k]) for k in ("x", "y", "r", "lo", "hi"))
    assert x == pytest.approx(cand.median_us, abs=0.06) and y == pytest.approx(base.median_us, abs=0.06)
    med, clo, chi = decisions.paired_ratio(cand, base)
    assert (r, lo, hi) == pytest.approx((med, clo, chi), abs=6e-4)
    # The rule it quotes says no: the ratio, the interval or the medians fail it.
    assert not (r < 1 - decisions.MIN_GAIN and hi < 1.0 and x < y) or math.isclose(hi, 1.0, abs_tol=6e-4), why


def test_lossy_rejections_quote_their_own_figures() -> None:
    base = _m([100.0] * 10)
    results = {
        "exact": base,
        "q_bad": _m([50.0] * 10, cosine=0.99, max_rel_error=0.4),
        "q_slow": _m([101.0] * 10, cosine=0.99999),
        "q_broken": Measurement(False, error="load: boom"),
    }
    pick, reasons = decisions.best_lossy(results, "exact", {"q_bad", "q_slow", "q_broken"},
                                         lambda m: m.cosine >= 0.9995 and m.max_rel_error <= 0.25)  # fmt: skip
    assert pick == "exact"
    by = {r.split(":", 1)[0]: r for r in reasons}
    assert "outside the accuracy budget (cosine 0.99000, max rel error 0.4)" in by["q_bad"]
    assert "101.0 us vs 100.0 us" in by["q_slow"] and "not clearly faster than exact" in by["q_slow"]
    assert "boom" in by["q_broken"]


@pytest.mark.parametrize(
    ("ratios", "verdict"),
    [([0.8 + 0.001 * i for i in range(21)], "faster"), ([1.2 + 0.001 * i for i in range(21)], "slower"),
     ([0.9 + 0.01 * i for i in range(21)], "no significant change")],
)  # fmt: skip
def test_the_confirming_verdict_follows_its_interval(ratios: list[float], verdict: str) -> None:
    got, med, (lo, hi) = verdict_of(ratios)
    assert got == verdict
    assert lo <= med <= hi
    assert (hi < 1.0) == (verdict == "faster") and (lo > 1.0) == (verdict == "slower")


def test_the_session_search_leaves_the_thread_count_alone() -> None:
    # measured with spinning off, fewer threads win where a deployed session loses
    from aoed.engine.session import dimensions

    for cores in (1, 2, 16):
        tried = [k for _, values in dimensions(cores) for v in values for k in v]
        assert tried and "intra_op_num_threads" not in tried


def test_a_banked_thread_count_is_kept_only_while_the_cores_are_free() -> None:
    from aoed.engine.session import QUIET_SCALING, busy_cores_note

    one = _m([520.0, 530.0, 525.0])
    assert busy_cores_note(one, _m([290.0, 295.0, 300.0]), 2) is None  # 1.78x: free
    note = busy_cores_note(one, _m([520.0, 528.0, 531.0]), 2)  # no faster on two: busy
    assert note is not None and "not tuned" in note and "0.99x" in note and f"{QUIET_SCALING}x" in note
    assert busy_cores_note(one, _m([525.0 / QUIET_SCALING * 1.01] * 3), 2) is not None  # just under
    failed = busy_cores_note(Measurement(False, error="boom"), _m([290.0]), 2)
    assert failed is not None and "could not be measured" in failed


def test_the_cores_probe_is_one_product_that_runs_alike_on_one_thread_and_on_two(tmp_path) -> None:
    import numpy as np
    import onnxruntime as ort

    from aoed.engine.session import probe_model

    model, inputs = probe_model(tmp_path)
    with np.load(inputs, allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files}
    outs = []
    for threads in (1, 2):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
        assert [i.name for i in sess.get_inputs()] == list(feeds)
        outs.append(sess.run(None, feeds)[0])
    assert outs[0].shape == (256, 512)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-3)
    again, again_inputs = probe_model(tmp_path / "again")  # the same probe every time
    assert again.read_bytes() == model.read_bytes() and again_inputs.read_bytes() == inputs.read_bytes()


def test_only_a_thread_count_below_the_cores_is_checked_again() -> None:
    from aoed.engine.session import fewer_threads

    assert fewer_threads({"intra_op_num_threads": 1}, 2)
    assert not fewer_threads({"intra_op_num_threads": 2}, 2)
    assert not fewer_threads({"graph_optimization_level": "basic"}, 2)
    assert not fewer_threads({"intra_op_num_threads": 0}, 4)  # onnxruntime's default: every core
