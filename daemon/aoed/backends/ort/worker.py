"""Compile worker: `python -m aoed.backends.ort.worker`, one of N in the compile pool.

It does a job's graph work, one request at a time (messages in aoed.engine.messages):

  prepare    load, check and normalize a model (engine/prep.py); find its tunable tasks;
             load it into onnxruntime and (exact precision) run it once on the job's
             synthetic inputs, so a model the runtime refuses or cannot run fails here
  samples    write the job's input samples (held back, and for calibration)
  calibrate  activation ranges over the calibration samples (probe.py)
  extract    each task as a standalone model, with its real input activations
  compile    one candidate: a strategy applied to a task model, checked, saved and
             loaded into a single-threaded session so a candidate the runtime rejects
             fails here, not on the device
  assemble   whole models with chosen strategies applied (and their metadata)
  check      whether strategies the bank names still apply to their tasks
  describe   what a task was decided on (its inputs, its small constants), for its entry
  rebuild    a bank entry's task rebuilt from its signature, default and strategy forms
  ping       nothing: that the worker answers

It never measures and never touches the bank. The last model it loaded stays cached,
since a job sends several requests about the same prepared model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from aoe.errors import ModelError
from aoe.signature import ModelContext
from aoed.engine import messages as m
from aoed.engine.registry import DEFAULT, StrategyRegistry
from aoed.engine.tasks import Constants

if TYPE_CHECKING:
    from aoed.backends.ort.shapecheck import Points
    from aoed.engine.prep import Prepared
    from aoed.engine.shapeprofile import Profile

_registry: StrategyRegistry | None = None
_cached: tuple[tuple[str, int], onnx.ModelProto, ModelContext, Constants] | None = None


def _loaded(path: Path) -> tuple[onnx.ModelProto, ModelContext, Constants]:
    """The model at `path` (with its context and constants), cached by path and mtime."""
    global _cached
    stamp = (str(path), path.stat().st_mtime_ns)
    if _cached is None or _cached[0] != stamp:
        model = onnx.load(str(path))
        _cached = (
            stamp,
            model,
            ModelContext(model),
            Constants(model.graph, list(model.opset_import)),
        )
    return _cached[1], _cached[2], _cached[3]


_ranges_cache: tuple[str, dict[str, tuple[float, float]]] | None = None


def _ranges(path: Path | None) -> dict[str, tuple[float, float]]:
    """Calibrated activation ranges from `path` (cached: every compile of a job reads them)."""
    global _ranges_cache
    if path is None:
        return {}
    if _ranges_cache is None or _ranges_cache[0] != str(path):
        data = json.loads(path.read_text())
        _ranges_cache = (str(path), {k: (float(v[0]), float(v[1])) for k, v in data.items()})
    return _ranges_cache[1]


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _prepare(req: m.PrepareRequest) -> m.PrepareReply:
    from aoe.shapes import ShapeProfile
    from aoed.backends.ort.sessions import session
    from aoed.engine.assemble import model_signature, tunable_tasks
    from aoed.engine.calibration import integer_ranges
    from aoed.engine.policy import policy
    from aoed.engine.prep import make_inputs, prepare

    prep = prepare(
        req.source,
        req.workdir,
        req.input_shapes,
        req.keep_initializer_inputs,
        req.limits,
        expect=req.model_file,
        shape_profile=ShapeProfile(req.profile_dims, req.profile_gears),
    )
    int_high = integer_ranges(prep.model, prep.inputs)
    try:
        sess = session(prep.path, {"intra_op_num_threads": 1})
    except Exception as exc:
        raise ModelError(
            f"{req.source}: onnxruntime cannot load the model: {_ort_error(exc, prep.path)}"
        ) from None
    if not policy(req.precision).lossy:
        # These are the job's inputs (the samples stage makes the same ones). A model that
        # cannot run on them cannot be profiled, tuned or confirmed; unchecked, it reached
        # the confirming A/B, where a failed input reads as "the input ships". A lossy job
        # runs the model on its calibration samples next, which reports the same way.
        try:
            sess.run(None, make_inputs(prep.inputs, int_high=int_high))
        except MemoryError:
            raise
        except Exception as exc:
            raise ModelError(
                f"{req.source}: onnxruntime cannot run the model on the tuner's synthetic inputs: "
                f"{_ort_error(exc, prep.path)}"
            ) from None
    del sess
    profile = _points_that_run(prep, int_high) if prep.profile is not None else None
    assert _registry is not None
    tasks = tunable_tasks(
        prep.model, prep.ctx, _registry, req.precision, req.job_type, req.device_kind
    )
    return m.PrepareReply(
        prepared=prep.path,
        inputs=prep.inputs,
        outputs=tuple(prep.outputs),
        tasks=tuple(tasks),
        model_signature=model_signature(prep.model, profile),
        int_high=int_high,
        notes=tuple(prep.notes),
        digest=_file_digest([prep.path, prep.path.with_name(prep.path.name + ".data")]),
        op_types=tuple(sorted({n.op_type for n in prep.model.graph.node})),
        profile=profile,
    )


def _points_that_run(prep: Prepared, int_high: dict[str, int]) -> Profile:
    """The prepared model's profile less the derived points where the input model itself
    fails (a size past what it computes: the derivation guessed too far), with a note for
    each; ModelError for a point the user gave, or the one the model was prepared at."""
    import msgspec

    from aoed.backends.ort.shapecheck import Points

    profile = prep.profile
    assert profile is not None
    points = Points(prep.model, profile, prep.inputs, int_high)
    keep, checks, measured = [], [], len(profile.points)
    for k, point in enumerate(profile.checked):
        ref = points.reference(k)
        if not isinstance(ref, str):
            (keep if k < measured else checks).append(point)
            continue
        where = " ".join(f"{n}:{','.join(map(str, d))}" for n, d in point.items())
        if k == profile.representative or (k < measured and not profile.derived):
            raise ModelError(
                f"{prep.source.name}: onnxruntime cannot run the model at {where}: {ref}"
            )
        prep.notes.append(f"shape profile: the input model fails at {where} ({ref}); left out")
    rep = keep.index(profile.point)
    return msgspec.structs.replace(
        profile, points=tuple(keep), checks=tuple(checks), representative=rep
    )


def _file_digest(paths: list[Path]) -> str:
    """sha256 over the sha256 digests of the files of `paths` that exist, in order."""
    h = hashlib.sha256()
    for path in paths:
        if path.is_file():
            with open(path, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def _ort_error(exc: Exception, prepared: Path) -> str:
    """onnxruntime's message on one line, without its status prefix, the prepared
    copy's path (the user knows their own file) or the source location of the check."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = text.replace(f"Load model from {prepared} failed:", "")
    return re.sub(r"/onnxruntime_src/\S+:\d+ (\S+ )*?\S+\([^)]*\) ", "", text).strip()


