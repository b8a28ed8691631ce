"""Side by side: onnxruntime fp32, onnxruntime's quantize_dynamic, aoe tune exact and int8.

    python bench/run.py [--quick] [--models a,b] [--out bench/RESULTS.md]

For every model, in one run: onnxruntime with default session options (fp32, the 1.00x
reference); `onnxruntime.quantization.quantize_dynamic` with its defaults (what a user
picks for int8 today); `aoe tune --precision exact`; `aoe tune --precision int8`. Each
aoe run tunes into a fresh bank and is then repeated on that bank, which answers it from
the bank alone (the bank-hit path). Latency and accuracy of the four variants are
measured interleaved in this one process on the same inputs (bench/measure.py); tuning
cost comes from each run's result JSON and wall clock.

Writes the section between `<!-- models:begin -->` and `<!-- models:end -->` of the
results file, the machine header above it, and PNG plots beside it; other sections
(bank lookups) are kept as they are. Run from the repository root with the project's
Python. Exit status 0 unless the harness itself breaks: a failing variant or a missed
target is a result, reported in the file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import measure
import onnx
import report
import targets

# Model name -> kind; the targets are stated per kind.
MODELS: dict[str, str] = {
    "mlp": "mlp",
    "legacy_mlp": "mlp",
    "outlier_mlp": "mlp",
    "cnn": "cnn",
    "legacy_cnn": "cnn",
    "resnet": "cnn",
    "transformer": "transformer",
    "bert": "transformer",
    "gpt": "transformer",
}
QUICK_MODELS = ("cnn", "legacy_cnn", "transformer", "resnet", "bert", "gpt")
PRECISIONS = ("exact", "int8")
TUNE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Mode:
    name: str
    budget_s: float  # `aoe tune --budget`
    rounds: int  # interleaved latency rounds
    round_s: float  # burst length per variant and round
    warmup_s: float
    accuracy_inputs: int


FULL = Mode("full", budget_s=20.0, rounds=40, round_s=0.15, warmup_s=1.0, accuracy_inputs=8)
QUICK = Mode("quick", budget_s=3.0, rounds=21, round_s=0.06, warmup_s=0.3, accuracy_inputs=4)


@dataclass
class TuneRun:
    """One `aoe tune` job, then the same job again on the bank it filled."""

    precision: str
    error: str = ""
    wall_s: float = 0.0
    doc: dict[str, Any] = field(default_factory=dict)
    hit_error: str = ""
    hit_wall_s: float = 0.0
    hit_doc: dict[str, Any] = field(default_factory=dict)
    # Models the verify step built to A/B the result without one task's choice.
    verify_models: int = 0
    hit_verify_models: int = 0


@dataclass
class Variant:
    name: str
    path: Path | None
    error: str = ""
    latency: measure.Latency | None = None
    accuracy: measure.Accuracy | None = None
    ops: dict[str, int] = field(default_factory=dict)


@dataclass
class ModelResult:
    name: str
    kind: str
    description: str
    variants: dict[str, Variant]
    tunes: dict[str, TuneRun]


class Log:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet_logging() -> Iterator[None]:
    """quantize_dynamic logs advice through the root logger; it is not a result."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _first_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def quantize(src: Path, dst: Path) -> Variant:
    from onnxruntime.quantization import quantize_dynamic

    try:
        with _quiet_logging():
            quantize_dynamic(src, dst)
    except Exception as exc:  # noqa: BLE001 - the compared tool failing is the result
        return Variant("quantize_dynamic", None, error=_first_line(f"{type(exc).__name__}: {exc}"))
    return Variant("quantize_dynamic", dst)


