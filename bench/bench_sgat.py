"""Subgraph tuning side by side: aoe's SGAT, OPAT and both, against what a user would try.

    python bench/bench_sgat.py [--quick] [--models a,b] [--out bench/RESULTS.md]

Models. Transformers: the project's synthetic samples `bert` and `gpt` (aoed.samples),
and transformers' BertModel, GPT2Model and LlamaModel (also with grouped-query attention,
`hf_llama_gqa`), small configs, exported by torch.onnx with the TorchScript exporter
(`hf_bert`, `hf_gpt2`, `hf_llama`, `hf_llama_gqa`) and the dynamo exporter (the same names
with `_dynamo`), batch 1, sequence 128, opset 17.
All of these have RANDOM weights.
CNNs: `digits_cnn`, a small conv net trained here with torch on scikit-learn's digits,
and the sample `resnet` (random weights). torch runs only in child processes
(bench/torch_models.py); an export that fails, or that onnxruntime refuses to load, is
that model's result.

Peers, per model, measured side by side with aoe's tuned models:
onnxruntime fp32 with its default session (ORT_ENABLE_ALL), the 1.00x reference;
transformers: `quantize_dynamic` with its defaults, onnxruntime's transformers optimizer
(`optimize_model(path, model_type, num_heads, hidden_size)`), and the optimizer's output
through quantize_dynamic; CNNs: `quant_pre_process` + `quantize_static` (QDQ, per-channel,
calibrated on the same files aoe gets) and quantize_dynamic. aoe: `aoe tune --job-type
opat|sgat|sgat+opat` at precision exact and int8 (CNNs: int8 opat and sgat+opat), each
into a fresh bank and output folder; the tuned model its result JSON names is measured
here, not the figures aoe printed. A peer or a job that fails is recorded as
"failed: <message>".

Latency is measured as a user deploys a model (bench/deployed.py): one session per
process with onnxruntime's defaults, the processes taking turns in paired rounds, while
this process holds the machine-wide device lock. Accuracy is measured on held-back inputs
never used for calibration: lowest output cosine vs fp32 (transformers: random token ids,
attention mask all ones), top-1 on the digits test split, and top-1 agreement with fp32
for the random-weight resnet.

Writes the section between `<!-- sgat:begin -->` and `<!-- sgat:end -->` of the results
file, leaving the others as they are. Exit status 0 unless the harness itself breaks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import deployed
import measure
from machine import Machine
from run import Log, as_deployed, holding_device, op_counts
from sgat_report import (
    CALIBRATION_SEED,
    CNN_TUNES,
    CONTROL,
    EXPORT_TIMEOUT_S,
    MODELS,
    QUICK_MODELS,
    REFERENCE,
    RESNET_CALIBRATION,
    SAMPLE_TYPES,
    TEXT_CALIBRATION,
    TEXT_SHAPE,
    TEXT_TUNES,
    TORCH_MODELS,
    TRANSFORMERS,
    aoe_name,
    label,
    section,
)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- sgat:begin -->", "<!-- sgat:end -->"


@dataclass(frozen=True)
class Mode:
    name: str
    budget_s: float  # `aoe tune --budget` of every job
    rounds: int  # paired latency rounds, one session per process
    measure_s: float  # latency budget per model, all variants together
    samples: int  # timed samples per variant and round (fewer for slow models)
    text_inputs: int  # held-back inputs of a transformer
    resnet_inputs: int  # held-back inputs of the resnet
    deployed_rounds: int = (
        5  # rounds of the quantize_dynamic vs aoe table per transformer and regime
    )


# Full: about 30 minutes on 2 cores (6 aoe jobs per transformer, 2 per CNN).
# 11 deployed rounds: at 5, two full runs of the same models read up to 0.10 apart
# (hf_gpt2_dynamo: 1.15x and 1.25x) on this shared machine; 11 rounds of all ten transformers
# took 2.1 min, about a minute more than 5.
FULL = Mode(
    "full",
    10.0,
    rounds=30,
    measure_s=60.0,
    samples=20,
    text_inputs=8,
    resnet_inputs=32,
    deployed_rounds=11,
)
QUICK = Mode(
    "quick",
    2.0,
    rounds=12,
    measure_s=10.0,
    samples=10,
    text_inputs=4,
    resnet_inputs=8,
    deployed_rounds=2,
)


@dataclass
class Job:
    """One `aoe tune` process."""

    job_type: str
    precision: str
    error: str = ""
    wall_s: float = 0.0  # the process, start to exit
    doc: dict[str, Any] = field(default_factory=dict)

    @property
    def job_s(self) -> float | None:
        t = (self.doc.get("basic") or {}).get("tuning_time(s)")
        return None if t is None else float(t)


@dataclass
class Variant:
    name: str
    path: Path | None
    error: str = ""
    latency: measure.Latency | None = None
    accuracy: measure.Accuracy | None = None
    top1: float | None = None  # share of labelled inputs classified right
    agree: float | None = None  # share of inputs with fp32's top-1 class
    ops: dict[str, int] = field(default_factory=dict)  # int8 / float matrix products
    note: str = ""  # how it was made, where that differs from the plain call


@dataclass
class ModelResult:
    name: str
    kind: str  # "transformer" or "cnn"
    description: str = ""
    data: str = ""  # weights and inputs, in words
    error: str = ""  # the model itself could not be built or loaded
    variants: dict[str, Variant] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)  # by variant name
    fused: str = ""  # what onnxruntime's transformers optimizer wrote (transformers)
    labelled: int = 0  # inputs with true labels (digits_cnn)
    inputs: int = 0  # held-back inputs the accuracy is on
    deployed: Any = None  # deployed.Deployed: SGAT+OPAT int8 vs qdyn, spinning on and off


def short(text: str, limit: int = 400) -> str:
    """The first non-empty line of `text`, cut to `limit` characters."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


