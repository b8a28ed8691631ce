"""The decision rules, the statistics under them, and the reasons they give: every reason
string quotes figures that bear out the comparison it states."""

from __future__ import annotations

import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aoe.bankrecord import BankRecord
from aoed.engine import bankrules, decisions, stats
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
    dropped = {
        **results,
        "a": Measurement(True, median_us=60.0, rounds_us=a.rounds_us, dropped=True),
    }
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
def test_a_reason_for_not_winning_states_figures_that_bear_it_out(
    base_rounds, factor, jitter
) -> None:
    rng = random.Random(len(base_rounds))
    cand_rounds = [b * factor * (1 + rng.uniform(-jitter, jitter)) for b in base_rounds]
    base, cand = _m(base_rounds), _m(cand_rounds)
    if decisions.clearly_faster(cand, base):
        return
    why = decisions.why_not_faster(cand, base, "default")
    m = NUMBERS.search(why)
    assert m, why
    x, y, r, lo, hi = (float(m[k]) for k in ("x", "y", "r", "lo", "hi"))
    assert x == pytest.approx(cand.median_us, abs=0.06) and y == pytest.approx(
        base.median_us, abs=0.06
    )
    med, clo, chi = decisions.paired_ratio(cand, base)
    assert (r, lo, hi) == pytest.approx((med, clo, chi), abs=6e-4)
    # The rule it quotes says no: the ratio, the interval or the medians fail it.
    assert not (r < 1 - decisions.MIN_GAIN and hi < 1.0 and x < y) or math.isclose(
        hi, 1.0, abs_tol=6e-4
    ), why


def test_lossy_rejections_quote_their_own_figures() -> None:
    base = _m([100.0] * 10)
    results = {
        "exact": base,
        "q_bad": _m([50.0] * 10, cosine=0.99, max_rel_error=0.4),
        "q_slow": _m([101.0] * 10, cosine=0.99999),
        "q_broken": Measurement(False, error="load: boom"),
    }
    pick, reasons = decisions.best_lossy(
        results,
        "exact",
        {"q_bad", "q_slow", "q_broken"},
        lambda m: m.cosine >= 0.9995 and m.max_rel_error <= 0.25,
    )
    assert pick == "exact"
    by = {r.split(":", 1)[0]: r for r in reasons}
    assert "outside the accuracy budget (cosine 0.99000, max rel error 0.4)" in by["q_bad"]
    assert (
        "101.0 us vs 100.0 us" in by["q_slow"] and "not clearly faster than exact" in by["q_slow"]
    )
    assert "boom" in by["q_broken"]


def test_a_lossy_choice_steps_to_the_fastest_alternate_more_accurate_than_it() -> None:
    """What a refused or backed-off lossy choice steps to: the other lossy candidates
    within the gate that ran faster than the exact form (one dropped early behind the
    choice too), fastest first; then the fastest more accurate than the step it left and
    not yet tried; none when only the exact form is left."""
    results = {
        "exact": _m([100.0] * 10),
        "q4": _m([20.0] * 10, cosine=0.9996),  # the choice
        "q8_dropped": Measurement(
            True, median_us=40.0, rounds_us=(40.0,) * 3, cosine=0.99995, dropped=True
        ),
        "q8_fast": _m([30.0] * 10, cosine=0.9997),
        "q_outside": _m([10.0] * 10, cosine=0.99),  # outside the gate
        "q_slower": _m([120.0] * 10, cosine=0.99999),  # slower than the exact form
        "q_broken": Measurement(False, error="load: boom"),
    }
    lossy = set(results) - {"exact"}
    alts = decisions.lossy_alternates(
        results, "exact", lossy, lambda m: m.cosine >= 0.9995, chosen="q4"
    )
    assert [a[0] for a in alts] == ["q8_fast", "q8_dropped"]
    assert alts[0] == ("q8_fast", 30.0, pytest.approx(0.0003))
    step = decisions.next_alternate(alts, 1 - 0.9996, {"q4"})
    assert step is not None and step[0] == "q8_fast"
    # backed off again: only what is more accurate than q8_fast and untried is left
    step = decisions.next_alternate(alts, step[2], {"q4", "q8_fast"})
    assert step is not None and step[0] == "q8_dropped"
    assert decisions.next_alternate(alts, step[2], {"q4", "q8_fast", "q8_dropped"}) is None
    # a refused choice more accurate than every alternate has nowhere to step
    assert decisions.next_alternate(alts, 1e-6, {"q4"}) is None


