"""onnxruntime against OpenVINO on the sample models, as deployed, side by side.

    python bench/bench_runtimes.py [--models cnn,transformer,hf_bert] [--precision int8]
                                   [--rounds 15] [--work DIR] [--json FILE] [--no-write]
                                   [--out FILE]

For each model, a sample of aoed.samples (random weights, synthetic N(0, 1) inputs, token
ids over the table they index, as the tuner draws its own samples) or a held-out
transformer of bench/torch_models.py (`hf_*`: random weights, token ids over its
vocabulary with an attention mask of ones; the job and NNCF calibrate on 16 such inputs),
five ways to run it are measured together:

- `onnxruntime fp32`: the input model on onnxruntime's defaults (what every figure of a
  job compares with);
- `aoe shipped`: what `aoe tune --precision P` ships for it (an embedded job with a bank of
  its own under --work): an ONNX model with its session options, or an OpenVINO IR with
  its compile config, whichever won;
- `openvino default`: the input model on OpenVINO with no compile property at all
  (OpenVINO's defaults: bf16 on a CPU with AMX);
- `openvino nncf int8`: NNCF's post-training int8 of the input (calibrated on 16
  synthetic samples) on OpenVINO's defaults;
- `quantize_dynamic`: onnxruntime's dynamic int8 quantization of the input, on
  onnxruntime's defaults.

They are timed by the tuner's own procedure (aoed.backends.ort.runner with a deployed
plan): each in a process of its own, in rounds whose order rotates, every process stopped
between its turns, while this process holds the machine-wide device lock. A cell gives
the median time, the median of the paired per-round ratios to `onnxruntime fp32` with its
95% interval, and the output cosine against it; the section goes into bench/RESULTS.md
(unless --no-write).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path[:0] = [
    str(Path(__file__).resolve().parent.parent / "client"),
    str(Path(__file__).resolve().parent.parent / "daemon"),
    str(Path(__file__).resolve().parent),
]

import numpy as np
import onnx

from aoe import session_options_of
from aoe.config import load_config
from aoe.device import CPU
from aoe.ovartifact import port_name
from aoe.spec import JobSpec
from aoed import embedded, samples
from aoed.backends.ort import runner
from aoed.engine import stats
from aoed.engine.calibration import integer_ranges
from aoed.engine.messages import Candidate, MeasurePlan, MeasureRequest
from aoed.engine.prep import make_inputs, prepare
from bench_bank import publish
from bench_sgat import _export, _write_calibration, text_feeds
from machine import Machine
from run import holding_device, quantize

NAMES = (
    "onnxruntime fp32",
    "aoe shipped",
    "openvino default",
    "openvino nncf int8",
    "quantize_dynamic",
)
#: What aoe's shipped artifact is held against (the issue's anchors measured here).
OTHERS = ("openvino default", "openvino nncf int8", "quantize_dynamic")
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN, END = "<!-- runtimes:begin -->", "<!-- runtimes:end -->"
#: The output cosine against fp32 aoe's int8 gate keeps (aoed.engine.policy).
GATE = 0.999
#: Calibration samples NNCF gets for the `openvino nncf int8` row.
CALIBRATION = 16


def _feeds(model: Path, work: Path, seed: int) -> dict[str, np.ndarray]:
    """Inputs as the tuner makes its synthetic samples: N(0, 1) floats, and token ids
    over the whole table an id input indexes (not the first 8 ids alone, which no text
    is made of, and on which an int8 model calibrated on real ids drifts)."""
    prep = prepare(model, work / f"prep{seed}")
    highs = integer_ranges(onnx.load(str(model)), prep.inputs)
    return make_inputs(prep.inputs, seed=seed, int_high=highs)


def _nncf_int8(model: Path, feeds: Callable[[int], dict[str, np.ndarray]]) -> Path:
    from aoe.ovdevices import quiet

    quiet()  # before nncf's import, as aoed's own builds do: no usage telemetry
    import nncf
    import openvino as ov

    ov_model = ov.Core().read_model(str(model))
    calib = [feeds(seed) for seed in range(CALIBRATION)]
    names = [port_name(p, i, "input") for i, p in enumerate(ov_model.inputs)]
    data = nncf.Dataset([{n: f[n] for n in names} for f in calib])
    xml = model.parent / "nncf_int8.xml"
    ov.save_model(nncf.quantize(ov_model, data), str(xml), compress_to_fp16=False)
    return xml


def _model(
    name: str, work: Path
) -> tuple[Path, Callable[[int], dict[str, np.ndarray]], Path | None]:
    """`name`'s model file, its inputs by seed and its calibration folder (None: the
    tuner's synthetic samples, drawn as `_feeds` draws). A sample of aoed.samples, or a
    held-out transformer of bench/torch_models.py (`hf_*`: exported in a child process,
    fed token ids over its vocabulary with an attention mask of ones, and calibrated on
    16 such inputs, as bench_claims does)."""
    if not name.startswith("hf_"):
        path = samples.save(samples.build(name), work / f"{name}.onnx")
        return path, lambda seed: _feeds(path, work, seed), None
    vocab = max(1, int(_export(name, work)["vocab"]))
    path = work / f"{name}.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    calib = _write_calibration(
        work / "calibration", [text_feeds(proto, s, vocab) for s in range(CALIBRATION)]
    )
    return path, lambda seed: text_feeds(proto, seed, vocab), calib


def _shipped(
    model: Path, work: Path, precision: str, calibration: Path | None = None
) -> tuple[Candidate, list[str]]:
    """What `aoe tune` ships for `model` (a bank of its own under `work`), with the
    options it runs with; and the job's notes on the runtimes (why one won)."""
    config = load_config().replace(bank=work / "bank")
    spec = JobSpec(precision=precision, job_type="opat", calibration_dir=calibration)
    outcome = embedded.tune(model, spec, work / "tune", config=config)
    path = Path(outcome.tuned_model)
    why = [n for n in outcome.notes if "OpenVINO" in n]
    table = json.loads(Path(outcome.result_json).read_text()).get("runtimes", [])
    why += [
        f"{r['name']} {r.get('gate') or r.get('error') or 'not judged'}"
        for r in table
        if r.get("runtime") == "openvino" and r.get("gate") != "passed"
    ]
    if outcome.runtime == "openvino":
        opts = dict(outcome.runtime_options)
        return Candidate("aoe shipped", path, opts, runtime="openvino"), why
    return Candidate("aoe shipped", path, session_options_of(path)), why