_ORT_NOISE = re.compile(
    r"\[ONNXRuntimeError\] : \d+ : \w+ : |Load model from \S+ failed: ?|This is an invalid model\. "
)


def _exc(exc: BaseException) -> str:
    """`Type: message`, less onnxruntime's boilerplate (status code, the model's path)."""
    return short(_ORT_NOISE.sub("", f"{type(exc).__name__}: {exc}"))


def _stderr_reason(stderr: str) -> str:
    """The last line of a child's stderr that says something (a traceback's last line, or
    aoe's `aoe: error: ...`)."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower() or "Error" in ln:
            return short(ln)
    return short(lines[-1]) if lines else "no message"


# ------------------------------------------------------------------ models and data


def _export(name: str, out: Path) -> dict[str, Any]:
    """bench/torch_models.py NAME in a child process; its info.json, or RuntimeError."""
    cmd = [sys.executable, str(HERE / "torch_models.py"), name, "-o", str(out)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=EXPORT_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"export timed out after {EXPORT_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"export failed: {_stderr_reason(proc.stderr)}")
    return json.loads((out / "info.json").read_text())


def text_feeds(model: onnx.ModelProto, seed: int, vocab: int) -> dict[str, np.ndarray]:
    """Random token ids in [0, vocab) for every integer input but an attention mask, which
    is all ones (no padding); N(0, 1) for float inputs."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if "mask" in vi.name:
            feeds[vi.name] = np.ones(dims, dtype)
        elif dtype.kind in "iu":
            feeds[vi.name] = rng.integers(0, vocab, size=dims).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(dims).astype(dtype)
    return feeds


def _write_calibration(folder: Path, samples: list[dict[str, np.ndarray]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(samples):
        np.savez(folder / f"{i:03d}.npz", **s)
    return folder


@dataclass
class Built:
    path: Path
    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]  # held back: never calibrated on
    calibration: Path
    labels: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)


