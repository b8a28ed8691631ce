"""The models section of RESULTS.md: machine header, tables, targets, what each miss shows.

Writes only its own section (between `<!-- models:begin -->` and `<!-- models:end -->`)
and the header above all sections; every other section of the file is kept.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine import Machine
from targets import (
    agreement,
    field_of,
    full_hit,
    job_s,
    repeat,
    shipped,
    signed,
    speedup,
    targets,
    time_to_fraction,
    tuner_ab,
)

__all__ = ["BEGIN", "COST_BEGIN", "COST_END", "END", "merge", "write"]

BEGIN, END = "<!-- models:begin -->", "<!-- models:end -->"
COST_BEGIN, COST_END = "<!-- default-job-type:begin -->", "<!-- default-job-type:end -->"
TITLE = "# Benchmark results"
INTRO = (
    "Each benchmark of `make bench` owns one section below; the first section, every "
    "target at a glance, is kept with them (tests/test_bench_results.py checks it names "
    "every section, at the commit that section was measured at)."
)
PACKAGES = ("onnxruntime", "onnx", "numpy", "scikit-learn")
_SECTION = re.compile(r"<!-- [\w-]+:begin -->")
VARIANTS = ("fp32", "quantize_dynamic", "aoe exact", "aoe int8")


def _budget(mode) -> str:
    if mode.budget_s is None:
        return "budget fitted by the tuner (no --budget)"
    return f"budget {mode.budget_s:g} s per job"


def _cell(text: object) -> str:
    return str(text).replace("|", "/")


def _latency_table(results: Sequence[Any]) -> list[str]:
    lines = [
        (
            "| model | variant | median ms | spread | vs fp32 [95% interval] | rounds | cosine | "
            "max abs err | products int8/float | note |"
        ),
        "|---|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in results:
        for name in VARIANTS:
            v = r.variants[name]
            if v.latency is None:
                note = _cell(v.error or "not run")
                lines.append(f"| {r.name} | {name} | failed | | | | | | | {note} |")
                continue
            a = v.accuracy
            cover = f"{v.ops.get('int8', 0)}/{v.ops.get('float', 0)}" if v.ops else ""
            notes = [v.latency.dropped] if v.latency.dropped else []
            if name.startswith("aoe"):
                doc = r.tunes[name.split()[1]].full.doc
                notes.append(f"shipped: {shipped(doc)}")
                if doc.get("session_options"):
                    notes.append(f"options {doc['session_options']}")
            s = speedup(r, name)
            lines.append(
                f"| {r.name} | {name} | {v.latency.median_ms:.3f} | ±{v.latency.spread:.1%} | "
                f"**{s.text() if s else 'n/a'}** | {v.latency.rounds} | {a.cosine:.6f} | "
                f"{a.max_abs:.2e} | {cover} | {_cell('; '.join(notes))} |"
            )
    return lines


def _real_data_table(results: Sequence[Any]) -> list[str]:
    rows = [r for r in results if r.labelled]
    if not rows:
        return []
    lines = [
        "| model | variant | top-1 accuracy | top-1 agreement with fp32 | cosine vs fp32 |",
        "|---|---|--:|--:|--:|",
    ]
    for r in rows:
        for name in VARIANTS:
            v = r.variants[name]
            if v.top1 is None:
                lines.append(f"| {r.name} | {name} | failed | | {_cell(v.error or 'not run')} |")
                continue
            lines.append(
                f"| {r.name} | {name} | {v.top1:.2%} ({round(v.top1 * r.labelled)}/{r.labelled}) "
                f"| {v.agree:.2%} | {v.accuracy.cosine:.6f} |"
            )
    return lines


def _agreement_table(results: Sequence[Any]) -> list[str]:
    lines = [
        (
            "| model | precision | shipped | tuner's verdict | tuner: improvement | tuner: 95% "
            "interval | bench: improvement | bench: 95% interval | paired rounds | result |"
        ),
        "|---|---|---|---|--:|--:|--:|--:|--:|---|",
    ]
    for r in results:
        for p, run in r.tunes.items():
            a = agreement(r, p)
            if a is None:
                lines.append(f"| {r.name} | {p} | failed | | | | | | | {_cell(run.full.error)} |")
                continue
            doc = run.full.doc
            ci = f"{signed(a.tuner_ci[0])} to {signed(a.tuner_ci[1])}" if a.tuner_ci else "n/a"
            if a.bench is None:
                bench, rng, pairs = "n/a", "n/a", ""
            else:
                lo, hi = a.bench_range
                bench, rng, pairs = (
                    signed(a.bench.median - 1),
                    f"{signed(lo)} to {signed(hi)}",
                    a.bench.pairs,
                )
            verdict = field_of(doc, "confirmation", "verdict") or "n/a"
            lines.append(
                f"| {r.name} | {p} | {shipped(doc)} | {verdict} | {signed(a.tuner)} | {ci} | "
                f"{bench} | {rng} | {pairs} | **{a.status}** |"
            )
    return lines


def _repeat_table(results: Sequence[Any]) -> list[str]:
    lines = [
        (
            "| model | precision | tasks | same final choice | session options | shipped "
            "(1st / 2nd) | differing tasks (1st vs 2nd) | result |"
        ),
        "|---|---|--:|--:|---|---|---|---|",
    ]
    any_row = False
    for r in results:
        for p, run in r.tunes.items():
            if run.repeat is None:
                continue
            any_row = True
            rep = repeat(run)
            if rep is None:
                err = run.full.error or run.repeat.error
                lines.append(f"| {r.name} | {p} | failed | | | | {_cell(err)} | **FAIL** |")
                continue
            opts = "same" if rep.options_same else f"{rep.options[0]} vs {rep.options[1]}"
            diffs = "; ".join(f"{t}: {a} vs {b}" for t, a, b in rep.differing) or "none"
            ok = "PASS" if rep.share >= 0.9 else "FAIL"
            lines.append(
                f"| {r.name} | {p} | {rep.tasks} | {rep.same} ({rep.share:.0%}) | {_cell(opts)} | "
                f"{rep.shipped[0]} / {rep.shipped[1]} | {_cell(diffs)} | **{ok}** |"
            )
    return lines if any_row else []


def _tuning_table(results: Sequence[Any]) -> list[str]:
    lines = [
        (
            "| model | precision | job s | process s | trials | duty | device waits | t90 s | "
            "tuner's A/B | verify variants | bank-hit job s | hit/full (job) | "
            "bank-hit process s | hit/full (process) |"
        ),
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        for p, run in r.tunes.items():
            full = run.full
            if full.error:
                lines.append(f"| {r.name} | {p} | failed | {full.wall_s:.1f} | | | | | | | | | | |")
                continue
            doc = full.doc
            t90 = time_to_fraction(doc)
            t90s = "no gain" if t90 is None else f"{t90:.1f} ({t90 / job_s(doc):.0%})"
            variants = field_of(doc, "decision", "variants_measured")
            hit = run.hit
            if hit is None or hit.error:
                hit_cells = "| failed | | | "
            else:
                h = job_s(hit.doc)
                mark = "" if full_hit(hit.doc) else " (not a full hit)"
                hit_cells = (
                    f"| {h:.2f}{mark} | {h / job_s(doc):.1%} | {hit.wall_s:.1f} | "
                    f"{hit.wall_s / full.wall_s:.1%} "
                )
            lines.append(
                f"| {r.name} | {p} | {job_s(doc):.1f} | {full.wall_s:.1f} | "
                f"{doc['resources']['trials']} | {doc['resources']['duty_cycle']:.1%} | "
                f"{full.lock_waits} | {t90s} | {tuner_ab(doc):.2f}x | "
                f"{'n/a' if variants is None else variants} {hit_cells}|"
            )
    return lines


def _job_budget(doc: dict[str, Any]) -> str:
    budget = field_of(doc, "budget", "budget_s")
    return f"job {job_s(doc):.1f}" + ("" if budget is None else f" of {float(budget):.1f}")


def _default_cost_table(results: Sequence[Any]) -> list[str]:
    lines = [
        (
            "| model | precision | default (sgat+opat) s | OPAT alone s | default / OPAT | "
            "tasks (default / OPAT) | shipped (default / OPAT) |"
        ),
        "|---|---|--:|--:|--:|--:|---|",
    ]
    for r in results:
        for p, run in r.tunes.items():
            full, opat = run.full, run.opat
            if opat is None:
                continue
            if full.error or opat.error:
                err = "; ".join(
                    f"{what}: {j.error}"
                    for what, j in (("default", full), ("OPAT", opat))
                    if j.error
                )
                lines.append(f"| {r.name} | {p} | failed | | | | {_cell(err)} |")
                continue
            lines.append(
                f"| {r.name} | {p} | {full.wall_s:.1f} ({_job_budget(full.doc)}) | "
                f"{opat.wall_s:.1f} ({_job_budget(opat.doc)}) | {full.wall_s / opat.wall_s:.2f}x | "
                f"{len(full.doc['tasks'])} / {len(opat.doc['tasks'])} | "
                f"{shipped(full.doc)} / {shipped(opat.doc)} |"
            )
    return lines


def cost_section(
    results: Sequence[Any], mode, *, started: float, command: str, host: Machine
) -> str:
    """The section on what the default job type costs in tuning time against OPAT alone."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    models = ", ".join(f"`{r.name}`" for r in results)
    real = [f"`{r.name}`" for r in results if r.labelled]
    return "\n".join(
        [
            "## Tuning time of the default job type",
            "",
            f"Machine: {host.describe(*PACKAGES)}.",
            "",
            (
                f"`{command}` ({mode.name} mode) on {when}. The aoe jobs of that run's models "
                "comparison name no job type, so they run the default, sgat+opat (subgraphs, then "
                "operators over the nodes they left); just before each, the same job ran with "
                "`--job-type opat` (OPAT alone) into a fresh bank of its own, "
                + (
                    f"with the same `--budget {mode.budget_s:g}`: both searches get the same device "
                    "seconds, so the ratio is what finding, compiling and verifying the subgraph "
                    "tasks adds. "
                    if mode.budget_s is not None
                    else "both with no `--budget`, as a user who names none runs them: the tuner fits each "
                    "job's budget to the tasks it finds, so a job with more tasks gets more seconds. "
                )
                + "Seconds of each `aoe tune` process, start to exit (the job's own "
                "`tuning_time(s)` and the budget it had in brackets). Models: "
                f"{models}; "
                + (
                    f"all have random weights and synthetic inputs but {', '.join(real)} "
                    "(trained, real images)."
                    if real
                    else "all have random weights and synthetic inputs."
                )
            ),
            "",
            *_default_cost_table(results),
        ]
    ).rstrip()