def bench_model(name: str, work: Path, precision: str, rounds: int) -> dict[str, object]:
    work.mkdir(parents=True, exist_ok=True)
    model, feeds, calibration = _model(name, work)
    shipped, why = _shipped(model, work, precision, calibration)
    inputs = work / "inputs.npz"
    np.savez(inputs, **feeds(1234))
    cands = (
        Candidate("onnxruntime fp32", model),
        shipped,
        Candidate("openvino default", model, runtime="openvino"),
    )
    unbuilt: dict[str, str] = {}
    try:
        cands += (Candidate("openvino nncf int8", _nncf_int8(model, feeds), runtime="openvino"),)
    except Exception as exc:  # NNCF fails on some graphs: that way is not there to time
        unbuilt["openvino nncf int8"] = f"NNCF failed: {type(exc).__name__} {exc}"[:160]
    qdyn = quantize(model, work / f"{name}_qdyn.onnx")
    if qdyn.path is not None:
        cands += (Candidate("quantize_dynamic", qdyn.path),)
    plan = MeasurePlan.fixed(rounds, 120.0, deployed=True)
    req = MeasureRequest(cands, inputs, "onnxruntime fp32", CPU, plan)
    got = holding_device(lambda: runner.measure(req).results, print)
    base = got["onnxruntime fp32"]
    row: dict[str, object] = {"model": name, "shipped_runtime": shipped.runtime, "why": why}
    for cid in NAMES:
        m = got.get(cid)
        if m is None:
            row[cid] = {"error": unbuilt.get(cid, "not built")}
            continue
        if not m.ok:
            row[cid] = {"error": m.error}
            continue
        ratios = stats.paired_ratios(m.rounds_us, base.rounds_us)
        lo, hi = stats.median_ci(ratios, 0.95) if len(ratios) >= 6 else (float("nan"),) * 2
        row[cid] = {
            "median_ms": m.median_us / 1000,
            "speedup": 1 / stats.median(ratios) if ratios else float("nan"),
            "speedup_ci95": (1 / hi, 1 / lo),
            "cosine": m.cosine,
            "rounds": len(ratios),
        }
    return row


def _cell(c: object) -> str:
    if not isinstance(c, dict) or "error" in c:
        return f"failed: {c.get('error') if isinstance(c, dict) else c}"
    lo, hi = c["speedup_ci95"]
    return (
        f"{c['median_ms']:.4f} ms, {c['speedup']:.2f}x [{lo:.2f}, {hi:.2f}], "
        f"cosine {c['cosine']:.6f}"
    )


def _ratio(aoe: dict[str, Any], others: Iterable[dict[str, Any]]) -> float:
    """aoe's speedup over the fastest of `others` (nan when there is none)."""
    best = max((c["speedup"] for c in others), default=float("nan"))
    return float(aoe["speedup"]) / best


def _speedup(c: object) -> str:
    if not isinstance(c, dict):
        return "failed"
    if "error" in c:
        return "failed: " + str(c["error"]).replace("|", "/")
    lo, hi = c["speedup_ci95"]
    return f"{c['median_ms']:.3f} ms, {c['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]"