def build(r: ModelResult, mode: Mode, work: Path) -> Built:
    """Model file, held-back inputs and calibration folder of `r.name`; fills in its
    description and data; raises RuntimeError when the model cannot be had."""
    folder = work / r.name
    if r.name in TORCH_MODELS:
        info = _export(r.name, folder)
        path = Path(info["model"])
        weights = "trained weights" if info["weights"] == "trained" else "RANDOM weights"
    else:
        from aoed import samples

        m = samples.build(r.name)
        path = samples.save(m, folder / f"{r.name}.onnx")
        info = {"description": m.doc_string, "vocab": TEXT_SHAPE["vocab"]}
        if r.kind == "transformer":
            info.update(model_type=SAMPLE_TYPES[r.name], **TEXT_SHAPE)
        weights = "RANDOM weights (aoed.samples, built in code)"
    model = onnx.load(str(path))
    r.description = info["description"]
    if r.name == "digits_cnn":
        import digits

        feeds, labels = digits.held_out(Path(info["test"]))
        r.labelled = len(labels)
        r.data = (
            f"{weights}; inputs are real: {info['test_images']} held-out digit images "
            f"({len(feeds)} batches of {digits.BATCH}) with their true labels (torch's own "
            f"top-1 before export {info['torch_test_accuracy']:.2%}); aoe `--calibration` and "
            f"quantize_static both get the same {info['calibration_files']} files of "
            f"{digits.BATCH} real training images"
        )
        r.inputs = len(feeds)
        return Built(path, model, feeds, Path(info["calibration"]), labels, info)
    if r.kind == "transformer":
        vocab = int(info["vocab"])
        feeds = [text_feeds(model, seed, vocab) for seed in range(mode.text_inputs)]
        calib = [text_feeds(model, CALIBRATION_SEED + i, vocab) for i in range(TEXT_CALIBRATION)]
        shapes = ", ".join(f"`{k}` {list(v.shape)}" for k, v in feeds[0].items())
        r.data = (
            f"{weights}; inputs are synthetic: {shapes}, random token ids in [0, {vocab})"
            + (", attention mask all ones" if any("mask" in k for k in feeds[0]) else "")
            + f"; accuracy on {len(feeds)} held-back inputs; aoe gets `--calibration` with "
            f"{TEXT_CALIBRATION} other such inputs"
        )
    else:  # resnet
        feeds = [measure.feeds_for(model, seed) for seed in range(mode.resnet_inputs)]
        calib = [measure.feeds_for(model, CALIBRATION_SEED + i) for i in range(RESNET_CALIBRATION)]
        r.data = (
            f'{weights}; inputs are synthetic: {measure.describe_inputs(model)}; its "top-1" '
            f"is the agreement of the top-1 class with fp32's on {len(feeds)} held-back inputs, "
            f"not an accuracy; aoe `--calibration` and quantize_static both get the same "
            f"{RESNET_CALIBRATION} other such inputs"
        )
    r.inputs = len(feeds)
    return Built(path, model, feeds, _write_calibration(folder / "calibration", calib), None, info)


# ------------------------------------------------------------------ peers


@contextlib.contextmanager
def _quiet() -> Any:
    """The quantizers and the optimizer log advice through the root logger and print;
    neither is a result."""
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        root.setLevel(level)