def section(
    results: Sequence[Any],
    mode,
    *,
    elapsed_s: float,
    started: float,
    command: str,
    plots: Sequence[str],
    machine: str = "",
) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    repeated = [f"{r.name} {p}" for r in results for p, run in r.tunes.items() if run.repeat]
    lines = [
        "## Models: onnxruntime fp32, quantize_dynamic, aoe tune exact and int8",
        "",
        *([machine, ""] if machine else []),
        (
            f"`{command}` ({mode.name} mode) on {when}, {elapsed_s / 60:.1f} min in all. "
            f"aoe tune {_budget(mode)}, no job type named (the default, "
            f"sgat+opat); latency over up to {mode.rounds} paired rounds, one session per "
            f"process (per variant and round up to {mode.samples} timed samples of about 2 ms "
            f"or one run, fewer for a slow model so that the rounds fit in "
            f"{mode.measure_s:g} s); repeat-decision check on "
            f"{', '.join(repeated) or 'no model'}."
        ),
        "",
        "Models, and where their weights and inputs come from:",
        "",
        *[f"- `{r.name}` ({r.description}): {r.data}." for r in results],
        "",
        (
            "How to read it: latency is measured as a user deploys a model (bench/deployed.py): "
            "each variant in a process of its own holding one session with onnxruntime's "
            "defaults (intra-op spinning on), the processes taking turns in rounds, the order "
            "rotating from round to round, while this process holds the machine-wide device "
            "lock, so no tuner measures at the same time. *median ms* is the median of "
            "a variant's timed samples and *spread* their interquartile range over it. *vs "
            "fp32* is the median of the per-round ratios fp32 / variant, with a distribution-free "
            "95% interval for that median; *rounds* is how many rounds measured the variant. "
            "aoe variants run through `aoe.session` (the session options the tuner stored in "
            "the model); quantize_dynamic is called with its defaults. *cosine* (lowest) and "
            "*max abs err* (largest) compare each variant's outputs with fp32 on the bench's "
            "inputs, which the tuner never saw. *products int8/float* counts "
            "MatMul/Gemm/Conv-type nodes that run in int8 (integer kernels, or fed by "
            "DequantizeLinear) and in float."
        ),
        "",
        "### Latency and accuracy",
        "",
        *_latency_table(results),
    ]
    real = _real_data_table(results)
    if real:
        lines += [
            "",
            "### Real data: top-1 accuracy on held-out images",
            "",
            (
                "Each variant classifies every held-out image; *top-1 accuracy* is against the "
                "true labels, *top-1 agreement* against fp32's predicted class."
            ),
            "",
            *real,
        ]
    lines += [
        "",
        "### Tuner-reported vs independently measured improvement",
        "",
        (
            "*tuner* columns come from the job's result JSON: `model_performance_improvement` "
            "(input / shipped model - 1, from the tuner's confirming A/B: **not as deployed**, "
            "both models interleaved in its one runner process with spinning off) "
            "and `confirmation.improvement_ci95`, `confirmation.verdict` where the job wrote "
            "them (n/a where it did not). *bench* columns are this run's measurement of the "
            "shipped model against onnxruntime fp32 of the input model (the *vs fp32* column "
            "above, minus 1). PASS: the tuner's figure lies inside the bench's interval, or the "
            "two intervals overlap."
        ),
        "",
        *_agreement_table(results),
    ]
    reps = _repeat_table(results)
    if reps:
        lines += [
            "",
            "### Repeat-decision check",
            "",
            (
                "The same job tuned a second time, with the same settings, into a fresh bank. A "
                "task's *final choice* is the strategy the shipped model runs for it: the "
                "task's `strategy` where `applied` and the tuned graph shipped, else default. "
                "Target: the same final choice on at least 90% of tasks. This is not the "
                "bank-hit run below, which answers from the first run's bank."
            ),
            "",
            *reps,
        ]
    lines += [
        "",
        "### Tuning cost",
        "",
        (
            "*job s* is the tuner's own `tuning_time(s)`; *process s* adds starting Python and "
            "loading the engine. *duty* is the share of the job the device spent measuring "
            "(`resources.duty_cycle`). *device waits* counts the times the job said it waited "
            "for another process measuring on the same device. *t90* is when the estimated "
            "gain (`gain_timeline`, after each task decision) first reached 90% of its final "
            "value (*no gain*: no task beat its default; session options are not on that "
            "timeline). *tuner's A/B* is `model_baseline_performance / "
            "model_result_performance` from the result JSON. *verify variants* is "
            "`decision.variants_measured` (leave-one-out models verification built and "
            "measured). The bank-hit columns are a second `aoe tune` of the same model on the "
            "bank the first one filled."
        ),
        "",
        *_tuning_table(results),
        "",
        "### Targets",
        "",
        "| target | measured | result |",
        "|---|---|---|",
    ]
    tgs = targets(results)
    for t in tgs:
        lines.append(f"| {t.title} | {_cell(t.measured)} | **{t.status}** |")
    lines += ["", "### Where we miss: the numbers of each miss", ""]
    missed = [t for t in tgs if t.misses]
    if not missed:
        lines.append("Every target stated above was met in this run.")
    for t in missed:
        lines.append(f"*{t.title}* ({t.status}):")
        lines.append("")
        lines += [f"- {m}" for m in t.misses]
        lines.append("")
    if plots:
        lines += ["", "### Plots", ""]
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines).rstrip()