def _samples(req: m.SamplesRequest) -> m.SamplesReply:
    from aoed.engine.calibration import Samples, load_samples
    from aoed.engine.prep import make_inputs

    if req.lossy:
        samples = load_samples(req.inputs, req.calibration, req.int_high)
    else:
        samples = Samples.single(
            make_inputs(req.inputs, int_high=req.int_high), "synthetic (1 sample)"
        )
    req.workdir.mkdir(parents=True, exist_ok=True)
    held, calib = [], []
    h = hashlib.sha256()
    for i, sample in enumerate(samples.held_back):
        held.append(req.workdir / f"held_back_{i}.npz")
        np.savez(held[-1], **sample)
    for i, sample in enumerate(samples.calibrate):
        calib.append(req.workdir / f"calibrate_{i}.npz")
        np.savez(calib[-1], **sample)
    for sample in (*samples.held_back, *samples.calibrate):
        for name in sorted(sample):
            arr = np.ascontiguousarray(sample[name])
            h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
            h.update(arr.tobytes())
    return m.SamplesReply(tuple(held), tuple(calib), samples.source, h.hexdigest())


def _calibrate(req: m.CalibrateRequest) -> m.CalibrateReply:
    from aoed.backends.ort.probe import activation_ranges

    model, ctx, _ = _loaded(req.prepared)
    ranges = activation_ranges(model, ctx.tensors, (_load_npz(p) for p in req.samples))
    req.out.write_text(json.dumps(ranges))
    return m.CalibrateReply(req.out, len(ranges))


