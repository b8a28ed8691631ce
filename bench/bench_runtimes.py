"""onnxruntime against OpenVINO, Olive and onnxruntime's quantizers, as deployed, side by side.

    python bench/bench_runtimes.py [--quick] [--models cnn,hf_bert,digits_cnn] [--precision int8]
                                   [--rounds 11] [--work DIR] [--json FILE] [--no-write]
                                   [--out FILE]

For each model: a sample of aoed.samples (random weights, synthetic N(0, 1) inputs, token
ids over the table they index, as the tuner draws its own samples), a held-out
transformer of bench/torch_models.py (`hf_*`: random weights, token ids over its
vocabulary with an attention mask of ones; the job and NNCF calibrate on 16 such
inputs), or `digits_cnn`, the conv net bench/torch_models.py trains on scikit-learn's
digits (real images: the job, NNCF and quantize_static calibrate on the same 10 files of
32 training images; top-1 is counted on the 384 held-out test images). These ways to run
it are measured together:

- `onnxruntime fp32`: the input model on onnxruntime's defaults (what every figure of a
  job compares with);
- `aoe shipped`: what `aoe tune --precision P` ships for it (an embedded job with a bank of
  its own under --work): an ONNX model with its session options, or an OpenVINO IR with
  its compile config, whichever won;
- `openvino default`: the input model on OpenVINO with no compile property at all
  (OpenVINO's defaults: bf16 on a CPU with AMX);
- `openvino nncf int8`: NNCF's post-training int8 of the input (calibrated as above) on
  OpenVINO's defaults;
- `quantize_dynamic`: onnxruntime's dynamic int8 quantization of the input, on
  onnxruntime's defaults;
- `olive` (transformers only): Olive's CPU recipe (bench/olive_cpu.py: the transformers
  optimizer, dynamic int8, session-parameter tuning) with the session options it chose;
- `quantize_static` (the trained CNN only): onnxruntime's quant_pre_process then
  quantize_static, QDQ, over a CalibrationDataReader of the calibration images; with its
  defaults, or per_channel=True where that classifies more test images right.

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
from collections.abc import Iterable
from dataclasses import dataclass
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
from bench_sgat import _export, _write_calibration, quantize_static, text_feeds
from machine import Machine
from olive_cpu import cpu_recipe
from run import holding_device, quantize

NAMES = (
    "onnxruntime fp32",
    "aoe shipped",
    "openvino default",
    "openvino nncf int8",
    "quantize_dynamic",
    "olive",
    "quantize_static",
)
#: What aoe's shipped artifact is held against (the anchors measured here).
OTHERS = NAMES[2:]
#: The trained CNN's rivals: the two that calibrate on its real images, as aoe does.
CALIBRATED = ("quantize_static", "openvino nncf int8")
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN, END = "<!-- runtimes:begin -->", "<!-- runtimes:end -->"
#: The output cosine against fp32 aoe's int8 gate keeps (aoed.engine.policy).
GATE = 0.999
#: The trained CNN's target: a top-1 within this share (1 point) of fp32's is kept.
TOP1_POINTS = 0.01
#: Calibration samples NNCF gets for the synthetic models.
CALIBRATION = 16
MODELS = "cnn,transformer,bert,hf_bert,hf_gpt2,hf_llama_gqa,hf_vit,digits_cnn"
QUICK_MODELS = "bert,digits_cnn"
#: The transformers optimizer's model type Olive gets for a sample transformer (an
#: encoder is a `bert` to it); the held-out ones carry theirs in bench/torch_models.py.
OLIVE_TYPES = {"transformer": "bert", "bert": "bert", "gpt": "gpt2"}


@dataclass(frozen=True)
class Data:
    """A model and the data every way of running it gets."""

    path: Path
    feed: dict[str, np.ndarray]  # what each way is timed on, and its cosine taken on
    calibration: list[dict[str, np.ndarray]]  # NNCF's calibration set
    calibration_dir: Path | None  # `aoe tune --calibration` (None: the tuner's samples)
    olive: dict[str, Any] | None  # the transformers optimizer's arguments; None: no transformer
    labelled: tuple[list[dict[str, np.ndarray]], np.ndarray] | None = None  # held-out test


def _feeds(model: Path, work: Path, seed: int) -> dict[str, np.ndarray]:
    """Inputs as the tuner makes its synthetic samples: N(0, 1) floats, and token ids
    over the whole table an id input indexes (not the first 8 ids alone, which no text
    is made of, and on which an int8 model calibrated on real ids drifts)."""
    prep = prepare(model, work / f"prep{seed}")
    highs = integer_ranges(onnx.load(str(model)), prep.inputs)
    return make_inputs(prep.inputs, seed=seed, int_high=highs)


def _read_folder(folder: Path) -> list[dict[str, np.ndarray]]:
    """A calibration folder's samples, one per .npz file, as `aoe tune` reads them."""
    out = []
    for f in sorted(folder.glob("*.npz")):
        with np.load(f, allow_pickle=False) as data:
            out.append({k: data[k] for k in data.files})
    return out


