"""The inbox agent: models dropped into watched folders are tuned once each, and their
outputs land in the folder's outbox (or the model in its failed folder, with the reason).

    inbox/m.onnx --settled--> claimed/<id>/.moved --copied--> claimed/<id>/m.onnx --submit--> job

    job --final-------------------> outbox/m_tuned.onnx
                                    outbox/m_result.json
                                    outbox/m_report.txt
        (failed, cancelled) ------> failed/m.onnx
                                    failed/m.onnx.error.txt

When a file is complete: names starting with `.` or ending in `.part` or `~` are
ignored, so a writer that copies to such a name and renames it is taken at once on the
rename. Any other `*.onnx` (or, for GDAT, `*.pt2`) directly in the folder is taken once
its size and mtime have stayed the same for the inbox's `stable_s`. A `.pt2` is a GDAT
job's (its folder's aoed.toml says job_type = "gdat"); its outbox gets
`m_ddp_config.json` where an ONNX model's gets `m_tuned.onnx`.

Exactly once: a file is claimed by renaming it into the state dir's `claimed/`, recorded
in the job store before the rename (`claiming`) and after its job is recorded
(`claimed`). At start, claims a crash interrupted are settled: renamed but not submitted
-> submitted; never renamed -> forgotten (the scan takes the file again); submitted ->
delivered when the job ends (or at once if it already has). A claim row is dropped only
after its delivery, so a crash during delivery delivers again (under a `_2` name) rather
than never.

What is hashed is what runs: whoever dropped the file may still hold it open for
writing, and a write through that descriptor reaches the renamed file wherever it is.
So the claim copies the moved file (`.moved`) to the daemon's own file (`m.onnx`, which
only the daemon can write) before anything reads it as a model, and the job (its hash,
its deduplication, what it tunes) uses only that copy (`_privatize`). From another file
system the move is a copy already, straight to the daemon's own file.

Missing folders: an inbox, outbox or failed folder that is missing (at start, or removed
while the daemon runs) is made again with the inbox's `mode` and `group` (deploy/'s
2770: group-writable and setgid) and logged; one that cannot be made (a full disk, no
right to its parent) is logged naming it and why, and tried again every `remake_s`.

Options come from an optional `aoed.toml` in the inbox folder, read for each model:
precision, job_type (default sgat+opat, as `aoe tune`), input_shapes (a table name =
[dims]), priority, budget_s, repeat_tune, min_cosine, max_rel_error; for GDAT
world_size, backend, gradient_precision.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import math
import os
import shutil
import stat
import time
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import trio
import watchfiles

from aoe import figures
from aoe.errors import (
    AoedError,
    DaemonUnavailableError,
    DiskFullError,
    ModelError,
    NotFoundError,
    OptionError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from aoe.outcome import GdatDetails, OnnxDetails, ddp_text
from aoe.spec import JobSpec, JobType
from aoed import safefs, space
from aoed.config import DaemonConfig, Inbox
from aoed.jobs.manager import JobManager, Submission
from aoed.jobs.store import FAILED, SUCCEEDED, Claim, JobRow
from aoed.logs import printable

__all__ = ["OPTIONS_FILE", "Watcher", "folder_spec"]

log = logging.getLogger(__name__)

#: the folder's options file (never a model)
OPTIONS_FILE = "aoed.toml"
#: rows of finished jobs waiting for the delivery task (see `_on_final` for why bounded)
_DELIVERY_BUFFER = 1024
#: how long the start waits to see a folder's watch working before it says ready anyway
_PROBE_S = 2.0
_PROBE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: a file that fails to be claimed this many times goes to the failed folder
CLAIM_TRIES = 3
#: bytes an options file may hold
_OPTIONS_MAX = 64 << 10
#: in a claim's folder, the entry renamed out of the inbox until the daemon's own copy of
#: it is made (`_privatize`); inbox names starting with `.` are never taken, so no model
#: has this name
_MOVED = ".moved"


def _ignored(name: str) -> bool:
    """Temporary names of writers that copy and rename (and hidden files)."""
    return name.startswith(".") or name.endswith((".part", "~"))


def _candidate(name: str) -> bool:
    return not _ignored(name) and name.lower().endswith((".onnx", ".pt2"))


@dataclass(eq=False)
class _Folder:
    """One watched inbox. `stop` ends the current watch (reload, or the folder was
    replaced); the watch loop starts a new one unless `removed`."""

    inbox: Inbox
    stop: trio.Event = field(default_factory=trio.Event)
    ready: trio.Event = field(default_factory=trio.Event)
    removed: bool = False
    ino: int = -1
    probe: str = ""
    probe_seen: trio.Event = field(default_factory=trio.Event)


@dataclass(eq=False)
class _Pending:
    """A file being watched until it is complete; `fast` once it arrived by a rename."""

    fast: bool = False


class Watcher:
    """Watches the configured inbox folders and turns each model dropped there into one
    job; delivers the job's outputs when it ends. Depends on the job manager only through
    `submit`, `get`, `on_final` and its claims (`claims`, `claim_begin`, `claim_done`,
    `claim_drop`)."""

    #: safety-net rescan of every folder (and of finished jobs not yet delivered)
    rescan_s = 30.0
    #: wait before submitting again when the queue is full
    retry_s = 5.0
    #: wait before trying again to make a folder that could not be made
    remake_s = 5.0

    def __init__(self, cfg: DaemonConfig, jobs: JobManager):
        self._cfg = cfg
        self._jobs = jobs
        self._claims_dir = cfg.claims_dir
        self._folders: dict[Path, _Folder] = {}
        #: every inbox configured since start: deliveries of a folder removed by a reload
        #: still go to its outbox
        self._known: dict[Path, Inbox] = {}
        self._pending: dict[Path, _Pending] = {}
        #: a file that could not be claimed is tried again no sooner than this
        self._retry_at: dict[Path, float] = {}
        #: sources of claims a task of this run is claiming or submitting (the sweep
        #: settles the other 'claiming' claims)
        self._in_flight: set[str] = set()
        #: failed claims of each file (see `_claim_failed`), and files given up on, with
        #: their `_signature` then: a file is tried again only once it changes
        self._claim_errors: dict[Path, int] = {}
        #: files whose claim waits for a full disk to have room (said once)
        self._waiting_room: set[Path] = set()
        self._given_up: dict[Path, tuple[int, int, int] | None] = {}
        #: per folder, entries that are not taken and were logged (name: inode)
        self._left: dict[Path, dict[str, int]] = {}
        #: folders where whether a file is still being written cannot be told (logged once)
        self._no_lease: set[Path] = set()
        self._nursery: trio.Nursery | None = None
        self._final_send, self._final_recv = trio.open_memory_channel[JobRow](_DELIVERY_BUFFER)

    # ------------------------------------------------------------- lifecycle

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Settle the claims a previous run left, start watching every inbox (each scanned
        once), then say ready and watch until cancelled. Errors about single files or
        folders are logged and never end it."""
        try:
            await trio.to_thread.run_sync(
                lambda: self._claims_dir.mkdir(parents=True, exist_ok=True)
            )
        except OSError as exc:  # (a claim makes it, once it can be made)
            log.error("inbox: cannot make %s (%s)", self._claims_dir, exc.strerror or exc)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._jobs.on_final.append(self._on_final)
            try:
                nursery.start_soon(self._deliver_loop)
                await self._reconcile()
                for inbox in self._cfg.inboxes:
                    self._add_folder(inbox)
                with trio.move_on_after(_PROBE_S + 3.0):
                    for folder in list(self._folders.values()):
                        await folder.ready.wait()
                nursery.start_soon(self._sweep_loop)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._jobs.on_final.remove(self._on_final)
                # watchfiles' thread only notices cancellation through its stop event;
                # without it the watch tasks would wait out the watcher's 5 s timeout.
                for folder in self._folders.values():
                    folder.stop.set()

    def reload(self, cfg: DaemonConfig) -> None:
        """SIGHUP: watch folders new to `cfg`, stop watching those it no longer lists,
        and apply changed outbox, failed and stable_s at once. Claims of a removed folder
        are still delivered to its outbox."""
        self._cfg = cfg
        wanted = {i.path: i for i in cfg.inboxes}
        for path, folder in list(self._folders.items()):
            if path not in wanted:
                log.info("inbox %s: no longer watched", path)
                folder.removed = True
                folder.stop.set()
                del self._folders[path]
            else:
                folder.inbox = self._known[path] = wanted[path]
        if self._nursery is None:  # not running yet: run() reads cfg
            return
        for path, inbox in wanted.items():
            if path not in self._folders:
                self._add_folder(inbox)

    # ------------------------------------------------------------- watching

    def _add_folder(self, inbox: Inbox) -> None:
        assert self._nursery is not None
        if inbox.path in (inbox.outbox, inbox.failed):
            # Outputs (or failed models) dropped back into the inbox would be tuned again.
            log.error(
                "inbox %s: its outbox and failed folders must be other folders; not watched",
                inbox.path,
            )
            return
        folder = self._folders[inbox.path] = _Folder(inbox)
        self._known[inbox.path] = inbox
        self._nursery.start_soon(self._watch_folder, folder)

    async def _watch_folder(self, folder: _Folder) -> None:
        """Watch `folder` until it is removed: (re)create it, prove the watch works with a
        probe file, scan what is already there, then handle changes as they come."""
        polling = False
        said = ""  # why the folders could not be made, as last logged
        while not folder.removed:
            inbox = folder.inbox
            try:
                folder.ino = await trio.to_thread.run_sync(_prepare_dirs, inbox)
            except OSError as exc:
                why = (
                    f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
                )
                # Said once at error level, then quietly while the reason stays the same
                # (a full disk may last hours).
                log.log(
                    logging.DEBUG if why == said else logging.ERROR,
                    "inbox %s: not watched (%s); trying again every %gs, or make the folder as "
                    "deploy/tmpfiles.d/aoed.conf does",
                    inbox.path,
                    why,
                    self.remake_s,
                )
                said = why
                folder.ready.set()  # a broken folder must not hold up the daemon's start
                await trio.sleep(self.remake_s)
                continue
            if said:
                log.warning("inbox %s: its folders are there now; watching it", inbox.path)
                said = ""
            if folder.removed:  # by a reload while the folder was being created
                break
            folder.stop = trio.Event()
            folder.probe, folder.probe_seen = f".aoed-probe-{uuid.uuid4().hex[:12]}", trio.Event()
            assert self._nursery is not None
            self._nursery.start_soon(self._probe_then_scan, folder, folder.probe)
            # A poller misses a file replaced by one of the same size within its mtime
            # resolution (a model claimed and dropped again), so polling also rescans,
            # at least every second.
            scans = polling or _polling_forced()
            try:
                async for changes in watchfiles.awatch(
                    inbox.path,
                    watch_filter=None,
                    stop_event=folder.stop,
                    recursive=False,
                    debounce=500,
                    step=50,
                    force_polling=True if polling else None,
                    yield_on_timeout=scans,
                    rust_timeout=1000 if scans else None,
                ):
                    self._on_changes(folder, changes)
                    if scans:
                        await self._scan(folder)
            except (OSError, RuntimeError) as exc:  # RuntimeError: watchfiles' internal errors
                if not polling and inbox.path.is_dir():
                    log.warning(
                        "inbox %s: file notifications failed (%s); polling instead", inbox.path, exc
                    )
                    polling = True
                    continue
                log.warning(
                    "inbox %s: watching failed (%s); trying again in %gs",
                    inbox.path,
                    exc,
                    self.rescan_s,
                )
                await trio.sleep(self.rescan_s)

    async def _probe_then_scan(self, folder: _Folder, probe: str) -> None:
        """Touch a hidden probe file until the watch reports it (the watch is then known to
        be running, so nothing created after the scan can be missed), then scan once."""
        path = folder.inbox.path / probe
        fd = -1
        try:
            with trio.move_on_after(_PROBE_S):
                fd = await trio.to_thread.run_sync(os.open, path, _PROBE_FLAGS, 0o600)
                while not folder.probe_seen.is_set():
                    # Touched through its descriptor: the name may have been swapped for a
                    # link since it was made, and a touch by name would follow it.
                    await trio.to_thread.run_sync(os.utime, fd)
                    with trio.move_on_after(0.25):
                        await folder.probe_seen.wait()
        except OSError as exc:
            log.warning("inbox %s: cannot write in it (%s)", folder.inbox.path, exc.strerror or exc)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    if fd >= 0:
                        os.close(fd)
                        await trio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))
                except OSError:
                    pass
        if not folder.probe_seen.is_set():
            log.info(
                "inbox %s: the watch did not report a probe file; the %gs rescan covers it",
                folder.inbox.path,
                self.rescan_s,
            )
        await self._scan(folder)
        folder.ready.set()

    def _on_changes(self, folder: _Folder, changes: set[tuple[watchfiles.Change, str]]) -> None:
        names = [(change, Path(p).name) for change, p in changes]
        if any(name == folder.probe for _, name in names):
            folder.probe_seen.set()
        # A temporary name that vanished in the same batch as a model appeared: the model
        # was renamed into place, complete, and needs no waiting.
        gone_temps = [
            name for change, name in names if change == watchfiles.Change.deleted and _ignored(name)
        ]
        for change, name in names:
            if change == watchfiles.Change.deleted or _ignored(name) or name == OPTIONS_FILE:
                continue
            if not _candidate(name):
                self._note_left(folder, name)
                continue
            fast = change == watchfiles.Change.added and any(name in t for t in gone_temps)
            self._consider(folder.inbox.path / name, folder, fast)

    async def _scan(self, folder: _Folder) -> None:
        try:
            names, left = await trio.to_thread.run_sync(_listing, folder.inbox.path)
        except OSError as exc:
            log.warning("inbox %s: cannot list it (%s)", folder.inbox.path, exc.strerror or exc)
            return
        # Forget what has gone, so that a new entry under an old name is reported again.
        noted = self._left.setdefault(folder.inbox.path, {})
        for name in set(noted) - set(left):
            del noted[name]
        for name, (ino, kind) in left.items():
            self._note_left(folder, name, ino, kind)
        for name in names:
            self._consider(folder.inbox.path / name, folder, False)

    def _note_left(self, folder: _Folder, name: str, ino: int = -1, kind: str = "") -> None:
        """Log once that the entry `name` of the folder is not taken (looked up when `kind`
        is not given); logged again only if the name comes to hold another file."""
        if not kind:
            try:
                st = os.lstat(folder.inbox.path / name)
            except OSError:
                return
            ino, kind = st.st_ino, _kind(st.st_mode)
        noted = self._left.setdefault(folder.inbox.path, {})
        if noted.get(name) == ino:
            return
        noted[name] = ino
        log.warning(
            "inbox %s: %s is %s; left where it is (only regular *.onnx and *.pt2 files are taken)",
            folder.inbox.path,
            name,
            kind,
        )

    async def _sweep_loop(self) -> None:
        """The safety net: rescan every folder (watches can miss events, a folder can be
        replaced under its watch) and queue finished jobs whose delivery did not happen."""
        while True:
            await trio.sleep(self.rescan_s)
            for folder in list(self._folders.values()):
                try:
                    ino = os.stat(folder.inbox.path).st_ino
                except OSError:
                    ino = -1
                if ino != folder.ino:
                    log.warning(
                        "inbox %s: the folder was removed or replaced; watching it anew",
                        folder.inbox.path,
                    )
                    folder.stop.set()  # the watch loop recreates it, probes and scans
                else:
                    await self._scan(folder)
            self._settle_claims()
            self._queue_finished_claims()
            now = trio.current_time()
            self._retry_at = {p: t for p, t in self._retry_at.items() if t > now}

    # ------------------------------------------------------------- claiming

    def _consider(self, path: Path, folder: _Folder, fast: bool) -> None:
        pending = self._pending.get(path)
        if pending is not None:
            pending.fast |= fast
            return
        if trio.current_time() < self._retry_at.get(path, -math.inf):
            return
        given_up = self._given_up.get(path)
        if given_up is not None:
            if given_up == _signature(path):
                return
            del self._given_up[path]  # the file changed: it is a new one
        self._pending[path] = _Pending(fast)
        assert self._nursery is not None
        self._nursery.start_soon(self._take, path, folder)

    async def _take(self, path: Path, folder: _Folder) -> None:
        """Wait for `path` to be complete, claim it, submit it. Never raises (but
        Cancelled): one file's trouble must not stop the watcher."""
        key = str(path)
        try:
            if not await self._settled(path, folder) or key in self._in_flight:
                return  # (an earlier file of this name is still being submitted)
            self._in_flight.add(key)
            try:
                claim = await self._claim(path, folder.inbox)
                if claim is not None:
                    self._retry_at.pop(path, None)
                    self._claim_errors.pop(path, None)
                    self._waiting_room.discard(path)
                    await self._submit(claim)
            finally:
                self._in_flight.discard(key)
        except Exception as exc:
            self._retry_at[path] = trio.current_time() + self.rescan_s
            if not isinstance(exc, AoedError | OSError):
                log.exception("inbox: %s: internal error; trying again at the next scan", path)
            elif await trio.to_thread.run_sync(_signature, path) is None:
                # claimed (or gone) already: nothing to try again
                log.error("inbox: %s: %s", path, exc)
            else:
                await self._claim_failed(path, folder, exc)
        finally:
            self._pending.pop(path, None)

    async def _claim_failed(self, path: Path, folder: _Folder, exc: Exception) -> None:
        """`path` could not be claimed: try again at the next scan, up to CLAIM_TRIES
        times; then move it to the failed folder saying why, or, when even that fails,
        log so once and leave it until it changes. A full disk is not the file's fault
        and passes: it is tried again at every scan, as long as it lasts, and counts no
        try (said once, at warning level, then at debug level)."""
        why = (
            f"{exc.filename or path}: {exc.strerror or exc}"
            if isinstance(exc, OSError)
            else str(exc)
        )
        if isinstance(exc, DiskFullError) or (
            isinstance(exc, OSError) and exc.errno in space.FULL_ERRNOS
        ):
            said = path in self._waiting_room
            self._waiting_room.add(path)
            log.log(
                logging.DEBUG if said else logging.WARNING,
                "inbox %s: %s waits for room to be claimed (%s); trying again at the next scan",
                folder.inbox.path,
                path.name,
                why,
            )
            return
        self._waiting_room.discard(path)
        tries = self._claim_errors[path] = self._claim_errors.get(path, 0) + 1
        if tries < CLAIM_TRIES:
            log.error(
                "inbox %s: %s could not be claimed (%s); trying again at the next scan (%d of %d tries)",
                folder.inbox.path,
                path.name,
                why,
                tries,
                CLAIM_TRIES,
            )
            return
        del self._claim_errors[path]
        self._retry_at.pop(path, None)
        text = (
            f"model: {printable(path.name)}\njob:   (none: the file could not be claimed)\nstate: rejected\n"
            f"error: {printable(why)} ({CLAIM_TRIES} tries)\n"
        )
        try:
            where = await trio.to_thread.run_sync(_fail_into, folder.inbox, path, path.name, text)
        except OSError as err:
            self._given_up[path] = await trio.to_thread.run_sync(_signature, path)
            if self._given_up[path] is None:  # moved, but its error file could not be written
                log.error(
                    "inbox %s: %s could not be claimed (%s) %d times; moved to %s without its error file (%s)",
                    folder.inbox.path,
                    path.name,
                    why,
                    CLAIM_TRIES,
                    folder.inbox.failed,
                    err.strerror or err,
                )
                return
            log.error(
                "inbox %s: %s could not be claimed (%s) %d times, nor moved to %s (%s); left in the inbox and "
                "not tried again until it changes",
                folder.inbox.path,
                path.name,
                why,
                CLAIM_TRIES,
                folder.inbox.failed,
                err.strerror or err,
            )
            return
        log.warning(
            "inbox %s: %s could not be claimed (%s) %d times; moved to %s",
            folder.inbox.path,
            path.name,
            why,
            CLAIM_TRIES,
            where,
        )

    async def _settled(self, path: Path, folder: _Folder) -> bool:
        """True once `path` is a complete regular file; False when it vanished, is not a
        regular file, or its folder is no longer watched."""
        pending = self._pending[path]
        last: tuple[int, int, int] | None = None
        since = trio.current_time()
        while not folder.removed:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return False
            if not stat.S_ISREG(st.st_mode):
                self._note_left(folder, path.name, st.st_ino, _kind(st.st_mode))
                return False
            stable_s = folder.inbox.stable_s  # a reload may change it while we wait
            now = trio.current_time()
            sig = (st.st_size, st.st_mtime_ns, st.st_ino)
            if pending.fast:
                done = True
            elif sig != last:
                last, since, done = sig, now, False
            else:
                done = now - since >= stable_s
            if done:
                # A file with several links is refused unopened (JobManager.submit): the
                # lease, which needs an open, is not asked of it.
                if st.st_nlink > 1 or not await trio.to_thread.run_sync(
                    self._written_to, path, folder
                ):
                    return True
                # A writer still has it open (it paused longer than stable_s): wait for it
                # to close the file and for the file to stay unchanged again.
                pending.fast, last, since = False, sig, now
            await trio.sleep(max(0.01, min(stable_s / 4, 0.5)))
        return False

    def _written_to(self, path: Path, folder: _Folder) -> bool:
        """Whether a process has `path` open for writing (in a worker thread). Where
        Linux cannot say (see safefs.read_lease), False, once logged for the folder: the
        unchanged size and mtime for stable_s are then all there is to go by."""
        try:
            fd = safefs.open_file(path)
        except OSError:
            return False  # gone or replaced: the claim finds out
        try:
            writers = safefs.has_writers(fd)
        finally:
            os.close(fd)
        if writers is None and folder.inbox.path not in self._no_lease:
            self._no_lease.add(folder.inbox.path)
            log.warning(
                "inbox %s: cannot tell whether a writer still has a file open (%s); a file counts as "
                "complete once its size and mtime stay the same for stable_s = %gs",
                folder.inbox.path,
                _no_lease_reason(),
                folder.inbox.stable_s,
            )
        return bool(writers)

    async def _claim(self, path: Path, inbox: Inbox) -> Claim | None:
        """Move `path` into the claims dir, recorded before and after; None when another
        file of that name is still claimed (it is taken after that one's delivery) or the
        file vanished. Raises DiskFullError when the daemon's copy of it (`_privatize`)
        would leave less than [limits] min_free_mb in the state dir, OSError or StoreError
        (the claim is then undone)."""
        if any(c.src == str(path) for c in self._jobs.claims()):
            return None
        try:
            size = (await trio.to_thread.run_sync(os.lstat, path)).st_size
        except FileNotFoundError:
            return None
        what = f"claiming {path.name} ({space.size_text(size)})"
        space.check_floor(self._claims_dir, self._cfg.min_free_bytes, what, need=size)
        dst = self._claims_dir / uuid.uuid4().hex / path.name
        await trio.to_thread.run_sync(lambda: dst.parent.mkdir(parents=True))
        try:
            self._jobs.claim_begin(str(path), str(dst), str(inbox.path))
        except AoedError:
            await trio.to_thread.run_sync(dst.parent.rmdir)
            raise
        try:
            await trio.to_thread.run_sync(_move_in, path, dst)
        except OSError as exc:
            self._jobs.claim_drop(str(path))
            await trio.to_thread.run_sync(shutil.rmtree, dst.parent, True)
            if isinstance(exc, FileNotFoundError) and not await trio.Path(path).exists():
                return None
            raise
        log.info("inbox %s: claimed %s", inbox.path, path.name)
        return Claim(str(path), str(dst), str(inbox.path), "claiming", "", time.time())

    async def _submit(self, claim: Claim) -> None:
        """Submit a claimed file and record its job; a refused submission sends the file
        to the failed folder, except a full queue (or a daemon shutting down), where it
        stays claimed and is submitted again later."""
        model = Path(claim.dst)
        while True:
            try:
                await self._privatize(claim)
                _check_claimed(model)
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
            await self._deliver_failure(claim, "", "rejected", error)
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
            self._queue(row)

    async def _privatize(self, claim: Claim) -> None:
        """`_privatize` the claim's file; a full disk is DiskFullError (the claim waits
        for room, as for a full queue)."""
        dst = Path(claim.dst)
        try:
            await trio.to_thread.run_sync(_privatize, dst.parent, dst.name)
        except OSError as exc:
            if exc.errno in space.FULL_ERRNOS:
                raise space.disk_full(self._claims_dir, f"claiming {dst.name}") from None
            raise

    # ------------------------------------------------------------- reconciling

    async def _reconcile(self) -> None:
        """At start: settle the claims a previous run left, and remove claimed copies no
        claim refers to (a crash between creating the folder and recording the claim, or
        between a delivery and the removal of the copy)."""
        self._settle_claims()
        referenced = {Path(c.dst).parent for c in self._jobs.claims()}
        try:
            strays = await trio.to_thread.run_sync(lambda: list(self._claims_dir.iterdir()))
        except FileNotFoundError:  # (not made: see run)
            strays = []
        for d in strays:
            if d not in referenced:
                await trio.to_thread.run_sync(_remove, d)
        self._queue_finished_claims()

    def _settle_claims(self) -> None:
        """'claiming' claims no task of this run is working on: submit those whose file
        was moved, forget those whose file never was (the scan takes it again)."""
        assert self._nursery is not None
        for c in self._jobs.claims("claiming"):
            if c.src in self._in_flight:
                continue
            src, dst = Path(c.src), Path(c.dst)
            if os.path.lexists(dst) or os.path.lexists(dst.parent / _MOVED):
                log.info(
                    "inbox %s: %s was claimed but not submitted; submitting it", c.inbox, dst.name
                )
                self._in_flight.add(c.src)
                self._nursery.start_soon(
                    self._submit_reconciled, c, src.exists() and _same_file_data(src, dst)
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
            await self._submit(claim)
        except (AoedError, OSError) as exc:
            log.error(
                "inbox %s: %s: %s (trying again at the next sweep)", claim.inbox, claim.dst, exc
            )
        finally:
            self._in_flight.discard(claim.src)

    def _queue_finished_claims(self) -> None:
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
                self._queue(row)

    # ------------------------------------------------------------- delivering

    def _on_final(self, row: JobRow) -> None:
        """The job manager's final-state callback (sync, in the trio thread)."""
        if any(c.job_id == row.id for c in self._jobs.claims("claimed")):
            self._queue(row)

    def _queue(self, row: JobRow) -> None:
        # Bounded so that a stuck delivery (a full or hung outbox disk) cannot grow memory
        # without limit; a row that does not fit is not lost: its claim stays 'claimed'
        # and the periodic sweep queues it again.
        try:
            self._final_send.send_nowait(row)
        except trio.WouldBlock:
            log.warning(
                "inbox: job %s: the delivery queue is full; delivering at the next sweep", row.id
            )

    async def _deliver_loop(self) -> None:
        """The one task that delivers: one claim at a time, so that a job queued twice
        (callback and sweep) finds its claims gone the second time."""
        async for row in self._final_recv:
            for claim in self._jobs.claims("claimed"):
                if claim.job_id != row.id:
                    continue
                try:
                    if row.state == SUCCEEDED:
                        await self._deliver_success(claim, row)
                    else:
                        await self._deliver_failure(claim, row.id, row.state, row.error)
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

    def _inbox(self, path: str) -> Inbox:
        p = Path(path)
        # (The configuration's, for a claim settled at start, before the folder is watched.)
        configured = next((i for i in self._cfg.inboxes if i.path == p), None)
        return (
            self._known.get(p) or configured or Inbox(p, p.parent / "outbox", p.parent / "failed")
        )

    async def _deliver_success(self, claim: Claim, row: JobRow) -> None:
        inbox = self._inbox(claim.inbox)
        names = await trio.to_thread.run_sync(_write_outputs, inbox, Path(claim.src).name, row)
        log.info(
            "inbox %s: job %s delivered to %s (%s)",
            claim.inbox,
            row.id,
            inbox.outbox,
            ", ".join(names),
        )
        await self._release(claim)

    async def _deliver_failure(self, claim: Claim, job_id: str, state: str, error: str) -> None:
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
            lambda: _fail_into(inbox, _claimed_entry(dst), name, text)
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
            await trio.to_thread.run_sync(_remove, dst.parent)
        src = Path(claim.src)
        if await trio.Path(src).exists():
            folder = self._folders.get(Path(claim.inbox))
            if folder is not None:
                self._consider(src, folder, False)


# ------------------------------------------------------------------ folder options


def folder_spec(folder: Path) -> JobSpec:
    """The job spec of `folder`'s aoed.toml (the defaults without one): JobSpec.from_toml.
    Raises OptionError naming the file and the key."""
    f = folder / OPTIONS_FILE
    try:
        # Opened as safefs opens files: a link or a FIFO planted under this name is neither
        # followed nor waited on.
        with os.fdopen(safefs.open_file(f), "rb") as fh:
            data = fh.read(_OPTIONS_MAX + 1)
        if len(data) > _OPTIONS_MAX:
            raise OptionError(
                f"{f}: larger than {_OPTIONS_MAX} bytes; an options file holds a few lines"
            )
        raw = tomllib.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raw = {}
    except safefs.LinkRefusedError as exc:
        raise OptionError(f"{f}: {exc.strerror}; the options file must be a regular file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionError(f"{f}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise OptionError(f"{f}: not valid TOML ({exc}); fix it and drop the model again") from None
    try:
        return JobSpec.from_toml(raw)
    except OptionError as exc:
        raise OptionError(f"{f}: {exc}; fix it and drop the model again") from None


# ------------------------------------------------------------------ file system (worker threads)


def _polling_forced() -> bool:
    """Whether watchfiles polls without being asked to (its environment variable)."""
    return os.environ.get("WATCHFILES_FORCE_POLLING", "").lower() not in (
        "",
        "false",
        "disable",
        "disabled",
    )


def _prepare_dirs(inbox: Inbox) -> int:
    """Make the inbox and its outbox and failed folders where missing (`_ensure_folder`);
    returns the inbox's inode. LinkRefusedError when one is a link (they are opened
    without following one when used), OSError naming the folder when one cannot be made."""
    for d in (inbox.path, inbox.outbox, inbox.failed):
        _ensure_folder(d, inbox)
    return os.stat(inbox.path).st_ino


def _ensure_folder(folder: Path, inbox: Inbox) -> None:
    """Make the drop folder `folder` (`inbox`'s inbox, outbox or failed folder) when it is
    missing, with the inbox's mode and group, and log that it was made: writers of a
    folder made with the daemon's umask alone (0750) would meet "Permission denied",
    and nothing would say why. A folder that is there is left as it is. LinkRefusedError
    when `folder` is a link or a file; OSError naming `folder` when it cannot be made
    (a folder made but not given its mode and group is removed again)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with safefs.opened_dir(folder.parent) as parent:
        try:
            # 0700 until its group and mode are set: never open to more than they say
            os.mkdir(folder.name, 0o700, dir_fd=parent)
        except FileExistsError:
            os.close(safefs.open_dir(folder.name, dir_fd=parent))
            return
        except OSError as exc:
            raise OSError(exc.errno, f"cannot make it: {exc.strerror}", str(folder)) from None
        try:
            group = _give_mode(folder, parent, inbox)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(folder.name, dir_fd=parent)
            raise
    log.warning(
        "inbox %s: %s was missing; made it with mode %04o, group %s ([[inbox]] mode and group)",
        inbox.path,
        folder,
        inbox.mode,
        group,
    )


def _give_mode(folder: Path, parent: int, inbox: Inbox) -> str:
    """Give the folder `folder` just made in `parent` the inbox's group and mode; returns
    the group's name. OSError naming the folder and the setting when the daemon may not."""
    fd = safefs.open_dir(folder.name, dir_fd=parent)
    try:
        if inbox.group:
            try:
                gid = grp.getgrnam(inbox.group).gr_gid
            except KeyError:
                raise OSError(
                    errno.EINVAL, f"[[inbox]] group {inbox.group!r}: no such group", str(folder)
                ) from None
            try:
                os.fchown(fd, -1, gid)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"cannot give it the group {inbox.group!r} of [[inbox]] group ({exc.strerror}): "
                    "the daemon's user must be a member of it",
                    str(folder),
                ) from None
        # (after the chown, which may clear a setgid bit)
        os.fchmod(fd, inbox.mode)
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) != inbox.mode:  # the kernel drops setgid for a non-member
            raise OSError(
                errno.EPERM,
                f"it has mode {stat.S_IMODE(st.st_mode):04o}, not {inbox.mode:04o} as [[inbox]] mode "
                "says: the daemon's user must be a member of its group",
                str(folder),
            )
        try:
            return grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            return str(st.st_gid)
    finally:
        os.close(fd)