def _extract(req: m.ExtractRequest) -> m.ExtractReply:
    from aoed.backends.ort.probe import capture
    from aoed.engine.tasks import task_model

    model, ctx, consts = _loaded(req.prepared)
    wanted = {n for t in req.tasks for n in t.inputs if n not in consts}
    values = capture(model, ctx.tensors, wanted, _load_npz(req.sample))
    dirs = {}
    for t in req.tasks:
        d = req.root / t.id
        d.mkdir(parents=True, exist_ok=True)
        onnx.save(task_model(model, t, consts, ctx.tensors), str(d / "task.onnx"))
        np.savez(d / "inputs.npz", **{n: values[n] for n in t.inputs if n not in consts})
        dirs[t.id] = d
    return m.ExtractReply(dirs)


def _compile(req: m.CompileRequest) -> m.CompileReply:
    from aoed.backends.ort.sessions import session
    from aoed.engine.tasks import TaskView, apply_rewrites

    t0 = time.perf_counter()
    model = onnx.load(str(req.task_model))
    assert _registry is not None
    strategy = _registry.get(req.family, req.strategy)
    nodes = list(model.graph.node)
    ctx = ModelContext(model)
    view = TaskView(
        nodes=nodes,
        consts=Constants(model.graph, list(model.opset_import)),
        infos=ctx.tensors,
        opset=ctx.opset(""),
        prefix=req.prefix,
        ranges=_ranges(req.ranges),
    )
    rewrite = strategy.apply(view)
    if rewrite is None:
        return m.CompileReply(applicable=False)
    candidate = apply_rewrites(model, {tuple(n.name for n in nodes): rewrite})
    onnx.checker.check_model(candidate)
    onnx.save(candidate, str(req.out))
    session(req.out, {"intra_op_num_threads": 1})
    return m.CompileReply(compile_s=time.perf_counter() - t0)


def _variants(req: m.VariantsRequest) -> m.VariantsReply:
    from aoed.backends.ort.sessions import session
    from aoed.engine.tasks import TaskView, apply_rewrites

    model = onnx.load(str(req.task_model))
    assert _registry is not None
    strategy = _registry.get(req.family, req.strategy)
    if strategy.propose is None:
        return m.VariantsReply()
    nodes = list(model.graph.node)
    ctx = ModelContext(model)
    view = TaskView(
        nodes=nodes,
        consts=Constants(model.graph, list(model.opset_import)),
        infos=ctx.tensors,
        opset=ctx.opset(""),
        prefix=req.prefix,
        ranges=_ranges(req.ranges),
    )
    with np.load(req.inputs, allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files}
    names = {i.name for i in model.graph.input}
    feeds = {k: v for k, v in feeds.items() if k in names}

    def evaluate(rewrite):
        candidate = (
            model
            if rewrite is None
            else apply_rewrites(model, {tuple(n.name for n in nodes): rewrite})
        )
        return session(candidate.SerializeToString(), {"intra_op_num_threads": 1}).run(None, feeds)[
            0
        ]

    notes: list[str] = []
    proposed = strategy.propose(view, evaluate, notes)
    return m.VariantsReply(tuple(proposed), tuple(notes))


def _describe(req: m.DescribeRequest) -> m.DescribeReply:
    from aoed.engine.taskinputs import describe

    model = onnx.load(str(req.task_model))
    consts = Constants(model.graph, list(model.opset_import))
    small = {n: consts[n] for n in req.names if n in consts}
    with np.load(req.inputs, allow_pickle=False) as data:
        values = {k: data[k] for k in data.files}
    return m.DescribeReply(describe(req.names, values, small).params())


_points_cache: tuple[tuple[str, int, str], Points] | None = None