def _model(name: str, work: Path) -> Data:
    """`name`'s model file and data: a sample of aoed.samples (the tuner's synthetic
    samples, drawn as `_feeds` draws), a held-out transformer of bench/torch_models.py
    (`hf_*`: exported in a child process, fed token ids over its vocabulary with an
    attention mask of ones, and calibrated on 16 such inputs, as bench_claims does), or
    the trained `digits_cnn` (its real training images to calibrate on, its held-out
    test split to count top-1 on, the first test batch to time)."""
    if name == "digits_cnn":
        import digits

        info = _export(name, work)
        folder = Path(info["calibration"])
        test = digits.held_out(Path(info["test"]))
        return Data(Path(info["model"]), test[0][0], _read_folder(folder), folder, None, test)
    if not name.startswith("hf_"):
        path = samples.save(samples.build(name), work / f"{name}.onnx")
        calib = [_feeds(path, work, seed) for seed in range(CALIBRATION)]
        olive = {"model_type": OLIVE_TYPES[name]} if name in OLIVE_TYPES else None
        return Data(path, _feeds(path, work, 1234), calib, None, olive)
    info = _export(name, work)
    vocab = max(1, int(info["vocab"]))
    path = work / f"{name}.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    calib = [text_feeds(proto, s, vocab) for s in range(CALIBRATION)]
    olive = {k: info[k] for k in ("model_type", "num_heads", "hidden_size")}
    folder = _write_calibration(work / "calibration", calib)
    return Data(path, text_feeds(proto, 1234, vocab), calib, folder, olive)


def _nncf_int8(model: Path, calib: list[dict[str, np.ndarray]]) -> Path:
    from aoe.ovdevices import quiet

    quiet()  # before nncf's import, as aoed's own builds do: no usage telemetry
    import nncf
    import openvino as ov

    ov_model = ov.Core().read_model(str(model))
    names = [port_name(p, i, "input") for i, p in enumerate(ov_model.inputs)]
    data = nncf.Dataset([{n: f[n] for n in names} for f in calib])
    xml = model.parent / "nncf_int8.xml"
    ov.save_model(nncf.quantize(ov_model, data), str(xml), compress_to_fp16=False)
    return xml


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


def top1(cand: Candidate, labelled: tuple[list[dict[str, np.ndarray]], np.ndarray]) -> float:
    """The share of the labelled images `cand` classifies right, opened as its runtime's
    measuring worker opens it (its options included)."""
    if cand.runtime == "openvino":
        from aoed.backends.openvino.deployed import open_session

        sess = open_session(str(cand.model), dict(cand.options))
    else:
        from aoed.backends.ort.sessions import session

        sess = session(cand.model, dict(cand.options))
    feeds, labels = labelled
    pred = np.concatenate([np.argmax(sess.run(None, f)[0], axis=1) for f in feeds])
    return float(np.mean(pred == labels))


def _quantize_static(model: Path, data: Data, work: Path) -> tuple[Candidate, str]:
    """quantize_static as a user settles it: its defaults, or per_channel=True where that
    classifies more held-out images right; the one taken, and which it is in words.
    RuntimeError where neither builds."""
    assert data.calibration_dir is not None and data.labelled is not None
    made: dict[bool, tuple[Candidate, float]] = {}
    errors = []
    for per_channel in (False, True):
        v = quantize_static(
            model,
            work / f"qstatic_pc{int(per_channel)}.onnx",
            data.calibration_dir,
            per_channel=per_channel,
        )
        if v.path is None:
            errors.append(f"per_channel={per_channel}: {v.error}")
            continue
        cand = Candidate("quantize_static", v.path)
        made[per_channel] = (cand, top1(cand, data.labelled))
    if not made:
        raise RuntimeError("; ".join(errors))
    take = True in made and (False not in made or made[True][1] > made[False][1])
    said = ", ".join(
        f"{'per_channel=True' if pc else 'defaults'} top-1 {t:.2%}" for pc, (_, t) in made.items()
    )
    return made[take][0], f"{'per_channel=True' if take else 'defaults'} taken ({said})"