def section(rows: list[dict[str, object]], host: Machine, precision: str, rounds: int) -> str:
    lines = [
        "## Runtimes: what aoe ships against OpenVINO and quantize_dynamic (`python bench/bench_runtimes.py`)",
        "",
        f"Machine: {host.describe('onnxruntime', 'openvino', 'nncf')}.",
        "",
        (
            "The repository's sample models (**synthetic**: random weights, synthetic N(0, 1) "
            "inputs, token ids over the whole embedding table; NNCF's baseline calibrated on 16 "
            "such inputs, as the tuner's own samples are drawn) and the held-out transformers "
            "of bench/torch_models.py (`hf_*`, **random weights**, small configs; token ids over "
            "the vocabulary with an attention mask of ones; the job and NNCF calibrate on 16 such "
            f"inputs). `aoe shipped`: what `aoe tune --precision {precision} --job-type opat` "
            "ships (fitted budget, `--runtime auto`: an ONNX model or an OpenVINO IR, whichever "
            "won); the others as the module doc says. All five timed together as deployed (a "
            f"process each, rotating turns), {rounds} rounds; each cell: median, speedup over "
            "onnxruntime fp32 (median of the per-round ratios, 95% interval) and the output's "
            "cosine against it. `aoe vs best`: aoe's speedup over the best of the other three, "
            f"from those medians; `vs best at cosine >= {GATE}`: over the best of those whose "
            "output keeps that cosine (aoe's int8 gate)."
        ),
        "",
        (
            "| model | onnxruntime fp32 | aoe shipped | ships on | OpenVINO defaults | "
            "OpenVINO + NNCF int8 | quantize_dynamic | aoe vs best | "
            f"vs best at cosine >= {GATE} | aoe cosine |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    vs_best: list[float] = []
    vs_gated: list[float] = []
    for r in rows:
        aoe = r["aoe shipped"]
        ok = {o: r[o] for o in OTHERS if isinstance(r[o], dict) and "speedup" in r[o]}
        ratio, gated = (
            (_ratio(aoe, ok.values()), _ratio(aoe, (c for c in ok.values() if c["cosine"] >= GATE)))
            if isinstance(aoe, dict) and "speedup" in aoe
            else (float("nan"), float("nan"))
        )
        vs_best.append(ratio)
        vs_gated.append(gated)
        base = r["onnxruntime fp32"]
        lines.append(
            f"| {r['model']} | {base['median_ms']:.3f} ms | {_speedup(aoe)} | "
            f"{r['shipped_runtime']} | {_speedup(r['openvino default'])} | "
            f"{_speedup(r['openvino nncf int8'])} | {_speedup(r['quantize_dynamic'])} | "
            f"{ratio:.2f}x | {gated:.2f}x | "
            f"{aoe.get('cosine', float('nan')) if isinstance(aoe, dict) else float('nan'):.5f} |"
        )
    met = all(v >= 1.0 for v in vs_best)
    gated_met = all(v >= 1.0 for v in vs_gated)
    share = sum(v >= 1.1 for v in vs_best) / max(1, len(vs_best))
    lines += [
        "",
        (
            f"Targets: aoe >= 1.0x the best other on every model: **{'PASS' if met else 'MISS'}** "
            f"({', '.join(f'{v:.2f}x' for v in vs_best)}); >= 1.1x on 60% of them: "
            f"{share:.0%}; against the best at cosine >= {GATE}: "
            f"**{'PASS' if gated_met else 'MISS'}** ({', '.join(f'{v:.2f}x' for v in vs_gated)}). "
            "Olive and the trained CNN are not in this bench."
        ),
        "",
        f"What this machine's OpenVINO computes in: {_capabilities()}. Why each job shipped "
        "what it did, in its own words (the notes of its result that name OpenVINO, and why "
        "each OpenVINO build that lost was out):",
        "",
        *(
            f"- {r['model']}: " + (" ".join(_cell_text(n) for n in r.get("why") or []) or "no note")
            for r in rows
        ),
    ]
    return "\n".join(lines)


def _capabilities() -> str:
    from aoe.ovdevices import find

    offer = find()
    if not offer.usable:
        return f"nothing ({offer.why_not})"
    return f"{', '.join(sorted(offer.capabilities))} on {offer.cpu_name} (OpenVINO {offer.version})"


def _cell_text(note: str) -> str:
    return note.replace("|", "/").rstrip(".") + "."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,transformer,resnet,bert")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    args = ap.parse_args()
    host = Machine()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-runtimes-"))
    rows = []
    for name in args.models.split(","):
        row = bench_model(name, work / name, args.precision, args.rounds)
        rows.append(row)
        print(f"{name} (aoe shipped on {row['shipped_runtime']}):", file=sys.stderr)
        for cid in NAMES:
            print(f"  {cid:<20} {_cell(row[cid])}", file=sys.stderr)
    host.finish()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    publish(
        section(rows, host, args.precision, args.rounds),
        args.out,
        BEGIN,
        END,
        not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
