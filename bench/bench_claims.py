"""What aoe tune prints against what its tuned model does deployed, on held-out models.

    python bench/bench_claims.py [--models a,b] [--precisions exact,int8] [--budget S]
                                 [--rounds N] [--workdir DIR] [--out bench/RESULTS.md]

For every model and precision: `aoe tune` (the default job type a user gets, into a fresh
bank, with `--calibration`) prints an improvement over the input model, from its own
confirming A/B; then, independently of that decision, this process times the input model
and the tuned model its result JSON names as a user deploys them (bench/deployed.py: one
session per process, onnxruntime's defaults, the tuned model through `aoe.session` with
the options its job stored; processes in turn, paired rounds, while this process holds
the machine-wide device lock). The claim is the tuner's speedup (1 + its improvement),
the deployed figure the median of the paired per-round ratios input/tuned with its 95%
interval. Target: every claim within 10% of the deployed figure (claim / deployed in
[0.90, 1.10]).

Models are held out from the tuner's development: transformers' BertModel, GPT2Model, a
grouped-query LlamaModel (the attention of Qwen2 and Llama 3) and ViTModel, small configs
with RANDOM weights, exported by bench/torch_models.py in child processes; inputs are
synthetic (random token ids with an attention mask of ones; N(0, 1) pixels for ViT).

Writes the section between `<!-- claims:begin -->` and `<!-- claims:end -->` of the
results file. Exit status 0 unless the harness itself breaks; a miss is a result.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import onnx

import deployed
import measure
from bench_bank import publish
from bench_sgat import _export, _write_calibration, text_feeds
from machine import Machine
from run import Log, aoe_tune, holding_device

BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"

MODELS = ("hf_bert", "hf_gpt2", "hf_llama_gqa", "hf_vit")
PRECISIONS = ("exact", "int8")
TOLERANCE = 0.10
CALIBRATION = 16


@dataclass
class Row:
    model: str
    precision: str
    shipped: str = ""
    options: str = ""
    claim: float = 0.0  # the tuner's speedup over the input: 1 + its improvement
    claim_ci: tuple[float, float] = (0.0, 0.0)
    verdict: str = ""
    deployed: measure.Ratio | None = None
    input_ms: float = 0.0
    tuned_ms: float = 0.0
    wall_s: float = 0.0
    error: str = ""

    @property
    def agreement(self) -> float:
        return self.claim / self.deployed.median if self.deployed else float("nan")

    @property
    def ok(self) -> bool:
        return not self.error and self.deployed is not None and abs(self.agreement - 1) <= TOLERANCE


def bench(
    name: str, precisions: Sequence[str], work: Path, budget_s: float, rounds: int, log: Log
) -> list[Row]:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    try:
        vocab = max(1, int(_export(name, folder)["vocab"]))
    except (RuntimeError, KeyError) as exc:
        return [Row(name, p, error=f"export: {exc}") for p in precisions]
    path = folder / f"{name}.onnx"
    model = onnx.load(path, load_external_data=False)
    feed = text_feeds(model, 1000, vocab)
    calib = _write_calibration(
        folder / "calibration", [text_feeds(model, s, vocab) for s in range(CALIBRATION)]
    )
    rows = []
    for precision in precisions:
        row = Row(name, precision)
        job = aoe_tune(
            path, precision, folder / f"bank-{precision}", folder / precision, budget_s, calib
        )
        row.wall_s = job.wall_s
        if job.error:
            row.error = job.error
            rows.append(row)
            log(f"  {name} {precision}: FAILED {job.error}")
            continue
        conf = job.doc.get("confirmation", {})
        row.shipped = str(conf.get("shipped", ""))
        row.verdict = str(conf.get("verdict", ""))
        imp = float(conf.get("improvement", 0.0))
        lo, hi = conf.get("improvement_ci95") or (imp, imp)
        row.claim, row.claim_ci = 1 + imp, (1 + float(lo), 1 + float(hi))
        tuned = Path(job.doc["tuned_model"])
        import aoe

        if job.doc.get("runtime") == "openvino":  # an IR, with the compile config it runs with
            row.options = json.dumps(job.doc.get("runtime_options", {}), sort_keys=True)
            row.shipped += " on OpenVINO"
        else:
            row.options = json.dumps(aoe.session_options_of(tuned), sort_keys=True)
        models = {
            "input": deployed.Model(path),
            "tuned": deployed.Model(tuned, tuned=True),
        }
        timed, errors = holding_device(
            lambda models=models: deployed.latencies(
                models, feed, rounds=rounds, budget_s=max(30.0, rounds * 2.0), samples=20
            ),
            log,
        )
        if errors:
            row.error = "; ".join(f"{k}: {v}" for k, v in errors.items())
        else:
            row.deployed = measure.ratio(timed["input"], timed["tuned"])
            row.input_ms, row.tuned_ms = timed["input"].median_ms, timed["tuned"].median_ms
        rows.append(row)
        log(
            f"  {name} {precision}: claim {row.claim:.2f}x, deployed "
            f"{row.deployed.text() if row.deployed else row.error}"
        )
    return rows


def section(rows: list[Row], machine: str, args: argparse.Namespace, minutes: float) -> str:
    passed = sum(r.ok for r in rows)
    lines = [
        "## What aoe tune prints vs what its model does deployed (`python bench/bench_claims.py`)",
        "",
        machine,
        "",
        f"`python bench/bench_claims.py --budget {args.budget:g} --rounds {args.rounds}` "
        f"on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {minutes:.1f} min in all. "
        "Models held out from the tuner's development, small configs, **RANDOM weights**, "
        "synthetic inputs (random token ids with an attention mask of ones; N(0, 1) pixels "
        "for ViT); exported by "
        "bench/torch_models.py (TorchScript exporter, opset 17). Each job: `aoe tune` with "
        "the default job type, a fresh bank, `--calibration` of 16 such inputs.",
        "",
        "*claim*: the speedup `aoe tune` printed (1 + the improvement of its result JSON, "
        "from its confirming A/B) with its 95% interval. *deployed*: this run's own "
        "measurement, afterwards, of the input model and the tuned model (through "
        "`aoe.session`, with the options its job stored), one session per process, "
        f"onnxruntime's defaults, {args.rounds} paired rounds: the median of the per-round "
        "ratios input/tuned, 95% interval. *agreement*: claim / deployed; target "
        f"within {TOLERANCE:.0%}.",
        "",
        "| model | precision | shipped | session options (or OpenVINO compile config) | claim | deployed | input / tuned ms | agreement | tuning | result |",
        "|---|---|---|---|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        if r.error:
            lines.append(
                f"| {r.model} | {r.precision} | | | | failed: {r.error[:200].replace('|', '/')} | | | | **MISS** |"
            )
            continue
        dep = r.deployed.text() if r.deployed else "n/a"
        lines.append(
            f"| {r.model} | {r.precision} | {r.shipped} ({r.verdict}) | `{r.options}` | "
            f"{r.claim:.2f}x [{r.claim_ci[0]:.2f}, {r.claim_ci[1]:.2f}] | {dep} | "
            f"{r.input_ms:.2f} / {r.tuned_ms:.2f} | {r.agreement:.3f} | {r.wall_s:.0f} s | "
            f"**{'PASS' if r.ok else 'MISS'}** |"
        )
    lines += ["", f"Target met on {passed} of {len(rows)}.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--budget", type=float, default=10.0, help="aoe tune --budget, seconds")
    ap.add_argument("--rounds", type=int, default=15, help="paired deployed rounds")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    log = Log()
    t0 = time.time()
    host = Machine()  # before the work: the load average says what else was running
    work = args.workdir or Path(tempfile.mkdtemp(prefix="aoe-claims-"))
    rows: list[Row] = []
    for name in args.models.split(","):
        log(f"{name}:")
        rows += bench(name, args.precisions.split(","), work, args.budget, args.rounds, log)
    host.finish()
    machine = f"Machine: {host.describe('onnxruntime', 'torch', 'transformers')}."
    text = section(rows, machine, args, (time.time() - t0) / 60)
    publish(text, args.out, BEGIN, END)
    log(f"target met on {sum(r.ok for r in rows)} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
