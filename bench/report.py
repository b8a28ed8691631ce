"""The models section of RESULTS.md: machine header, tables, targets, where we miss.

Writes only its own section (between `<!-- models:begin -->` and `<!-- models:end -->`)
and the header above all sections; every other section of the file is kept.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from targets import job_s, pct, ratio_text, speedup, targets, time_to_fraction, tuner_ab

__all__ = ["BEGIN", "END", "merge", "write"]

BEGIN, END = "<!-- models:begin -->", "<!-- models:end -->"
TITLE = "# Benchmark results"
INTRO = "This file is written by `make bench`; each benchmark owns one section."
_SECTION = re.compile(r"<!-- [\w-]+:begin -->")
VARIANTS = ("fp32", "quantize_dynamic", "aoe exact", "aoe int8")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ver = importlib.metadata.version
    return (
        f"{cpu}, {os.cpu_count()} cores ({platform.machine()}, {platform.system()} "
        f"{platform.release()}); Python {platform.python_version()}, onnxruntime "
        f"{ver('onnxruntime')}, onnx {ver('onnx')}, numpy {ver('numpy')}"
    )


def _latency_table(results: Sequence[Any]) -> list[str]:
    lines = [
        (
            "| model | variant | median ms | spread | vs fp32 | cosine | max abs err | "
            "products int8/float | note |"
        ),
        "|---|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in results:
        for name in VARIANTS:
            v = r.variants[name]
            if v.latency is None:
                note = (v.error or "not run").replace("|", "/")
                lines.append(f"| {r.name} | {name} | failed | | | | | | {note} |")
                continue
            a = v.accuracy
            cover = f"{v.ops.get('int8', 0)}/{v.ops.get('float', 0)}" if v.ops else ""
            note = ""
            if name.startswith("aoe"):
                doc = r.tunes[name.split()[1]].doc
                note = f"verify: {doc.get('verification')}"
                if doc.get("session_options"):
                    note += f"; options {doc['session_options']}"
            s = ratio_text(speedup(r, name))
            lines.append(
                f"| {r.name} | {name} | {v.latency.median_ms:.3f} | ±{pct(v.latency.spread)} | "
                f"**{s}** | {a.cosine:.6f} | {a.max_abs:.2e} | {cover} | "
                f"{note.replace('|', '/')} |"
            )
    return lines


def _tuning_table(results: Sequence[Any]) -> list[str]:
    lines = [
        (
            "| model | precision | job s | process s | trials | duty | t90 s | tuner's A/B | "
            "bank-hit job s | hit/full (job) | bank-hit process s | hit/full (process) |"
        ),
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        for p, run in r.tunes.items():
            if run.error:
                lines.append(f"| {r.name} | {p} | failed | {run.wall_s:.1f} | | | | | | | | |")
                continue
            doc = run.doc
            t90 = time_to_fraction(doc)
            t90s = "no gain" if t90 is None else f"{t90:.1f} ({t90 / job_s(doc):.0%})"
            if run.hit_error:
                hit = "| failed | | | "
            else:
                h = job_s(run.hit_doc)
                hit = (
                    f"| {h:.2f} | {h / job_s(doc):.1%} | {run.hit_wall_s:.1f} | "
                    f"{run.hit_wall_s / run.wall_s:.1%} "
                )
            lines.append(
                f"| {r.name} | {p} | {job_s(doc):.1f} | {run.wall_s:.1f} | "
                f"{doc['resources']['trials']} | {doc['resources']['duty_cycle']:.1%} | {t90s} | "
                f"{tuner_ab(doc):.2f}x {hit}|"
            )
    return lines


def section(
    results: Sequence[Any],
    mode,
    *,
    elapsed_s: float,
    started: float,
    command: str,
    plots: Sequence[str],
    load: str = "",
) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    models = ", ".join(f"`{r.name}` ({r.description})" for r in results)
    lines = [
        "## Models: onnxruntime fp32, quantize_dynamic, aoe tune exact and int8",
        "",
        f"`{command}` ({mode.name} mode) on {when}, {elapsed_s / 60:.1f} min in all. "
        f"aoe tune budget {mode.budget_s:g} s per job; latency over {mode.rounds} interleaved "
        f"rounds; accuracy over {mode.accuracy_inputs} held-out inputs. {load}".rstrip(),
        "",
        f"Models: {models}.",
        "",
        (
            "How to read it: all four variants of a model run in one process on the same "
            "inputs, in interleaved rounds whose order rotates; *median ms* is the median of the "
            "per-round medians and *spread* their interquartile range over the median. *vs fp32* "
            "divides onnxruntime's default session (fp32) by the variant, so the ratios are "
            "measured side by side even though this machine's absolute speed drifts. aoe "
            "variants run through `aoe.session` (the session options the tuner stored in the "
            "model); quantize_dynamic is called with its defaults. *cosine* (lowest) and *max "
            "abs err* (largest) compare each variant's outputs with fp32 on inputs the tuner "
            "never saw. *products int8/float* "
            "counts MatMul/Gemm/Conv-type nodes that run in int8 (integer kernels, or fed by "
            "DequantizeLinear) and in float."
        ),
        "",
        "### Latency and accuracy",
        "",
        *_latency_table(results),
        "",
        "### Tuning cost",
        "",
        (
            "*job s* is the tuner's own `tuning_time(s)`; *process s* adds starting Python and "
            "loading the engine. *duty* is the share of the job the device spent measuring. "
            "*t90* is when the estimated gain (`gain_timeline`, after each task decision) first "
            "reached 90% of its final value (*no gain*: no task beat its default; session options "
            "are not on that timeline). *tuner's A/B* is the tuner's end-to-end "
            "baseline/tuned ratio from its verify step. The bank-hit columns are a second "
            "`aoe tune` of the same model on the bank the first one filled."
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
        lines.append(f"| {t.title} | {t.measured} | **{t.status}** |")
    lines += ["", "### Where we miss and why", ""]
    missed = [t for t in tgs if t.misses]
    if not missed:
        lines.append("Every target stated above was met in this run.")
    for t in missed:
        lines.append(f"*{t.title}* ({t.status}):")
        lines.append("")
        lines += [f"- {m}" for m in t.misses]
        lines.append("")
        if t.why:
            lines += [t.why, ""]
    if plots:
        lines += ["", "### Plots", ""]
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines).rstrip()


def merge(doc: str, header: str, block: str) -> str:
    """`doc` with its header replaced, and our block replaced or put first among the
    sections; every other section is kept as it is."""
    m = _SECTION.search(doc)
    sections = doc[m.start() :] if m else ""
    wrapped = f"{BEGIN}\n{block}\n{END}"
    if BEGIN in sections and END in sections:
        head, rest = sections.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
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
    load: str = "",
) -> list[Path]:
    """Writes the plots beside `out` and our section of `out`; returns the paths written."""
    import plots

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = plots.draw(results, out.parent)
    header = f"{TITLE}\n\n{INTRO}\n\nMachine: {machine()}."
    block = section(
        results,
        mode,
        elapsed_s=elapsed_s,
        started=started,
        command=command,
        plots=[str(p) for p in pngs],
        load=load,
    )
    doc = out.read_text() if out.exists() else ""
    out.write_text(merge(doc, header, block))
    return [*pngs, out]
