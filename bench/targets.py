"""The stated targets, checked against one `bench/run.py` run, and what each miss shows.

Each target is PASS or FAIL on the numbers of that run: latency ratios are medians of
paired per-round ratios with a 95% interval (bench/measure.py); everything about a tuning
job comes from its result JSON. A note on a miss only quotes those numbers (what was
measured, what the tuner changed, rejected, verified and spent); where the JSON lacks a
field the note says n/a. Nothing here is written by hand about a particular run.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import measure

__all__ = [
    "Agreement",
    "Repeat",
    "Target",
    "agreement",
    "aoe_sections",
    "field_of",
    "final_choices",
    "full_hit",
    "job_s",
    "model_figure",
    "pct",
    "repo_counts",
    "repeat",
    "shipped",
    "signed",
    "speedup",
    "target_lines",
    "targets",
    "time_to_fraction",
    "tuner_ab",
    "tuning_jobs",
]

EXACT_MIN = 1.00
QD_RATIO_MIN = 1.2
QD_COSINE_MIN = 0.999
CNN_INT8_MIN = 1.00
RESNET_INT8_MIN = 1.3
DUTY_MEDIAN_MIN = 0.85
DUTY_MIN = 0.80
HIT_MAX = 0.10
REPEAT_MIN = 0.90


# ------------------------------------------------------------------ numbers


def field_of(doc: dict[str, Any], *path: str) -> Any:
    """doc[path[0]][path[1]]...; None where any step is missing."""
    cur: Any = doc
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def speedup(r, name: str) -> measure.Ratio | None:
    """fp32 / variant, paired by round."""
    return measure.ratio(r.variants["fp32"].latency, r.variants[name].latency)


def job_s(doc: dict[str, Any]) -> float:
    return float(doc["basic"]["tuning_time(s)"])


def time_to_fraction(doc: dict[str, Any], fraction: float = 0.9) -> float | None:
    """Seconds into the job at which the estimated gain first reached `fraction` of its
    final value; None when the job ended with no estimated gain."""
    timeline = doc.get("gain_timeline") or []
    if not timeline or timeline[-1][1] <= 0:
        return None
    final = timeline[-1][1]
    return next(t for t, g in timeline if g >= fraction * final)


def shipped(doc: dict[str, Any]) -> str:
    """What the job shipped: 'tuned', 'options only' or 'input' (confirmation.shipped;
    older result files only have `verification`)."""
    got = field_of(doc, "confirmation", "shipped")
    if got:
        return str(got)
    verification = str(doc.get("verification") or "n/a")
    return "input" if "input" in verification else verification


def final_choices(doc: dict[str, Any]) -> dict[str, str]:
    """task_id -> the strategy the shipped model runs for it: the task's strategy where it
    was applied and the tuned graph shipped, else 'default'."""
    graph = shipped(doc) == "tuned"
    return {
        t["task_id"]: t["strategy"] if graph and t.get("applied", True) else "default"
        for t in doc.get("tasks") or []
    }


def _choice_label(doc: dict[str, Any], task_id: str, choice: str | None) -> str:
    """`choice` as shown in a table: why a task ships default when it was tuned."""
    if choice is None:
        return "absent"
    task = next((t for t in doc.get("tasks") or [] if t["task_id"] == task_id), None)
    if task is None or choice != "default" or task["strategy"] == "default":
        return choice
    if not task.get("applied", True):
        return f"default ({task['strategy']} reverted in context)"
    return f"default ({task['strategy']} not shipped: {shipped(doc)})"


def _changed(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in doc["tasks"] if t["applied"] and t["strategy"] != "default"]


def _reverted(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in doc["tasks"] if not t.get("applied", True)]


def _rejections(doc: dict[str, Any]) -> Counter[str]:
    """Why candidates lost, over all tasks: 'accuracy', 'not faster', 'other'."""
    why: Counter[str] = Counter()
    for t in doc["tasks"]:
        for reason in t.get("rejected") or []:
            if "accuracy" in reason:
                why["accuracy"] += 1
            elif "not faster" in reason or "not clearly faster" in reason:
                why["not faster"] += 1
            else:
                why["other"] += 1
    return why


def _strategies(tasks: list[dict[str, Any]]) -> str:
    counts = Counter(t["strategy"] for t in tasks)
    return ", ".join(f"{s} x{n}" for s, n in counts.most_common()) or "none"


def aoe_sections(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's AOE sections: OPAT, SGAT, or both for a sgat+opat job (each with the
    job's model figures, and the repo summary of its own tasks)."""
    return [doc[k] for k in ("OPAT", "SGAT") if isinstance(doc.get(k), dict)]