def _aoe_tune(
    model: Path, precision: str, bank: Path, output: Path, budget_s: float
) -> tuple[float, dict[str, Any], str]:
    """Runs `aoe tune` in its own process: (wall seconds, result JSON, error or '')."""
    cmd = [sys.executable, "-m", "aoe.cli", "tune", str(model), "--no-progress"]
    cmd += ["--precision", precision, "--bank", str(bank), "--output", str(output)]
    cmd += ["--budget", f"{budget_s:g}"]
    # The bank is the one named here, and a bank hit must be taken, not re-tuned.
    env = {k: v for k, v in os.environ.items() if k not in ("TUNE_BANK_PATH", "REPEAT_TUNE")}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=TUNE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, {}, f"aoe tune timed out after {TUNE_TIMEOUT_S:.0f} s"
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return wall, {}, f"aoe tune exit {proc.returncode}: {_first_line(proc.stderr)}"
    reports = sorted(output.glob("aoe_result_opat_*.json"))
    if len(reports) != 1:
        return wall, {}, f"aoe tune wrote {len(reports)} result files in {output}, expected 1"
    return wall, json.loads(reports[0].read_text()), ""


def _leave_one_out(output: Path) -> int:
    return len(list(output.glob("aoe_workspace/*/tunespace/verify_without_*.onnx")))


def tune_twice(model: Path, precision: str, work: Path, budget_s: float, log: Log) -> TuneRun:
    bank = work / "bank"  # fresh per model and precision
    run = TuneRun(precision)
    run.wall_s, run.doc, run.error = _aoe_tune(model, precision, bank, work / "full", budget_s)
    if run.error:
        log(f"  aoe {precision}: FAILED {run.error}")
        return run
    log(f"  aoe {precision}: tuned in {run.wall_s:.1f} s")
    run.hit_wall_s, run.hit_doc, run.hit_error = _aoe_tune(
        model, precision, bank, work / "hit", budget_s
    )
    run.verify_models = _leave_one_out(work / "full")
    run.hit_verify_models = _leave_one_out(work / "hit")
    if run.hit_error:
        log(f"  aoe {precision} from the bank: FAILED {run.hit_error}")
    else:
        log(f"  aoe {precision} from the bank: {run.hit_wall_s:.1f} s")
    return run


_FLOAT_PRODUCTS = {"MatMul", "Gemm", "Conv", "FusedConv", "FusedGemm", "FusedMatMul"}
_INT8_PRODUCTS = {
    "MatMulInteger",
    "ConvInteger",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "QLinearConv",
    "QLinearMatMul",
    "QGemm",
}


def op_counts(path: Path) -> dict[str, int]:
    """How many matrix products (MatMul/Gemm/Conv-type nodes) run in int8 and in float.

    A float product fed by a DequantizeLinear counts as int8: onnxruntime fuses that
    quantize-dequantize pattern into an integer kernel when it builds the session.
    """
    model = onnx.load(str(path), load_external_data=False)
    nodes = model.graph.node
    dequantized = {o for n in nodes if n.op_type == "DequantizeLinear" for o in n.output}
    counts = {"int8": 0, "float": 0}
    for n in nodes:
        if n.op_type in _INT8_PRODUCTS:
            counts["int8"] += 1
        elif n.op_type in _FLOAT_PRODUCTS:
            counts["int8" if any(i in dequantized for i in n.input) else "float"] += 1
    return counts


def _session(variant: Variant):
    import onnxruntime as ort

    if variant.name.startswith("aoe"):
        import aoe

        return aoe.session(variant.path)  # the session options the tuner chose
    return ort.InferenceSession(str(variant.path), providers=["CPUExecutionProvider"])


