"""Inputs, accuracy, and the latency figures of several variants of one model.

The latency itself is measured one session per process, as a user deploys a model
(bench/deployed.py); this module holds what those measurements become (`Latency`) and
how two of them compare: by their paired per-round ratios (drift of a shared machine hits
both sides of a pair alike), each with a distribution-free 95% interval for its median
(`aoed.engine.stats`). The sessions this process makes itself, for the accuracy
comparisons, have intra-op spinning off (`quiet_session`), as the tuner makes its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from aoed.engine.stats import median, median_ci, paired_ratios


def quiet_session(path, tuned: bool):
    """A session for `path` with intra-op spinning off, as the tuner measures (see
    aoed.backends.ort.runner.quiet): idle sessions' spinning threads would otherwise slow
    whichever variant runs. A tuned model gets the session options the tuner stored."""
    import onnxruntime as ort

    import aoe
    from aoed.backends.ort.runner import NO_SPIN

    if tuned:
        stored = aoe.session_options_of(path)
        return aoe.session(path, config={**NO_SPIN, **stored.get("config", {})})
    so = ort.SessionOptions()
    for k, v in NO_SPIN.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


__all__ = [
    "Accuracy",
    "Latency",
    "Ratio",
    "accuracy",
    "describe_inputs",
    "feeds_for",
    "quiet_session",
    "predictions",
    "ratio",
    "run_all",
]


@dataclass(frozen=True)
class Latency:
    median_ms: float  # median of every timed sample
    spread: float  # interquartile range of the samples over their median
    rounds_us: tuple[float | None, ...]  # per-round medians; None where not measured
    batch: int  # runs per timed sample
    dropped: str = ""  # why the procedure stopped measuring it, if it did

    @property
    def rounds(self) -> int:
        return sum(1 for r in self.rounds_us if r)


@dataclass(frozen=True)
class Ratio:
    """The median of paired per-round ratios a/b and a 95% interval for it."""

    median: float
    lo: float
    hi: float
    pairs: int

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def text(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f}x [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


@dataclass(frozen=True)
class Accuracy:
    cosine: float  # lowest over the inputs
    max_abs: float  # largest over the inputs
    max_rel: float  # max_abs relative to the range of the fp32 outputs


def _int_highs(model: onnx.ModelProto) -> dict[str, int]:
    """Upper bounds for integer inputs that index a constant table through Gather."""
    tables = {t.name: list(t.dims) for t in model.graph.initializer}
    highs: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[0] in tables:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = tables[node.input[0]]
            highs[node.input[1]] = min(highs.get(node.input[1], 1 << 62), dims[axis])
    return highs


def feeds_for(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    """Deterministic inputs: N(0, 1) floats; token ids spread over the vocabulary.

    The seeds are not the tuner's (it draws its own calibration data), so the accuracy
    measured here is on inputs the tuner never saw.
    """
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    highs = _int_highs(model)
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if dtype.kind == "f":
            feeds[vi.name] = rng.standard_normal(dims).astype(dtype)
        elif dtype.kind in "iu":
            feeds[vi.name] = rng.integers(0, highs.get(vi.name, 8), size=dims).astype(dtype)
        elif dtype.kind == "b":
            feeds[vi.name] = rng.integers(0, 2, size=dims).astype(bool)
        else:
            raise ValueError(f"input {vi.name!r} has dtype {dtype}; no data can be made for it")
    return feeds


def describe_inputs(model: onnx.ModelProto) -> str:
    """What `feeds_for` feeds this model, input by input, in words."""
    inits = {t.name for t in model.graph.initializer}
    highs = _int_highs(model)
    parts = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = "x".join(str(d.dim_value) if d.HasField("dim_value") else "1" for d in tt.shape.dim)
        kind = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).kind
        if kind == "f":
            what = "random N(0, 1) values"
        elif kind in "iu":
            high = highs.get(vi.name, 8)
            what = "random token ids" if vi.name in highs else "random integers"
            what += f" in [0, {high})"
        else:
            what = "random booleans"
        parts.append(f"`{vi.name}` [{dims}] {what}")
    return "; ".join(parts)


def ratio(a: Latency | None, b: Latency | None) -> Ratio | None:
    """a/b over the rounds that measured both (a speedup of b when a is the reference);
    None when no round did."""
    if a is None or b is None:
        return None
    pairs = paired_ratios(a.rounds_us, b.rounds_us)
    if not pairs:
        return None
    lo, hi = median_ci(pairs)
    return Ratio(median(pairs), lo, hi, len(pairs))


def run_all(session, feeds_list: Sequence[Mapping[str, np.ndarray]]) -> list[list[np.ndarray]]:
    return [list(session.run(None, feeds)) for feeds in feeds_list]


def accuracy(reference: list[list[np.ndarray]], outputs: list[list[np.ndarray]]) -> Accuracy:
    """Worst cosine and largest absolute error of `outputs` against `reference`, over all
    inputs; every output of a run is flattened and joined into one vector."""
    cosines, abs_errs, ranges = [], [], []
    for ref_run, out_run in zip(reference, outputs, strict=True):
        ref = np.concatenate([np.asarray(a, np.float64).ravel() for a in ref_run])
        out = np.concatenate([np.asarray(a, np.float64).ravel() for a in out_run])
        denom = float(np.linalg.norm(ref) * np.linalg.norm(out))
        cosines.append(float(ref @ out) / denom if denom > 0 else float(np.array_equal(ref, out)))
        abs_errs.append(float(np.max(np.abs(ref - out))) if ref.size else 0.0)
        ranges.append(float(ref.max() - ref.min()) if ref.size else 0.0)
    # NaN (a variant that produced non-finite outputs) must win both comparisons.
    cosine = min(cosines, key=lambda c: -math.inf if math.isnan(c) else c)
    max_abs = max(abs_errs, key=lambda e: math.inf if math.isnan(e) else e)
    span = max(ranges)
    return Accuracy(cosine, max_abs, max_abs / span if span > 0 else 0.0)


def predictions(outputs: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """Predicted classes: the argmax over the last axis of each run's first output, all
    runs joined in order."""
    return np.concatenate([np.asarray(run[0]).argmax(axis=-1).ravel() for run in outputs])


def ratio_text(r: Ratio | None) -> str:
    """`r` as a table cell: median with its 95% interval ("n/a" when none)."""
    return "n/a" if r is None else f"{r.median:.2f}x [{r.lo:.2f}, {r.hi:.2f}]"


def outputs_of(
    path: Path, feed: Mapping[str, np.ndarray], tuned: bool, names: Sequence[str] | None = None
) -> list[np.ndarray]:
    """`path`'s outputs (`names`, default all) on `feed`: a model aoe shipped opened with
    `aoe.session` (its options, or its runtime), any other with onnxruntime's defaults."""
    import onnxruntime as ort

    import aoe

    sess = (
        aoe.session(path)
        if tuned
        else ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    )
    return list(sess.run(list(names) if names else None, dict(feed)))


def shape_bench_args(doc: str, results: Path, argv: list[str] | None) -> Any:
    """The options the shape benches share (bench_dynamic.py, bench_decode.py)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--budget", type=float, default=60.0, help="aoe tune's budget (s)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=results, help="results file to write into")
    return ap.parse_args(argv)