def _olive(model: Path, data: Data, work: Path) -> Candidate:
    assert data.olive is not None
    built = cpu_recipe(model, work / "olive", **data.olive)
    return Candidate("olive", built.model, built.options)


def bench_model(name: str, work: Path, precision: str, rounds: int) -> dict[str, object]:
    work.mkdir(parents=True, exist_ok=True)
    data = _model(name, work)
    model = data.path
    shipped, why = _shipped(model, work, precision, data.calibration_dir)
    inputs = work / "inputs.npz"
    np.savez(inputs, **data.feed)
    cands = [
        Candidate("onnxruntime fp32", model),
        shipped,
        Candidate("openvino default", model, runtime="openvino"),
    ]
    unbuilt: dict[str, str] = {}
    notes: dict[str, str] = {}
    try:
        xml = _nncf_int8(model, data.calibration)
        cands.append(Candidate("openvino nncf int8", xml, runtime="openvino"))
    except Exception as exc:  # NNCF fails on some graphs: that way is not there to time
        unbuilt["openvino nncf int8"] = f"NNCF failed: {type(exc).__name__} {exc}"[:160]
    qdyn = quantize(model, work / f"{name}_qdyn.onnx")
    if qdyn.path is not None:
        cands.append(Candidate("quantize_dynamic", qdyn.path))
    else:
        unbuilt["quantize_dynamic"] = qdyn.error
    if data.olive is not None:
        try:
            cands.append(_olive(model, data, work))
            notes["olive"] = f"session options {json.dumps(cands[-1].options, sort_keys=True)}"
        except Exception as exc:  # Olive failing on a model is its cell
            unbuilt["olive"] = f"Olive failed: {type(exc).__name__} {exc}"[:200]
    if data.labelled is not None:
        try:
            qs, notes["quantize_static"] = _quantize_static(model, data, work)
            cands.append(qs)
        except Exception as exc:
            unbuilt["quantize_static"] = f"quantize_static failed: {exc}"[:200]
    accuracy = {c.id: top1(c, data.labelled) for c in cands} if data.labelled else {}
    plan = MeasurePlan.fixed(rounds, 120.0, deployed=True)
    req = MeasureRequest(tuple(cands), inputs, "onnxruntime fp32", CPU, plan)
    got = holding_device(lambda: runner.measure(req).results, print)
    base = got["onnxruntime fp32"]
    ran_with = "compile config" if shipped.runtime == "openvino" else "session options"
    row: dict[str, object] = {
        "model": name,
        "shipped_runtime": shipped.runtime,
        "why": [f"ships with {ran_with} {json.dumps(shipped.options, sort_keys=True)}", *why],
        "notes": notes,
    }
    for cid in NAMES:
        m = got.get(cid)
        if m is None:
            row[cid] = {"error": unbuilt[cid]} if cid in unbuilt else None  # None: not for it
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
            **({"top1": accuracy[cid]} if cid in accuracy else {}),
        }
    return row


def _timed(c: object) -> bool:
    return isinstance(c, dict) and "speedup" in c


def _cell(c: object) -> str:
    if c is None:
        return "not for this model"
    if not _timed(c):
        return f"failed: {c.get('error') if isinstance(c, dict) else c}"
    assert isinstance(c, dict)
    lo, hi = c["speedup_ci95"]
    top = f", top-1 {c['top1']:.2%}" if "top1" in c else ""
    return (
        f"{c['median_ms']:.4f} ms, {c['speedup']:.2f}x [{lo:.2f}, {hi:.2f}], "
        f"cosine {c['cosine']:.6f}{top}"
    )


def _ratio(aoe: dict[str, Any], others: Iterable[dict[str, Any]]) -> float:
    """aoe's speedup over the fastest of `others` (nan when there is none)."""
    best = max((c["speedup"] for c in others), default=float("nan"))
    return float(aoe["speedup"]) / best


