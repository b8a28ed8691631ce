"""The ONNX job kind (opat, sgat, sgat+opat): a run on the engine's agents, from its
`JobRun` to its outcome, through the pipeline's stages (pipeline.py).

`OnnxKind.run` picks the job's home device (`DeviceSet.home`: OptionError when none fits
the job), gives the job its own id, workspace, log and ledger, so jobs sharing the
engine never collide, and makes cancellation reach the hardware. It resumes from the
decisions an interrupted run of the job recorded (resume.py), in the workspace that run
left.

A torch.export program (.pt2) is tuned for inference as the ONNX model torch.onnx's
exporter makes of it (world.py, `export_model`: in a confined process that joins no
world), written in the workspace's `converted/`; every dimension the program left
dynamic stays dynamic. The job then runs on that model, and its messages name the .pt2.
A TensorFlow SavedModel (a directory, or a .tar archive of one: aoe.savedmodel) is tuned
the same way, as the ONNX model tf2onnx converts its serving signature to (tfconvert.py,
in a confined process too); each dimension the signature leaves unknown stays dynamic,
and the job's notes name the signature and the opset.
"""

from __future__ import annotations

import dataclasses
import logging

import trio

from aoe.device import Device
from aoe.errors import AoedError, JobCancelledError
from aoe.outcome import JobOutcome
from aoe.savedmodel import is_saved_model, is_saved_model_archive
from aoe.shapes import ShapeProfile
from aoe.spec import JobSpec, JobType
from aoed.engine.context import JobContext
from aoed.engine.device import DeviceAgent
from aoed.engine.devices import DeviceSet
from aoed.engine.job import JobHandle, JobRun
from aoed.engine.kind import Agents, Emit
from aoed.engine.ledger import JobLedger, new_job_id
from aoed.engine.pipeline import run_stages
from aoed.engine.policy import PrecisionPolicy, policy
from aoed.engine.tfconvert import convert_saved_model
from aoed.engine.workspace import Workspace
from aoed.engine.world import export_model
from aoed.logs import job_log

__all__ = ["ONNX_JOB_TYPES", "OnnxKind", "onnx_kinds"]

log = logging.getLogger(__name__)

#: The job types this kind runs: those that tune an ONNX model.
ONNX_JOB_TYPES = (JobType.OPAT, JobType.SGAT, JobType.SGAT_OPAT)