@pytest.mark.parametrize(
    ("ratios", "verdict"),
    [
        ([0.8 + 0.001 * i for i in range(21)], "faster"),
        ([1.2 + 0.001 * i for i in range(21)], "slower"),
        ([0.9 + 0.01 * i for i in range(21)], "no significant change"),
    ],
)
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
    assert (
        note is not None and "not tuned" in note and "0.99x" in note and f"{QUIET_SCALING}x" in note
    )
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
    assert (
        again.read_bytes() == model.read_bytes()
        and again_inputs.read_bytes() == inputs.read_bytes()
    )


def test_only_a_thread_count_below_the_cores_is_checked_again() -> None:
    from aoed.engine.session import fewer_threads

    assert fewer_threads({"intra_op_num_threads": 1}, 2)
    assert not fewer_threads({"intra_op_num_threads": 2}, 2)
    assert not fewer_threads({"graph_optimization_level": "basic"}, 2)
    assert not fewer_threads({"intra_op_num_threads": 0}, 4)  # onnxruntime's default: every core


# --------------------------------------------------------------------------- ties


def _runs(
    rng: random.Random, centers: dict[str, float], rounds: int = 10
) -> dict[str, Measurement]:
    """Per-round medians as the runner records them for one task: each round the machine
    runs everything faster or slower alike (drift, up to about ±20% here, as on a shared
    2-core machine), and each candidate's turn adds its own jitter (about ±5%) and now and
    then a slow outlier round (another process took a core)."""
    drift = [rng.lognormvariate(0.0, 0.08) for _ in range(rounds)]
    out = {}
    for name, center in centers.items():
        xs = [
            center * d * rng.lognormvariate(0.0, 0.03) * (1.6 if rng.random() < 0.05 else 1.0)
            for d in drift
        ]
        out[name] = _m(xs, cosine=0.99998)
    return out


# One conv task of the sample CNN at int8: QDQ around the Conv is fused by onnxruntime
# into the QLinearConv the other form writes out, so the two run the same kernel.
CONV = {"default": 190.0, "int8_qdq": 80.0, "int8_qlinearconv": 80.0}


def test_two_int8_forms_that_tie_give_the_same_choice_in_every_run() -> None:
    def ok(m: Measurement) -> bool:
        return True

    picks = []
    for seed in range(200):
        results = _runs(random.Random(seed), CONV)
        pick, _ = decisions.best_lossy(results, "default", {"int8_qdq", "int8_qlinearconv"}, ok)
        picks.append(pick)
        # The later form takes the place only by clearly beating the earlier one.
        beaten = decisions.clearly_faster(results["int8_qlinearconv"], results["int8_qdq"])
        assert pick == ("int8_qlinearconv" if beaten else "int8_qdq"), seed
        # The order of preference decides, not the run: listed the other way round, the
        # same measurements give the other form.
        swapped = {k: results[k] for k in ("default", "int8_qlinearconv", "int8_qdq")}
        back = decisions.clearly_faster(results["int8_qdq"], results["int8_qlinearconv"])
        got, _ = decisions.best_lossy(swapped, "default", {"int8_qdq", "int8_qlinearconv"}, ok)
        assert got == ("int8_qdq" if back else "int8_qlinearconv"), seed
    # The lowest measured ratio would have split these about evenly.
    assert picks.count("int8_qdq") >= 190, picks.count("int8_qdq")


def test_a_later_form_that_is_clearly_faster_still_wins() -> None:
    wins = 0
    for seed in range(50):
        results = _runs(random.Random(seed), {**CONV, "int8_qlinearconv": 60.0})
        clear = decisions.clearly_faster(results["int8_qlinearconv"], results["int8_qdq"])
        want = "int8_qlinearconv" if clear else "int8_qdq"
        assert (
            decisions.best_lossy(
                results, "default", {"int8_qdq", "int8_qlinearconv"}, lambda m: True
            )[0]
            == want
        )
        assert decisions.best(results, "default", lambda m: True) == want
        wins += clear
    assert wins >= 40, wins  # a 25% gain is clear, except where outlier rounds hide it


