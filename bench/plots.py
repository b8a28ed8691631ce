"""PNG plots for the models section of RESULTS.md (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a build machine

import matplotlib.pyplot as plt

__all__ = ["draw"]

COLORS = {"quantize_dynamic": "#9e9e9e", "aoe exact": "#1f77b4", "aoe int8": "#d62728"}


def _speedups(results: Sequence[Any], path: Path) -> Path:
    from targets import model_figure, speedup

    names = [r.name for r in results]
    variants = list(COLORS)
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names) + 2), 4.2))
    top = 1.0
    labeled: set[str] = set()
    for i, v in enumerate(variants):
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(names))]
        for x, r in zip(xs, results, strict=True):
            s = speedup(r, v)
            if s is None:
                ax.text(
                    x,
                    0.05,
                    "failed",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color=COLORS[v],
                )
                continue
            err = [[s.median - s.lo], [s.hi - s.median]]  # the 95% interval of the median
            ax.bar(
                x,
                s.median,
                width,
                color=COLORS[v],
                yerr=err,
                capsize=2,
                label=None if v in labeled else v,
            )
            labeled.add(v)
            ax.text(x, s.hi + 0.02, f"{s.median:.2f}", ha="center", va="bottom", fontsize=7)
            top = max(top, s.hi)
            if v.startswith("aoe"):
                run = r.tunes[v.split()[1]]
                tuner = (
                    None
                    if run.full.error
                    else model_figure(run.full.doc, "model_performance_improvement")
                )
                if tuner is not None:
                    label = None if "tuner" in labeled else "tuner's own figure"
                    ax.plot([x], [1 + tuner], "D", color="black", markersize=3, label=label)
                    labeled.add("tuner")
                    top = max(top, 1 + tuner)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="onnxruntime fp32")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("speedup vs onnxruntime fp32 (higher is better)")
    ax.set_ylim(0, top * 1.3 + 0.1)
    ax.set_title(
        "Speedup vs onnxruntime fp32, one session per process: median of paired per-round ratios, 95% interval",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _us(value: float) -> str:
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.0f} us"


def _convergence(results: Sequence[Any], path: Path) -> Path:
    from targets import job_s, time_to_fraction

    precisions = ["exact", "int8"]
    fig, axes = plt.subplots(1, len(precisions), figsize=(11, 4.2), sharey=True)
    cmap = plt.get_cmap("tab10")
    for ax, p in zip(axes, precisions, strict=True):
        for k, r in enumerate(results):
            run = r.tunes.get(p)
            if run is None or run.full.error:
                continue
            doc = run.full.doc
            timeline = doc.get("gain_timeline") or []
            end = job_s(doc)
            final = timeline[-1][1] if timeline else 0.0
            if final <= 0:
                ax.plot(
                    [0, end],
                    [0, 0],
                    color=cmap(k % 10),
                    linestyle=":",
                    label=f"{r.name} (no estimated gain)",
                )
                continue
            xs = [0.0] + [t for t, _ in timeline] + [end]
            ys = [0.0] + [g / final for _, g in timeline] + [1.0]
            ax.step(
                xs, ys, where="post", color=cmap(k % 10), label=f"{r.name} ({_us(final)} est. gain)"
            )
            t90 = time_to_fraction(doc)
            if t90 is not None:
                ax.plot([t90], [0.9], marker="o", color=cmap(k % 10), markersize=4)
        ax.axhline(0.9, color="gray", linewidth=0.6, linestyle="--")
        ax.set_title(f"aoe tune --precision {p}")
        ax.set_xlabel("seconds into the tuning job")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("share of the final estimated gain")
    fig.suptitle(
        "Tuning convergence (dots: 90% of the final gain; lines end when the job ends)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tuning_cost(results: Sequence[Any], path: Path) -> Path:
    from targets import job_s

    labels, full, hit = [], [], []
    for r in results:
        for p, run in r.tunes.items():
            if run.full.error:
                continue
            labels.append(f"{r.name}\n{p}")
            full.append(job_s(run.full.doc))
            hit.append(0.0 if run.hit is None or run.hit.error else job_s(run.hit.doc))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(labels) + 2), 4.2))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], full, 0.4, label="full tuning job", color="#1f77b4")
    ax.bar([x + 0.2 for x in xs], hit, 0.4, label="bank-hit job", color="#2ca02c")
    for x, f, h in zip(xs, full, hit, strict=True):
        if f > 0 and h > 0:
            ax.text(x + 0.2, h, f"{h / f:.0%}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("seconds (tuner's tuning_time)")
    ax.set_title("Tuning cost: a full job vs the same job answered from the bank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(results: Sequence[Any], folder: Path) -> list[Path]:
    """Writes speedup.png, convergence.png and tuning_cost.png into `folder`."""
    if not results:
        return []
    return [
        _speedups(results, folder / "speedup.png"),
        _convergence(results, folder / "convergence.png"),
        _tuning_cost(results, folder / "tuning_cost.png"),
    ]