def quantize_dynamic(src: Path, dst: Path) -> Variant:
    """quantize_dynamic with its defaults. Where it fails for want of a tensor type and
    its error advises `extra_options DefaultTensorType` (it does on the transformers
    optimizer's output, whose contrib ops shape inference cannot type), it is called
    again with that advice followed, as a user reading the error would."""
    from onnxruntime.quantization import quantize_dynamic as qd

    try:
        with _quiet():
            qd(src, dst)
        return Variant("", dst)
    except Exception as exc:  # noqa: BLE001 - the compared tool failing is the result
        first = exc
    if "DefaultTensorType" not in str(first):
        return Variant("", None, error=_exc(first))
    try:
        with _quiet():
            qd(src, dst, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    except Exception as exc:  # noqa: BLE001
        return Variant(
            "",
            None,
            error=f"{_exc(exc)} (also with DefaultTensorType=FLOAT, as the first error advised)",
        )
    note = (
        f"the plain call raised {short(_exc(first), 100)!r}; made with extra_options "
        "DefaultTensorType=FLOAT, as that error advises"
    )
    return Variant("", dst, note=note)


_FUSED_SHORT = {
    "Attention": "Attention",
    "MultiHeadAttention": "MHA",
    "SkipLayerNormalization": "SkipLN",
    "EmbedLayerNormalization": "EmbedLN",
    "BiasGelu": "BiasGelu",
    "FastGelu": "FastGelu",
    "Gelu": "Gelu",
    "BiasSkipLayerNormalization": "BiasSkipLN",
    "SkipSimplifiedLayerNormalization": "SkipSimplifiedLN",
    "GroupQueryAttention": "GQA",
}


def fused_ops(path: Path) -> str:
    """The contrib (com.microsoft) op types in a model with their counts, attention first
    (as `Attention 0` when the optimizer fused none)."""
    m = onnx.load(str(path), load_external_data=False)
    counts = Counter(n.op_type for n in m.graph.node if n.domain == "com.microsoft")
    parts = []
    if not counts.get("Attention") and not counts.get("MultiHeadAttention"):
        parts.append("Attention 0")
    for op, n in sorted(
        counts.items(), key=lambda kv: (kv[0] not in ("Attention", "MultiHeadAttention"), kv[0])
    ):
        parts.append(f"{_FUSED_SHORT.get(op, op)} {n}")
    return ", ".join(parts)


def ort_optimizer(src: Path, dst: Path, info: dict[str, Any]) -> Variant:
    from onnxruntime.transformers.optimizer import optimize_model

    try:
        with _quiet():
            m = optimize_model(
                str(src),
                model_type=info["model_type"],
                num_heads=int(info["num_heads"]),
                hidden_size=int(info["hidden_size"]),
            )
            m.save_model_to_file(str(dst))
    except Exception as exc:  # noqa: BLE001
        return Variant("", None, error=_exc(exc))
    return Variant("", dst)


class _Reader:
    """A CalibrationDataReader over a calibration folder of .npz files (one sample each,
    keyed by input name, as `aoe tune --calibration` reads them)."""

    def __init__(self, folder: Path) -> None:
        self._files = iter(sorted(folder.glob("*.npz")))

    def get_next(self) -> dict[str, np.ndarray] | None:
        f = next(self._files, None)
        if f is None:
            return None
        with np.load(f, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}


def quantize_static(
    src: Path, dst: Path, calibration: Path, *, per_channel: bool = True
) -> Variant:
    """quant_pre_process (onnxruntime's documented first step), then quantize_static in
    QDQ format (per channel unless told not to; otherwise its defaults), calibrated on
    every file of `calibration`."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat
    from onnxruntime.quantization import quantize_static as qs
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(_Reader, CalibrationDataReader):
        pass

    pre = dst.with_suffix(".pre.onnx")
    try:
        with _quiet():
            quant_pre_process(str(src), str(pre))
            qs(pre, dst, Reader(calibration), quant_format=QuantFormat.QDQ, per_channel=per_channel)
    except Exception as exc:  # noqa: BLE001
        return Variant("", None, error=_exc(exc))
    return Variant("", dst)


# ------------------------------------------------------------------ aoe


def aoe_tune(
    model: Path,
    job_type: str,
    precision: str,
    work: Path,
    budget_s: float,
    calibration: Path | None,
) -> Job:
    """`aoe tune` in its own process, into a fresh bank and output folder under `work`;
    reads its one result JSON (aoe_result_{job type}_*.json)."""
    bank, output = work / "bank", work / "out"
    cmd = [sys.executable, "-m", "aoe.cli", "tune", str(model), "--no-progress", "--local"]
    cmd += ["--job-type", job_type, "--precision", precision, "--budget", f"{budget_s:g}"]
    cmd += ["--bank", str(bank), "--output", str(output)]
    if calibration is not None:
        cmd += ["--calibration", str(calibration)]
    # Only the fresh bank named here: no user bank, no read-only layers, no forced re-tune.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TUNE_BANK_PATH", "REPEAT_TUNE", "AOED_BANK_LAYERS")
    }
    timeout = max(900.0, 40 * budget_s)
    job = Job(job_type, precision)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        job.error, job.wall_s = (
            f"aoe tune timed out after {timeout:.0f} s",
            time.perf_counter() - t0,
        )
        return job
    job.wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        reason = _stderr_reason(proc.stderr).removeprefix("aoe: error: ")
        job.error = f"exit {proc.returncode}: {reason}"
        return job
    reports = sorted(output.glob("aoe_result_*.json"))
    if len(reports) != 1:
        job.error = f"wrote {len(reports)} result files in {output}, expected 1"
        return job
    try:
        job.doc = json.loads(reports[0].read_text())
    except (OSError, ValueError) as exc:
        job.error = f"{reports[0].name}: {_exc(exc)}"
        return job
    if not job.doc.get("tuned_model"):
        job.error = f"{reports[0].name} names no tuned_model"
    return job


def _tuned_path(job: Job) -> Path | None:
    if job.error:
        return None
    return Path(job.doc["tuned_model"]).resolve()


# ------------------------------------------------------------------ measuring


def measure_variants(r: ModelResult, built: Built, mode: Mode, log: Log) -> None:
    """Accuracy of every variant vs fp32 over the held-back inputs (in this process), then
    latency of all of them side by side on the first input, one session per process; a
    variant that does not load or run gets its error."""
    outputs = {}
    for name, v in r.variants.items():
        if v.error or v.path is None:
            continue
        try:  # the session goes with the call: none stays idle here beside the timed ones
            outputs[name] = measure.run_all(
                measure.quiet_session(v.path, tuned=name.startswith("aoe ")), built.feeds
            )
        except Exception as exc:  # noqa: BLE001 - a model ORT refuses is a result
            v.error = f"onnxruntime refuses it: {_exc(exc)}"
            continue
        with contextlib.suppress(Exception):
            v.ops = op_counts(v.path)
    if REFERENCE not in outputs:
        raise RuntimeError(f"the fp32 model does not run: {r.variants[REFERENCE].error}")
    ref_pred = measure.predictions(outputs[REFERENCE])
    for name, out in outputs.items():
        v = r.variants[name]
        v.accuracy = measure.accuracy(outputs[REFERENCE], out)
        if r.kind == "cnn":
            pred = measure.predictions(out)
            v.agree = float(np.mean(pred == ref_pred))
            if built.labels is not None:
                v.top1 = float(np.mean(pred == built.labels))
    log(f"  measuring {len(outputs)} variants, one session per process")
    models = {n: deployed.Model(r.variants[n].path, tuned=n.startswith("aoe ")) for n in outputs}
    timed, errors = as_deployed(models, built.feeds[0], mode, log)
    for name, value in timed.items():
        r.variants[name].latency = value
    for name, why in errors.items():
        r.variants[name].error = short(why)


def bench_model(name: str, mode: Mode, work: Path, log: Log) -> ModelResult:
    r = ModelResult(name, "transformer" if name in TRANSFORMERS else "cnn")
    log(f"{name}: building")
    try:
        built = build(r, mode, work)
    except Exception as exc:  # noqa: BLE001 - one model failing is that model's result
        r.error = short(str(exc)) if isinstance(exc, RuntimeError) else _exc(exc)
        log(f"  FAILED {r.error}")
        return r
    try:  # the reference must load, or there is nothing to compare with
        import onnxruntime as ort

        ort.InferenceSession(str(built.path), providers=["CPUExecutionProvider"]).run(
            None, built.feeds[0]
        )
    except Exception as exc:  # noqa: BLE001
        r.error = f"onnxruntime refuses the exported model: {_exc(exc)}"
        log(f"  FAILED {r.error}")
        return r
    r.variants[REFERENCE] = Variant(REFERENCE, built.path)
    r.variants[CONTROL] = Variant(CONTROL, built.path)
    peers = work / name / "peers"
    peers.mkdir(parents=True, exist_ok=True)
    if r.kind == "transformer":
        found = {
            "qdyn": quantize_dynamic(built.path, peers / "qdyn.onnx"),
            "ort_opt": ort_optimizer(built.path, peers / "ort_opt.onnx", built.info),
        }
        opt = found["ort_opt"]
        if opt.error:
            found["ort_opt+qdyn"] = Variant("", None, error=f"the optimizer failed: {opt.error}")
        else:
            r.fused = fused_ops(opt.path)
            found["ort_opt+qdyn"] = quantize_dynamic(opt.path, peers / "ort_opt_qdyn.onnx")
        tunes = TEXT_TUNES
    else:
        found = {
            "qstatic": quantize_static(built.path, peers / "qstatic.onnx", built.calibration),
            "qdyn": quantize_dynamic(built.path, peers / "qdyn.onnx"),
        }
        tunes = CNN_TUNES
    for peer, v in found.items():
        v.name = peer
        r.variants[peer] = v
        log(f"  {label(peer)}: " + (f"FAILED {v.error}" if v.error else "written"))
    if r.fused:
        log(f"  ORT optimizer fused: {r.fused}")
    for job_type, precision in tunes:
        vname = aoe_name(job_type, precision)
        slug = f"{job_type.replace('+', '_')}_{precision}"
        job = aoe_tune(
            built.path,
            job_type,
            precision,
            work / name / "aoe" / slug,
            mode.budget_s,
            built.calibration,
        )
        r.jobs[vname] = job
        r.variants[vname] = Variant(vname, _tuned_path(job), error=job.error)
        log(
            f"  {label(vname)}: "
            + (f"FAILED {job.error}" if job.error else f"tuned in {job.wall_s:.1f} s")
        )
    try:
        measure_variants(r, built, mode, log)
    except Exception as exc:  # noqa: BLE001 - keep the other models' results
        import traceback

        traceback.print_exc()
        r.error = f"measuring failed: {_exc(exc)}"
        log(f"  FAILED {r.error}")
        return r
    ref = r.variants[REFERENCE].latency
    for v in r.variants.values():
        if v.latency is not None:
            s = measure.ratio(ref, v.latency)
            cos = f"  cos {v.accuracy.cosine:.5f}" if v.accuracy else ""
            log(
                f"    {label(v.name):<24} {v.latency.median_ms:9.3f} ms ±{v.latency.spread:.1%}"
                f"{'  ' + s.text() + ' vs fp32' if s else ''}{cos}"
            )
        elif v.error:
            log(f"    {label(v.name):<24} failed: {v.error}")
    return r


# ------------------------------------------------------------------ main


def _models(arg: str | None, quick: bool) -> list[str]:
    if not arg:
        return list(QUICK_MODELS if quick else MODELS)
    names = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(
            f"bench/bench_sgat.py: unknown model(s) {unknown}; choose from {list(MODELS)}"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="fewer models, small budgets, fewer rounds"
    )
    ap.add_argument("--models", help=f"comma-separated subset of: {','.join(MODELS)}")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--budget", type=float, help="aoe tune --budget (seconds) for every job")
    ap.add_argument("--workdir", type=Path, help="keep models, banks and tuner outputs here")
    args = ap.parse_args(argv)

    names = _models(args.models, args.quick)
    needed = ["sklearn"] if "digits_cnn" in names else []
    if any(n in TORCH_MODELS for n in names):
        needed += ["torch", "transformers"]
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"bench/bench_sgat.py: {', '.join(missing)} missing; install the bench extra "
            "(pip install -e '.[bench]'; make bench does it)"
        )
    mode = QUICK if args.quick else FULL
    if args.budget is not None:
        mode = dataclasses.replace(mode, budget_s=args.budget)
    log = Log()
    host = Machine()  # before the work: the load average says what else was running
    started = time.time()
    with contextlib.ExitStack() as stack:
        if args.workdir:
            work = args.workdir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aoe-bench-sgat-")))
        results = [bench_model(name, mode, work, log) for name in names]
        for r in results:
            if r.kind == "transformer" and not r.error:
                r.deployed = holding_device(
                    lambda r=r: deployed.measure_model(
                        work / r.name, mode.deployed_rounds, mode.measure_s, mode.samples
                    ),
                    log,
                )
                log(
                    f"{r.name} deployed: "
                    + (
                        r.deployed.skipped
                        or " | ".join(f"{g.name}: {g.text()}" for g in r.deployed.regimes)
                    )
                )
    host.finish()
    elapsed = time.perf_counter() - log.t0
    command = "python bench/bench_sgat.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    text = section(results, mode, host=host, command=command, started=started, elapsed_s=elapsed)
    from bench_bank import publish

    publish(text, args.out, BEGIN, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
