"""`aoe compile`: the tuned model a bank describes, built from the bank alone.

    prepare (as tuning does) -> the bank's answer for every task and for the model
    (engine/assemble.from_bank, through AOE's bank rules) -> the strategies applied
    -> the tuned model, with the metadata the tuner writes

The tasks are those the tuning run formed: its job type (opat, sgat, sgat+opat) is named
by the confirmation it stored with the model's record, so each entry applies to the same
nodes and twins it did. A task's entry is applied only when it was measured on this
device fingerprint and its strategy still applies to the task (and to each of its
twins); anything else is a miss, and the report says why. The result equals the tuning
run's model when the bank holds what that run chose. Runs in the caller's process; it measures nothing but the
session options the bank holds, which won on a machine that may have been busier: one
short A/B (with them, without them) on this device before they are applied
(`check_options`), through a measurement runner under the machine-wide device lock.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aoe.bank import BankReader
from aoe.bankrecord import BankRecord, decode
from aoe.keys import DeviceFingerprint
from aoe.partition import Task
from aoed.engine.assemble import Assembly, apply_choices, from_bank, set_metadata, tuned_metadata
from aoed.engine.calibration import integer_ranges, load_samples
from aoed.engine.modelio import load_model, save_model
from aoed.engine.policy import policy
from aoed.engine.prep import Prepared, prepare
from aoed.engine.runtime import Runtime
from aoed.engine.tasks import Constants

__all__ = ["compile_model"]


def _dynamic(
    runtime: Runtime,
    prep: Prepared,
    tasks: Sequence[Task],
    asm: Assembly,
    ranges: Mapping[str, tuple[float, float]] | None,
    precision: str,
    plugins: Sequence[str],
    work: Path,
) -> Any:
    """The bank's choices for a dynamic model, assembled by one of the runtime's compile
    workers as a tuning job assembles: with the input's own axes, each choice checked at
    every point of its shape profile, those that fail one left out with a note."""
    import json

    import onnx
    import trio

    from aoed.engine.messages import AssembleReply, AssembleRequest, Build
    from aoed.engine.pool import CompilePool

    out = work / "dynamic.onnx"
    ranges_path = None
    if ranges:
        ranges_path = work / "ranges.json"
        ranges_path.write_text(json.dumps({k: list(v) for k, v in ranges.items()}))
    p = policy(precision)
    req = AssembleRequest(
        prep.path,
        tuple(tasks),
        (Build(out, dict(asm.choices)),),
        ranges_path,
        prep.profile,
        (p.e2e_max_rel_error, p.e2e_min_cosine),
        integer_ranges(prep.model, prep.inputs),
    )

    async def run() -> AssembleReply:
        pool = CompilePool(1, work / "logs", runtime=runtime, plugins=plugins)
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            reply: AssembleReply = await pool.call(req)
            nursery.cancel_scope.cancel()
        return reply

    (work / "logs").mkdir(exist_ok=True)
    for tid, why in trio.run(run).refused.items():
        asm.choices.pop(tid, None)
        asm.notes.append(f"{tid}: {why}; left out")
    return onnx.load(str(out))


class _ReaderLookup:
    """A BankReader seen as the engine's `Lookup` (records decoded by the bank codec)."""

    def __init__(self, reader: BankReader):
        self.reader = reader

    def record(self, key: bytes) -> tuple[BankRecord | None, str]:
        raw, layer = self.reader.lookup_raw(key)
        return (decode(raw), layer) if raw is not None else (None, "")

    def default(self, key: bytes) -> tuple[dict[str, Any] | None, str]:
        return self.reader.lookup_default(key)

    def explain(self, key: bytes) -> str:
        return self.reader.lookup_explain(key).reason


def _options_hold(
    runtime: Runtime, model: Path, options: dict[str, Any], inputs: Path, runtime_dir: Path
) -> tuple[bool, str]:
    """One short A/B of `model` with and without `options` on this machine's CPU: (kept,
    why) where kept needs the whole 95% interval of the round ratio below 1."""
    import trio

    from aoe.device import CPU
    from aoed.engine import stats
    from aoed.engine.confirm import verdict_of
    from aoed.engine.device import DeviceAgent
    from aoed.engine.messages import Candidate, MeasurePlan, MeasureReply, MeasureRequest

    async def run() -> dict:
        with tempfile.TemporaryDirectory(prefix="aoe-compile-logs-") as logs:
            agent = DeviceAgent(CPU, None, Path(logs), runtime_dir, runtime=runtime)
            async with trio.open_nursery() as nursery:
                await nursery.start(agent.run)
                req = MeasureRequest(
                    (Candidate("with", model, options), Candidate("without", model)),
                    inputs,
                    "without",
                    CPU,
                    MeasurePlan.fixed(9, 5.0, deployed=True),
                )
                reply: MeasureReply = await agent.call(req)
                nursery.cancel_scope.cancel()
        return reply.results

    res = trio.run(run)
    verdict, med, (lo, hi) = verdict_of(
        stats.paired_ratios(res["with"].rounds_us, res["without"].rounds_us)
    )
    why = (
        f"session options {options} re-checked here: ratio with/without {med:.3f}, 95% interval "
        f"[{lo:.3f}, {hi:.3f}] over 9 rounds ({verdict})"
    )
    return verdict == "faster", why