def _speedup(c: object) -> str:
    if c is None:
        return "-"
    if not isinstance(c, dict):
        return "failed"
    if "error" in c:
        return "failed: " + str(c["error"]).replace("|", "/")
    lo, hi = c["speedup_ci95"]
    return f"{c['median_ms']:.3f} ms, {c['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]"


@dataclass(frozen=True)
class TrainedVerdict:
    """The trained CNN's target: aoe's top-1 within TOP1_POINTS of fp32's, and aoe at
    least as fast as the fastest of CALIBRATED whose top-1 is too."""

    kept: bool  # aoe's top-1 within the points
    rivals: dict[str, float]  # CALIBRATED within the points: their speedups over fp32
    faster: bool  # aoe >= the fastest of `rivals` (true where there is none)

    @property
    def met(self) -> bool:
        return self.kept and self.faster


def trained_verdict(row: dict[str, Any]) -> TrainedVerdict:
    floor = row["onnxruntime fp32"]["top1"] - TOP1_POINTS - 1e-9
    aoe = row["aoe shipped"]
    kept = _timed(aoe) and aoe["top1"] >= floor
    rivals = {
        n: row[n]["speedup"] for n in CALIBRATED if _timed(row[n]) and row[n]["top1"] >= floor
    }
    faster = _timed(aoe) and all(aoe["speedup"] >= s for s in rivals.values())
    return TrainedVerdict(kept, rivals, faster)


