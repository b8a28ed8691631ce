"""A dynamic encoder as a server runs it: tuned with no shape flags, then measured as
deployed at the shapes requests come in, written into bench/RESULTS.md.

    python bench/bench_dynamic.py [--quick] [--budget S] [--no-write] [--out bench/RESULTS.md]

The model is the repository's BERT-style encoder sample (aoed.samples.encoder: random
weights, dynamic `batch` and `seq` axes, a position table of 256) at BERT-mini's size.
`aoe tune --precision int8` gets no shape flag: the job derives its shape profile. At each
point of POINTS (outside the profile too), three models are timed with one onnxruntime
session per process, in turns (bench/deployed.py): the input model, quantize_dynamic's
model of it, and the model aoe shipped (opened with `aoe.session`); inputs are synthetic
token ids. The figures are the median of the per-round ratios with a 95% interval, and
the cosine of each model's output against the input model's at that point.

Targets (the dynamic-encoder anchor): never slower than the input model at any point,
>= 1.2x it at two or more, >= 1.1x quantize_dynamic at those, cosine >= 0.999 everywhere.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

import deployed
import measure
from bench_bank import publish
from machine import Machine
from run import Log, aoe_tune, holding_device, quantize

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- dynamic:begin -->", "<!-- dynamic:end -->"
#: (batch, seq) as requests come in
POINTS = ((1, 16), (1, 128), (4, 64), (2, 256))
#: BERT-mini's size; a position table as long as the longest point
SIZE = {"hidden": 256, "heads": 4, "ffn": 1024, "layers": 4, "vocab": 2048, "max_positions": 256}


def _feed(batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 1000 + seq)
    return {"input_ids": rng.integers(1, SIZE["vocab"], (batch, seq)).astype(np.int64)}


def main(argv: list[str] | None = None) -> int:
    args = measure.shape_bench_args(__doc__, RESULTS, argv)
    from aoed import samples

    log, host = Log(), Machine()
    rounds = 7 if args.quick else 15
    work = Path(tempfile.mkdtemp(prefix="bench-dynamic-"))
    src = samples.save(samples.encoder(**SIZE), work / "encoder.onnx")
    qdyn = quantize(src, work / "encoder_qdyn.onnx")
    log("aoe tune --precision int8 (no shape flags)")
    job = aoe_tune(src, "int8", work / "bank", work / "out", args.budget)
    if job.error or not job.doc:
        print(f"aoe tune failed: {job.error}", file=sys.stderr)
        return 1
    shipped = Path(job.doc["tuned_model"])
    said = next((n for n in job.doc["notes"] if n.startswith("shape profile:")), "")
    profile = f"shape profile: {said.split('; ')[-1]}" if said else ""
    rows, verdicts = [], []
    for batch, seq in POINTS:
        feed = _feed(batch, seq)
        models = {
            "input": deployed.Model(src),
            "aoe": deployed.Model(shipped, tuned=True),
        }
        if qdyn.path is not None:
            models["qdyn"] = deployed.Model(qdyn.path)
        log(f"point ({batch}, {seq}): {rounds} rounds, one session per process")
        lat, errors = holding_device(
            lambda feed=feed, models=models: deployed.latencies(
                models, feed, rounds=rounds, budget_s=120.0, samples=20
            ),
            log,
        )
        reference = measure.outputs_of(src, feed, tuned=False)
        acc = measure.accuracy([reference], [measure.outputs_of(shipped, feed, tuned=True)])
        q_acc = (
            measure.accuracy([reference], [measure.outputs_of(qdyn.path, feed, tuned=False)])
            if qdyn.path is not None
            else None
        )
        vs_input = measure.ratio(lat.get("input"), lat.get("aoe"))
        vs_qdyn = measure.ratio(lat.get("qdyn"), lat.get("aoe"))
        verdicts.append((vs_input, vs_qdyn, acc.cosine))
        rows.append(
            f"| ({batch}, {seq}) | {lat['input'].median_ms:.3f} ms | "
            + (f"{lat['qdyn'].median_ms:.3f} ms | " if "qdyn" in lat else "n/a | ")
            + f"{lat['aoe'].median_ms:.3f} ms | {measure.ratio_text(vs_input)} | {measure.ratio_text(vs_qdyn)} | "
            f"{acc.cosine:.6f} | {q_acc.cosine if q_acc else float('nan'):.6f} | "
            f"{vs_input.pairs if vs_input else 0} |" + (f" {errors}" if errors else "")
        )
    host.finish()
    never_slower = all(v is not None and v.hi >= 1.0 for v, _, _ in verdicts)
    fast = [(v, q) for v, q, _ in verdicts if v is not None and v.median >= 1.2]
    beats_qdyn = all(q is not None and q.median >= 1.1 for _, q in fast)
    accurate = all(c >= 0.999 for _, _, c in verdicts)
    ok = never_slower and len(fast) >= 2 and beats_qdyn and accurate
    lines = [
        "## A dynamic encoder at the shapes a server sees (`python bench/bench_dynamic.py`)",
        "",
        f"Machine: {host.describe('onnxruntime', 'onnx', 'numpy')}.",
        "",
        "The repository's encoder sample (**synthetic**: random weights, synthetic token ids) "
        f"at {SIZE['layers']} layers, hidden {SIZE['hidden']}, {SIZE['heads']} heads, FFN "
        f"{SIZE['ffn']}, vocabulary {SIZE['vocab']}, position table {SIZE['max_positions']}; "
        "`batch` and `seq` dynamic. `aoe tune --precision int8 --budget "
        f"{args.budget:g}` with no shape flag (the job's {profile or 'shape profile: none said'}; "
        f"it took {job.wall_s:.0f} s). Each point: the input model, quantize_dynamic's model "
        "and aoe's shipped model, one onnxruntime session per process in turns "
        f"(bench/deployed.py), {rounds} rounds; speedups are the median of the per-round "
        "ratios with a 95% interval; cosine of each model's output against the input "
        "model's at that point.",
        "",
        "| (batch, seq) | input | quantize_dynamic | aoe int8 | aoe vs input | aoe vs "
        "quantize_dynamic | cosine (aoe) | cosine (quantize_dynamic) | rounds |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Targets: never slower than the input (every interval reaches 1.0): "
        f"{'yes' if never_slower else 'no'}; >= 1.2x at two or more points: {len(fast)} point(s); "
        f">= 1.1x quantize_dynamic at those: {'yes' if beats_qdyn else 'no'}; cosine >= 0.999 "
        f"everywhere: {'yes' if accurate else 'no'}. **{'PASS' if ok else 'MISS'}**.",
    ]
    publish("\n".join(lines), args.out, BEGIN, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