def _points(
    source: Path,
    profile: Profile,
    int_high: dict[str, int],
    model: onnx.ModelProto,
    ctx: ModelContext,
) -> Points:
    """The profile's reference outputs for the model at `source` (cached: every check
    and assembly of a job runs against the same ones)."""
    global _points_cache
    from aoed.backends.ort.shapecheck import Points

    stamp = (str(source), source.stat().st_mtime_ns, repr(profile))
    if _points_cache is None or _points_cache[0] != stamp:
        inputs = {n: ctx.tensors[n] for n in profile.point if n in ctx.tensors}
        _points_cache = (stamp, Points(model, profile, inputs, int_high))
    return _points_cache[1]


def _assemble(req: m.AssembleRequest) -> m.AssembleReply:
    from aoed.backends.ort.shapecheck import guard
    from aoed.engine.assemble import apply_choices, set_metadata
    from aoed.engine.modelio import save_model

    model, ctx, consts = _loaded(req.source)
    ranges = _ranges(req.ranges)
    assert _registry is not None
    registry = _registry
    sizes, refused, checked = {}, {}, {}

    def build_of(choices: Any) -> onnx.ModelProto:
        return apply_choices(model, ctx, consts, req.tasks, choices, registry, ranges)

    for build in req.builds:
        if req.profile is not None and ctx.tensors:
            out, left_out, checks = guard(
                build_of,
                build.choices,
                _points(req.source, req.profile, req.int_high, model, ctx),
                req.tolerance,
            )
            refused.update(left_out)
            checked[str(build.out)] = tuple(checks)
        else:
            out = build_of(build.choices)
        if build.metadata:
            set_metadata(out, build.metadata)
        sizes[str(build.out)] = save_model(out, build.out)
    return m.AssembleReply(sizes, refused, checked)


def _check(req: m.CheckRequest) -> m.CheckReply:
    from aoe.errors import AoedError
    from aoed.engine.assemble import apply_choices, task_rewrites

    model, ctx, consts = _loaded(req.source)
    ranges = _ranges(req.ranges)
    assert _registry is not None
    failures = {}
    for t in req.tasks:
        if t.id in req.choices:
            try:
                task_rewrites(model, ctx, consts, t, req.choices[t.id], _registry, ranges)
            except (KeyError, AoedError) as exc:
                failures[t.id] = str(exc).strip("'\"")
    if req.profile is not None and ctx.tensors:
        from aoed.backends.ort.shapecheck import first_failure

        points = _points(req.source, req.profile, req.int_high, model, ctx)
        for t in req.tasks:
            choice = req.choices.get(t.id)
            if choice is None or t.id in failures or choice == DEFAULT:
                continue
            built = apply_choices(model, ctx, consts, [t], {t.id: choice}, _registry, ranges)
            if (why := first_failure(built, points, req.tolerance)) is not None:
                failures[t.id] = f"{choice} {why}"
    return m.CheckReply(failures)


def _rebuild(req: m.RebuildRequest) -> m.RebuildReply:
    from aoed.engine.bankverify import RebuildError, rebuild_task, task_feeds
    from aoed.engine.taskinputs import TaskInputs

    def skipped(why: str) -> m.RebuildReply:
        return m.RebuildReply(ok=False, verdict="skipped", detail=f"cannot rebuild the task: {why}")

    try:
        count = len(json.loads(req.canonical_json)["inputs"])
        described = TaskInputs.from_params(req.params, count)
        model, consts = rebuild_task(req.canonical_json, req.digest, described)
        feeds, unlike = task_feeds(model, described)
    except (RebuildError, ValueError, KeyError, TypeError) as exc:
        return skipped(str(exc).strip("'\""))
    assert _registry is not None
    try:
        strategy = _registry.get(req.family, req.strategy) if req.strategy != DEFAULT else None
    except KeyError as exc:
        return m.RebuildReply(ok=False, verdict="error", detail=str(exc).strip("'\""))
    try:
        rewrite = _rewrite_rebuilt(model, consts, feeds, strategy, req.precision)
    except Exception as exc:  # noqa: BLE001
        # A rebuilt task is made up where the entry keeps no values (weights at random),
        # and strategies (plugins among them) are written for real ones: whatever one
        # raises on it is this check's limit, said as such, never the whole run's end.
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return skipped(
            f"{req.strategy} failed on the rebuilt task ({type(exc).__name__}: {why})"
            + (f"; {unlike}" if unlike else "")
        )
    if rewrite is None:
        if unlike:  # the strategy may read values the rebuild made up
            return skipped(f"{req.strategy} does not apply to the rebuilt task; {unlike}")
        return m.RebuildReply(
            ok=False,
            verdict="error",
            detail=f"strategy {req.strategy} no longer applies to this task",
        )
    tuned = _applied(model, rewrite)
    req.workdir.mkdir(parents=True, exist_ok=True)
    paths = req.workdir / "default.onnx", req.workdir / "strategy.onnx", req.workdir / "inputs.npz"
    onnx.save(model, str(paths[0]))
    onnx.save(tuned, str(paths[1]))
    np.savez(paths[2], **feeds)
    return m.RebuildReply(
        ok=True, default=paths[0], candidate=paths[1], inputs=paths[2], unlike=unlike
    )