def repo_counts(doc: dict[str, Any]) -> dict[str, int]:
    """The job's repo_summary counts, summed over its sections (a sgat+opat job counts
    its subgraph and its operator tasks apart); {} where it has none."""
    out: dict[str, int] = {}
    for s in aoe_sections(doc):
        for k, v in (s.get("repo_summary") or {}).items():
            out[k] = out.get(k, 0) + int(v)
    return out


def model_figure(doc: dict[str, Any], key: str) -> Any:
    """One of the job's model figures (the same in every section); None where absent."""
    return next((s[key] for s in aoe_sections(doc) if key in s), None)


def tuner_ab(doc: dict[str, Any]) -> float:
    base, result = (model_figure(doc, f"model_{k}_performance(ms)") for k in ("baseline", "result"))
    return base / max(result, 1e-9)


def full_hit(doc: dict[str, Any]) -> bool:
    """Every bank entry the job needed came from the bank, and it measured no candidate."""
    repos = [s.get("repo_summary") or {} for s in aoe_sections(doc)]
    trials = field_of(doc, "resources", "trials")
    return (
        bool(repos)
        and all(r.get("repo_hit_num") == r.get("total_num") for r in repos)
        and trials == 0
    )


def pct(x: float) -> str:
    return f"{x:.0%}" if abs(x) >= 0.1 else f"{x:.1%}"


def signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _ms(v) -> str:
    return f"{v.latency.median_ms:.3f} ms"


def tuning_jobs(results: Sequence[Any]) -> list[tuple[str, Any]]:
    """(label, Job) of every full tuning job that ran: first tunes and repeats."""
    jobs = []
    for r in results:
        for p, run in r.tunes.items():
            if not run.full.error:
                jobs.append((f"{r.name} {p}", run.full))
            if run.repeat is not None and not run.repeat.error:
                jobs.append((f"{r.name} {p} (repeat)", run.repeat))
    return jobs


# ------------------------------------------------------------------ comparisons


@dataclass(frozen=True)
class Agreement:
    """The tuner's own improvement figure next to the bench's independent one."""

    tuner: float | None  # the result JSON's model_performance_improvement
    tuner_ci: tuple[float, float] | None  # confirmation.improvement_ci95
    bench: measure.Ratio | None  # fp32 / shipped model, paired by round
    status: str  # PASS, FAIL or n/a

    @property
    def bench_range(self) -> tuple[float, float] | None:
        if self.bench is None:
            return None
        return self.bench.lo - 1.0, self.bench.hi - 1.0


def agreement(r, precision: str) -> Agreement | None:
    """None where the job failed."""
    run = r.tunes[precision]
    if run.full.error:
        return None
    doc = run.full.doc
    tuner = model_figure(doc, "model_performance_improvement")
    ci = field_of(doc, "confirmation", "improvement_ci95")
    ci = (float(ci[0]), float(ci[1])) if isinstance(ci, list | tuple) and len(ci) == 2 else None
    bench = speedup(r, f"aoe {precision}")
    if tuner is None or bench is None:
        return Agreement(tuner, ci, bench, "n/a")
    lo, hi = bench.lo - 1.0, bench.hi - 1.0
    ok = lo <= tuner <= hi or (ci is not None and ci[0] <= hi and lo <= ci[1])
    return Agreement(float(tuner), ci, bench, "PASS" if ok else "FAIL")


@dataclass(frozen=True)
class Repeat:
    """Two full tunes of one model into two fresh banks, compared decision by decision."""

    tasks: int  # task ids in either run
    same: int  # with the same final choice in both
    differing: tuple[tuple[str, str, str], ...]  # (task id, first, second)
    options_same: bool
    options: tuple[dict[str, Any], dict[str, Any]]
    shipped: tuple[str, str]

    @property
    def share(self) -> float:
        return self.same / self.tasks if self.tasks else 1.0


def repeat(run) -> Repeat | None:
    """None unless both the first tune and its repeat succeeded."""
    if run.repeat is None or run.repeat.error or run.full.error:
        return None
    a, b = run.full.doc, run.repeat.doc
    ca, cb = final_choices(a), final_choices(b)
    ids = sorted(set(ca) | set(cb))
    differing = tuple(
        (t, _choice_label(a, t, ca.get(t)), _choice_label(b, t, cb.get(t)))
        for t in ids
        if ca.get(t) != cb.get(t)
    )
    oa, ob = a.get("session_options") or {}, b.get("session_options") or {}
    return Repeat(
        len(ids), len(ids) - len(differing), differing, oa == ob, (oa, ob), (shipped(a), shipped(b))
    )


