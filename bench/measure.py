"""Latency and accuracy of several sessions of one model, measured side by side.

Every variant of a model runs in this one process on the same inputs. Latency is taken
in interleaved rounds: each round runs every variant for a short burst, in an order that
rotates from round to round, and keeps the burst's median; a variant's latency is the
median over rounds and its spread the interquartile range over rounds divided by that
median. Slow drifts of a noisy machine then hit every variant alike, so the ratios
between variants hold even when the absolute numbers move.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

__all__ = ["Accuracy", "Latency", "accuracy", "feeds_for", "interleaved", "run_all"]

# A burst shorter than this many runs would let the first run after a switch (cold caches,
# the previous session's threads still spinning) dominate the round's median.
MIN_REPS = 3
MAX_REPS = 400


@dataclass(frozen=True)
class Latency:
    median_ms: float
    spread: float  # IQR / median of the per-round medians
    rounds: tuple[float, ...]
    reps: int  # runs per round


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


def _once(session, feeds: Mapping[str, np.ndarray]) -> float:
    t0 = time.perf_counter()
    session.run(None, feeds)
    return time.perf_counter() - t0


def interleaved(
    sessions: Mapping[str, object],
    feeds: Mapping[str, np.ndarray],
    *,
    rounds: int,
    round_s: float,
    warmup_s: float,
) -> dict[str, Latency]:
    """Latency of every session, measured in `rounds` interleaved rounds (see module doc)."""
    names = list(sessions)
    reps: dict[str, int] = {}
    for name in names:
        sess = sessions[name]
        times = []
        deadline = time.perf_counter() + warmup_s
        while len(times) < 5 or time.perf_counter() < deadline:
            times.append(_once(sess, feeds))
        estimate = statistics.median(times[len(times) // 2 :])
        reps[name] = max(MIN_REPS, min(MAX_REPS, math.ceil(round_s / max(estimate, 1e-6))))
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            sess = sessions[name]
            burst = [_once(sess, feeds) for _ in range(reps[name])]
            per_round[name].append(statistics.median(burst) * 1e3)
    out = {}
    for name, values in per_round.items():
        q1, med, q3 = np.percentile(values, [25, 50, 75])
        out[name] = Latency(float(med), float((q3 - q1) / med), tuple(values), reps[name])
    return out


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