def merge(doc: str, header: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """`doc` with its header replaced, and the block between `begin` and `end` replaced
    or put first among the sections; every other section is kept as it is."""
    m = _SECTION.search(doc)
    sections = doc[m.start() :] if m else ""
    wrapped = f"{begin}\n{block}\n{end}"
    if begin in sections and end in sections:
        head, rest = sections.split(begin, 1)
        _, tail = rest.split(end, 1)
        sections = head + wrapped + tail
    else:
        sections = wrapped + ("\n\n" + sections if sections else "\n")
    return header.rstrip() + "\n\n" + sections.rstrip() + "\n"


def write(
    results: Sequence[Any],
    mode,
    out: Path,
    *,
    elapsed_s: float,
    started: float,
    command: str,
    host: Machine,
) -> list[Path]:
    """Writes the plots beside `out` and our section of `out`; returns the paths written."""
    import plots

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = plots.draw(results, out.parent)
    header = f"{TITLE}\n\n{INTRO}"
    block = section(
        results,
        mode,
        elapsed_s=elapsed_s,
        started=started,
        command=command,
        plots=[str(p) for p in pngs],
        machine=f"Machine: {host.describe(*PACKAGES)}.",
    )
    doc = out.read_text() if out.exists() else ""
    doc = merge(doc, header, block)
    if any(run.opat is not None for r in results for run in r.tunes.values()):
        cost = cost_section(results, mode, started=started, command=command, host=host)
        # after the models section, where a first run puts it
        doc = (
            merge(doc, header, cost, COST_BEGIN, COST_END)
            if COST_BEGIN in doc
            else doc.replace(f"{END}\n", f"{END}\n\n{COST_BEGIN}\n{cost}\n{COST_END}\n", 1)
        )
    out.write_text(doc)
    return [*pngs, out]
