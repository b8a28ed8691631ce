"""The report of bench/bench_sgat.py: its tables, and the names they share with it.

`section(results, mode, ...)` renders what bench_sgat.py measured as the markdown section
it writes into bench/RESULTS.md; the model lists, peers and labels live here so both
modules spell them alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

import measure
from targets import shipped

if TYPE_CHECKING:
    from bench_sgat import Job, Mode, ModelResult
    from machine import Machine

TITLE = (
    "## Subgraph tuning: aoe SGAT, OPAT and both vs what a user would try "
    "(`python bench/bench_sgat.py`)"
)
PACKAGES = ("onnxruntime", "onnx", "numpy", "torch", "transformers", "onnxscript", "scikit-learn")

TRANSFORMERS = (
    "bert",
    "gpt",
    "hf_bert",
    "hf_bert_dynamo",
    "hf_gpt2",
    "hf_gpt2_dynamo",
    "hf_llama",
    "hf_llama_dynamo",
    "hf_llama_gqa",
    "hf_llama_gqa_dynamo",
)
CNNS = ("digits_cnn", "resnet")
MODELS = (*TRANSFORMERS, *CNNS)
TORCH_MODELS = (
    "hf_bert",
    "hf_bert_dynamo",
    "hf_gpt2",
    "hf_gpt2_dynamo",
    "hf_llama",
    "hf_llama_dynamo",
    "hf_llama_gqa",
    "hf_llama_gqa_dynamo",
    "digits_cnn",
)
# Quick: one export of each real architecture and the trained CNN, a few minutes in all.
QUICK_MODELS = ("hf_bert", "hf_gpt2", "digits_cnn")
# The transformer samples' sizes (aoed.samples defaults) and the exports' (torch_models.py).
TEXT_SHAPE = {"num_heads": 4, "hidden_size": 256, "vocab": 8192}
SAMPLE_TYPES = {"bert": "bert", "gpt": "gpt2"}

REFERENCE = "fp32"
# The same file in a second default session: what the bench reads for two identical models.
CONTROL = "fp32_again"
JOB_TYPES = ("opat", "sgat", "sgat+opat")
TEXT_TUNES = tuple((j, p) for p in ("exact", "int8") for j in JOB_TYPES)
CNN_TUNES = (("opat", "int8"), ("sgat+opat", "int8"))
TEXT_PEERS = ("qdyn", "ort_opt", "ort_opt+qdyn")
CNN_PEERS = ("qstatic", "qdyn")
LABELS = {
    "fp32": "fp32",
    "fp32_again": "fp32, 2nd session",
    "qdyn": "quantize_dynamic",
    "ort_opt": "ORT optimizer",
    "ort_opt+qdyn": "optimizer + qdyn",
    "qstatic": "quantize_static",
}
TEXT_CALIBRATION = 16  # files; aoe calibrates on half and judges on the other half
RESNET_CALIBRATION = 16
CALIBRATION_SEED = 1000  # held-back inputs use seeds 0.., calibration 1000..
EXPORT_TIMEOUT_S = 900.0
CELL_LIMIT = 110  # characters of an error in a table cell; the full text is listed below


def aoe_name(job_type: str, precision: str) -> str:
    return f"aoe {job_type} {precision}"


def label(name: str) -> str:
    if name.startswith("aoe "):
        _, jt, p = name.split()
        return f"aoe {jt.upper()} {p}"
    return LABELS[name]


# ------------------------------------------------------------------ report


def _cell(text: object, limit: int | None = None) -> str:
    """Table-safe text; cut in the middle to `limit` characters (an error's cause is often
    at its end)."""
    text = str(text).replace("|", "/").replace("\n", " ")
    if limit is None or len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return f"{text[:half].rstrip()} … {text[-half:].lstrip()}"


def _speed(r: ModelResult, name: str) -> str:
    """Speedup vs fp32 [95% interval], median ms and spread, for one table cell."""
    v = r.variants.get(name)
    if v is None:
        return "not run"
    if v.latency is None:
        return _cell(f"failed: {v.error or 'not measured'}", CELL_LIMIT)
    if name == REFERENCE:
        return f"{v.latency.median_ms:.2f} ms ±{v.latency.spread:.0%}<br>{v.latency.rounds} rounds"
    s = measure.ratio(r.variants[REFERENCE].latency, v.latency)
    head = f"**{s.median:.2f}x** [{s.lo:.2f}, {s.hi:.2f}]" if s else "n/a"
    return f"{head}<br>{v.latency.median_ms:.2f} ms ±{v.latency.spread:.0%}"


def _text_table(results: Sequence[ModelResult]) -> list[str]:
    cols = [REFERENCE, CONTROL, *TEXT_PEERS, *(aoe_name(j, p) for j, p in TEXT_TUNES)]
    head = "| model | " + " | ".join(label(c) for c in cols) + " | optimizer fused |"
    lines = [head, "|---|" + "--:|" * len(cols) + "---|"]
    for r in results:
        if r.error:
            lines.append(
                f"| {r.name} | "
                + " | ".join([_cell(f"failed: {r.error}", CELL_LIMIT)] + [""] * (len(cols) - 1))
                + " | |"
            )
            continue
        cells = [_speed(r, c) for c in cols]
        lines.append(f"| {r.name} | " + " | ".join(cells) + f" | {_cell(r.fused or 'n/a')} |")
        cos = []
        for c in cols:
            v = r.variants.get(c)
            cos.append(
                ""
                if c == REFERENCE or v is None or v.accuracy is None
                else f"{v.accuracy.cosine:.5f}"
            )
        lines.append("| ↳ min cosine | " + " | ".join(cos) + " | |")
    return lines


def _cnn_table(results: Sequence[ModelResult]) -> list[str]:
    cols = [REFERENCE, CONTROL, *CNN_PEERS, *(aoe_name(j, p) for j, p in CNN_TUNES)]
    head = "| model | " + " | ".join(label(c) for c in cols) + " |"
    lines = [head, "|---|" + "--:|" * len(cols)]
    for r in results:
        if r.error:
            lines.append(
                f"| {r.name} | "
                + " | ".join([_cell(f"failed: {r.error}", CELL_LIMIT)] + [""] * (len(cols) - 1))
                + " |"
            )
            continue
        lines.append(f"| {r.name} | " + " | ".join(_speed(r, c) for c in cols) + " |")
        acc = []
        for c in cols:
            v = r.variants.get(c)
            if v is None or v.agree is None:
                acc.append("")
            elif v.top1 is not None:
                acc.append(f"{v.top1:.2%} ({round(v.top1 * r.labelled)}/{r.labelled})")
            else:
                acc.append(f"{v.agree:.0%} agree ({round(v.agree * r.inputs)}/{r.inputs})")
        what = "top-1" if r.labelled else "top-1 = fp32"
        lines.append(f"| ↳ {what} | " + " | ".join(acc) + " |")
        cos = [
            ""
            if c == REFERENCE or r.variants.get(c) is None or r.variants[c].accuracy is None
            else f"{r.variants[c].accuracy.cosine:.5f}"
            for c in cols
        ]
        lines.append("| ↳ min cosine | " + " | ".join(cos) + " |")
    return lines


def _wall(j: Job | None) -> str:
    """Process seconds, with the job's own tuning_time(s) in brackets."""
    if j is None:
        return "not run"
    if j.error:
        return f"failed ({j.wall_s:.1f})"
    return f"{j.wall_s:.1f}" + (f" (job {j.job_s:.1f})" if j.job_s is not None else "")