def measure_variants(model: onnx.ModelProto, variants: dict[str, Variant], mode: Mode) -> None:
    feeds = [measure.feeds_for(model, seed) for seed in range(mode.accuracy_inputs)]
    sessions = {}
    outputs = {}
    for name, v in variants.items():
        if v.error or v.path is None:
            continue
        try:
            sess = _session(v)
            outputs[name] = measure.run_all(sess, feeds)
        except Exception as exc:  # noqa: BLE001 - a model that does not load or run is a result
            v.error = _first_line(f"{type(exc).__name__}: {exc}")
            continue
        sessions[name] = sess
        v.ops = op_counts(v.path)
    if "fp32" not in outputs:
        raise RuntimeError(f"the fp32 model does not run: {variants['fp32'].error}")
    for name, out in outputs.items():
        variants[name].accuracy = measure.accuracy(outputs["fp32"], out)
    lat = measure.interleaved(
        sessions, feeds[0], rounds=mode.rounds, round_s=mode.round_s, warmup_s=mode.warmup_s
    )
    for name, value in lat.items():
        variants[name].latency = value


def bench_model(name: str, mode: Mode, work: Path, log: Log) -> ModelResult:
    from aoed import samples

    log(f"{name}: building")
    model = samples.build(name)
    src = samples.save(model, work / name / f"{name}.onnx")
    variants = {"fp32": Variant("fp32", src)}
    variants["quantize_dynamic"] = quantize(src, work / name / f"{name}.quantize_dynamic.onnx")
    if variants["quantize_dynamic"].error:
        log(f"  quantize_dynamic: FAILED {variants['quantize_dynamic'].error}")
    tunes = {}
    for precision in PRECISIONS:
        run = tune_twice(src, precision, work / name / precision, mode.budget_s, log)
        tunes[precision] = run
        tuned = Path(run.doc["tuned_model"]) if not run.error else None
        variants[f"aoe {precision}"] = Variant(f"aoe {precision}", tuned, error=run.error)
    log(f"  measuring {len(variants)} variants interleaved")
    measure_variants(model, variants, mode)
    for v in variants.values():
        if v.latency:
            log(f"    {v.name:<18} {v.latency.median_ms:9.3f} ms  ±{v.latency.spread:.1%}")
        elif v.error:
            log(f"    {v.name:<18} failed: {v.error}")
    return ModelResult(name, MODELS[name], model.doc_string, variants, tunes)


def _models(arg: str | None, quick: bool) -> list[str]:
    if not arg:
        return list(QUICK_MODELS if quick else MODELS)
    names = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"bench/run.py: unknown model(s) {unknown}; choose from {list(MODELS)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer models, small tuning budget")
    ap.add_argument("--models", help=f"comma-separated subset of: {','.join(MODELS)}")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "RESULTS.md")
    ap.add_argument("--budget", type=float, help="aoe tune --budget (seconds) for every job")
    ap.add_argument("--rounds", type=int, help="interleaved latency rounds")
    ap.add_argument("--workdir", type=Path, help="keep models, banks and tuner outputs here")
    args = ap.parse_args(argv)

    try:
        import matplotlib  # noqa: F401 - checked now, not after the whole run
    except ImportError:
        raise SystemExit(
            "bench/run.py: matplotlib is missing; install the bench extra "
            "(pip install -e '.[bench]'; make bench does it)"
        ) from None
    mode = QUICK if args.quick else FULL
    if args.budget is not None or args.rounds is not None:
        mode = Mode(
            mode.name,
            args.budget or mode.budget_s,
            args.rounds or mode.rounds,
            mode.round_s,
            mode.warmup_s,
            mode.accuracy_inputs,
        )
    names = _models(args.models, args.quick)
    log = Log()
    started = time.time()
    load_start = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        if args.workdir:
            work = args.workdir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aoe-bench-")))
        results = [bench_model(name, mode, work, log) for name in names]
    elapsed = time.perf_counter() - log.t0
    command = "python bench/run.py" + ("".join(f" {a}" for a in (argv or sys.argv[1:])))
    # Other work on the machine is the main source of noise; say how much there was.
    load = (
        f"Load average {load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the "
        f"end on {os.cpu_count()} cores."
    )
    written = report.write(
        results, mode, args.out, elapsed_s=elapsed, started=started, command=command, load=load
    )
    for path in written:
        log(f"wrote {path}")
    for line in targets.target_lines(results):
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