# ------------------------------------------------------------------ targets


@dataclass
class Target:
    title: str
    status: str  # PASS, FAIL, or "not measured"
    measured: str
    misses: list[str] = field(default_factory=list)


def _status(rows: list[str], passed: bool) -> str:
    if not rows:
        return "not measured"
    return "PASS" if passed else "FAIL"


def _tuner_facts(doc: dict[str, Any]) -> str:
    changed = _changed(doc)
    opts = doc.get("session_options") or {}
    ci = field_of(doc, "confirmation", "improvement_ci95")
    verdict = field_of(doc, "confirmation", "verdict")
    text = (
        f"The tuner changed {len(changed)} of {len(doc['tasks'])} tasks "
        f"({_strategies(changed)}), session options {opts or 'none'}; it shipped "
        f"{shipped(doc)} (verdict {verdict or 'n/a'}) and reported "
        f"{signed(model_figure(doc, 'model_performance_improvement'))} "
        f"(95% interval {'n/a' if not ci else f'{signed(ci[0])} to {signed(ci[1])}'})."
    )
    reverted = _reverted(doc)
    if reverted:
        text += f" Verification reverted {len(reverted)} task choice(s) in the whole model."
    return text


def _why_slower(r, name: str, s: measure.Ratio, need: float) -> str:
    doc = r.tunes[name.split()[1]].full.doc
    v = r.variants[name]
    inside = s.contains(need)
    return (
        f"**{r.name}**: {name} {s.text(3)} over {s.pairs} paired rounds ({_ms(v)} vs fp32 "
        f"{_ms(r.variants['fp32'])}); needs {need:.2f}x. The 95% interval "
        f"{'contains' if inside else 'lies below'} {need:.2f}x"
        f"{', so this run cannot tell the two apart' if inside else ''}. " + _tuner_facts(doc)
    )


def _target_vs_fp32(
    results: Sequence[Any], title: str, name: str, need: float, kinds: set[str] | None
) -> Target:
    rows, misses, passed = [], [], True
    for r in results:
        if kinds is not None and r.kind not in kinds:
            continue
        s = speedup(r, name)
        if s is None:
            passed = False
            rows.append(f"{r.name} failed")
            misses.append(f"**{r.name}**: {name} failed: {r.variants[name].error or 'not timed'}")
            continue
        row = f"{r.name} {s.text()}"
        if name == "aoe int8" and kinds and "cnn" in kinds:
            qs = speedup(r, "quantize_dynamic")
            row += f" (quantize_dynamic {qs.median:.2f}x)" if qs else " (quantize_dynamic failed)"
        rows.append(row)
        if s.median < need:
            passed = False
            misses.append(_why_slower(r, name, s, need))
    return Target(title, _status(rows, passed), "; ".join(rows) or "no model", misses)


def _why_not_qd(r, ratio: measure.Ratio, cos: float) -> str:
    q, v = r.variants["quantize_dynamic"], r.variants["aoe int8"]
    doc = r.tunes["int8"].full.doc
    parts = [
        (
            f"**{r.name}**: quantize_dynamic / aoe int8 = {ratio.text()} over {ratio.pairs} paired "
            f"rounds ({_ms(q)} vs {_ms(v)}); cosine {cos:.5f} (quantize_dynamic "
            f"{q.accuracy.cosine:.5f}). "
        )
    ]
    if ratio.median < QD_RATIO_MIN:
        parts.append(
            f"The 95% interval {'contains' if ratio.contains(QD_RATIO_MIN) else 'lies below'} "
            f"{QD_RATIO_MIN:.1f}x. "
        )
    if cos < QD_COSINE_MIN:
        parts.append(f"The cosine on the bench's inputs is below {QD_COSINE_MIN}. ")
    qi, ai = q.ops.get("int8", 0), v.ops.get("int8", 0)
    why = _rejections(doc)
    parts.append(
        f"Matrix products in int8: aoe {ai} (float {v.ops.get('float', 0)}), quantize_dynamic "
        f"{qi} (float {q.ops.get('float', 0)}). Candidates the tuner rejected: "
        f"{why['accuracy']} outside the accuracy budget, {why['not faster']} not faster, "
        f"{why['other']} for other reasons. "
    )
    actact = [
        t for t in doc["tasks"] if any("actact" in c["strategy"] for c in t.get("candidates") or [])
    ]
    kept = [t for t in actact if not (t["applied"] and t["strategy"].startswith("int8"))]
    if kept:
        n = sum(t["instances"] for t in kept)
        reasons = "; ".join(x for t in kept for x in t.get("rejected") or []) or "none given"
        parts.append(
            f"{n} activation-by-activation MatMul(s) stayed in float; their int8 candidates "
            f"lost with: {reasons}. "
        )
    parts.append(_tuner_facts(doc))
    return "".join(parts)


