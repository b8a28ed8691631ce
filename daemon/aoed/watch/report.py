"""The report a drop folder's outbox gets beside a succeeded job's outputs
(`m_report.txt`): a short human summary of the job's outcome."""

from __future__ import annotations

from aoe import figures
from aoe.outcome import GdatDetails, OnnxDetails, ddp_text
from aoe.spec import JobType
from aoed.jobs.store import JobRow
from aoed.logs import printable

__all__ = ["report_text"]


def report_text(name: str, row: JobRow, written: list[str], missing: list[str]) -> str:
    """A short human summary of the succeeded job that tuned the model `name`: the drop
    folder's renderer of its outcome."""
    o = row.outcome
    f = o.figures if o is not None else figures.Figures("", figures.Shipped.NONE, 0.0)
    gdat = o is not None and o.job_type == JobType.GDAT
    where = (
        f"from the bank, as confirmed by {f.confirmed_by}"
        if f.confirmed_by
        else f"confirming A/B, {f.rounds} interleaved rounds of the world"
        if gdat
        else f"confirming A/B, {f.rounds} rounds, a process per model as deployed"
    )
    # A GDAT job's input is DDP's defaults, its output a DDP configuration, its figure a
    # training step of the world; an ONNX job's are models and a run of the model.
    d = o.details if o is not None else OnnxDetails()
    words = d.words
    if isinstance(d, GdatDetails):
        base = (
            f"{f.baseline_ms:.3f} ms per step, tail {d.baseline_tail_ms:.3f} ms "
            f"(DDP's defaults; {where})"
        )
        tail = f"; tail {d.result_tail_ms:.3f} ms" if f.changed else ""
    else:
        base, tail = f"{f.baseline_ms:.3f} ms ({where})", ""
    lines = [
        f"aoed tuned {printable(name)}",
        f"job:          {row.id}",
        f"baseline:     {base}",
        f"result:       {figures.result_text(f, 3, words)}{tail}",
        f"verdict:      {figures.verdict_text(f, words)}",
        f"shipped:      {figures.shipped_text(f, words)}",
    ]
    if isinstance(d, GdatDetails):
        lines.append(f"ddp:          {ddp_text(d)}")
    if o is not None and o.runtime != "onnxruntime":
        lines.append(
            f"runtime:      {o.runtime}, compile config {dict(o.runtime_options)} "
            "(open the .xml with aoe.session)"
        )
    lines += [
        f"bank:         {figures.bank_text(o.bank if o else {}, o.unshipped if o else 0)}",
        f"outputs:      {', '.join(written) or '(none)'}",
    ]
    lines += [f"missing:      {m}" for m in missing]
    return "\n".join(lines) + "\n"
