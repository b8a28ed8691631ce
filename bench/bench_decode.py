"""Decoding with a KV cache as a generation loop runs it: decode tokens per second at
several past lengths, as deployed, written into bench/RESULTS.md.

    python bench/bench_decode.py [--quick] [--budget S] [--no-write] [--out bench/RESULTS.md]

The model is the repository's KV-cache decoder sample (aoed.samples.kv_decoder: one
decode step of a pre-norm GPT-style decoder, exported by torch.onnx with the past
length dynamic; random weights) at the size below. `aoe tune --precision int8` gets no
shape flag: the job derives its profile (past lengths up to the position table). At each
past length of PASTS, three models are timed with one onnxruntime session per process,
in turns (bench/deployed.py): the input model, quantize_dynamic's model of it, and the
model aoe shipped (opened with `aoe.session`); one decode step per run, so tokens per
second is 1000 / the median step in ms. The logits' cosine against the input model's
is given per past length, on the same synthetic past.

Target (the decoder anchor, int8): decode tokens/s >= 1.3x the input model at every past
length, logits' cosine stated.
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
BEGIN, END = "<!-- decode:begin -->", "<!-- decode:end -->"
PASTS = (16, 256, 1024)
SIZE = {"hidden": 384, "heads": 6, "layers": 4, "vocab": 2048, "max_positions": 2048}


def _feed(past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(past)
    head_dim = SIZE["hidden"] // SIZE["heads"]
    feed = {"input_ids": np.array([[int(rng.integers(1, SIZE["vocab"]))]], np.int64)}
    for i in range(SIZE["layers"]):
        for kind in ("key", "value"):
            feed[f"past_{kind}_{i}"] = rng.standard_normal(
                (1, SIZE["heads"], past, head_dim)
            ).astype(np.float32)
    return feed


def main(argv: list[str] | None = None) -> int:
    args = measure.shape_bench_args(__doc__, RESULTS, argv)
    from aoed import samples

    log, host = Log(), Machine()
    rounds = 7 if args.quick else 15
    work = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    src = samples.save(samples.kv_decoder(**SIZE), work / "decoder.onnx")
    qdyn = quantize(src, work / "decoder_qdyn.onnx")
    shipped: dict[str, Path] = {}
    said, took = "", []
    for precision in ("int8", "int4"):
        log(f"aoe tune --precision {precision} (no shape flags)")
        job = aoe_tune(src, precision, work / f"bank_{precision}", work / precision, args.budget)
        if job.error or not job.doc:
            print(f"aoe tune --precision {precision} failed: {job.error}", file=sys.stderr)
            return 1
        shipped[precision] = Path(job.doc["tuned_model"])
        took.append(f"{precision} took {job.wall_s:.0f} s")
        said = said or next((n for n in job.doc["notes"] if n.startswith("shape profile:")), "")
    profile = "; ".join([f"shape profile: {said.split('; ')[-1]}"] * bool(said) + took)
    rows, speedups = [], []
    for past in PASTS:
        feed = _feed(past)
        models = {
            "input": deployed.Model(src),
            "int8": deployed.Model(shipped["int8"], tuned=True),
            "int4": deployed.Model(shipped["int4"], tuned=True),
        }
        if qdyn.path is not None:
            models["qdyn"] = deployed.Model(qdyn.path)
        log(f"past {past}: {rounds} rounds, one session per process")
        lat, errors = holding_device(
            lambda feed=feed, models=models: deployed.latencies(
                models, feed, rounds=rounds, budget_s=150.0, samples=20
            ),
            log,
        )
        reference = measure.outputs_of(src, feed, False, ["logits"])
        cos = {
            k: measure.accuracy(
                [reference], [measure.outputs_of(shipped[k], feed, True, ["logits"])]
            ).cosine
            for k in shipped
        }
        if qdyn.path is not None:
            cos["qdyn"] = measure.accuracy(
                [reference], [measure.outputs_of(qdyn.path, feed, False, ["logits"])]
            ).cosine
        vs_input = measure.ratio(lat.get("input"), lat.get("int8"))
        speedups.append(vs_input)
        tps = {k: 1000.0 / v.median_ms for k, v in lat.items()}
        rows.append(
            f"| {past} | {tps['input']:.0f} | "
            + (f"{tps['qdyn']:.0f} | " if "qdyn" in tps else "n/a | ")
            + f"{tps['int8']:.0f} | {tps['int4']:.0f} | {measure.ratio_text(vs_input)} | "
            f"{measure.ratio_text(measure.ratio(lat.get('input'), lat.get('int4')))} | "
            f"{measure.ratio_text(measure.ratio(lat.get('qdyn'), lat.get('int8')))} | "
            f"{cos['int8']:.5f} | {cos['int4']:.5f} | {cos.get('qdyn', float('nan')):.5f} |"
            + (f" {errors}" if errors else "")
        )
    host.finish()
    ok = all(r is not None and r.median >= 1.3 for r in speedups)
    lines = [
        "## Decoding with a KV cache: tokens per second as deployed (`python bench/bench_decode.py`)",
        "",
        f"Machine: {host.describe('onnxruntime', 'onnx', 'torch')}.",
        "",
        "The repository's KV-cache decoder sample (**synthetic**: random weights; a random "
        "past and token at each length) at "
        f"{SIZE['layers']} layers, hidden {SIZE['hidden']}, {SIZE['heads']} heads, "
        f"vocabulary {SIZE['vocab']}, position table {SIZE['max_positions']}; one decode step "
        "per run, the past length dynamic, as torch.onnx exports it. `aoe tune --precision "
        f"int8` and `--precision int4`, `--budget {args.budget:g}`, with no shape flag (the "
        f"jobs' {profile}). Each past length: the input model, quantize_dynamic's model and "
        "the models aoe shipped, one onnxruntime "
        f"session per process in turns (bench/deployed.py), {rounds} rounds; tokens/s is "
        "1000 / the median step (ms); speedups are the median of the per-round ratios with a "
        "95% interval; cosine of the logits against the input model's. Prefill is not "
        "measured (the sample's step takes one token).",
        "",
        "| past | input tokens/s | quantize_dynamic tokens/s | aoe int8 tokens/s | aoe int4 "
        "tokens/s | aoe int8 vs input | aoe int4 vs input | aoe int8 vs quantize_dynamic | "
        "logits cosine (int8) | (int4) | (quantize_dynamic) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Target: aoe int8 >= 1.3x the input model's decode tokens/s at every past length: "
        f"**{'PASS' if ok else 'MISS'}**. The int4 anchor (onnxruntime-genai's model builder) "
        "is not measured here.",
    ]
    publish("\n".join(lines), args.out, BEGIN, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