class OnnxKind:
    """The ONNX pipeline behind `Engine.run_job` (kind.py). `allow_unconfined`: a .pt2
    may be loaded (to export it) where the kernel cannot confine the process that loads
    it (`[daemon] allow_unconfined_gdat`, as for GDAT's); else such a job fails saying
    why."""

    def __init__(self, *, allow_unconfined: bool = False) -> None:
        self.allow_unconfined = allow_unconfined

    async def run(self, engine: Agents, run: JobRun, emit: Emit, handle: JobHandle) -> JobOutcome:
        name = run.spec.device or engine.device.device.name  # (checked where it was built)
        spec = run.spec.on(name)
        devices = engine.device_set
        # OptionError when no device fits the job
        with devices.home(Device.parse(name)) as home:
            job_id = run.job_id or new_job_id()
            prec = policy(spec.precision, spec.min_cosine, spec.max_rel_error)
            # The daemon's job id is the same in each run of a job; an embedded run's is new,
            # so there the model alone says which interrupted workspace is this job's.
            owner = {"model": str(run.model.absolute()), "job": run.job_id}
            ws = await trio.to_thread.run_sync(Workspace.create, run.output, run.model.stem, owner)
            outcome = "interrupted"  # ^C, or anything else that is not the job's own end
            try:
                notes = []
                if run.model.suffix == ".pt2":
                    run, said = await self._exported(run, ws)
                    spec = run.spec.on(name)
                    notes.append(said)
                elif is_saved_model(run.model) or is_saved_model_archive(run.model):
                    run, said = await self._converted(run, ws)
                    notes.append(said)
                result = await self._run(
                    engine, home, devices, spec, run, job_id, prec, ws, emit, handle, notes
                )
                outcome = "done"
                return result
            except JobCancelledError:
                outcome = "interrupted" if handle.resumable else "done"
                raise
            except Exception:
                outcome = "failed"
                raise
            finally:
                # a few file operations: not worth a thread (nor a cancellable await)
                ws.release(outcome)

    async def _exported(self, run: JobRun, ws: Workspace) -> tuple[JobRun, str]:
        """`run` on the ONNX model exported from its .pt2, and what the notes say of it."""
        folder = ws.root / "converted"
        await trio.Path(folder).mkdir(exist_ok=True)
        out = folder / f"{run.model.stem}.onnx"
        source = {"kind": "pt2", "path": str(run.model.resolve()), "shown": run.shown_model}
        if run.model_file is not None:
            source["expect"] = "{}:{}".format(*run.model_file)
        got = await export_model(source, out, folder, unconfined_ok=self.allow_unconfined)
        dynamic = sorted(
            {str(d) for dims in got.inputs.values() for d in dims if isinstance(d, str)}
        )
        said = f"{run.model.name}: tuned as the ONNX model torch.onnx exported from it" + (
            f" (dynamic dimensions kept: {', '.join(dynamic)})" if dynamic else ""
        )
        spec = run.spec
        declared = _declared_profile(got.inputs, got.ranges, spec)
        if declared:
            said += "; measured over the ranges the program declares: " + "; ".join(
                f"{k}:{v}" for k, v in declared.items()
            )
            spec = spec.replace(
                shape_profile=ShapeProfile(
                    {**spec.shape_profile.dims, **declared}, spec.shape_profile.gears
                )
            )
        log.info("%s", said)
        # The file checked at submission was the .pt2; the export is the job's own.
        exported = dataclasses.replace(
            run, model=out, shown=run.shown_model, model_file=None, spec=spec
        )
        return exported, said

    async def _converted(self, run: JobRun, ws: Workspace) -> tuple[JobRun, str]:
        """`run` on the ONNX model tf2onnx converted its SavedModel to, and what the notes
        say of it."""
        folder = ws.root / "converted"
        await trio.Path(folder).mkdir(exist_ok=True)
        archive = is_saved_model_archive(run.model)
        out = folder / f"{run.model.stem if archive else run.model.name}.onnx"
        got = await convert_saved_model(
            run.model.resolve(),
            run.model.name,
            out,
            folder,
            expect=run.model_file,
            unconfined_ok=self.allow_unconfined,
        )
        # tf2onnx names an unknown dimension by a counter (unk__6): say where each is.
        where: dict[str, str] = {}
        for input_name, dims in got.inputs.items():
            for axis, d in enumerate(dims):
                if isinstance(d, str):
                    where.setdefault(d, f"{input_name} axis {axis}")
        said = (
            f"{run.model.name}: tuned as the ONNX model tf2onnx {got.tf2onnx} converted its "
            f"signature {got.signature!r} to (opset {got.opset}, TensorFlow {got.tensorflow})"
            + (
                "; dynamic dimensions kept: "
                + ", ".join(f"{d} ({where[d]})" for d in sorted(where))
                if where
                else ""
            )
        )
        log.info("%s (%s)", said, got.sandbox)
        # The SavedModel checked at submission is the input; the conversion is the job's own.
        converted = dataclasses.replace(run, model=out, shown=run.shown_model, model_file=None)
        return converted, said

    async def _run(
        self,
        engine: Agents,
        home: DeviceAgent,
        devices: DeviceSet,
        spec: JobSpec,
        run: JobRun,
        job_id: str,
        prec: PrecisionPolicy,
        ws: Workspace,
        emit: Emit,
        handle: JobHandle,
        notes: list[str],
    ) -> JobOutcome:
        ledger = JobLedger(job_id, emit, weight=run.weight)
        ctx = JobContext(
            spec=spec,
            run=run,
            job_id=job_id,
            pool=engine.pool,
            device=home,
            bank=engine.bank,
            registry=engine.registry,
            policy=prec,
            fingerprint=home.device.fingerprint(),
            ledger=ledger,
            workspace=ws,
            config=engine.config,
            attempt=max(1, run.attempt),
            devices=devices,
            notes=notes,
        )
        failed = True
        with job_log(ws.log_path, job_id):
            log.info(
                "job %s: %s (%s, %s, device %s, home %s)",
                job_id,
                run.model,
                spec.job_type,
                spec.precision,
                spec.device,
                home.device,
            )
            if ws.resumed:
                log.info("job %s: continues in the workspace an interrupted run of it left", job_id)
            try:
                with trio.CancelScope() as scope:
                    handle.attach(scope)
                    result = await run_stages(ctx)
                    failed = False
                    log.info(
                        "job %s: done in %.1f s, %s", job_id, ledger.elapsed_s, result.verified
                    )
                    return result
                failed = False  # cancelled: nothing to debug, the scratch goes
            except Exception as exc:
                # A workspace removed under the job fails whatever ran there: say that, not
                # what it looked like to the stage that noticed (a model or file error).
                if gone := await trio.to_thread.run_sync(ws.gone):
                    log.info("job %s: failed: %s", job_id, gone)
                    raise AoedError(gone) from None
                if isinstance(exc, OSError):
                    log.info("job %s: failed: %s", job_id, exc)
                    raise AoedError(
                        f"{exc.filename or run.output}: {exc.strerror or exc}"
                    ) from None
                if isinstance(exc, AoedError):
                    log.info("job %s: failed: %s", job_id, exc)
                raise
            finally:
                if not failed and not run.keep_workspace:
                    ws.clean()
                elif failed and ws.started and ws.root.is_dir():
                    log.info("job %s: workspace kept for inspection at %s", job_id, ws.root)
            reason = f": {handle.reason}" if handle.reason else ""
            log.info("job %s: cancelled%s", job_id, reason)
        raise JobCancelledError(f"job {job_id} cancelled{reason}")


def _declared_profile(
    inputs: dict[str, list[int | str]], ranges: dict[str, tuple[int, int]], spec: JobSpec
) -> dict[str, str]:
    """The profile dims (`lo~hi` per dynamic dimension, aoe.shapes) of each exported input
    whose every dynamic dimension has a range the program declared and that the user gave
    no shape for: what a job measures over instead of the derived defaults."""
    out = {}
    for name, dims in inputs.items():
        if name in spec.input_shapes or name in spec.shape_profile.dims:
            continue
        if all(isinstance(d, int) for d in dims):
            continue
        if not all(isinstance(d, int) or d in ranges for d in dims):
            continue
        out[name] = ",".join(
            str(d) if isinstance(d, int) else "{}~{}".format(*ranges[d]) for d in dims
        )
    return out


def onnx_kinds(*, allow_unconfined: bool) -> dict[JobType, OnnxKind]:
    """The ONNX job types' kind for an engine whose host allows (or not) loading a .pt2
    unconfined (OnnxKind), as `open_engine`'s `kinds` take it."""
    kind = OnnxKind(allow_unconfined=allow_unconfined)
    return dict.fromkeys(ONNX_JOB_TYPES, kind)
