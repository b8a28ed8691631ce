"""The watcher: the inbox agent that watches each configured folder, tells when a file
dropped there is complete (the package's docstring says when), and hands it to the
claims (`claims.py`), which submit it once; the delivery (`delivery.py`) puts its job's
outputs in the outbox when it ends. A file that cannot be claimed is tried again at the
next scan, up to CLAIM_TRIES times, then moved to the failed folder saying why. A drop
folder that cannot be made (`folders.py`: a full disk, no right to its parent) is logged
naming it and why, and tried again every `remake_s`.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import trio
import watchfiles

from aoe.errors import AoedError, DiskFullError
from aoed import safefs, space
from aoed.config import DaemonConfig, Inbox
from aoed.jobs.manager import JobManager
from aoed.logs import printable
from aoed.watch.claims import Claims
from aoed.watch.delivery import Delivery, fail_into
from aoed.watch.discover import (
    candidate,
    entry_kind,
    entry_signature,
    ignored,
    listing,
    no_lease_reason,
    polling_forced,
)
from aoed.watch.folders import prepare_dirs
from aoed.watch.options import OPTIONS_FILE

__all__ = ["CLAIM_TRIES", "Watcher"]

# one logger for all of the watcher's parts: its lines name the watcher, not the part
log = logging.getLogger("aoed.watch")


#: how long the start waits to see a folder's watch working before it says ready anyway
_PROBE_S = 2.0
_PROBE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: a file that fails to be claimed this many times goes to the failed folder
CLAIM_TRIES = 3


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
    #: wait before trying again to make a folder that could not be made
    remake_s = 5.0

    def __init__(self, cfg: DaemonConfig, jobs: JobManager):
        self._cfg = cfg
        self._jobs = jobs
        self._claims_dir = cfg.claims_dir
        self._delivery = Delivery(jobs, cfg.claims_dir, self._inbox, self._retake)
        #: the claims: exactly once (its `retry_s` is the wait before submitting again
        #: when the queue is full)
        self.claims = Claims(jobs, cfg.claims_dir, self._delivery)
        self._folders: dict[Path, _Folder] = {}
        #: every inbox configured since start: deliveries of a folder removed by a reload
        #: still go to its outbox
        self._known: dict[Path, Inbox] = {}
        self._pending: dict[Path, _Pending] = {}
        #: a file that could not be claimed is tried again no sooner than this
        self._retry_at: dict[Path, float] = {}
        #: failed claims of each file (see `_claim_failed`), and files given up on, with
        #: their `entry_signature` then: a file is tried again only once it changes
        self._claim_errors: dict[Path, int] = {}
        #: files whose claim waits for a full disk to have room (said once)
        self._waiting_room: set[Path] = set()
        self._given_up: dict[Path, tuple[int, int, int] | None] = {}
        #: per folder, entries that are not taken and were logged (name: inode)
        self._left: dict[Path, dict[str, int]] = {}
        #: folders where whether a file is still being written cannot be told (logged once)
        self._no_lease: set[Path] = set()
        self._nursery: trio.Nursery | None = None

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
            self._jobs.on_final.append(self._delivery.on_final)
            try:
                nursery.start_soon(self._delivery.run)
                await self.claims.reconcile(nursery)
                for inbox in self._cfg.inboxes:
                    self._add_folder(inbox)
                with trio.move_on_after(_PROBE_S + 3.0):
                    for folder in list(self._folders.values()):
                        await folder.ready.wait()
                nursery.start_soon(self._sweep_loop)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._jobs.on_final.remove(self._delivery.on_final)
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
                folder.ino = await trio.to_thread.run_sync(prepare_dirs, inbox)
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
            scans = polling or polling_forced()
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
            name for change, name in names if change == watchfiles.Change.deleted and ignored(name)
        ]
        for change, name in names:
            if change == watchfiles.Change.deleted or ignored(name) or name == OPTIONS_FILE:
                continue
            if not candidate(name):
                self._note_left(folder, name)
                continue
            fast = change == watchfiles.Change.added and any(name in t for t in gone_temps)
            self._consider(folder.inbox.path / name, folder, fast)

    async def _scan(self, folder: _Folder) -> None:
        try:
            names, left = await trio.to_thread.run_sync(listing, folder.inbox.path)
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
            ino, kind = st.st_ino, entry_kind(st.st_mode)
        noted = self._left.setdefault(folder.inbox.path, {})
        if noted.get(name) == ino:
            return
        noted[name] = ino
        log.warning(
            "inbox %s: %s is %s; left where it is (only regular *.onnx, *.pt2 and *.tar files are taken; a TensorFlow SavedModel as a .tar of its folder)",
            folder.inbox.path,
            name,
            kind,
        )

    async def _sweep_loop(self) -> None:
        """The safety net: rescan every folder (watches can miss events, a folder can be
        replaced under its watch) and queue finished jobs whose delivery did not happen."""
        assert self._nursery is not None
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
            self.claims.settle(self._nursery)
            self.claims.queue_finished()
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
            if given_up == entry_signature(path):
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
            if not await self._settled(path, folder) or key in self.claims.in_flight:
                return  # (an earlier file of this name is still being submitted)
            self.claims.in_flight.add(key)
            try:
                claim = await self.claims.claim(path, folder.inbox, self._cfg.min_free_bytes)
                if claim is not None:
                    self._retry_at.pop(path, None)
                    self._claim_errors.pop(path, None)
                    self._waiting_room.discard(path)
                    await self.claims.submit(claim)
            finally:
                self.claims.in_flight.discard(key)
        except Exception as exc:
            self._retry_at[path] = trio.current_time() + self.rescan_s
            if not isinstance(exc, AoedError | OSError):
                log.exception("inbox: %s: internal error; trying again at the next scan", path)
            elif await trio.to_thread.run_sync(entry_signature, path) is None:
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
            where = await trio.to_thread.run_sync(fail_into, folder.inbox, path, path.name, text)
        except OSError as err:
            self._given_up[path] = await trio.to_thread.run_sync(entry_signature, path)
            if self._given_up[path] is None:  # moved, but its error file could not be written
                rest = "; moved to %s without its error file (%s)"
            else:
                rest = (
                    ", nor moved to %s (%s); left in the inbox and not tried again until it changes"
                )
            log.error(
                "inbox %s: %s could not be claimed (%s) %d times" + rest,
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
                self._note_left(folder, path.name, st.st_ino, entry_kind(st.st_mode))
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
                no_lease_reason(),
                folder.inbox.stable_s,
            )
        return bool(writers)

    # ------------------------------------------------------------- for the delivery

    def _inbox(self, path: str) -> Inbox:
        """The inbox whose folder is `path`, as configured now or when last watched."""
        p = Path(path)
        # (The configuration's, for a claim settled at start, before the folder is watched.)
        configured = next((i for i in self._cfg.inboxes if i.path == p), None)
        return (
            self._known.get(p) or configured or Inbox(p, p.parent / "outbox", p.parent / "failed")
        )

    def _retake(self, src: Path, inbox: str) -> None:
        """Take `src` again, a file that waited for a claim of its name to be released,
        if its folder is still watched."""
        folder = self._folders.get(Path(inbox))
        if folder is not None:
            self._consider(src, folder, False)
