"""Delivery: when the job of a claimed file ends, its outputs land in the folder's outbox
(`m_tuned.onnx`, or a GDAT job's `m_ddp_config.json`, with `m_result.json` and the
report), or the model in its failed folder with the reason beside it, and the claim is
released. One task delivers, one claim at a time; a claim row is dropped only after its
delivery, so a crash during delivery delivers again (under a `_2` name) rather than
never."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import trio

from aoe.errors import AoedError
from aoe.ovartifact import config_path
from aoe.spec import JobType
from aoed import safefs
from aoed.config import Inbox
from aoed.jobs.manager import JobManager
from aoed.jobs.store import SUCCEEDED, Claim, JobRow
from aoed.logs import printable
from aoed.watch._claimdir import claimed_entry, remove
from aoed.watch.folders import ensure_folder
from aoed.watch.report import report_text

__all__ = ["Delivery", "fail_into", "write_failure", "write_outputs"]

# one logger for all of the watcher's parts: its lines name the watcher, not the part
log = logging.getLogger("aoed.watch")

#: rows of finished jobs waiting for the delivery task (see `queue` for why bounded)
_DELIVERY_BUFFER = 1024


class Delivery:
    """Delivers the claims of jobs that ended, one at a time, in the task `run`. The
    watcher tells it which inbox a claim came from (`inbox_of`, by the inbox's path) and
    takes a file that waited for a claim of its name to be released (`retake`, the
    dropped file's path and the inbox's)."""

    def __init__(
        self,
        jobs: JobManager,
        claims_dir: Path,
        inbox_of: Callable[[str], Inbox],
        retake: Callable[[Path, str], None],
    ):
        self._jobs = jobs
        self._claims_dir = claims_dir
        self._inbox = inbox_of
        self._retake = retake
        self._final_send, self._final_recv = trio.open_memory_channel[JobRow](_DELIVERY_BUFFER)

    def on_final(self, row: JobRow) -> None:
        """The job manager's final-state callback (sync, in the trio thread)."""
        if any(c.job_id == row.id for c in self._jobs.claims("claimed")):
            self.queue(row)

    def queue(self, row: JobRow) -> None:
        """Queue the ended job `row` for the delivering task (sync; never blocks)."""
        # Bounded so that a stuck delivery (a full or hung outbox disk) cannot grow memory
        # without limit; a row that does not fit is not lost: its claim stays 'claimed'
        # and the periodic sweep queues it again.
        try:
            self._final_send.send_nowait(row)
        except trio.WouldBlock:
            log.warning(
                "inbox: job %s: the delivery queue is full; delivering at the next sweep", row.id
            )

    async def run(self) -> None:
        """The one task that delivers: one claim at a time, so that a job queued twice
        (callback and sweep) finds its claims gone the second time."""
        async for row in self._final_recv:
            for claim in self._jobs.claims("claimed"):
                if claim.job_id != row.id:
                    continue
                try:
                    if row.state == SUCCEEDED:
                        await self._success(claim, row)
                    else:
                        await self.failure(claim, row.id, row.state, row.error)
                except (AoedError, OSError) as exc:
                    log.error(
                        "inbox %s: delivering job %s failed (%s); trying again at the next sweep",
                        claim.inbox,
                        row.id,
                        exc,
                    )
                except Exception:
                    log.exception(
                        "inbox %s: delivering job %s: internal error", claim.inbox, row.id
                    )

    async def _success(self, claim: Claim, row: JobRow) -> None:
        """Write the succeeded job's outputs and report into the claim's outbox, then
        release the claim."""
        inbox = self._inbox(claim.inbox)
        names = await trio.to_thread.run_sync(write_outputs, inbox, Path(claim.src).name, row)
        log.info(
            "inbox %s: job %s delivered to %s (%s)",
            claim.inbox,
            row.id,
            inbox.outbox,
            ", ".join(names),
        )
        await self._release(claim)

    async def failure(self, claim: Claim, job_id: str, state: str, error: str) -> None:
        """Move the claimed model into the claim's failed folder with `error` beside it,
        then release the claim; `job_id` is empty for a refused submission."""
        inbox = self._inbox(claim.inbox)
        # name the file as dropped, not the claimed copy
        error = error.replace(claim.dst, claim.src)
        # One line per field whatever the name or the message hold (newlines are escaped).
        text = (
            f"model: {printable(Path(claim.src).name)}\njob:   {job_id or '(none: the submission was refused)'}\n"
            f"state: {state}\nerror: {printable(error) or '(no message)'}\n"
        )
        dst, name = Path(claim.dst), Path(claim.src).name
        where = await trio.to_thread.run_sync(
            lambda: fail_into(inbox, claimed_entry(dst), name, text)
        )
        log.warning(
            "inbox %s: %s %s: %s (moved to %s)",
            claim.inbox,
            Path(claim.src).name,
            state,
            error,
            where,
        )
        await self._release(claim)

    async def _release(self, claim: Claim) -> None:
        """Forget a delivered claim; take a newer file of the same name that waited."""
        self._jobs.claim_drop(claim.src)
        dst = Path(claim.dst)
        if dst.parent.parent == self._claims_dir:
            await trio.to_thread.run_sync(remove, dst.parent)
        src = Path(claim.src)
        if await trio.Path(src).exists():
            self._retake(src, claim.inbox)


# ------------------------------------------------------------------ file system (worker threads)


def _free_base(dir_fd: int, stem: str, suffixes: tuple[str, ...]) -> str:
    """`stem` (shortened by safefs.fit so that it fits NAME_MAX with any of `suffixes` and
    a `_N`), else `stem_2`, `stem_3`...: the first for which nothing, not even a link,
    has any `base+suffix` name in `dir_fd`."""
    stem = safefs.fit(stem, max(len(s.encode()) for s in suffixes) + _COUNTER_ROOM)
    n = 1
    while True:
        base = stem if n == 1 else f"{stem}_{n}"
        if not any(safefs.taken(f"{base}{s}", dir_fd=dir_fd) for s in suffixes):
            return base
        n += 1


_OUT_SUFFIXES = ("_tuned.onnx", "_result.json", "_report.txt")
#: a job that shipped OpenVINO's build: the IR, its weights and its compile config
#: (aoe.ovartifact), which `aoe.session` opens together
_IR_OUT_SUFFIXES = (
    "_tuned.xml",
    "_result.json",
    "_report.txt",
    "_tuned.bin",
    "_tuned.ovconfig.json",
)
#: a GDAT job's: its "tuned model" is the DDP configuration a training script applies
_GDAT_OUT_SUFFIXES = ("_ddp_config.json", "_result.json", "_report.txt")
#: bytes a shortened stem leaves for the `_N` of a taken name
_COUNTER_ROOM = len("_99999")


def write_outputs(inbox: Inbox, name: str, row: JobRow) -> list[str]:
    """Copy a succeeded job's tuned model and result JSON into `inbox`'s outbox (made
    again when missing) and write its report; returns the names written. An output the
    job no longer has (or that is now a link) is left out, and the report says so."""
    outbox = inbox.outbox
    ensure_folder(outbox, inbox)
    outcome = row.outcome
    ir = outcome is not None and outcome.runtime == "openvino"
    suffixes: tuple[str, ...] = (
        _GDAT_OUT_SUFFIXES
        if outcome is not None and outcome.job_type == JobType.GDAT
        else _IR_OUT_SUFFIXES
        if ir
        else _OUT_SUFFIXES
    )
    with safefs.opened_dir(outbox) as out:
        base = _free_base(out, Path(name).stem, suffixes)
        tuned, result_json, report = (f"{base}{s}" for s in suffixes[:3])
        # (what, its file, the name it gets)
        sources = [
            ("tuned_model", outcome.tuned_model if outcome is not None else "", tuned),
            ("result_json", outcome.result_json if outcome is not None else "", result_json),
        ]
        if ir:  # the IR's weights and compile config, named after it as aoe.session expects
            assert outcome is not None
            xml = Path(outcome.tuned_model)
            sources += [
                ("weights", str(xml.with_suffix(".bin")), f"{base}{suffixes[3]}"),
                ("compile config", str(config_path(xml)), f"{base}{suffixes[4]}"),
            ]
        written, missing = [], []
        for key, src, dst in sources:
            try:
                fd = safefs.open_file(src) if src else None
            except (FileNotFoundError, safefs.LinkRefusedError):
                fd = None
            if fd is None:
                missing.append(f"{key}: {printable(src) if src else 'none'} is not available")
                continue
            with os.fdopen(fd, "rb") as f:
                safefs.write_file(
                    dst, functools.partial(shutil.copyfileobj, f, length=1 << 20), dir_fd=out
                )
            written.append(dst)
        # The report last: once it is there, the delivery is whole (docs/daemon.md).
        text = report_text(name, row, written, missing)
        safefs.write_file(report, lambda f: f.write(text.encode()), dir_fd=out)
    return [*written, report]


def fail_into(inbox: Inbox, model: Path, name: str, text: str) -> Path:
    """`write_failure` into `inbox`'s failed folder, made again when missing."""
    ensure_folder(inbox.failed, inbox)
    return write_failure(inbox.failed, model, name, text)


def write_failure(failed: Path, model: Path, name: str, text: str) -> Path:
    """Move `model` (a claimed copy, or a file still in the inbox) into `failed` under
    `name` (shortened to fit, or `stem_2`...), with `<name>.error.txt` beside it; returns
    where it went. A model already gone leaves only the error file.

    The error file is written first: on a full disk that write is what fails, and then
    nothing has moved, so the delivery is tried again whole (a model in failed/ with no
    reason beside it would be a delivery no one can read)."""
    stem, suffix = Path(name).stem, Path(name).suffix
    with safefs.opened_dir(failed) as dst_fd:
        base = _free_base(dst_fd, stem, (suffix, f"{suffix}.error.txt"))
        dst = f"{base}{suffix}"
        safefs.write_file(f"{dst}.error.txt", lambda f: f.write(text.encode()), dir_fd=dst_fd)
        try:
            try:
                src_fd = safefs.open_dir(model.parent)
            except FileNotFoundError:
                src_fd = -1
            try:
                if src_fd >= 0 and safefs.taken(model.name, dir_fd=src_fd):
                    try:
                        safefs.move(model.name, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                    except safefs.LinkedError:
                        # only this name goes: the error says why
                        os.unlink(model.name, dir_fd=src_fd)
            finally:
                if src_fd >= 0:
                    os.close(src_fd)
        except BaseException:
            with contextlib.suppress(OSError):  # the model stays where it was: so does its reason
                os.unlink(f"{dst}.error.txt", dir_fd=dst_fd)
            raise
    return failed / dst
