"""`aoed.embedded`: the one door into the tuning engine for a process that runs it itself,
without a daemon: the `aoe` command, and Python callers.

    from aoe.spec import JobSpec, JobType
    from aoed import embedded
    outcome = embedded.tune("model.onnx", JobSpec(precision="int8"), "out/")

    tune / tune_async   one job of any kind, JobSpec -> JobOutcome, through the
                        engine's one door (Engine.run_job), with progress events and
                        cancellation (a JobHandle, or the caller's cancel scope); a
                        GDAT job (job type gdat: a .pt2, or with `spec.entry` a .py
                        file) runs its worlds of rank processes
    tune_module         a torch.nn.Module of the caller's, exported with torch.export (its
                        dynamic shapes kept) and tuned for inference as a .pt2 is
    apply_bank          the tuned model a bank describes, from the bank alone (written at
                        `output`; returns the per-task report)
    verify_bank         re-measure a sample of a bank's entries on this device
    import_bank, prune_bank, record_trials, sync_bank
                        the bank writes the command line makes without a daemon

Everything here runs in the caller's process and takes the same machine-wide locks as a
daemon (the device lock, the bank's writer lock), so an embedded run and a daemon never
measure at once nor write one bank together. Nothing else in aoed is for the client
package (import-linter holds this). Errors are aoe.errors classes, one error at a time
(never an exception group).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aoe.bank import BankReader
from aoe.config import Config, load_config
from aoe.errors import AoedError, BankBusyError, JobCancelledError, first_error
from aoe.outcome import JobOutcome
from aoe.spec import JobSpec, JobType
from aoed.bankcompile import compile_model as apply_bank
from aoed.engine.job import JobHandle
from aoed.engine.messages import JobEvent

__all__ = [
    "JobEvent",
    "JobHandle",
    "VerifyReport",
    "apply_bank",
    "import_bank",
    "prune_bank",
    "record_trials",
    "sync_bank",
    "tune",
    "tune_async",
    "verify_bank",
]

Progress = Callable[[JobEvent], None]


@contextlib.contextmanager
def _one_error() -> Iterator[None]:
    try:
        yield
    except BaseExceptionGroup as group:
        raise first_error(group, KeyboardInterrupt, JobCancelledError, AoedError, OSError) from None


# --------------------------------------------------------------------------- tune


async def tune_async(
    model: str | os.PathLike[str],
    spec: JobSpec,
    output: str | os.PathLike[str],
    *,
    config: Config | None = None,
    progress: Progress | None = None,
    handle: JobHandle | None = None,
    keep_workspace: bool = False,
) -> JobOutcome:
    """Tune `model` as `spec` asks, on an engine of its own for `config` (default: the
    environment's and AOED_CONFIG's settings): outputs under `output` (aoe_workspace/,
    the result JSON). `progress` receives the job's events; `handle.cancel()` (or
    cancelling the caller's scope) stops the job at once, its child processes killed:
    JobCancelledError. Raises the aoe.errors class of a failure (OptionError, ModelError,
    BankError, DeviceError), one at a time."""
    from aoed.backends.runtimes import load_runtime
    from aoed.engine.engine import open_engine
    from aoed.engine.job import JobRun
    from aoed.engine.onnxjob import onnx_kinds
    from aoed.gdat import GdatKind
    from aoed.sandbox import UNCONFINED_ENV

    config = config if config is not None else load_config(None)
    output = Path(output)
    # The daemon's setting is [daemon] allow_unconfined_gdat; a run of one's own says it
    # in its environment.
    unconfined_ok = os.environ.get(UNCONFINED_ENV, "") == "1"
    gdat = GdatKind(allow_unconfined=unconfined_ok)
    run = JobRun(Path(model), output, spec, keep_workspace=keep_workspace)
    with _one_error():
        async with open_engine(
            config,
            load_runtime(),
            output / "aoe_workspace" / "logs",
            kinds={**onnx_kinds(allow_unconfined=unconfined_ok), JobType.GDAT: gdat},
        ) as engine:
            return await engine.run_job(run, progress or (lambda event: None), handle)


def tune(
    model: str | os.PathLike[str],
    spec: JobSpec,
    output: str | os.PathLike[str],
    *,
    config: Config | None = None,
    progress: Progress | None = None,
    keep_workspace: bool = False,
) -> JobOutcome:
    """`tune_async` in a trio run of its own (blocking); ^C cancels the job."""
    import trio

    with _one_error():
        return trio.run(
            lambda: tune_async(
                model, spec, output, config=config, progress=progress, keep_workspace=keep_workspace
            )
        )


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyReport:
    """What `verify_bank` found: the seed that chose the sample, how many of how many
    entries it measured, a verdict for each, and the trials to record in the bank."""

    seed: int
    sampled: int
    of: int
    verdicts: list[Any]
    trials: list[tuple[bytes, dict]]


def tune_module(
    module: Any,
    args: Sequence[Any],
    spec: JobSpec,
    output: str | os.PathLike[str],
    *,
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    name: str = "model",
    config: Config | None = None,
    progress: Progress | None = None,
) -> JobOutcome:
    """Tune the caller's `module` (a torch.nn.Module) for inference: exported here with
    `torch.export.export(module, args, kwargs, dynamic_shapes=...)`, saved as
    `output/{name}.pt2`, and tuned as a .pt2 is (exported to ONNX, each dynamic
    dimension kept: engine/onnxjob.py) with `spec` (an ONNX job type). ModelError when
    torch.export cannot take the module, naming it and why."""
    import torch

    from aoe.errors import ModelError

    if spec.job_type == JobType.GDAT:
        raise ModelError("tune_module tunes a module for inference: give an ONNX job type")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    try:
        program = torch.export.export(
            module.eval(), tuple(args), kwargs=kwargs, dynamic_shapes=dynamic_shapes
        )
    except Exception as exc:  # torch.export's errors share no class
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "no message"
        raise ModelError(
            f"{type(module).__name__}: torch.export could not export it ({type(exc).__name__}: "
            f"{first})"
        ) from None
    pt2 = out / f"{name}.pt2"
    torch.export.save(program, str(pt2))
    return tune(pt2, spec, out, config=config, progress=progress)


def verify_bank(
    reader: BankReader,
    *,
    config: Config,
    sample: int,
    seed: int,
    budget_s: float,
    op_type: str = "",
    layer: str = "all",
    models: Sequence[Path] = (),
    check_writable: Path | None = None,
) -> VerifyReport:
    """Re-measure `sample` entries (0: all) of `reader` (of its `layer`, or all), chosen
    with `seed`, on `config`'s device, `budget_s` seconds each. `check_writable`: the
    bank the trials will be recorded in, checked before anything is measured
    (BankBusyError naming the process that writes it)."""
    import trio

    from aoe.bankrecord import decode
    from aoed.backends.runtimes import load_runtime
    from aoed.bank.lock import busy_holder
    from aoed.engine.bankverify import sample_entries, verify_entries
    from aoed.engine.engine import open_engine

    entries = [
        decode(e.SerializeToString()) for _, e in reader.entries(None if layer == "all" else layer)
    ]
    chosen = sample_entries(entries, sample, seed, op_type)
    if chosen and check_writable is not None:
        holder = busy_holder(check_writable)
        if holder is not None:
            raise BankBusyError(
                f"bank {check_writable}: being written by {holder}; wait for it to finish, "
                "or pass --wait (or --no-record)",
                holder,
            )

    async def run():
        with tempfile.TemporaryDirectory(prefix="aoe-verify-logs-") as logs:
            async with open_engine(
                config.replace(parallel=1), load_runtime(), Path(logs)
            ) as engine:
                return await verify_entries(engine, chosen, budget_s, models)

    with _one_error():
        verdicts, trials = trio.run(run)
    return VerifyReport(seed, len(chosen), len(entries), verdicts, trials)


# --------------------------------------------------------------------------- bank writes


@contextlib.contextmanager
def _store(path: Path, wait: bool, on_wait: Callable[[str], None] | None) -> Iterator[Any]:
    from aoed.bank.store import BankStore

    store = BankStore(path, wait=wait, on_wait=on_wait)
    try:
        yield store
    finally:
        store.close()


def import_bank(
    path: Path,
    lines: Iterable[str],
    policy: str = "keep-faster",
    *,
    wait: bool = False,
    on_wait: Callable[[str], None] | None = None,
    plugins: Sequence[str] = (),
):
    """Merge exchange lines (`aoe bank export`'s JSON Lines) into the bank at `path`,
    each record checked against what this tuner (the built-in strategies and `plugins`)
    writes; returns the report (counts per kind, refusals). BankBusyError while another
    process writes it, unless `wait`; OptionError for a broken plugin."""
    from aoed.bank.exchange import import_lines
    from aoed.vocabulary import tuner_vocabulary

    vocabulary = tuner_vocabulary(plugins=plugins)
    with _store(path, wait, on_wait) as store:
        return import_lines(store, lines, policy, vocabulary)


def prune_bank(
    path: Path,
    dry_run: bool = False,
    *,
    wait: bool = False,
    on_wait: Callable[[str], None] | None = None,
):
    """Drop the measurement history of the bank at `path`, keeping its winners (only
    count them with `dry_run`); returns the counts and sizes."""
    with _store(path, wait, on_wait) as store:
        return store.prune(dry_run=dry_run)


def record_trials(
    path: Path,
    trials: list[tuple[bytes, dict]],
    *,
    wait: bool = False,
    on_wait: Callable[[str], None] | None = None,
) -> None:
    """Add `trials` (as `verify_bank` returns them) to the history of the bank at `path`."""
    with _store(path, wait, on_wait) as store:
        store.commit(trials=trials)


def sync_bank(
    path: Path,
    peer: str,
    connect: Callable[[str], Any],
    *,
    wait: bool = False,
    on_wait: Callable[[str], None] | None = None,
    plugins: Sequence[str] = (),
):
    """One follow pass: apply to the bank at `path` what the bank of the daemon at `peer`
    (reached through `connect`, which returns an aoe.Client) wrote since this bank last
    took its writes, each record checked and kept as an import keeps it (with `plugins`'
    strategies); returns the report."""
    import trio

    from aoed.bank.follow import Follower
    from aoed.bank.writer import BankWriter
    from aoed.vocabulary import tuner_vocabulary

    vocabulary = tuner_vocabulary(plugins=plugins)

    async def run():
        writer = BankWriter(path, layers=[], wait=wait, on_wait=on_wait)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(writer.run)
                report = await Follower(writer, peer, connect, vocabulary).sync()
                nursery.cancel_scope.cancel()
            return report
        finally:
            writer.close()

    with _one_error():
        return trio.run(run)