def test_the_default_keeps_its_place_against_forms_that_tie_with_it() -> None:
    wins = 0
    for seed in range(200):
        results = _runs(
            random.Random(seed), {"default": 50.0, "gemm_pretransposed": 50.0, "fused_gemm": 50.0}
        )
        pick = decisions.best(results, "default", lambda m: True)
        wins += pick != "default"
    assert wins <= 10, wins


def test_ranked_keeps_the_order_of_preference_among_ties() -> None:
    results = _runs(random.Random(7), {"a": 100.0, "b": 100.0, "c": 60.0, "d": 100.0})
    assert not any(
        decisions.clearly_faster(results[x], results[y]) for x in "abd" for y in "abd" if x != y
    )
    assert decisions.ranked(results, ["a", "b", "c", "d"]) == ["c", "a", "b", "d"]
    assert decisions.ranked(results, ["d", "b", "a", "c"]) == ["c", "d", "b", "a"]
    assert decisions.preferred(results, ["b", "a"]) == "b"


def _bank_entry(strategy: str) -> BankRecord:
    from aoe.fingerprint import device_fingerprint

    from .bank_util import make_signature

    sig = make_signature()
    dev = device_fingerprint("CPUExecutionProvider", {})
    m = _m([80.0] * 10)
    return bankrules.make_record(
        bankrules.key_for(sig, dev, "int8"),
        sig,
        dev,
        strategy,
        "conv",
        "int8",
        m,
        _m([190.0] * 10),
        "job-1",
        "cnn.onnx",
    )


def test_the_banks_entry_stands_against_a_challenger_that_ties() -> None:
    """REPEAT_TUNE: this run's search prefers QDQ, the bank holds QLinearConv; measured
    alike, the bank's entry is kept (reserved), and only a clear win replaces it."""
    hit = _bank_entry("int8_qlinearconv")
    kept = 0
    for seed in range(200):
        results = _runs(random.Random(seed), CONV)
        best, _ = decisions.best_lossy(
            results, "default", {"int8_qdq", "int8_qlinearconv"}, lambda m: True
        )
        out = bankrules.after_tuning(hit, best, results, lambda m: True)
        if best == "int8_qdq" and not decisions.clearly_faster(
            results["int8_qdq"], results["int8_qlinearconv"]
        ):
            assert (out.mode, out.strategy, out.write_entry) == (
                "reserved",
                "int8_qlinearconv",
                False,
            ), seed
        kept += out.strategy == "int8_qlinearconv"
    assert kept >= 190, kept
    clear = _runs(random.Random(1), {**CONV, "int8_qdq": 60.0})
    best, _ = decisions.best_lossy(
        clear, "default", {"int8_qdq", "int8_qlinearconv"}, lambda m: True
    )
    out = bankrules.after_tuning(hit, best, clear, lambda m: True)
    assert (out.mode, out.strategy, out.write_entry) == ("update", "int8_qdq", True)


def test_real_measurements_of_one_model_under_three_names_keep_the_incumbent(tmp_path) -> None:
    """The runner's own measurement (racing, until stable) of the same model file under
    three names: whatever this run's noise, the incumbent keeps its place unless a name
    clearly beats it, and of the other two the first stands unless the second clearly
    beats it."""
    import numpy as np

    from aoe.device import CPU
    from aoed import samples
    from aoed.backends.ort import runner
    from aoed.engine.messages import Candidate, MeasurePlan, MeasureRequest

    model = samples.save(samples.build("mlp"), tmp_path / "mlp.onnx")
    np.savez(
        tmp_path / "inputs.npz",
        input=np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32),
    )
    names = ["default", "int8_dynamic", "int8_matmulinteger"]
    results = runner.measure(
        MeasureRequest(
            tuple(Candidate(n, model) for n in names),
            tmp_path / "inputs.npz",
            "default",
            CPU,
            MeasurePlan(budget_s=1.0),
        )
    ).results
    assert all(results[n].ok and results[n].cosine == 1.0 for n in names)
    ordered = {n: results[n] for n in names}
    pick, _ = decisions.best_lossy(ordered, "default", set(names[1:]), lambda m: True)
    if not any(decisions.clearly_faster(results[n], results["default"]) for n in names[1:]):
        assert pick == "default"
    first, second = names[1:]
    want = second if decisions.clearly_faster(results[second], results[first]) else first
    assert decisions.preferred(ordered, [first, second]) == want
