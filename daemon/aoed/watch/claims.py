"""Exactly-once claims: a file is claimed by renaming it into the state dir's `claimed/`,
recorded in the job store before the rename (`claiming`) and after its job is recorded
(`claimed`). At start, claims a crash interrupted are settled: renamed but not submitted
-> submitted; never renamed -> forgotten (the scan takes the file again); submitted ->
delivered when the job ends (or at once if it already has). The claim's files on disk
are `_claimdir`'s."""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import trio

from aoe.errors import (
    AoedError,
    DaemonUnavailableError,
    NotFoundError,
    ResourceExhaustedError,
)
from aoe.spec import JobSpec
from aoed import space
from aoed.config import Inbox
from aoed.jobs.manager import JobManager, Submission
from aoed.jobs.store import FAILED, Claim, JobRow
from aoed.watch._claimdir import (
    MOVED,
    check_claimed,
    move_in,
    privatize,
    remove,
    same_file_data,
)
from aoed.watch.delivery import Delivery
from aoed.watch.options import folder_spec

__all__ = ["Claims"]

# one logger for all of the watcher's parts: its lines name the watcher, not the part
log = logging.getLogger("aoed.watch")


class Claims:
    """The watcher's claims: claims a complete file, submits it and records its job,
    settles the claims a crash left, and hands finished jobs' claims to the delivery.
    `in_flight` holds the sources of the claims a task of this run is claiming or
    submitting (`settle` leaves those alone)."""

    #: wait before submitting again when the queue is full
    retry_s = 5.0

    def __init__(self, jobs: JobManager, claims_dir: Path, delivery: Delivery):
        self._jobs = jobs
        self._claims_dir = claims_dir
        self._delivery = delivery
        self.in_flight: set[str] = set()

    async def claim(self, path: Path, inbox: Inbox, min_free_bytes: int) -> Claim | None:
        """Move `path` into the claims dir, recorded before and after; None when another
        file of that name is still claimed (it is taken after that one's delivery) or the
        file vanished. Raises DiskFullError when the daemon's copy of it (`privatize`)
        would leave less than [limits] min_free_mb in the state dir, OSError or StoreError
        (the claim is then undone)."""
        if any(c.src == str(path) for c in self._jobs.claims()):
            return None
        try:
            size = (await trio.to_thread.run_sync(os.lstat, path)).st_size
        except FileNotFoundError:
            return None
        what = f"claiming {path.name} ({space.size_text(size)})"
        space.check_floor(self._claims_dir, min_free_bytes, what, need=size)
        dst = self._claims_dir / uuid.uuid4().hex / path.name
        await trio.to_thread.run_sync(lambda: dst.parent.mkdir(parents=True))
        try:
            self._jobs.claim_begin(str(path), str(dst), str(inbox.path))
        except AoedError:
            await trio.to_thread.run_sync(dst.parent.rmdir)
            raise
        try:
            await trio.to_thread.run_sync(move_in, path, dst)
        except OSError as exc:
            self._jobs.claim_drop(str(path))
            await trio.to_thread.run_sync(shutil.rmtree, dst.parent, True)
            if isinstance(exc, FileNotFoundError) and not await trio.Path(path).exists():
                return None
            raise
        log.info("inbox %s: claimed %s", inbox.path, path.name)
        return Claim(str(path), str(dst), str(inbox.path), "claiming", "", time.time())

    async def submit(self, claim: Claim) -> None:
        """Submit a claimed file and record its job; a refused submission sends the file
        to the failed folder, except a full queue (or a daemon shutting down), where it
        stays claimed and is submitted again later."""
        model = Path(claim.dst)
        while True:
            try:
                await self._privatize(claim)
                check_claimed(model)
                spec = folder_spec(Path(claim.inbox))
                row, joined = await self._jobs.submit(
                    Submission(model=model, spec=spec, source=f"inbox:{claim.inbox}", private=True)
                )
            except AoedError as exc:
                if isinstance(exc, ResourceExhaustedError | DaemonUnavailableError):
                    log.info("inbox %s: %s waits (%s)", claim.inbox, model.name, exc)
                    await trio.sleep(self.retry_s)
                    continue
                error = str(exc)
            except OSError as exc:  # the claimed copy cannot be read
                error = f"{exc.filename or model}: {exc.strerror or exc}"
            else:
                break
            # Refused. Should this delivery fail, the claim stays 'claiming' and the sweep
            # submits (and so delivers) it again.
            await self._delivery.failure(claim, "", "rejected", error)
            return
        self._jobs.claim_done(claim.src, row.id)
        log.info(
            "inbox %s: %s is job %s%s",
            claim.inbox,
            model.name,
            row.id,
            " (joined)" if joined else "",
        )
        if row.final:  # joined a job that has ended since: on_final will not come again
            self._delivery.queue(row)

    async def _privatize(self, claim: Claim) -> None:
        """`privatize` the claim's file; a full disk is DiskFullError (the claim waits
        for room, as for a full queue)."""
        dst = Path(claim.dst)
        try:
            await trio.to_thread.run_sync(privatize, dst.parent, dst.name)
        except OSError as exc:
            if exc.errno in space.FULL_ERRNOS:
                raise space.disk_full(self._claims_dir, f"claiming {dst.name}") from None
            raise

    async def reconcile(self, nursery: trio.Nursery) -> None:
        """At start: settle the claims a previous run left, and remove claimed copies no
        claim refers to (a crash between creating the folder and recording the claim, or
        between a delivery and the removal of the copy)."""
        self.settle(nursery)
        referenced = {Path(c.dst).parent for c in self._jobs.claims()}
        try:
            strays = await trio.to_thread.run_sync(lambda: list(self._claims_dir.iterdir()))
        except FileNotFoundError:  # (not made: see run)
            strays = []
        for d in strays:
            if d not in referenced:
                await trio.to_thread.run_sync(remove, d)
        self.queue_finished()

    def settle(self, nursery: trio.Nursery) -> None:
        """'claiming' claims no task of this run is working on: submit those whose file
        was moved, forget those whose file never was (the scan takes it again)."""
        for c in self._jobs.claims("claiming"):
            if c.src in self.in_flight:
                continue
            src, dst = Path(c.src), Path(c.dst)
            if os.path.lexists(dst) or os.path.lexists(dst.parent / MOVED):
                log.info(
                    "inbox %s: %s was claimed but not submitted; submitting it", c.inbox, dst.name
                )
                self.in_flight.add(c.src)
                nursery.start_soon(
                    self._submit_reconciled, c, src.exists() and same_file_data(src, dst)
                )
            else:
                try:
                    self._jobs.claim_drop(c.src)
                except AoedError as exc:  # (a full disk: the next sweep drops it)
                    log.warning("inbox %s: %s", c.inbox, exc)

    async def _submit_reconciled(self, claim: Claim, unlink_src: bool) -> None:
        try:
            if unlink_src:  # a cross-device copy that ended before its unlink
                await trio.to_thread.run_sync(lambda: Path(claim.src).unlink(missing_ok=True))
            await self.submit(claim)
        except (AoedError, OSError) as exc:
            log.error(
                "inbox %s: %s: %s (trying again at the next sweep)", claim.inbox, claim.dst, exc
            )
        finally:
            self.in_flight.discard(claim.src)

    def queue_finished(self) -> None:
        """Hand every claimed file whose job has ended to the delivery."""
        for c in self._jobs.claims("claimed"):
            try:
                row = self._jobs.get(c.job_id)
            except NotFoundError:
                row = JobRow(
                    id=c.job_id,
                    state=FAILED,
                    model_path=c.dst,
                    model_name=Path(c.dst).name,
                    model_sha256="",
                    dedup_key="",
                    spec=JobSpec(),
                    output_dir="",
                    error="the job's record is gone (removed after its retention?)",
                )
            except AoedError as exc:
                log.error("inbox %s: job %s: %s", c.inbox, c.job_id, exc)
                continue
            if row.final:
                self._delivery.queue(row)
