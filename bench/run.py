"""Side by side: onnxruntime fp32, onnxruntime's quantize_dynamic, aoe tune exact and int8.

    python bench/run.py [--quick] [--models a,b] [--out bench/RESULTS.md]

For every model, in one run: onnxruntime with default session options (fp32, the 1.00x
reference); `onnxruntime.quantization.quantize_dynamic` with its defaults (what a user
picks for int8 today); `aoe tune --precision exact`; `aoe tune --precision int8`. The aoe
jobs name no job type, so they run the default a user gets (sgat+opat); each is also run
with `--job-type opat` (OPAT alone) into a fresh bank, with the same budget, for what the
default costs in tuning time.

Each aoe run tunes into a fresh bank and is then repeated on that bank, which answers it
from the bank alone (the bank-hit path). For the repeat check (every model and precision
in full mode; two models, int8, in quick mode) the same job also runs a second time into
another fresh bank, and the two runs' decisions are compared. Accuracy of the four
variants is compared in this process on the same inputs; latency is measured as a user
deploys a model (bench/deployed.py): one session per process with onnxruntime's
defaults, the processes taking turns in paired rounds, while this process holds the
machine-wide device lock, so no tuner measures at the same time. Tuning cost and the
tuner's own figures come from each run's result JSON and wall clock.

The sample models (aoed.samples) have random weights and are fed synthetic inputs;
`digits` (bench/digits.py) is trained on real images and is fed real held-out images, and
its int8 run calibrates on real training images.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import deployed
import measure
import report
import targets
from machine import Machine

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
    "digits": "real data",
}
QUICK_MODELS = ("cnn", "legacy_cnn", "transformer", "resnet", "bert", "gpt", "digits")
PRECISIONS = ("exact", "int8")
#: The job type run beside the default (which the jobs leave unnamed) for its tuning time.
OPAT = "opat"
TUNE_TIMEOUT_S = 3600.0
REFERENCE = "fp32"


@dataclass(frozen=True)
class Mode:
    name: str
    budget_s: float | None  # `aoe tune --budget`; None: none given, the tuner fits one
    rounds: int  # paired latency rounds, one session per process
    measure_s: float  # the latency measurement's budget per model, all variants together
    # Timed samples per variant and round, each of about 2 ms or one run (the tuner's
    # sizing); fewer for slow models, so that the rounds fit in `measure_s`.
    samples: int
    accuracy_inputs: int  # synthetic inputs the accuracy is compared on
    repeat: tuple[str, ...] | None  # models of the repeat-decision check; None: all
    repeat_precisions: tuple[str, ...] = PRECISIONS


FULL = Mode("full", 20.0, rounds=40, measure_s=120.0, samples=25, accuracy_inputs=8, repeat=None)
# Quick mode stays under about 10 minutes on 2 cores: the repeat check covers the two
# cheapest models, one random-weight and one real-data, at int8 (the precision with the
# most candidates per task).
QUICK = Mode(
    "quick",
    3.0,
    rounds=21,
    measure_s=12.0,
    samples=15,
    accuracy_inputs=4,
    repeat=("cnn", "digits"),
    repeat_precisions=("int8",),
)


@dataclass
class Job:
    """One `aoe tune` process."""

    error: str = ""
    wall_s: float = 0.0  # the process, start to exit
    doc: dict[str, Any] = field(default_factory=dict)
    # Times the job said it waited for another process measuring on the same device.
    lock_waits: int = 0


@dataclass
class TuneRun:
    """A full tune into a fresh bank, the same job again on that bank (the bank-hit
    path), and, for the repeat check, the full tune again into another fresh bank."""

    precision: str
    full: Job
    hit: Job | None = None
    repeat: Job | None = None
    #: the same job as `full` with --job-type opat, into a fresh bank, for the default's cost
    opat: Job | None = None


@dataclass
class Variant:
    name: str
    path: Path | None
    error: str = ""
    latency: measure.Latency | None = None
    accuracy: measure.Accuracy | None = None
    ops: dict[str, int] = field(default_factory=dict)
    top1: float | None = None  # share of the labelled inputs classified right
    agree: float | None = None  # share of inputs with the same top-1 class as fp32


@dataclass
class ModelResult:
    name: str
    kind: str
    description: str
    data: str  # where the weights and the inputs come from, in words
    variants: dict[str, Variant]
    tunes: dict[str, TuneRun]
    labelled: int = 0  # inputs with a true label (real data only)


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


def aoe_tune(
    model: Path,
    precision: str,
    bank: Path,
    output: Path,
    budget_s: float | None,
    calibration: Path | None = None,
    job_type: str | None = None,
) -> Job:
    """Runs `aoe tune` in its own process (with `--job-type job_type`, or none: the
    default a user gets) and reads its result JSON."""
    cmd = [sys.executable, "-m", "aoe.cli", "tune", str(model), "--no-progress"]
    cmd += ["--precision", precision, "--bank", str(bank), "--output", str(output)]
    if budget_s is not None:
        cmd += ["--budget", f"{budget_s:g}"]
    if job_type is not None:
        cmd += ["--job-type", job_type]
    if calibration is not None:
        cmd += ["--calibration", str(calibration)]
    # The bank is the one named here, and a bank hit must be taken, not re-tuned.
    env = {k: v for k, v in os.environ.items() if k not in ("TUNE_BANK_PATH", "REPEAT_TUNE")}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=TUNE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return Job(f"aoe tune timed out after {TUNE_TIMEOUT_S:.0f} s", time.perf_counter() - t0)
    job = Job(wall_s=time.perf_counter() - t0)
    job.lock_waits = sum(1 for ln in proc.stderr.splitlines() if "waiting for" in ln)
    if proc.returncode != 0:
        job.error = f"aoe tune exit {proc.returncode}: {_first_line(proc.stderr)}"
        return job
    reports = sorted(output.glob("aoe_result_*.json"))
    if len(reports) != 1:
        job.error = f"aoe tune wrote {len(reports)} result files in {output}, expected 1"
        return job
    job.doc = json.loads(reports[0].read_text())
    return job


def tune(
    model: Path,
    precision: str,
    work: Path,
    mode: Mode,
    log: Log,
    *,
    calibration: Path | None,
    repeat: bool,
) -> TuneRun:
    def one(bank: str, out: str, job_type: str | None = None) -> Job:
        return aoe_tune(
            model, precision, work / bank, work / out, mode.budget_s, calibration, job_type
        )

    # OPAT alone first, then the default, one after the other: their tuning times are a pair.
    opat = one("bank-opat", "opat", OPAT)
    log(
        f"  aoe {precision} --job-type {OPAT}: "
        + (f"FAILED {opat.error}" if opat.error else f"tuned in {opat.wall_s:.1f} s")
    )
    run = TuneRun(precision, one("bank", "full"), opat=opat)
    if run.full.error:
        log(f"  aoe {precision}: FAILED {run.full.error}")
        return run
    log(f"  aoe {precision}: tuned in {run.full.wall_s:.1f} s")
    run.hit = one("bank", "hit")
    if run.hit.error:
        log(f"  aoe {precision} from the bank: FAILED {run.hit.error}")
    else:
        log(f"  aoe {precision} from the bank: {run.hit.wall_s:.1f} s")
    if repeat:
        run.repeat = one("bank-repeat", "repeat")
        if run.repeat.error:
            log(f"  aoe {precision} again, fresh bank: FAILED {run.repeat.error}")
        else:
            log(f"  aoe {precision} again, fresh bank: {run.repeat.wall_s:.1f} s")
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


def holding_device(fn: Callable[[], Any], log: Log) -> Any:
    """`fn()` while holding the machine-wide device lock the tuner's measurements take,
    so no `aoe tune` (this run's or another process's) measures at the same time."""
    import trio

    from aoe.config import load_config
    from aoed.engine.devlock import DeviceLock

    async def held() -> Any:
        lock = DeviceLock(load_config().runtime_dir, "cpu")
        try:
            async with lock.hold(on_wait=lambda msg: log(f"  {msg}")):
                return fn()
        finally:
            lock.close()

    return trio.run(held)


def measure_variants(
    feeds: list[dict[str, np.ndarray]],
    variants: dict[str, Variant],
    mode: Mode,
    log: Log,
    labels: np.ndarray | None = None,
) -> None:
    """Accuracy of every variant against fp32 over `feeds` (and against `labels`, one
    per row of the first output, where given), in this process; then latency on
    `feeds[0]`, one session per process (`as_deployed`)."""
    outputs = {}
    for name, v in variants.items():
        if v.error or v.path is None:
            continue
        try:  # the session goes with the call: none stays idle here beside the timed ones
            outputs[name] = measure.run_all(
                measure.quiet_session(v.path, tuned=name.startswith("aoe")), feeds
            )
        except Exception as exc:  # noqa: BLE001 - a model that does not load or run is a result
            v.error = _first_line(f"{type(exc).__name__}: {exc}")
            continue
        v.ops = op_counts(v.path)
    if REFERENCE not in outputs:
        raise RuntimeError(f"the fp32 model does not run: {variants[REFERENCE].error}")
    reference = measure.predictions(outputs[REFERENCE]) if labels is not None else None
    for name, out in outputs.items():
        variants[name].accuracy = measure.accuracy(outputs[REFERENCE], out)
        if labels is not None:
            predicted = measure.predictions(out)
            variants[name].top1 = float(np.mean(predicted == labels))
            variants[name].agree = float(np.mean(predicted == reference))
    models = {n: deployed.Model(variants[n].path, tuned=n.startswith("aoe")) for n in outputs}
    timed, errors = as_deployed(models, feeds[0], mode, log)
    for name, value in timed.items():
        variants[name].latency = value
    for name, why in errors.items():
        variants[name].error = _first_line(why)


def as_deployed(models: dict[str, deployed.Model], feed: dict[str, np.ndarray], mode, log: Log):
    """Latency of every model on `feed` as a user deploys it: one session per process,
    the processes in turn over `mode`'s rounds, budget and samples (bench/deployed.py),
    while this process holds the device lock; and why any could not be timed."""
    return holding_device(
        lambda: deployed.latencies(
            models, feed, rounds=mode.rounds, budget_s=mode.measure_s, samples=mode.samples
        ),
        log,
    )


def _sample(name: str, work: Path, mode: Mode):
    """(model file, model, data description, feeds, labels, calibration) of a model."""
    if name == "digits":
        import digits

        info = digits.build(work / name)
        feeds, labels = digits.held_out(info.test)
        data = (
            f"trained weights; inputs are real: {info.test_images} held-out digit images "
            f"({len(feeds)} batches of {digits.BATCH}) with their true labels; both aoe runs "
            f"get `--calibration` with {len(list(info.calibration.glob('*.npz')))} files of "
            f"{digits.BATCH} real training images, on which int8 calibrates"
        )
        return info.model, onnx.load(str(info.model)), data, feeds, labels, info.calibration
    from aoed import samples

    model = samples.build(name)
    src = samples.save(model, work / name / f"{name}.onnx")
    feeds = [measure.feeds_for(model, seed) for seed in range(mode.accuracy_inputs)]
    data = (
        f"random weights; inputs are synthetic: {measure.describe_inputs(model)}; aoe "
        f"calibrates int8 on its own synthetic samples"
    )
    return src, model, data, feeds, None, None


def bench_model(name: str, mode: Mode, work: Path, log: Log) -> ModelResult:
    log(f"{name}: building")
    src, model, data, feeds, labels, calibration = _sample(name, work, mode)
    variants = {REFERENCE: Variant(REFERENCE, src)}
    variants["quantize_dynamic"] = quantize(src, work / name / f"{name}.quantize_dynamic.onnx")
    if variants["quantize_dynamic"].error:
        log(f"  quantize_dynamic: FAILED {variants['quantize_dynamic'].error}")
    repeated = mode.repeat is None or name in mode.repeat
    tunes = {}
    for precision in PRECISIONS:
        run = tune(
            src,
            precision,
            work / name / precision,
            mode,
            log,
            calibration=calibration,
            repeat=repeated and precision in mode.repeat_precisions,
        )
        tunes[precision] = run
        full = run.full
        tuned = Path(full.doc["tuned_model"]) if not full.error else None
        variants[f"aoe {precision}"] = Variant(f"aoe {precision}", tuned, error=full.error)
    log(f"  measuring {len(variants)} variants, one session per process")
    measure_variants(feeds, variants, mode, log, labels)
    ref = variants[REFERENCE].latency
    for v in variants.values():
        if v.latency:
            s = measure.ratio(ref, v.latency)
            vs = f"  {s.text()} vs fp32" if s else ""
            log(f"    {v.name:<18} {v.latency.median_ms:9.3f} ms  ±{v.latency.spread:.1%}{vs}")
        elif v.error:
            log(f"    {v.name:<18} failed: {v.error}")
    return ModelResult(
        name,
        MODELS[name],
        model.doc_string,
        data,
        variants,
        tunes,
        labelled=0 if labels is None else len(labels),
    )


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
    ap.add_argument(
        "--budget",
        help="aoe tune --budget (seconds) for every job, or 'fitted': none "
        "given, as a user who names none runs it (the tuner fits one to the tasks it finds)",
    )
    ap.add_argument("--rounds", type=int, help="paired latency rounds")
    ap.add_argument(
        "--repeat",
        help="comma-separated models whose tuning is repeated into a fresh bank to compare "
        "decisions ('all', or 'none'; default: all in full mode, "
        f"{','.join(QUICK.repeat or ())} in quick mode, at the mode's precisions)",
    )
    ap.add_argument("--workdir", type=Path, help="keep models, banks and tuner outputs here")
    args = ap.parse_args(argv)

    try:
        import matplotlib  # noqa: F401 - checked now, not after the whole run
        import sklearn  # noqa: F401 - the real-data model needs it
    except ImportError as exc:
        raise SystemExit(
            f"bench/run.py: {exc.name} is missing; install the bench extra "
            "(pip install -e '.[bench]'; make bench does it)"
        ) from None
    mode = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    if args.budget is not None:
        changes["budget_s"] = None if args.budget == "fitted" else float(args.budget)
    if args.rounds is not None:
        changes["rounds"] = args.rounds
    if args.repeat is not None:
        names = [n.strip() for n in args.repeat.split(",") if n.strip()]
        changes["repeat"] = None if names == ["all"] else () if names == ["none"] else tuple(names)
    if changes:
        import dataclasses

        mode = dataclasses.replace(mode, **changes)
    names = _models(args.models, args.quick)
    log = Log()
    host = Machine()
    started = time.time()
    with contextlib.ExitStack() as stack:
        if args.workdir:
            work = args.workdir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aoe-bench-")))
        results = [bench_model(name, mode, work, log) for name in names]
    host.finish()
    elapsed = time.perf_counter() - log.t0
    command = "python bench/run.py" + ("".join(f" {a}" for a in (argv or sys.argv[1:])))
    written = report.write(
        results, mode, args.out, elapsed_s=elapsed, started=started, command=command, host=host
    )
    for path in written:
        log(f"wrote {path}")
    for line in targets.target_lines(results):
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