def _target_vs_qd(results: Sequence[Any]) -> Target:
    rows, misses, passed = [], [], True
    for r in (r for r in results if r.kind == "transformer"):
        q, v = r.variants["quantize_dynamic"], r.variants["aoe int8"]
        if v.latency is None:
            passed = False
            rows.append(f"{r.name}: aoe int8 failed")
            misses.append(f"**{r.name}**: aoe int8 failed: {v.error or 'not timed'}")
            continue
        cos = v.accuracy.cosine
        ratio = measure.ratio(q.latency, v.latency)
        if ratio is None:
            good = cos >= QD_COSINE_MIN
            rows.append(f"{r.name}: quantize_dynamic failed, aoe int8 cosine {cos:.5f}")
            passed &= good
            continue
        rows.append(f"{r.name} {ratio.text()} at cosine {cos:.5f}")
        if ratio.median >= QD_RATIO_MIN and cos >= QD_COSINE_MIN:
            continue
        passed = False
        misses.append(_why_not_qd(r, ratio, cos))
    return Target(
        "int8 >= 1.2x faster than quantize_dynamic on transformer models, at cosine >= 0.999",
        _status(rows, passed),
        "; ".join(rows) or "no model",
        misses,
    )


def _target_resnet(results: Sequence[Any]) -> Target:
    rows, misses, passed = [], [], True
    for r in (r for r in results if r.name == "resnet"):
        v = r.variants["aoe int8"]
        s = speedup(r, "aoe int8")
        if s is None:
            passed = False
            rows.append("failed")
            misses.append(f"**resnet**: aoe int8 failed: {v.error or 'not timed'}")
            continue
        doc = r.tunes["int8"].full.doc
        budget = doc.get("accuracy_budget") or {}
        min_cos = budget.get("min_cosine", QD_COSINE_MIN)
        max_rel = budget.get("max_rel_error", 1.0)
        gate = v.accuracy.cosine >= min_cos and v.accuracy.max_rel <= max_rel
        rows.append(
            f"{s.text()}, cosine {v.accuracy.cosine:.5f} (gate >= {min_cos}), max rel error "
            f"{v.accuracy.max_rel:.3g} (gate <= {max_rel}): gate {'met' if gate else 'missed'}"
        )
        if s.median < RESNET_INT8_MIN:
            passed = False
            misses.append(_why_slower(r, "aoe int8", s, RESNET_INT8_MIN) + " " + _float_left(r))
        if not gate:
            passed = False
            misses.append(
                f"**resnet**: on the bench's inputs aoe int8 reached cosine "
                f"{v.accuracy.cosine:.5f} and max rel error {v.accuracy.max_rel:.3g}; on its "
                f"own held-back samples the tuner measured {doc.get('accuracy')}."
            )
    return Target(
        "int8 >= 1.3x vs fp32 on the ResNet-style model, accuracy gate met",
        _status(rows, passed),
        "; ".join(rows) or "resnet not run",
        misses,
    )


def _float_left(r) -> str:
    doc = r.tunes["int8"].full.doc
    kept = [t for t in doc["tasks"] if not (t["applied"] and t["strategy"].startswith("int8"))]
    if not kept:
        return "Every task runs in int8."
    share = sum(t["latency_share"] for t in kept)
    names = ", ".join(t["op_name"] for t in kept[:4]) + (" ..." if len(kept) > 4 else "")
    ops = r.variants["aoe int8"].ops
    return (
        f"{len(kept)} task(s) stay in float ({names}), {share:.0%} of the baseline profile; "
        f"the int8 variant runs {ops.get('int8', 0)} convolution/matrix products in int8 and "
        f"{ops.get('float', 0)} in float."
    )


