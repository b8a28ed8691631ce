"""The inbox agent: models dropped into watched folders are tuned once each, and their
outputs land in the folder's outbox (or the model in its failed folder, with the reason).

    inbox/m.onnx --settled--> claimed/<id>/m.onnx --submit--> job --final--> outbox/m_tuned.onnx
                                                                               outbox/m_result.json
                                                                               outbox/m_report.txt
                                                         (failed, cancelled) -> failed/m.onnx
                                                                               failed/m.onnx.error.txt

When a file is complete: names starting with `.` or ending in `.part` or `~` are
ignored, so a writer that copies to such a name and renames it is taken at once on the
rename. Any other `*.onnx` directly in the folder is taken once its size and mtime have
stayed the same for the inbox's `stable_s`.

Exactly once: a file is claimed by renaming it into the state dir's `claimed/`, recorded
in the job store before the rename (`claiming`) and after its job is recorded
(`claimed`). At start, claims a crash interrupted are settled: renamed but not submitted
-> submitted; never renamed -> forgotten (the scan takes the file again); submitted ->
delivered when the job ends (or at once if it already has). A claim row is dropped only
after its delivery, so a crash during delivery delivers again (under a `_2` name) rather
than never.

Options come from an optional `aoed.toml` in the inbox folder, read for each model:
precision, job_type (default sgat+opat, as `aoe tune`), input_shapes (a table name =
[dims]), priority, budget_s, repeat_tune, min_cosine, max_rel_error.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import stat
import time
import tomllib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import watchfiles

from aoe.errors import AoedError, OptionError
from aoed.config import DaemonConfig, Inbox
from aoed.jobs.manager import JobManager, Submission, options_from_dict
from aoed.jobs.store import FAILED, SUCCEEDED, Claim, JobRow

__all__ = ["OPTIONS_FILE", "Watcher", "folder_options"]

log = logging.getLogger(__name__)

#: the folder's options file (never a model)
OPTIONS_FILE = "aoed.toml"
_OPTION_KEYS = ("budget_s", "input_shapes", "job_type", "max_rel_error", "min_cosine", "precision", "priority",
                "repeat_tune")  # fmt: skip
#: rows of finished jobs waiting for the delivery task (see `_on_final` for why bounded)
_DELIVERY_BUFFER = 1024
#: how long the start waits to see a folder's watch working before it says ready anyway
_PROBE_S = 2.0


def _ignored(name: str) -> bool:
    """Temporary names of writers that copy and rename (and hidden files)."""
    return name.startswith(".") or name.endswith((".part", "~"))


def _candidate(name: str) -> bool:
    return not _ignored(name) and name.lower().endswith(".onnx")


def _status(exc: AoedError) -> str:
    """The gRPC status name an error maps to."""
    return exc.grpc_status


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
    `submit`, `get`, `on_final`, `store` and `engine.device.device`."""

    #: safety-net rescan of every folder (and of finished jobs not yet delivered)
    rescan_s = 30.0
    #: wait before submitting again when the queue is full
    retry_s = 5.0

    def __init__(self, cfg: DaemonConfig, jobs: JobManager):
        self._cfg = cfg
        self._jobs = jobs
        self._store = jobs.store
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
        self._nursery: trio.Nursery | None = None
        self._final_send, self._final_recv = trio.open_memory_channel[JobRow](_DELIVERY_BUFFER)

    # ------------------------------------------------------------- lifecycle

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Settle the claims a previous run left, start watching every inbox (each scanned
        once), then say ready and watch until cancelled. Errors about single files or
        folders are logged and never end it."""
        await trio.to_thread.run_sync(lambda: self._claims_dir.mkdir(parents=True, exist_ok=True))
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
            log.error("inbox %s: its outbox and failed folders must be other folders; not watched", inbox.path)
            return
        folder = self._folders[inbox.path] = _Folder(inbox)
        self._known[inbox.path] = inbox
        self._nursery.start_soon(self._watch_folder, folder)

    async def _watch_folder(self, folder: _Folder) -> None:
        """Watch `folder` until it is removed: (re)create it, prove the watch works with a
        probe file, scan what is already there, then handle changes as they come."""
        polling = False
        while not folder.removed:
            inbox = folder.inbox
            try:
                folder.ino = await trio.to_thread.run_sync(_prepare_dirs, inbox)
            except OSError as exc:
                log.error("inbox %s: cannot create it, its outbox or its failed folder (%s); trying again in %gs",
                          inbox.path, exc.strerror or exc, self.rescan_s)  # fmt: skip
                folder.ready.set()  # a broken folder must not hold up the daemon's start
                await trio.sleep(self.rescan_s)
                continue
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
                    inbox.path, watch_filter=None, stop_event=folder.stop, recursive=False, debounce=500, step=50,
                    force_polling=True if polling else None, yield_on_timeout=scans, rust_timeout=1000 if scans else None,
                ):  # fmt: skip
                    self._on_changes(folder, changes)
                    if scans:
                        await self._scan(folder)
            except (OSError, RuntimeError) as exc:  # RuntimeError: watchfiles' internal errors
                if not polling and inbox.path.is_dir():
                    log.warning("inbox %s: file notifications failed (%s); polling instead", inbox.path, exc)
                    polling = True
                    continue
                log.warning("inbox %s: watching failed (%s); trying again in %gs", inbox.path, exc, self.rescan_s)
                await trio.sleep(self.rescan_s)

    async def _probe_then_scan(self, folder: _Folder, probe: str) -> None:
        """Touch a hidden probe file until the watch reports it (the watch is then known to
        be running, so nothing created after the scan can be missed), then scan once."""
        path = folder.inbox.path / probe
        try:
            with trio.move_on_after(_PROBE_S):
                while not folder.probe_seen.is_set():
                    await trio.to_thread.run_sync(path.touch)
                    with trio.move_on_after(0.25):
                        await folder.probe_seen.wait()
        except OSError as exc:
            log.warning("inbox %s: cannot write in it (%s)", folder.inbox.path, exc.strerror or exc)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await trio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))
                except OSError:
                    pass
        if not folder.probe_seen.is_set():
            log.info("inbox %s: the watch did not report a probe file; the %gs rescan covers it", folder.inbox.path,
                     self.rescan_s)  # fmt: skip
        await self._scan(folder)
        folder.ready.set()

    def _on_changes(self, folder: _Folder, changes: set[tuple[watchfiles.Change, str]]) -> None:
        names = [(change, Path(p).name) for change, p in changes]
        if any(name == folder.probe for _, name in names):
            folder.probe_seen.set()
        # A temporary name that vanished in the same batch as a model appeared: the model
        # was renamed into place, complete, and needs no waiting.
        gone_temps = [name for change, name in names if change == watchfiles.Change.deleted and _ignored(name)]
        for change, name in names:
            if change == watchfiles.Change.deleted or not _candidate(name):
                continue
            fast = change == watchfiles.Change.added and any(name in t for t in gone_temps)
            self._consider(folder.inbox.path / name, folder, fast)

    async def _scan(self, folder: _Folder) -> None:
        try:
            names = await trio.to_thread.run_sync(_candidates_in, folder.inbox.path)
        except OSError as exc:
            log.warning("inbox %s: cannot list it (%s)", folder.inbox.path, exc.strerror or exc)
            return
        for name in names:
            self._consider(folder.inbox.path / name, folder, False)

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
                    log.warning("inbox %s: the folder was removed or replaced; watching it anew", folder.inbox.path)
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
                    await self._submit(claim)
            finally:
                self._in_flight.discard(key)
        except Exception as exc:
            self._retry_at[path] = trio.current_time() + self.rescan_s
            if isinstance(exc, AoedError | OSError):
                log.error("inbox: %s: %s; trying again at the next scan", path, exc)
            else:
                log.exception("inbox: %s: internal error; trying again at the next scan", path)
        finally:
            self._pending.pop(path, None)

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
                return False
            if pending.fast:
                return True
            stable_s = folder.inbox.stable_s  # a reload may change it while we wait
            now = trio.current_time()
            sig = (st.st_size, st.st_mtime_ns, st.st_ino)
            if sig != last:
                last, since = sig, now
            elif now - since >= stable_s:
                return True
            await trio.sleep(max(0.01, min(stable_s / 4, 0.5)))
        return False

    async def _claim(self, path: Path, inbox: Inbox) -> Claim | None:
        """Move `path` into the claims dir, recorded before and after; None when another
        file of that name is still claimed (it is taken after that one's delivery) or the
        file vanished. Raises OSError or StoreError (the claim is then undone)."""
        if any(c.src == str(path) for c in self._store.claims()):
            return None
        dst = self._claims_dir / uuid.uuid4().hex / path.name
        await trio.to_thread.run_sync(lambda: dst.parent.mkdir(parents=True))
        try:
            self._store.claim_begin(str(path), str(dst), str(inbox.path))
        except AoedError:
            await trio.to_thread.run_sync(dst.parent.rmdir)
            raise
        try:
            await trio.to_thread.run_sync(_move, path, dst)
        except OSError as exc:
            self._store.claim_drop(str(path))
            await trio.to_thread.run_sync(shutil.rmtree, dst.parent, True)
            if isinstance(exc, FileNotFoundError) and not path.exists():
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
                opts = folder_options(Path(claim.inbox), self._jobs.engine.device.device)
                row, joined = await self._jobs.submit(Submission(model=model, options=opts,
                                                                 source=f"inbox:{claim.inbox}"))  # fmt: skip
            except AoedError as exc:
                if _status(exc) in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"):
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
        self._store.claim_done(claim.src, row.id)
        log.info("inbox %s: %s is job %s%s", claim.inbox, model.name, row.id, " (joined)" if joined else "")
        if row.final:  # joined a job that has ended since: on_final will not come again
            self._queue(row)

    # ------------------------------------------------------------- reconciling

    async def _reconcile(self) -> None:
        """At start: settle the claims a previous run left, and remove claimed copies no
        claim refers to (a crash between creating the folder and recording the claim, or
        between a delivery and the removal of the copy)."""
        self._settle_claims()
        referenced = {Path(c.dst).parent for c in self._store.claims()}
        for d in await trio.to_thread.run_sync(lambda: list(self._claims_dir.iterdir())):
            if d not in referenced:
                await trio.to_thread.run_sync(_remove, d)
        self._queue_finished_claims()

    def _settle_claims(self) -> None:
        """'claiming' claims no task of this run is working on: submit those whose file
        was moved, forget those whose file never was (the scan takes it again)."""
        assert self._nursery is not None
        for c in self._store.claims("claiming"):
            if c.src in self._in_flight:
                continue
            src, dst = Path(c.src), Path(c.dst)
            if dst.exists():
                log.info("inbox %s: %s was claimed but not submitted; submitting it", c.inbox, dst.name)
                self._in_flight.add(c.src)
                self._nursery.start_soon(self._submit_reconciled, c, src.exists() and _same_file_data(src, dst))
            else:
                self._store.claim_drop(c.src)

    async def _submit_reconciled(self, claim: Claim, unlink_src: bool) -> None:
        try:
            if unlink_src:  # a cross-device copy that ended before its unlink
                await trio.to_thread.run_sync(lambda: Path(claim.src).unlink(missing_ok=True))
            await self._submit(claim)
        except (AoedError, OSError) as exc:
            log.error("inbox %s: %s: %s (trying again at the next sweep)", claim.inbox, claim.dst, exc)
        finally:
            self._in_flight.discard(claim.src)

    def _queue_finished_claims(self) -> None:
        for c in self._store.claims("claimed"):
            try:
                row = self._jobs.get(c.job_id)
            except AoedError as exc:
                if _status(exc) != "NOT_FOUND":
                    log.error("inbox %s: job %s: %s", c.inbox, c.job_id, exc)
                    continue
                row = JobRow(id=c.job_id, state=FAILED, model_path=c.dst, model_name=Path(c.dst).name,
                             model_sha256="", dedup_key="", options={}, output_dir="",
                             error="the job's record is gone (removed after its retention?)")  # fmt: skip
            if row.final:
                self._queue(row)

    # ------------------------------------------------------------- delivering

    def _on_final(self, row: JobRow) -> None:
        """The job manager's final-state callback (sync, in the trio thread)."""
        if any(c.job_id == row.id for c in self._store.claims("claimed")):
            self._queue(row)

    def _queue(self, row: JobRow) -> None:
        # Bounded so that a stuck delivery (a full or hung outbox disk) cannot grow memory
        # without limit; a row that does not fit is not lost: its claim stays 'claimed'
        # and the periodic sweep queues it again.
        try:
            self._final_send.send_nowait(row)
        except trio.WouldBlock:
            log.warning("inbox: job %s: the delivery queue is full; delivering at the next sweep", row.id)

    async def _deliver_loop(self) -> None:
        """The one task that delivers: one claim at a time, so that a job queued twice
        (callback and sweep) finds its claims gone the second time."""
        async for row in self._final_recv:
            for claim in self._store.claims("claimed"):
                if claim.job_id != row.id:
                    continue
                try:
                    if row.state == SUCCEEDED:
                        await self._deliver_success(claim, row)
                    else:
                        await self._deliver_failure(claim, row.id, row.state, row.error)
                except (AoedError, OSError) as exc:
                    log.error("inbox %s: delivering job %s failed (%s); trying again at the next sweep",
                              claim.inbox, row.id, exc)  # fmt: skip
                except Exception:
                    log.exception("inbox %s: delivering job %s: internal error", claim.inbox, row.id)

    def _inbox(self, path: str) -> Inbox:
        p = Path(path)
        return self._known.get(p) or Inbox(p, p.parent / "outbox", p.parent / "failed")

    async def _deliver_success(self, claim: Claim, row: JobRow) -> None:
        inbox = self._inbox(claim.inbox)
        names = await trio.to_thread.run_sync(_write_outputs, inbox.outbox, Path(claim.src).name, row)
        log.info("inbox %s: job %s delivered to %s (%s)", claim.inbox, row.id, inbox.outbox, ", ".join(names))
        await self._release(claim)

    async def _deliver_failure(self, claim: Claim, job_id: str, state: str, error: str) -> None:
        inbox = self._inbox(claim.inbox)
        text = (f"model: {Path(claim.src).name}\njob:   {job_id or '(none: the submission was refused)'}\n"
                f"state: {state}\nerror: {error or '(no message)'}\n")  # fmt: skip
        where = await trio.to_thread.run_sync(_write_failure, inbox.failed, Path(claim.dst), Path(claim.src).name, text)
        log.warning("inbox %s: %s %s: %s (moved to %s)", claim.inbox, Path(claim.src).name, state, error, where)
        await self._release(claim)

    async def _release(self, claim: Claim) -> None:
        """Forget a delivered claim; take a newer file of the same name that waited."""
        self._store.claim_drop(claim.src)
        dst = Path(claim.dst)
        if dst.parent.parent == self._claims_dir:
            await trio.to_thread.run_sync(_remove, dst.parent)
        folder = self._folders.get(Path(claim.inbox))
        src = Path(claim.src)
        if folder is not None and src.exists():
            self._consider(src, folder, False)


# ------------------------------------------------------------------ folder options


def folder_options(folder: Path, device: Any) -> dict[str, Any]:
    """The job options of `folder`'s aoed.toml (defaults without one), checked. Raises
    OptionError naming the file and the key."""
    f = folder / OPTIONS_FILE
    try:
        raw = tomllib.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raw = {}
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionError(f"{f}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise OptionError(f"{f}: not valid TOML ({exc}); fix it and drop the model again") from None
    unknown = sorted(set(raw) - set(_OPTION_KEYS))
    if unknown:
        raise OptionError(f"{f}: unknown key {unknown[0]!r} (known: {', '.join(_OPTION_KEYS)}); "
                          "fix it and drop the model again")  # fmt: skip
    if not isinstance(raw.get("input_shapes", {}), dict):
        raise OptionError(f"{f}: input_shapes must be a table of name = [dims]")
    try:
        return options_from_dict(raw, device)
    except OptionError as exc:
        raise OptionError(f"{f}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise OptionError(f"{f}: a value has the wrong type ({exc})") from None


# ------------------------------------------------------------------ file system (worker threads)


def _polling_forced() -> bool:
    """Whether watchfiles polls without being asked to (its environment variable)."""
    return os.environ.get("WATCHFILES_FORCE_POLLING", "").lower() not in ("", "false", "disable", "disabled")


def _prepare_dirs(inbox: Inbox) -> int:
    for d in (inbox.path, inbox.outbox, inbox.failed):
        d.mkdir(parents=True, exist_ok=True)
    return os.stat(inbox.path).st_ino


def _candidates_in(folder: Path) -> list[str]:
    with os.scandir(folder) as it:
        return [e.name for e in it if _candidate(e.name) and e.is_file(follow_symlinks=False)]


def _same_file_data(a: Path, b: Path) -> bool:
    try:
        sa, sb = a.stat(), b.stat()
    except OSError:
        return False
    return (sa.st_size, sa.st_mtime_ns) == (sb.st_size, sb.st_mtime_ns)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LinkedError(OSError):
    """A file with several hard links that a move would have to copy."""


def _move(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; across file systems, copy to a temporary name beside `dst`,
    fsync, rename, then unlink `src` (so `dst` exists only complete). A file with several
    hard links is never copied (_LinkedError): a hard link may be a file from elsewhere,
    which the copy would read for whoever dropped the link (JobManager refuses it)."""
    try:
        os.rename(src, dst)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    links = os.lstat(src).st_nlink
    if links > 1:
        raise _LinkedError(errno.EPERM, f"the file has {links} hard links, so it may be a file from elsewhere, and is "
                           "not copied across file systems; copy it into the inbox (cp, not ln)", str(src))  # fmt: skip
    _atomic_write(dst, lambda f: _copy_into(src, f))
    os.unlink(src)


def _copy_into(src: Path, f: Any) -> None:
    with open(src, "rb") as s:
        shutil.copyfileobj(s, f, 1 << 20)


def _atomic_write(dst: Path, fill: Callable[[Any], None]) -> None:
    """Write `dst` as `.NAME.part` in its folder, fsynced, then renamed into place."""
    tmp = dst.with_name(f".{dst.name}.part")
    try:
        with open(tmp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(dst.parent)


def _free_base(folder: Path, stem: str, suffixes: tuple[str, ...]) -> str:
    """`stem`, else `stem_2`, `stem_3`... : the first for which no `base+suffix` exists."""
    n = 1
    while True:
        base = stem if n == 1 else f"{stem}_{n}"
        if not any((folder / f"{base}{s}").exists() for s in suffixes):
            return base
        n += 1


_OUT_SUFFIXES = ("_tuned.onnx", "_result.json", "_report.txt")


def _write_outputs(outbox: Path, name: str, row: JobRow) -> list[str]:
    """Copy a succeeded job's tuned model and result JSON into `outbox` and write its
    report; returns the names written. An output the job no longer has is left out
    (and the report says so)."""
    outbox.mkdir(parents=True, exist_ok=True)
    result = row.result or {}
    base = _free_base(outbox, Path(name).stem, _OUT_SUFFIXES)
    tuned, result_json, report = (outbox / f"{base}{s}" for s in _OUT_SUFFIXES)
    written, missing = [], []
    for key, dst in (("tuned_model", tuned), ("result_json", result_json)):
        src = Path(str(result.get(key) or ""))
        if result.get(key) and src.is_file():
            _atomic_write(dst, lambda f, src=src: _copy_into(src, f))
            written.append(dst.name)
        else:
            missing.append(f"{key}: {src if result.get(key) else 'none'} is not available")
    text = _report_text(name, row, written, missing)
    _atomic_write(report, lambda f: f.write(text.encode()))
    return [*written, report.name]


def _report_text(name: str, row: JobRow, written: list[str], missing: list[str]) -> str:
    """A short human summary of the succeeded job that tuned the model `name`."""
    r = row.result or {}
    lo, hi = (list(r.get("improvement_ci95") or [0.0, 0.0]) + [0.0, 0.0])[:2]
    repo = r.get("repo") or {}
    shipped = {"tuned": "the tuned model", "options only": "the input model with tuned session options",
               "input": "the input model, unchanged"}.get(r.get("shipped", ""), r.get("shipped") or "-")  # fmt: skip
    result = "the input model timed again" if r.get("shipped") == "input" else "the shipped model"
    where = (f"from the bank, as confirmed by {r['confirmed_by']}" if r.get("confirmed_by")
             else f"confirming A/B, {r.get('confirm_rounds', 0)} interleaved rounds")  # fmt: skip
    lines = [
        f"aoed tuned {name}",
        f"job:          {row.id}",
        f"baseline:     {float(r.get('baseline_ms', 0.0)):.3f} ms ({where})",
        f"result:       {float(r.get('tuned_ms', 0.0)):.3f} ms ({result})",
        f"improvement:  {float(r.get('improvement', 0.0)):+.1%} (median of paired round ratios; 95% interval "
        f"{float(lo):+.1%} .. {float(hi):+.1%})",
        f"verdict:      {r.get('verdict') or '-'}",
        f"shipped:      {shipped}",
        f"bank:         add {repo.get('repo_add_num', 0)}, hit {repo.get('repo_hit_num', 0)}, reserved "
        f"{repo.get('repo_reserved_num', 0)}, unsatisfied {repo.get('repo_unsatisfied_num', 0)}, update "
        f"{repo.get('repo_update_num', 0)}, total {repo.get('total_num', 0)}",
        f"outputs:      {', '.join(written) or '(none)'}",
    ]
    lines += [f"missing:      {m}" for m in missing]
    return "\n".join(lines) + "\n"


def _write_failure(failed: Path, model: Path, name: str, text: str) -> Path:
    """Move the claimed `model` into `failed` under `name` (or `stem_2`...), with
    `<name>.error.txt` beside it; returns where it went."""
    failed.mkdir(parents=True, exist_ok=True)
    stem, suffix = Path(name).stem, Path(name).suffix
    base = _free_base(failed, stem, (suffix, f"{suffix}.error.txt"))
    dst = failed / f"{base}{suffix}"
    if model.exists():
        try:
            _move(model, dst)
        except _LinkedError:
            model.unlink()  # only this name goes: the file keeps its others, and the error says why
    _atomic_write(failed / f"{dst.name}.error.txt", lambda f: f.write(text.encode()))
    return dst
