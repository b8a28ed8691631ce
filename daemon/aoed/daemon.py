"""The daemon's supervisor: starts the agents in dependency order, handles signals, and
shuts down in the reverse order within a bound.

    job store -> engine (bank writer, compile pool, device agent) -> job manager
              -> inbox watcher -> gRPC server -> bank followers, metrics endpoint
    (last: "ready" means everything answers)

A follower per peer in `[bank] follow` applies that peer's bank writes to this one
(aoed.bank.follow); the metrics endpoint (`[metrics] listen`, aoed.metrics) serves a
snapshot of the agents' figures at each scrape.

SIGTERM and SIGINT stop: health turns NOT_SERVING, no new job starts, running jobs get
`shutdown_grace_s` to finish and are then cancelled (they stay queued and resume at the
next start), the server cancels the RPCs still open, the engine stops its children, and
the store and the bank are closed. Whatever the loop is doing, the process ends
`shutdown_grace_s` + 15 s after the signal (aoed.stopping).

SIGHUP re-reads the configuration: inbox folders and limits change at once; engine
settings (bank, device, workers), the peers followed and the metrics endpoint need a
restart, and the log says so.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from aoe.config import temp_runtime_dir
from aoe.errors import AoedError, BankError, PermissionDeniedError
from aoe.spec import JobType
from aoed.api import Bridge
from aoed.api.info import DaemonServicer, DeviceServicer
from aoed.api.server import Server, build_server, register
from aoed.api.tuning import TuningServicer
from aoed.bank.follow import Follower
from aoed.config import DaemonConfig, load_daemon_config
from aoed.endpoint import Limits
from aoed.jobs import store as st

if TYPE_CHECKING:
    import grpc
from aoed.jobs.manager import JobManager
from aoed.jobs.store import JobStore
from aoed.metrics import DaemonMetrics, Snapshot, count_states
from aoed.notify import Notifier, Watchdog
from aoed.stopping import StopDeadline
from aoed.vocabulary import tuner_vocabulary

__all__ = ["Daemon"]

log = logging.getLogger("aoed.service")


class Daemon:
    def __init__(self, cfg: DaemonConfig, config_path: str | None = None):
        self.cfg = cfg
        self.config_path = config_path
        self.server: Server | None = None
        self.jobs: JobManager | None = None
        self.watcher = None
        self._stop = trio.Event()
        self.started = time.time()
        # Read (and removed from the environment) before any child process starts.
        self.notifier = Notifier()
        self._probe_channel: grpc.Channel | None = None
        self.followers: list[Follower] = []
        self.metrics = DaemonMetrics() if cfg.metrics_listen else None
        self._bank_api = None
        self.deadline = StopDeadline(cfg.shutdown_grace_s)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until SIGTERM/SIGINT (or `request_stop()`). Raises AoedError when it
        cannot start (a bad config, a busy socket, an unusable device)."""
        from aoed.backends.runtimes import load_runtime
        from aoed.engine.engine import open_engine
        from aoed.engine.onnxjob import onnx_kinds
        from aoed.gdat import GdatKind

        cfg = self.cfg
        for d in (cfg.state_dir, cfg.uploads_dir, cfg.jobs_dir, cfg.claims_dir):
            try:
                d.mkdir(mode=0o750, parents=True, exist_ok=True)
            except OSError as exc:
                raise AoedError(f"state dir {d}: {exc.strerror or exc}") from None
        for d in (cfg.state_dir, cfg.engine.bank):
            _close_to_others(d)
        for d in {cfg.engine.runtime_dir, *([cfg.socket.parent] if cfg.socket else [])}:
            if d == temp_runtime_dir():
                _own_temp_folder(d)
        store = JobStore(cfg.store_path)
        try:
            runtime = load_runtime()
            gdat = GdatKind(limits=cfg.world_limits, allow_unconfined=cfg.allow_unconfined_gdat)
            async with open_engine(
                cfg.engine,
                runtime,
                cfg.state_dir / "logs",
                lock_group=cfg.socket_gid(),
                kinds={
                    **onnx_kinds(allow_unconfined=cfg.allow_unconfined_gdat),
                    JobType.GDAT: gdat,
                },
            ) as engine:
                # A damaged bank is refused, and logged, before a resumed job meets it:
                # the daemon serves without it (aoed.bank.writer).
                await engine.bank.check()
                async with trio.open_nursery() as nursery:
                    self.jobs = jobs = JobManager(cfg, store, engine)
                    await nursery.start(jobs.run)
                    self.watcher = await self._start_watcher(nursery, jobs)
                    bridge = Bridge(nursery)
                    connect = _peer_client(cfg)
                    self._bank_api = self._bank_servicer(bridge, engine, connect)
                    self.server = server = build_server(
                        cfg,
                        lambda s: register(
                            s,
                            TuningServicer(bridge, jobs),
                            self._bank_api,
                            DeviceServicer(bridge, jobs),
                            DaemonServicer(
                                bridge,
                                jobs,
                                cfg,
                                self.started,
                                lambda: self.server.addresses if self.server else [],
                            ),
                        ),
                        interceptors=[self.metrics.interceptor] if self.metrics is not None else [],
                    )
                    server.grpc.start()
                    server.set_serving(True)
                    log.info(
                        "aoed: serving on %s; state in %s; bank %s",
                        ", ".join(server.addresses),
                        cfg.state_dir,
                        cfg.engine.bank,
                    )
                    vocabulary = tuner_vocabulary(engine.registry)
                    for peer in cfg.follow:
                        follower = Follower(engine.bank, peer, connect, vocabulary)
                        self.followers.append(follower)
                        await nursery.start(follower.run)
                    if cfg.follow:
                        log.info("aoed: following the banks of %s", ", ".join(cfg.follow))
                    if self.metrics is not None:
                        try:
                            await nursery.start(
                                self.metrics.run,
                                cfg.metrics_listen,
                                self._snapshot,
                                Limits(cfg.metrics_max_connections, cfg.metrics_timeout_s),
                            )
                        except OSError as exc:
                            raise AoedError(
                                f"[metrics] listen = {cfg.metrics_listen!r}: cannot listen "
                                f"({exc.strerror or exc})"
                            ) from None
                    self.notifier.ready(self._status())
                    await nursery.start(Watchdog(self.notifier, self._probe, self._status).run)
                    task_status.started(server.addresses)
                    with (
                        trio.open_signal_receiver(
                            signal.SIGTERM, signal.SIGINT, signal.SIGHUP
                        ) as signals,
                        self.deadline.armed_by(signal.SIGTERM, signal.SIGINT),
                    ):
                        nursery.start_soon(self._signals, signals)
                        await self._stop.wait()
                    self.notifier.stopping(
                        "stopping: letting running jobs finish or requeueing them"
                    )
                    await self._shutdown(server, jobs)
                    nursery.cancel_scope.cancel()
        finally:
            store.close()
            self.notifier.close()
            if self._probe_channel is not None:
                self._probe_channel.close()
            log.info("aoed: stopped")

    def request_stop(self) -> None:
        self._stop.set()

    async def _signals(self, signals) -> None:
        async for sig in signals:
            if sig == signal.SIGHUP:
                self._reload()
            else:
                log.info("aoed: %s: shutting down", signal.Signals(sig).name)
                self._stop.set()

    def _status(self) -> str:
        if self.jobs is None or self.server is None:
            return "starting"
        queued, running = self.jobs.counts()
        device = self.jobs.engine.device.device
        bank = "; its bank is refused as damaged" if self.jobs.engine.bank.refused else ""
        return (
            f"{running} running, {queued} queued; {device} {'busy' if running else 'idle'}; "
            f"serving on {', '.join(self.server.addresses)}{bank}"
        )

    def _probe(self) -> bool:
        """One real call through gRPC and the bridge (runs in a thread): True when the
        daemon answered. Needs a socket it can reach without credentials: the unix
        socket, else plain loopback TCP; with TLS-only TCP the server is not probed."""
        import grpc

        from aoe.v1 import daemon_pb2, daemon_pb2_grpc

        cfg = self.cfg
        target = f"unix:{cfg.socket}" if cfg.socket else (cfg.tcp if cfg.tls_cert is None else "")
        if not target:
            return True
        if self._probe_channel is None:
            self._probe_channel = grpc.insecure_channel(target)
        try:
            daemon_pb2_grpc.DaemonServiceStub(self._probe_channel).GetDaemonInfo(
                daemon_pb2.GetDaemonInfoRequest(), timeout=5
            )
            return True
        except grpc.RpcError as exc:
            # At its RPC limit the server still answers: that is alive.
            return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    def _reload(self) -> None:
        self.notifier.reloading()
        try:
            self._reload_config()
        finally:
            self.notifier.ready(self._status())

    def _reload_config(self) -> None:
        try:
            new = load_daemon_config(self.config_path)
        except AoedError as exc:
            log.error("aoed: SIGHUP: the configuration was not reloaded: %s", exc)
            return
        old = self.cfg
        restart_only = (
            "follow",
            "follow_ca",
            "follow_cert",
            "follow_key",
            "follow_insecure_loopback",
            "metrics_listen",
            "metrics_allow_remote",
            "metrics_max_connections",
            "metrics_timeout_s",
        )
        if (
            new.engine != old.engine
            or new.listen_addresses() != old.listen_addresses()
            or any(getattr(new, k) != getattr(old, k) for k in restart_only)
        ):
            log.warning(
                "aoed: SIGHUP: engine, listen, [bank] follow and [metrics] settings change only at a restart"
            )
        kept = replace(
            new,
            engine=old.engine,
            socket=old.socket,
            tcp=old.tcp,
            state_dir=old.state_dir,
            **{k: getattr(old, k) for k in restart_only},
        )
        self.cfg = kept
        if self.jobs is not None:
            self.jobs.cfg = kept
            self.jobs.wake()
        if self.watcher is not None:
            self.watcher.reload(kept)
        log.info("aoed: SIGHUP: reloaded inboxes and limits")

    async def _shutdown(self, server: Server, jobs: JobManager) -> None:
        grace = self.cfg.shutdown_grace_s
        server.set_serving(False)
        with trio.CancelScope(shield=True):
            await jobs.stop(grace)
            # Streams still open (watchers of queued jobs) are cancelled after a moment.
            await trio.to_thread.run_sync(server.stop, 1.0)

    async def _start_watcher(self, nursery: trio.Nursery, jobs: JobManager):
        try:
            from aoed.watch import Watcher
        except ImportError:  # pragma: no cover - the watcher is optional while it is built
            return None
        watcher = Watcher(self.cfg, jobs)
        await nursery.start(watcher.run)
        return watcher

    def _bank_servicer(self, bridge: Bridge, engine, connect):
        try:
            from aoed.api.bank import BankServicer
        except ImportError:  # pragma: no cover
            return None
        return BankServicer(bridge, engine, connect, self.cfg.follow)

    async def _snapshot(self) -> Snapshot:
        """The figures the metrics endpoint serves, read in trio (see aoed.metrics)."""
        snap = Snapshot()
        jobs = self.jobs
        if jobs is None:
            return snap
        rows = jobs.list([], 1_000_000, None)
        snap.jobs = count_states([r.state for r in rows], (*st.ACTIVE, *st.FINAL))
        snap.queued = snap.jobs.get(st.QUEUED, 0)
        engine = jobs.engine
        snap.devices = engine.device_set.snapshot()
        snap.workers, snap.workers_busy = engine.pool.size, engine.pool.busy
        try:
            store = await engine.bank.store()
            stats = await trio.to_thread.run_sync(store.stats)
            snap.bank_head = await engine.bank.head()
        except BankError:  # a refused bank has no figures; the rest are served
            pass
        else:
            snap.bank_records = {
                "entry": stats.entries,
                "default": stats.defaults,
                "trial": stats.history,
            }
            snap.bank_used_bytes = stats.used_bytes
        w = engine.bank
        snap.lookups = {("engine", "hit"): w.hits, ("engine", "miss"): w.lookups - w.hits}
        if self._bank_api is not None:
            api = self._bank_api.bank
            snap.lookups.update({("api", "hit"): api.hits, ("api", "miss"): api.lookups - api.hits})
        snap.follow = {
            f.peer: (f.connected, f.behind, f.lag_s, f.applied, f.refused) for f in self.followers
        }
        return snap