def compile_model(
    model_path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    reader: BankReader,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    precision: str = "exact",
    keep_initializer_inputs: bool = False,
    calibration: Path | None = None,
    plugins: Sequence[str] = (),
    check_options: bool = False,
    runtime_dir: Path | None = None,
    job_type: str | None = None,
) -> Assembly:
    """Prepare `model_path` as tuning does, apply the bank, save the tuned model at
        `output` (with the tuner's metadata; when the tuning run shipped OpenVINO's build,
    that build rebuilt as an IR beside it, `stem.xml`: `Assembly.output` says which);
    returns the assembly with its per-task report.
        Under a lossy policy the activations are calibrated as tuning does (`calibration`:
        the same sample folder the tuning run used; None: the same synthetic samples).

        With `check_options`, banked session options are applied only if one short A/B
        here still finds them faster (see the module doc; `runtime_dir` holds the device
        lock). `job_type` forms the tasks as a job of that type does (None: as the job
        that wrote the bank did; see the module doc). Raises ModelError/OptionError from preparation, AoedError when `output` cannot
        be written, DeviceError when the check cannot measure. Blocking.
    """
    from aoed.backends.runtimes import load_runtime

    runtime = load_runtime()
    registry = runtime.registry(plugins)
    device: DeviceFingerprint = reader.device
    with tempfile.TemporaryDirectory(prefix="aoe-compile-") as work:
        prep = prepare(model_path, work, dict(input_shapes or {}), keep_initializer_inputs)
        ranges = None
        calibrate: list[dict[str, Any]] = []  # tuning's calibration samples (lossy)
        if policy(precision).lossy:
            samples = load_samples(
                prep.inputs, calibration, integer_ranges(prep.model, prep.inputs)
            )
            calibrate = list(samples.calibrate)
            ranges = runtime.activation_ranges(prep.model, prep.ctx.tensors, samples.calibrate)
        consts = Constants(prep.model.graph, list(prep.model.opset_import))
        asm, tasks = from_bank(
            prep.model,
            prep.ctx,
            consts,
            _ReaderLookup(reader),
            device,
            registry,
            precision,
            ranges,
            job_type,
            prep.profile,
        )
        if asm.ship_input:
            model = load_model(Path(model_path))
        elif prep.profile is not None:
            model = _dynamic(runtime, prep, tasks, asm, ranges, precision, plugins, Path(work))
        else:
            model = apply_choices(
                prep.model, prep.ctx, consts, tasks, asm.choices, registry, ranges
            )
        if check_options and asm.session_options and not asm.ship_input:
            import numpy as np

            from aoed.engine.prep import make_inputs

            plain = Path(work) / "plain.onnx"
            save_model(model, plain)
            feeds = make_inputs(prep.inputs, int_high=integer_ranges(prep.model, prep.inputs))
            np.savez(Path(work) / "inputs.npz", **feeds)  # type: ignore[arg-type]  # (numpy's stub)
            kept, why = _options_hold(
                runtime,
                plain,
                asm.session_options,
                Path(work) / "inputs.npz",
                runtime_dir or Path(work) / "run",
            )
            asm.notes.append(why + ("" if kept else ": left out"))
            if not kept:
                asm.session_options = {}
        if asm.runtime is not None and not asm.ship_input:
            ir = _openvino(model_path, asm, Path(work), Path(output), calibrate)
            if ir is not None:
                asm.output = str(ir)
                asm.notes = [*prep.notes, *asm.notes]
                return asm
    set_metadata(model, tuned_metadata(asm.session_options, precision, device.digest))
    save_model(model, Path(output))
    asm.output = str(output)
    asm.notes = [*prep.notes, *asm.notes]
    return asm


def _openvino(
    model_path: str | os.PathLike[str],
    asm: Assembly,
    work: Path,
    output: Path,
    samples: list[dict[str, Any]],
) -> Path | None:
    """The bank's OpenVINO build of the input rebuilt (as the tuning run's compile worker
    built it: aoed.backends.runtimes.build_for) and written beside `output` as `stem.xml`,
    `.bin` and its compile config; None (and a note) when it cannot be, so the ONNX
    model is written instead."""
    import shutil

    import numpy as np

    from aoe.ovartifact import CompileConfig, config_path, write_config
    from aoed.backends.runtimes import build_for
    from aoed.engine.messages import RuntimeBuildRequest

    assert asm.runtime is not None
    calib = []
    for i, sample in enumerate(samples):
        calib.append(work / f"calibrate_{i}.npz")
        np.savez(calib[-1], **sample)
    reply = build_for(
        RuntimeBuildRequest(
            "openvino", Path(model_path), work / "openvino", (asm.runtime.variant,), tuple(calib)
        )
    )
    got = [a.model for a in reply.artifacts if a.model is not None and not a.error]
    if not got:
        why = "; ".join([*reply.notes, *(a.error for a in reply.artifacts)]) or "not built"
        asm.notes.append(f"OpenVINO's build not rebuilt ({why}): the ONNX model is written")
        return None
    xml = output.with_suffix(".xml")
    xml.parent.mkdir(parents=True, exist_ok=True)  # as save_model does for the ONNX model
    shutil.copyfile(got[0], xml)
    shutil.copyfile(got[0].with_suffix(".bin"), xml.with_suffix(".bin"))
    write_config(xml, CompileConfig("CPU", dict(asm.runtime.options)))
    asm.notes.append(
        f"OpenVINO IR written: {xml}, {xml.with_suffix('.bin').name}, {config_path(xml).name}"
    )
    return xml