def _listing(folder: Path) -> tuple[list[str], dict[str, tuple[int, str]]]:
    """The folder's candidate models, and the entries that are left alone, as name:
    (inode, what it is). Hidden and temporary names and the options file are neither."""
    models: list[str] = []
    left: dict[str, tuple[int, str]] = {}
    with os.scandir(folder) as it:
        for e in it:
            if _ignored(e.name) or e.name == OPTIONS_FILE:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and _candidate(e.name):
                models.append(e.name)
            else:
                left[e.name] = (st.st_ino, _kind(st.st_mode))
    return models, left


def _kind(mode: int) -> str:
    """What an entry that is not taken is, in words."""
    for test, words in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    ):
        if test(mode):
            return words
    return "not a regular file" if not stat.S_ISREG(mode) else "not an .onnx model (nor a .pt2)"


def _signature(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of the entry `path`, not following a link; None when gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _no_lease_reason() -> str:
    """Why a read lease cannot be taken, as far as can be told."""
    try:
        with open("/proc/sys/fs/leases-enable", encoding="ascii") as f:
            if f.read().strip() == "0":
                return "leases are off: /proc/sys/fs/leases-enable is 0"
    except OSError:
        pass
    return (
        "no read lease: the daemon neither owns the files dropped here nor has CAP_LEASE, or the file system "
        "has no leases"
    )


def _move_in(src: Path, dst: Path) -> None:
    """Take the inbox entry `src` into the claim folder of `dst`: renamed to `_MOVED` (the
    entry itself, whatever it is, at once: a file dropped under its name after this is
    another file), or, from another file system, copied straight to `dst` (a regular file
    with one link, else LinkRefusedError or LinkedError: safefs.move) and unlinked."""
    with safefs.opened_dir(src.parent) as s, safefs.opened_dir(dst.parent) as d:
        try:
            os.rename(src.name, _MOVED, src_dir_fd=s, dst_dir_fd=d)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            safefs.move(src.name, dst.name, src_dir_fd=s, dst_dir_fd=d)


def _privatize(folder: Path, name: str) -> None:
    """Make `name` in the claim folder `folder` the daemon's own copy of the entry moved
    there (`_MOVED`), then remove that entry. Whoever dropped the file may still hold it
    open for writing, and writes through that descriptor reach it wherever it is
    renamed; nobody but the daemon can write the copy, so what is hashed is what runs.
    Done already (a crash after the copy, or a claim from another file system): only the
    moved entry, if any, goes. ModelError when the moved entry is not a regular file,
    PermissionDeniedError when it has several hard links: either way nothing behind it
    is opened. OSError (ENOSPC...) when the copy cannot be made: nothing changed then."""
    with safefs.opened_dir(folder) as d:
        if not safefs.taken(name, dir_fd=d):
            try:
                st = os.stat(_MOVED, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                raise FileNotFoundError(
                    errno.ENOENT, "gone from the claims folder before it was copied", str(folder)
                ) from None
            # Looked at before it is opened: opening a hard link reads, for whoever made
            # it, a file from elsewhere (its atime, a FIFO's writer...).
            if not stat.S_ISREG(st.st_mode):
                raise ModelError(
                    f"{name}: {_kind(st.st_mode)} by the time it was claimed (it was replaced after "
                    "it was found); only regular files are taken, and nothing behind it was read"
                )
            if st.st_nlink > 1:
                raise PermissionDeniedError(
                    f"{name}: the file has {st.st_nlink} hard links, and a hard link can make the "
                    "daemon read a file its submitter could not; copy the file (cp, not ln) or upload it"
                )
            try:
                fd = safefs.open_file(_MOVED, dir_fd=d, single_link=True)
            except (safefs.LinkRefusedError, safefs.LinkedError) as exc:  # swapped since
                raise ModelError(f"{name}: {exc.strerror}; nothing behind it was read") from None
            with os.fdopen(fd, "rb") as moved:
                safefs.write_file(
                    name, lambda f: safefs.copy_fd(moved.fileno(), f.fileno()), dir_fd=d
                )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_MOVED, dir_fd=d)


def _claimed_entry(dst: Path) -> Path:
    """What a claim of `dst` holds: the daemon's copy, else the entry moved out of the
    inbox (a claim refused before its copy was made)."""
    moved = dst.parent / _MOVED
    return moved if not os.path.lexists(dst) and os.path.lexists(moved) else dst


def _check_claimed(model: Path) -> None:
    """ModelError unless the claimed entry `model` is a regular file: a writer of the
    inbox may swap a link in between the look and the claim's rename, which moves the
    entry itself; nothing reads through such a link."""
    st = os.lstat(model)
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(
            f"{model.name}: {_kind(st.st_mode)} by the time it was claimed (it was replaced "
            "after it was found); only regular files are taken, and nothing behind it was read"
        )


def _same_file_data(a: Path, b: Path) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return (sa.st_size, sa.st_mtime_ns) == (sb.st_size, sb.st_mtime_ns)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


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
#: a GDAT job's: its "tuned model" is the DDP configuration a training script applies
_GDAT_OUT_SUFFIXES = ("_ddp_config.json", "_result.json", "_report.txt")
#: bytes a shortened stem leaves for the `_N` of a taken name
_COUNTER_ROOM = len("_99999")


def _write_outputs(inbox: Inbox, name: str, row: JobRow) -> list[str]:
    """Copy a succeeded job's tuned model and result JSON into `inbox`'s outbox (made
    again when missing) and write its report; returns the names written. An output the
    job no longer has (or that is now a link) is left out, and the report says so."""
    outbox = inbox.outbox
    _ensure_folder(outbox, inbox)
    outcome = row.outcome
    suffixes = (
        _GDAT_OUT_SUFFIXES
        if outcome is not None and outcome.job_type == JobType.GDAT
        else _OUT_SUFFIXES
    )
    with safefs.opened_dir(outbox) as out:
        base = _free_base(out, Path(name).stem, suffixes)
        tuned, result_json, report = (f"{base}{s}" for s in suffixes)
        written, missing = [], []
        for key, dst in (("tuned_model", tuned), ("result_json", result_json)):
            src = getattr(outcome, key) if outcome is not None else ""
            try:
                fd = safefs.open_file(src) if src else None
            except (FileNotFoundError, safefs.LinkRefusedError):
                fd = None
            if fd is None:
                missing.append(f"{key}: {printable(src) if src else 'none'} is not available")
                continue
            with os.fdopen(fd, "rb") as f:
                safefs.write_file(dst, lambda o, f=f: shutil.copyfileobj(f, o, 1 << 20), dir_fd=out)
            written.append(dst)
        text = _report_text(name, row, written, missing)
        safefs.write_file(report, lambda f: f.write(text.encode()), dir_fd=out)
    return [*written, report]


def _report_text(name: str, row: JobRow, written: list[str], missing: list[str]) -> str:
    """A short human summary of the succeeded job that tuned the model `name`: the drop
    folder's renderer of its outcome."""
    o = row.outcome
    f = o.figures if o is not None else figures.Figures("", "", 0.0)
    gdat = o is not None and o.job_type == JobType.GDAT
    where = (
        f"from the bank, as confirmed by {f.confirmed_by}"
        if f.confirmed_by
        else f"confirming A/B, {f.rounds} interleaved rounds of the world"
        if gdat
        else f"confirming A/B, {f.rounds} rounds, a process per model as deployed"
    )
    # A GDAT job's input is DDP's defaults, its output a DDP configuration, its figure a
    # training step of the world; an ONNX job's are models and a run of the model.
    d = o.details if o is not None else OnnxDetails()
    words = d.words
    if isinstance(d, GdatDetails):
        base = (
            f"{f.baseline_ms:.3f} ms per step, tail {d.baseline_tail_ms:.3f} ms "
            f"(DDP's defaults; {where})"
        )
        tail = f"; tail {d.result_tail_ms:.3f} ms" if f.changed else ""
    else:
        base, tail = f"{f.baseline_ms:.3f} ms ({where})", ""
    lines = [
        f"aoed tuned {printable(name)}",
        f"job:          {row.id}",
        f"baseline:     {base}",
        f"result:       {figures.result_text(f, 3, words)}{tail}",
        f"verdict:      {figures.verdict_text(f, words)}",
        f"shipped:      {figures.shipped_text(f, words)}",
    ]
    if isinstance(d, GdatDetails):
        lines.append(f"ddp:          {ddp_text(d)}")
    lines += [
        f"bank:         {figures.bank_text(o.bank if o else {}, o.unshipped if o else 0)}",
        f"outputs:      {', '.join(written) or '(none)'}",
    ]
    lines += [f"missing:      {m}" for m in missing]
    return "\n".join(lines) + "\n"


def _fail_into(inbox: Inbox, model: Path, name: str, text: str) -> Path:
    """`_write_failure` into `inbox`'s failed folder, made again when missing."""
    _ensure_folder(inbox.failed, inbox)
    return _write_failure(inbox.failed, model, name, text)


def _write_failure(failed: Path, model: Path, name: str, text: str) -> Path:
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