def _time_ratio(j: Job | None, opat: Job | None) -> str:
    if j is None or opat is None or j.error or opat.error or opat.wall_s <= 0:
        return "n/a"
    return f"{j.wall_s / opat.wall_s:.2f}x"


def _tuning_table(results: Sequence[ModelResult]) -> list[str]:
    lines = [
        (
            "| model | precision | OPAT s | SGAT s | SGAT+OPAT s | SGAT / OPAT | SGAT+OPAT / OPAT "
            "| shipped (OPAT / SGAT / SGAT+OPAT) | failed |"
        ),
        "|---|---|--:|--:|--:|--:|--:|---|---|",
    ]
    for r in results:
        for p in ("exact", "int8"):
            jobs = {jt: r.jobs.get(aoe_name(jt, p)) for jt in JOB_TYPES}
            if not any(jobs.values()):
                continue
            opat, sgat, both = (jobs[jt] for jt in JOB_TYPES)
            what = " / ".join(
                "-" if j is None or j.error else shipped(j.doc) for j in jobs.values()
            )
            errors = "; ".join(
                f"{jt.upper()}: {j.error}" for jt, j in jobs.items() if j and j.error
            )
            lines.append(
                f"| {r.name} | {p} | {_wall(opat)} | {_wall(sgat)} | {_wall(both)} | "
                f"{_time_ratio(sgat, opat)} | {_time_ratio(both, opat)} | {what} | "
                f"{_cell(errors, CELL_LIMIT)} |"
            )
    return lines


def _failures(results: Sequence[ModelResult]) -> list[str]:
    out = []
    for r in results:
        if r.error:
            out.append(f"- `{r.name}`: the model: {r.error}")
            continue
        for name, v in r.variants.items():
            if v.note:
                out.append(f"- `{r.name}` {label(name)} (not a failure): {v.note}")
            if v.latency is None:
                out.append(f"- `{r.name}` {label(name)}: {v.error or 'not measured'}")
            elif v.latency.dropped:
                out.append(
                    f"- `{r.name}` {label(name)}: measured, then dropped: {v.latency.dropped}"
                )
    return out


def _deployed_table(results: Sequence[ModelResult]) -> list[str]:
    rows = [
        "| model | stored session options | spinning on (deployed) | spinning off |",
        "|---|---|--:|--:|",
    ]
    for r in results:
        d = r.deployed
        if d is None:
            continue
        if d.skipped:
            rows.append(f"| {r.name} | | skipped: {d.skipped} | |")
            continue
        cells = []
        for g in d.regimes:
            ratios = g.ratios()
            cells.append(
                f"**{float(np.median(ratios)):.2f}x** [{ratios.min():.2f}, {ratios.max():.2f}]<br>"
                f"{float(np.median(g.qdyn_us)) / 1e3:.2f} ms vs {float(np.median(g.aoe_us)) / 1e3:.2f} ms"
            )
        options = ", ".join(f"{k}={v}" for k, v in sorted(d.options.items())) or "none"
        rows.append(f"| {r.name} | {options} | " + " | ".join(cells) + " |")
    return rows