def _trained_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The top-1 table and target of the models with labelled data (the trained CNN)."""
    labelled = [
        r for r in rows if _timed(r["onnxruntime fp32"]) and "top1" in r["onnxruntime fp32"]
    ]
    if not labelled:
        return []
    shown = [n for n in NAMES if any(_timed(r[n]) for r in labelled)]
    lines = [
        "",
        (
            f"The trained CNN on real data, top-1 on its held-out test split (counted on every "
            f"test image, each way opened as its timing worker opens it); target: aoe's top-1 "
            f"within {TOP1_POINTS * 100:g} point of fp32's, and aoe at least as fast as the fastest of "
            f"{' and '.join(CALIBRATED)} whose top-1 is too."
        ),
        "",
        "| model | " + " | ".join(shown) + " | target |",
        "|---" * (len(shown) + 2) + "|",
    ]
    for r in labelled:
        v = trained_verdict(r)
        rivals = ", ".join(f"{n} {s:.2f}x" for n, s in v.rivals.items()) or "none within the point"
        aoe = r["aoe shipped"]
        said = (
            f"**{'PASS' if v.met else 'MISS'}** (top-1 {'kept' if v.kept else 'lost'}; aoe "
            f"{aoe['speedup']:.2f}x against {rivals})"
            if _timed(aoe)
            else "**MISS** (aoe's artifact was not timed)"
        )
        cells = [f"{r[n]['top1']:.2%}" if _timed(r[n]) else "-" for n in shown]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + f" | {said} |")
    for r in labelled:
        if "quantize_static" in r.get("notes", {}):
            lines += ["", f"quantize_static on {r['model']}: {r['notes']['quantize_static']}."]
    return lines


def section(
    rows: list[dict[str, Any]], host: Machine, precision: str, rounds: int, command: str
) -> str:
    lines = [
        "## Runtimes: what aoe ships against OpenVINO, Olive and onnxruntime's quantizers (`python bench/bench_runtimes.py`)",
        "",
        f"Machine: {host.describe('onnxruntime', 'openvino', 'nncf', 'olive-ai')}.",
        "",
        f"`{command}`.",
        "",
        (
            "The repository's sample models (**synthetic**: random weights, synthetic N(0, 1) "
            "inputs, token ids over the whole embedding table; NNCF's baseline calibrated on 16 "
            "such inputs, as the tuner's own samples are drawn), the held-out transformers "
            "of bench/torch_models.py (`hf_*`, **random weights**, small configs; token ids over "
            "the vocabulary with an attention mask of ones; the job and NNCF calibrate on 16 such "
            "inputs) and `digits_cnn`, a conv net **trained** on scikit-learn's digits (**real "
            "images**: the job, NNCF and quantize_static calibrate on the same 320 training "
            "images; timed on the first batch of 32 held-out test images). `aoe shipped`: what "
            f"`aoe tune --precision {precision} --job-type opat` ships (fitted budget, "
            "`--runtime auto`: an ONNX model or an OpenVINO IR, whichever won). Olive: its CPU "
            "recipe run through `olive run` on the local ONNX file (transformers optimizer with "
            "the model's type, dynamic int8, session-parameter tuning), timed with the session "
            "options it chose; transformers only. quantize_static: quant_pre_process, then QDQ "
            "over a CalibrationDataReader of the calibration images, defaults or "
            "per_channel=True, whichever classifies more test images right; the trained CNN only. "
            f"All timed together as deployed (a process each, rotating turns), {rounds} rounds; "
            "each cell: median, speedup over onnxruntime fp32 (median of the per-round ratios, "
            "95% interval) and, in the last column, aoe's output cosine against it; `-`: not run "
            "for that model. `aoe vs best`: aoe's speedup over the best of the others, from those "
            f"medians; `vs best at cosine >= {GATE}`: over the best of those whose output keeps "
            "that cosine (aoe's int8 gate)."
        ),
        "",
        (
            "| model | onnxruntime fp32 | aoe shipped | ships on | OpenVINO defaults | "
            "OpenVINO + NNCF int8 | quantize_dynamic | Olive | quantize_static | aoe vs best | "
            f"vs best at cosine >= {GATE} | aoe cosine |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    vs_best: list[float] = []
    vs_gated: list[float] = []
    for r in rows:
        aoe = r["aoe shipped"]
        ok = {o: r[o] for o in OTHERS if _timed(r[o])}
        ratio, gated = (
            (_ratio(aoe, ok.values()), _ratio(aoe, (c for c in ok.values() if c["cosine"] >= GATE)))
            if _timed(aoe)
            else (float("nan"), float("nan"))
        )
        vs_best.append(ratio)
        vs_gated.append(gated)
        base = r["onnxruntime fp32"]
        lines.append(
            f"| {r['model']} | {base['median_ms']:.3f} ms | {_speedup(aoe)} | "
            f"{r['shipped_runtime']} | {_speedup(r['openvino default'])} | "
            f"{_speedup(r['openvino nncf int8'])} | {_speedup(r['quantize_dynamic'])} | "
            f"{_speedup(r['olive'])} | {_speedup(r['quantize_static'])} | "
            f"{ratio:.2f}x | {gated:.2f}x | "
            f"{aoe.get('cosine', float('nan')) if isinstance(aoe, dict) else float('nan'):.5f} |"
        )
    met = all(v >= 1.0 for v in vs_best)
    gated_met = all(v >= 1.0 for v in vs_gated)
    share = sum(v >= 1.1 for v in vs_best) / max(1, len(vs_best))
    olive = [f"{r['model']} {r['notes']['olive']}" for r in rows if "olive" in r.get("notes", {})]
    lines += [
        "",
        (
            f"Targets: aoe >= 1.0x the best other on every model: **{'PASS' if met else 'MISS'}** "
            f"({', '.join(f'{v:.2f}x' for v in vs_best)}); >= 1.1x on 60% of them: "
            f"{share:.0%}; against the best at cosine >= {GATE}: "
            f"**{'PASS' if gated_met else 'MISS'}** ({', '.join(f'{v:.2f}x' for v in vs_gated)})."
        ),
        *_trained_lines(rows),
        "",
        "What Olive's session-parameter tuning chose: "
        + ("; ".join(olive) if olive else "nothing (Olive ran on no model)")
        + ".",
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
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_MODELS}, 5 rounds")
    ap.add_argument("--models", default=None, help=f"comma-separated (default {MODELS})")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 11)")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    args = ap.parse_args()
    models = args.models or (QUICK_MODELS if args.quick else MODELS)
    rounds = args.rounds or (5 if args.quick else 11)
    host = Machine()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-runtimes-"))
    rows = []
    for name in models.split(","):
        row = bench_model(name, work / name, args.precision, rounds)
        rows.append(row)
        print(f"{name} (aoe shipped on {row['shipped_runtime']}):", file=sys.stderr)
        for cid in NAMES:
            print(f"  {cid:<20} {_cell(row[cid])}", file=sys.stderr)
    host.finish()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    command = (
        f"python bench/bench_runtimes.py --models {models} --precision {args.precision} "
        f"--rounds {rounds}"
    )
    publish(
        section(rows, host, args.precision, rounds, command),
        args.out,
        BEGIN,
        END,
        not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