def _target_agreement(results: Sequence[Any]) -> Target:
    rows, misses, passed, unknown = [], [], True, 0
    for r in results:
        for p in r.tunes:
            a = agreement(r, p)
            if a is None:
                continue
            if a.status == "n/a":
                unknown += 1
                continue
            rows.append(f"{r.name} {p}")
            if a.status == "FAIL":
                passed = False
                misses.append(_why_disagree(r, p, a))
    failed = len(misses)
    measured = (
        f"{len(rows) - failed} of {len(rows)} rows agree"
        + (f"; {unknown} without a figure on one side" if unknown else "")
        if rows
        else "no row with both figures"
    )
    return Target(
        "the tuner's reported improvement agrees with the bench's measurement of the shipped "
        "model (inside the bench's 95% interval, or the two intervals overlap)",
        _status(rows, passed),
        measured,
        misses,
    )


def _why_disagree(r, p: str, a: Agreement) -> str:
    doc = r.tunes[p].full.doc
    o = {
        k: model_figure(doc, f"model_{k}_performance(ms)") or "n/a" for k in ("baseline", "result")
    }
    lo, hi = a.bench_range
    ci = f"{signed(a.tuner_ci[0])} to {signed(a.tuner_ci[1])}" if a.tuner_ci else "n/a"
    return (
        f"**{r.name} {p}**: the tuner reported {signed(a.tuner)} (interval {ci}; input "
        f"{o['baseline']} ms, shipped {o['result']} ms, in its runner process); the bench "
        f"measured {signed(a.bench.median - 1)} ({signed(lo)} to {signed(hi)}) over "
        f"{a.bench.pairs} paired rounds (fp32 {_ms(r.variants['fp32'])}, aoe {p} "
        f"{_ms(r.variants[f'aoe {p}'])}). Shipped: {shipped(doc)}; session options "
        f"{doc.get('session_options') or 'none'}."
    )


def _target_repeat(results: Sequence[Any]) -> Target:
    rows, misses, passed = [], [], True
    for r in results:
        for p, run in r.tunes.items():
            if run.repeat is None:
                continue
            rep = repeat(run)
            if rep is None:
                passed = False
                err = run.full.error or run.repeat.error
                rows.append(f"{r.name} {p} failed")
                misses.append(f"**{r.name} {p}**: a run failed: {err}")
                continue
            rows.append(
                f"{r.name} {p} {rep.same}/{rep.tasks}"
                + ("" if rep.options_same else " (options differ)")
            )
            if rep.share < REPEAT_MIN:
                passed = False
                diffs = "; ".join(f"{t}: {a} vs {b}" for t, a, b in rep.differing)
                opts = (
                    "the same session options"
                    if rep.options_same
                    else f"session options {rep.options[0] or 'none'} vs {rep.options[1] or 'none'}"
                )
                misses.append(
                    f"**{r.name} {p}**: {rep.same} of {rep.tasks} tasks ({rep.share:.0%}) with "
                    f"the same final choice; differing: {diffs}. Shipped {rep.shipped[0]} vs "
                    f"{rep.shipped[1]}, {opts}."
                )
    return Target(
        "the same job tuned twice into fresh banks makes the same final choice on >= 90% of tasks",
        _status(rows, passed),
        "; ".join(rows) or "no repeated job",
        misses,
    )


def _why_idle(label: str, job) -> str:
    doc = job.doc
    res = doc["resources"]
    total = job_s(doc)
    d = res["duty_cycle"]
    timeline = doc.get("gain_timeline") or []
    parts = [
        (
            f"**{label}**: {d:.1%} of a {total:.1f} s job ({res['trials']} trials): device busy "
            f"{res.get('device_s', total * d):.1f} s, idle {total * (1 - d):.1f} s"
        ),
    ]
    if timeline:
        parts.append(f"first task decision {timeline[0][0]:.1f} s in")
    if res.get("compile_s") is not None:
        parts.append(f"compiling {res['compile_s']:.1f} s in worker processes")
    budget = doc.get("budget") or {}
    for key, what in (("profile_s", "profiling"), ("confirm_s", "the confirming A/B")):
        if budget.get(key) is not None:
            parts.append(f"{what} {budget[key]:.1f} s")
    if job.lock_waits:
        parts.append(f"waited {job.lock_waits} time(s) for another process measuring on the device")
    return "; ".join(parts) + "."


