"""The GPU check (run by bench/gpu_check.sh): tune two models on a GPU, then time them
against onnxruntime's own setups, interleaved in this one process.

Models, random weights (aoed.samples): a BERT-base-sized encoder (12 layers, hidden 768,
12 heads, FFN 3072) at sequence 128, and a ResNet at 224x224 with ResNet-34's layout
(basic blocks 3-4-6-3: about 3.6 GFLOPs, near ResNet-50's 4.1; the samples have no
bottleneck blocks). Each is tuned with `aoe tune --device cuda:0` and a small budget,
then tuned again from the same bank (the bank-hit path). Rows, timed with inputs and
outputs bound in device memory (as the tuner measures): CUDA EP default, TensorRT EP
default, fp16 by hand (onnxconverter-common's float16 conversion on the CUDA EP), and
aoe's tuned model (aoe.session); cosine against the fp32 model on the CPU provider.

`--dry-run` runs the same steps on the CPU with tiny models: every "GPU" row is the CPU
provider, so the figures mean nothing; it checks the script's logic only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from aoe.device import Device
from aoed import samples
from aoed.backends.ort.measure import interleaved
from aoed.backends.ort.sessions import BoundRun
from aoed.engine.messages import MeasurePlan

TARGETS = "tuned >= 1.2x CUDA EP default and >= 1.0x TensorRT EP default; cosine >= 0.999; bank-hit re-tune <= 10% of the tune"


def _models(dry: bool) -> dict[str, onnx.ModelProto]:
    if dry:
        return {
            "bert_tiny": samples.bert(seq=16, hidden=64, heads=2, ffn=128, layers=1, vocab=128),
            "resnet_tiny": samples.resnet(size=32, width=8, stages=(1, 1, 1, 1), classes=10),
        }
    return {
        "bert_base_s128": samples.bert(
            seq=128, hidden=768, heads=12, ffn=3072, layers=12, vocab=30522
        ),
        "resnet34_224": samples.resnet(size=224, stages=(3, 4, 6, 3)),
    }


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    from aoe.signature import ModelContext
    from aoed.engine.prep import make_inputs

    ctx = ModelContext(model)
    inputs = {i.name: ctx.tensors[i.name] for i in model.graph.input if i.name in ctx.tensors}
    return make_inputs(
        inputs, int_high={n: 100 for n, t in inputs.items() if t.dtype.startswith("int")}
    )


def _tune(model: Path, out: Path, device: str, budget: float) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "aoe.cli",
            "tune",
            str(model),
            "--device",
            device,
            "--budget",
            str(budget),
            "--bank",
            str(out / "bank"),
            "--output",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    took = time.perf_counter() - t0
    (out / f"tune-{int(t0)}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SystemExit(
            f"aoe tune {model.name} failed ({r.returncode}): {r.stderr.strip()[-2000:]}"
        )
    doc = json.loads(
        max(out.glob("aoe_result_*.json"), key=lambda p: p.stat().st_mtime).read_text()
    )
    return took, doc


def _cosine(ref: list[np.ndarray], out: list[np.ndarray]) -> float:
    a = np.concatenate([np.asarray(x, np.float64).ravel() for x in ref])
    b = np.concatenate([np.asarray(x, np.float64).ravel() for x in out])
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _compare(
    name: str, path: Path, tuned: Path, device: Device, dry: bool, seconds: float
) -> list[dict]:
    import onnxruntime as ort

    import aoe

    model = onnx.load(path)
    feeds = _feeds(model)
    cpu = ["CPUExecutionProvider"]
    ref = ort.InferenceSession(str(path), providers=cpu).run(None, feeds)
    cuda = cpu if dry else [("CUDAExecutionProvider", {"device_id": str(device.index)}), *cpu]
    trt = cpu if dry else [("TensorrtExecutionProvider", {"device_id": str(device.index)}), *cuda]
    rows: dict[str, object] = {
        "ORT CUDA EP default": ort.InferenceSession(str(path), providers=cuda),
        "ORT TensorRT EP default": ort.InferenceSession(str(path), providers=trt),
    }
    try:
        from onnxconverter_common import float16

        half = path.with_name(path.stem + "_fp16.onnx")
        onnx.save(float16.convert_float_to_float16(model, keep_io_types=True), half)
        rows["fp16 by hand (onnxconverter-common)"] = ort.InferenceSession(
            str(half), providers=cuda
        )
    except ImportError:
        print(
            f"{name}: onnxconverter-common is not installed: no fp16-by-hand row", file=sys.stderr
        )
    rows["aoe tuned"] = (
        aoe.session(tuned, providers=cpu) if dry else aoe.session(tuned, device_id=device.index)
    )
    runs, cosines = {}, {}
    where = Device.parse("cpu") if dry else device
    for label, sess in rows.items():
        run = BoundRun(
            sess,
            {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}},
            where,
        )
        cosines[label] = _cosine(ref, run.outputs())
        runs[label] = run
    timings = interleaved(runs, MeasurePlan.fixed(15, seconds), keep="ORT CUDA EP default")
    base = timings["ORT CUDA EP default"].median_us
    trt_us = timings["ORT TensorRT EP default"].median_us
    return [
        {
            "model": name,
            "row": label,
            "median_ms": t.median_us / 1000,
            "spread": t.spread,
            "vs_cuda_default": base / t.median_us if t.median_us else 0.0,
            "vs_trt_default": trt_us / t.median_us if t.median_us else 0.0,
            "cosine": cosines[label],
        }
        for label, t in timings.items()
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dry-run", action="store_true", help="the same steps on the CPU with tiny models"
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="tuning budget per model, s (default 60; dry run 1)",
    )
    p.add_argument("--device", default="cuda:0")
    a = p.parse_args(argv)
    dry = a.dry_run
    device = Device.parse("cpu" if dry else a.device)
    budget = a.budget or (1.0 if dry else 60.0)
    a.out.mkdir(parents=True, exist_ok=True)
    rows, tunes = [], []
    for name, model in _models(dry).items():
        work = a.out / name
        work.mkdir(exist_ok=True)
        path = work / f"{name}.onnx"
        samples.save(model, path)
        full_s, doc = _tune(path, work, device.name, budget)
        again_s, _ = _tune(path, work, device.name, budget)
        tunes.append(
            {
                "model": name,
                "tune_s": full_s,
                "bank_hit_s": again_s,
                "ratio": again_s / full_s,
                "device_info": doc.get("device_info", {}),
                "verdict": doc.get("verification"),
            }
        )
        rows += _compare(name, path, Path(doc["tuned_model"]), device, dry, 1.5 if dry else 30.0)
    _write(a.out, rows, tunes, dry)
    return 0


def _write(out: Path, rows: list[dict], tunes: list[dict], dry: bool) -> None:
    (out / "gpu_results.json").write_text(
        json.dumps({"rows": rows, "tunes": tunes, "dry_run": dry}, indent=1)
    )
    info = tunes[0]["device_info"] if tunes else {}
    lines = [
        "## GPU check" + (" (DRY RUN on the CPU: these figures mean nothing)" if dry else ""),
        "",
        f"Device: {info.get('hardware', '?')}; {json.dumps(info.get('accelerator', {}))}; "
        f"versions {json.dumps(info.get('versions', {}))}. Targets: {TARGETS}.",
        "",
        "| model | row | median ms (spread) | vs CUDA EP default | vs TRT EP default | cosine vs fp32 |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['row']} | {r['median_ms']:.3f} ({r['spread']:.1%}) | {r['vs_cuda_default']:.2f}x "
        f"| {r['vs_trt_default']:.2f}x | {r['cosine']:.5f} |"
        for r in rows
    ]
    lines += ["", "| model | tune s | bank-hit re-tune s | re-tune / tune |", "|---|---|---|---|"]
    lines += [
        f"| {t['model']} | {t['tune_s']:.1f} | {t['bank_hit_s']:.1f} | {t['ratio']:.0%} |"
        for t in tunes
    ]
    (out / "gpu_results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