def _peer_client(cfg: DaemonConfig):
    """What opens an aoe.client.Client to a peer whose bank this daemon follows (or
    syncs with): over TLS with the [bank] follow_* files, except unix sockets and
    plain loopback peers. Raises AoedError when a file cannot be read."""
    from aoe.client import Client

    def read(path) -> bytes | None:
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError as exc:
            raise AoedError(f"[bank] {path}: {exc.strerror or exc}") from None

    ca, cert, key = read(cfg.follow_ca), read(cfg.follow_cert), read(cfg.follow_key)

    def connect(target: str) -> Client:
        if target.startswith("unix:") or ca is None:
            return Client(target, timeout=30)
        return Client(
            target, timeout=30, root_certificates=ca, private_key=key, certificate_chain=cert
        )

    return connect


def _close_to_others(folder: Path) -> None:
    """Take other users' access away from `folder` (the state dir, the bank) when it is
    ours: what an earlier run under a looser umask left open (a 0755 state dir let any
    user read job rows; a 0755 bank let them export it). Logged; never fatal."""
    try:
        st = folder.stat()
    except FileNotFoundError:  # a bank made later is made closed
        return
    except OSError as exc:
        log.warning(
            "aoed: %s cannot be checked for other users' access (%s)", folder, exc.strerror or exc
        )
        return
    if st.st_uid != os.geteuid() or not st.st_mode & 0o007:
        return
    try:
        folder.chmod(stat.S_IMODE(st.st_mode) & ~0o007)
    except OSError as exc:
        log.warning(
            "aoed: %s is open to other users and could not be closed to them (%s)",
            folder,
            exc.strerror or exc,
        )
        return
    log.warning(
        "aoed: %s was open to other users (mode %04o); it is now %04o",
        folder,
        stat.S_IMODE(st.st_mode),
        stat.S_IMODE(st.st_mode) & ~0o007,
    )


def _own_temp_folder(folder: Path) -> None:
    """Make the runtime dir of last resort (`<tmp>/aoed-<uid>`, aoe.config) 0700, or
    check the one there: anyone may have made it first, to pass a socket of theirs off
    as this daemon's or to plant links where it puts its locks. One that is not a
    folder of this user's, or that others may write, is refused (PermissionDeniedError);
    one that others may only read is narrowed to 0700."""
    try:
        os.mkdir(folder, 0o700)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise AoedError(
            f"runtime folder {folder}: cannot create it ({exc.strerror or exc})"
        ) from None
    st = os.lstat(folder)
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        why = "is not a folder (a link or a file is in the way)"
    elif st.st_uid != os.geteuid():
        why = f"belongs to uid {st.st_uid}, not to this daemon's user (uid {os.geteuid()})"
    elif mode & 0o022:
        why = f"mode {mode:04o} lets others write in it"
    else:
        if mode != 0o700:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
            log.warning("aoed: %s was mode %04o; it is now 0700", folder, mode)
        return
    raise PermissionDeniedError(
        f"runtime folder {folder}: {why}, so what is in it may be someone else's; remove it "
        "(aoed makes it again, 0700), or set AOED_RUNTIME_DIR to a folder of your own"
    )