def _target_duty(results: Sequence[Any]) -> Target:
    misses, duties = [], []
    for label, job in tuning_jobs(results):
        if not job.doc["resources"]["trials"]:
            continue
        d = job.doc["resources"]["duty_cycle"]
        duties.append(d)
        if d < DUTY_MIN:
            misses.append(_why_idle(label, job))
    if not duties:
        return Target("device duty cycle", "not measured", "no tuning job")
    med = statistics.median(duties)
    passed = med >= DUTY_MEDIAN_MIN and min(duties) >= DUTY_MIN
    if med < DUTY_MEDIAN_MIN and not misses:
        low = sorted(
            (
                (job.doc["resources"]["duty_cycle"], label, job)
                for label, job in tuning_jobs(results)
            ),
            key=lambda x: x[0],
        )
        misses = [_why_idle(label, job) for d, label, job in low if d < DUTY_MEDIAN_MIN]
    return Target(
        "device duty cycle during tuning: median >= 85%, every job >= 80%",
        "PASS" if passed else "FAIL",
        f"median {med:.1%}, lowest {min(duties):.1%} over {len(duties)} tuning jobs",
        misses,
    )


def _why_hit_slow(model: str, precision: str, run) -> str:
    hit, full = run.hit.doc, run.full.doc
    repo = repo_counts(hit)
    res = hit["resources"]
    h = job_s(hit)
    budget = hit.get("budget") or {}
    confirm = budget.get("confirm_s")
    variants = field_of(hit, "decision", "variants_measured")
    return (
        f"**{model} {precision}**: bank-hit job {h:.2f} s = {h / job_s(full):.1%} of the "
        f"{job_s(full):.1f} s full job ({repo.get('repo_hit_num', 'n/a')} of "
        f"{repo.get('total_num', 'n/a')} entries from the bank, {res['trials']} trials); device "
        f"busy {res.get('device_s', h * res['duty_cycle']):.2f} s, of which the confirming A/B "
        f"{'n/a' if confirm is None else f'{confirm:.2f} s'}; verification measured "
        f"{'n/a' if variants is None else variants} leave-one-out variant(s); not on the "
        f"device {h - res.get('device_s', h * res['duty_cycle']):.2f} s"
        + (f"; waited {run.hit.lock_waits} time(s) for the device" if run.hit.lock_waits else "")
        + "."
    )


def _target_hit(results: Sequence[Any]) -> Target:
    rows, misses, passed, ratios = [], [], True, []
    for r in results:
        for p, run in r.tunes.items():
            if run.full.error or run.hit is None:
                continue
            if run.hit.error:
                passed = False
                misses.append(f"**{r.name} {p}**: the bank-hit run failed: {run.hit.error}")
                continue
            if not full_hit(run.hit.doc):
                passed = False
                repo = repo_counts(run.hit.doc)
                misses.append(
                    f"**{r.name} {p}**: the second run was not a full bank hit: "
                    f"{repo.get('repo_hit_num', 'n/a')} of {repo.get('total_num', 'n/a')} "
                    f"entries from the bank, {run.hit.doc['resources']['trials']} trials."
                )
                continue
            ratio = job_s(run.hit.doc) / job_s(run.full.doc)
            ratios.append((ratio, f"{r.name} {p}"))
            if ratio > HIT_MAX:
                passed = False
                misses.append(_why_hit_slow(r.name, p, run))
    if ratios:
        worst = max(ratios)
        rows.append(
            f"highest {worst[0]:.1%} ({worst[1]}), median "
            f"{statistics.median(x for x, _ in ratios):.1%} over {len(ratios)} full hits"
        )
    return Target(
        "a full bank-hit run <= 10% of the full tune's job time",
        _status(rows or misses, passed),
        "; ".join(rows) or "no full bank hit",
        misses,
    )


def targets(results: Sequence[Any]) -> list[Target]:
    ok = [r for r in results if r.variants["fp32"].latency is not None]
    return [
        _target_vs_fp32(ok, "exact >= 1.00x vs fp32 on every model", "aoe exact", EXACT_MIN, None),
        _target_vs_qd(ok),
        _target_vs_fp32(
            ok, "int8 never slower than fp32 on CNNs", "aoe int8", CNN_INT8_MIN, {"cnn"}
        ),
        _target_resnet(ok),
        _target_agreement(ok),
        _target_repeat(results),
        _target_duty(results),
        _target_hit(results),
    ]


def target_lines(results: Sequence[Any]) -> list[str]:
    return [f"{t.status:<12} {t.title}: {t.measured}" for t in targets(results)]