def _rewrite_rebuilt(model, consts, feeds, strategy, precision: str):
    """The rewrite `strategy` makes of a rebuilt task, calibrated (lossy precisions) on
    `feeds`; None when it does not apply. ValueError when the activation ranges of the
    rebuilt task are not finite (its made-up constants overflow)."""
    from aoed.backends.ort.probe import activation_ranges
    from aoed.engine.policy import policy
    from aoed.engine.tasks import TaskView

    ctx = ModelContext(model)
    ranges = activation_ranges(model, ctx.tensors, [feeds]) if policy(precision).lossy else {}
    bad = sorted(n for n, r in ranges.items() if not np.all(np.isfinite(np.asarray(r, float))))
    if bad:
        raise ValueError(f"the activation ranges of {', '.join(bad[:3])} are not finite")
    view = TaskView(
        nodes=list(model.graph.node),
        consts=consts,
        infos=ctx.tensors,
        opset=ctx.opset(""),
        prefix="aoe/verify",
        ranges=ranges,
    )
    return strategy.apply(view) if strategy is not None else None


def _applied(model, rewrite):
    """`model` with `rewrite` applied to its one task (all its nodes)."""
    from aoed.engine.tasks import apply_rewrites

    return apply_rewrites(model, {tuple(n.name for n in model.graph.node): rewrite})


def _runtime_build(req: m.RuntimeBuildRequest) -> m.RuntimeBuildReply:
    """Another runtime's builds of the model (aoed.backends.runtimes.BUILDS): made here,
    in a compile worker, so a crash in that runtime costs this request only."""
    from aoed.backends.runtimes import build_for

    return build_for(req)


def _ping(req: m.PingRequest) -> m.PingReply:
    return m.PingReply(len(os.sched_getaffinity(0)), ())


_OPS: dict[type[m.Request], Callable[[Any], Any]] = {
    m.PingRequest: _ping,
    m.PrepareRequest: _prepare,
    m.SamplesRequest: _samples,
    m.CalibrateRequest: _calibrate,
    m.ExtractRequest: _extract,
    m.CompileRequest: _compile,
    m.VariantsRequest: _variants,
    m.DescribeRequest: _describe,
    m.AssembleRequest: _assemble,
    m.CheckRequest: _check,
    m.RebuildRequest: _rebuild,
    m.RuntimeBuildRequest: _runtime_build,
}


def _handle(req: m.Request) -> Any:
    return _OPS[type(req)](req)


def line_handler(plugins: Sequence[str] = ()) -> Callable[[bytes], bytes]:
    """This worker's protocol for one request line (its answer line), with the strategy
    registry of `plugins`: what an executor that carries the lines itself runs
    (aoed.engine.rayexec)."""
    global _registry
    from aoed.backends._wire import line_server
    from aoed.backends.ort.catalog import build_registry

    _registry = build_registry(list(plugins))
    return line_server(_handle, tuple(_OPS))


def main() -> int:
    global _registry
    from aoed.backends._wire import child_main, serve
    from aoed.backends.ort.catalog import build_registry

    args = child_main()
    _registry = build_registry(args.plugins)
    return serve(_handle, tuple(_OPS))


if __name__ == "__main__":
    sys.exit(main())
