"""A dynamic model's assembled graph at every point of its shape profile.

Tuning prepares a dynamic model at one point (aoed.engine.shapeprofile), and a rewrite
chosen there may hold that point's sizes: a Reshape target, a constant shape, a fused
attention's parameters. The tuned model keeps the input's dynamic axes, so such a
choice would ship a model that fails, or computes something else, at every other shape.
`Points` runs a model at each point on the same synthetic inputs as the input model
(the prepared model with its dynamic axes restored, which computes what the input does)
and `guard` leaves out each choice whose model fails a point or leaves the tolerance
there: the guard is what makes a profiled shape baked into a graph harmless.

Runs in a compile worker: onnxruntime on the CPU provider, one thread.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import numpy as np
import onnx

from aoe.signature import TensorInfo
from aoed.engine.messages import PointCheck
from aoed.engine.shapeprofile import Profile, restore_io

__all__ = ["Points", "first_failure", "guard"]

#: The seed of a point's synthetic inputs (the same for the input and every candidate).
_SEED = 7


def _error(exc: BaseException) -> str:
    """onnxruntime's message, first line, without its code prefix, cut to a length a
    report can repeat."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", lines[0] if lines else "")
    return (text or type(exc).__name__)[:240]


class Points:
    """The reference outputs of the input model at each point, made once, and checks of
    other models against them."""

    def __init__(
        self,
        reference: onnx.ModelProto,
        profile: Profile,
        inputs: Mapping[str, TensorInfo],
        int_high: Mapping[str, int],
    ) -> None:
        self.profile = profile
        self._reference = onnx.ModelProto()
        self._reference.CopyFrom(reference)
        restore_io(self._reference, profile)
        self._dtypes = {k: v.dtype for k, v in inputs.items()}
        self._int_high = dict(int_high)
        self._outputs: dict[int, list[np.ndarray] | str] = {}

    def feeds(self, k: int) -> dict[str, np.ndarray]:
        """The synthetic inputs of point `k` (every model checked there gets these)."""
        from aoed.engine.prep import make_inputs

        point = self.profile.checked[k]
        infos = {n: TensorInfo(self._dtypes[n], point[n]) for n in self._dtypes if n in point}
        return make_inputs(infos, seed=_SEED, int_high=self._int_high)

    def reference(self, k: int) -> list[np.ndarray] | str:
        """The input model's outputs at point `k`, or why it fails there."""
        if k not in self._outputs:
            self._outputs[k] = self._run(self._reference, k)
        return self._outputs[k]

    def _run(self, model: onnx.ModelProto, k: int) -> list[np.ndarray] | str:
        import onnxruntime as ort

        from aoed.backends.ort.sessions import session

        quiet = ort.RunOptions()
        quiet.log_severity_level = 4  # a failure is this check's finding, not a log line
        try:
            sess = session(model.SerializeToString(), {"intra_op_num_threads": 1})
            return list(sess.run(None, self.feeds(k), quiet))
        except MemoryError:
            raise
        except Exception as exc:  # onnxruntime raises its own types; each is a failure here
            return _error(exc)

    def check(self, model: onnx.ModelProto, tolerance: tuple[float, float]) -> list[PointCheck]:
        """`model` (dynamic axes restored) at every point the input model runs at."""
        from aoed.backends.ort.runner import accuracy

        out = []
        measured = len(self.profile.points)
        for k, point in enumerate(self.profile.checked):
            ref = self.reference(k)
            if isinstance(ref, str):
                continue  # the input fails here too: nothing to hold the model to
            got = self._run(model, k)
            if isinstance(got, str):
                out.append(PointCheck(point, error=got, checked_only=k >= measured))
                continue
            try:
                acc = accuracy(ref, got)
            except ValueError as exc:
                out.append(PointCheck(point, error=str(exc), checked_only=k >= measured))
                continue
            max_rel, min_cos = tolerance
            error = ""
            if not (acc["max_rel_error"] <= max_rel and acc["cosine"] >= min_cos):
                error = (
                    f"outputs differ from the input model's (max relative error "
                    f"{acc['max_rel_error']:.3g}, cosine {acc['cosine']:.6f}; allowed "
                    f"{max_rel:g}, {min_cos:g})"
                )
            out.append(PointCheck(point, acc, error, checked_only=k >= measured))
        return out


def _failed(checks: list[PointCheck]) -> PointCheck | None:
    return next((c for c in checks if not c.ok), None)


def _where(c: PointCheck) -> str:
    return " ".join(f"{k}:{','.join(map(str, v))}" for k, v in c.shapes.items())


def first_failure(
    model: onnx.ModelProto, points: Points, tolerance: tuple[float, float]
) -> str | None:
    """Where `model` (as assembled, at the searched point) fails once it has the input's
    dynamic axes back (restored in place): "fails at shape ...: why", or None when it
    holds at every point."""
    restore_io(model, points.profile)
    bad = _failed(points.check(model, tolerance))
    return None if bad is None else f"fails at shape {_where(bad)}: {bad.error}"


def guard(
    build: Callable[[Mapping[str, str]], onnx.ModelProto],
    choices: Mapping[str, str],
    points: Points,
    tolerance: tuple[float, float],
) -> tuple[onnx.ModelProto, dict[str, str], list[PointCheck]]:
    """The model `build` makes of `choices` (dynamic axes restored), with each choice
    whose model fails a point left out: (model, task id -> why, its checks). A choice
    is judged alone (the input model with it and nothing else); when the choices that
    pass alone still fail together (their errors add up past the tolerance at a point),
    they are left out one at a time, the least accurate alone first (the lowest cosine
    at any point), until the rest hold together; a failure that is no loss of accuracy
    leaves every one out."""

    def made(chosen: Mapping[str, str]) -> onnx.ModelProto:
        model = build(chosen)
        restore_io(model, points.profile)
        return model

    model = made(choices)
    checks = points.check(model, tolerance)
    if _failed(checks) is None or not choices:
        return model, {}, checks
    refused: dict[str, str] = {}
    alone: dict[str, float] = {}  # task id -> its lowest cosine at any point, alone
    for tid, strategy in choices.items():
        own = points.check(made({tid: strategy}), tolerance)
        bad = _failed(own)
        if bad is not None:
            refused[tid] = f"{strategy} fails at shape {_where(bad)}: {bad.error}"
        else:
            alone[tid] = min((c.accuracy.get("cosine", 1.0) for c in own), default=1.0)
    kept = {t: s for t, s in choices.items() if t not in refused}
    model = made(kept)
    checks = points.check(model, tolerance)
    while (bad := _failed(checks)) is not None and kept:
        if bad.accuracy:  # it runs there, less accurately than allowed: the worst goes
            tid = min(kept, key=lambda t: (alone.get(t, 1.0), t))
            out = [tid]
        else:  # it fails to run with the others: no one to blame
            out = list(kept)
        for tid in out:
            refused[tid] = (
                f"{kept.pop(tid)} fails at shape {_where(bad)} with the others: {bad.error}"
            )
        model = made(kept)
        checks = points.check(model, tolerance)
    return model, refused, checks