def section(
    results: Sequence[ModelResult],
    mode: Mode,
    *,
    host: Machine,
    command: str,
    started: float,
    elapsed_s: float,
) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    text = [r for r in results if r.kind == "transformer"]
    cnns = [r for r in results if r.kind == "cnn"]
    lines = [
        TITLE,
        "",
        f"Machine: {host.describe(*PACKAGES)}.",
        "",
        (
            f"`{command}` ({mode.name} mode) on {when}, {elapsed_s / 60:.1f} min in all. aoe tune "
            f"budget {mode.budget_s:g} s per job, each job into a fresh bank; latency over up to "
            f"{mode.rounds} paired rounds, one session per process (up to {mode.samples} timed "
            f"samples per variant and round, fewer for a slow model so that the rounds fit in "
            f"{mode.measure_s:g} s)."
        ),
        "",
        (
            "Models, and where their weights and inputs come from. **Every transformer here and "
            "the resnet have random weights** (the samples are built in code, the exports are "
            "initialized by transformers from a fixed seed); only `digits_cnn` is trained:"
        ),
        "",
        *[f"- `{r.name}` ({r.description or 'not built'}): {r.data or 'n/a'}." for r in results],
        "",
        (
            "How to read it: latency is measured as a user deploys a model (bench/deployed.py): "
            "every variant of a model in a process of its own holding one session, on the same "
            "input, the processes taking turns in rounds (the order rotating from round to "
            "round) while this process holds the machine-wide device lock. A cell is the "
            "speedup vs fp32 (median of per-round ratios, 95% interval), then the median ms and "
            "the interquartile spread over it. fp32 and the peers run in a default onnxruntime "
            "session (ORT_ENABLE_ALL, intra-op spinning on); aoe's tuned models (the "
            "`tuned_model` of each job's result JSON) run through `aoe.session`, with the "
            "session options the tuner stored. *min cosine* is the "
            "lowest cosine of the outputs vs fp32 over the held-back inputs. *fp32, 2nd "
            "session* is the same file in a second such session, timed like the others: how "
            "far apart two identical models read here (a job that shipped its input runs "
            "that input too). A failed cell quotes the error."
        ),
    ]
    if text:
        lines += [
            "",
            "### Transformers",
            "",
            (
                "*quantize_dynamic*: `onnxruntime.quantization.quantize_dynamic` with its "
                "defaults. *ORT optimizer*: `onnxruntime.transformers.optimizer.optimize_model("
                "path, model_type='bert' or 'gpt2', num_heads=4, hidden_size=256)`, otherwise "
                "defaults ('gpt2' for the LLaMA exports too, as onnxruntime's own "
                "llama/convert_to_onnx.py calls it); *optimizer fused* lists the contrib ops in its output (`Attention 0`: "
                "it fused no attention). *optimizer + qdyn*: its output through quantize_dynamic."
            ),
            "",
            *_text_table(text),
        ]
        deployed = _deployed_table(text)
        if len(deployed) > 2:
            lines += [
                "",
                "### Transformers: intra-op spinning on (deployed) and off (`bench/deployed.py`)",
                "",
                (
                    "quantize_dynamic and aoe's SGAT+OPAT int8 model again, one session per "
                    "process as above, with intra-op spinning on (onnxruntime's default, as "
                    "deployed) and forced off (as the tuner measures, so that its interleaved "
                    f"sessions do not disturb each other), {mode.deployed_rounds} paired rounds "
                    "per regime (aoe's with the session options its job stored). A cell is "
                    "aoe's speedup over quantize_dynamic: the median of the per-round ratios, "
                    "their range in brackets, then each side's median time."
                ),
                "",
                *deployed,
            ]
    if cnns:
        lines += [
            "",
            "### CNNs",
            "",
            (
                "*quantize_static*: `quant_pre_process`, then `quantize_static(..., "
                "quant_format=QDQ, per_channel=True)` with a CalibrationDataReader over the same "
                "files aoe's `--calibration` gets. *top-1*: `digits_cnn` against the true labels "
                "of its test split; `resnet` (random weights) the share of held-back inputs whose "
                "top-1 class matches fp32's."
            ),
            "",
            *_cnn_table(cnns),
        ]
    tuning = _tuning_table(results)
    if len(tuning) > 2:
        lines += [
            "",
            "### Tuning time",
            "",
            (
                "Seconds of each `aoe tune` process, start to exit (in brackets the job's own "
                "`tuning_time(s)`), same budget for every job type; the ratios are SGAT's and "
                "SGAT+OPAT's process time over OPAT's on the same model and precision."
            ),
            "",
            *tuning,
        ]
    fails = _failures(results)
    if fails:
        lines += ["", "### Failures and notes, in full", "", *fails]
    return "\n".join(lines).rstrip()
