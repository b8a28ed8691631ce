"""The Ray executor: device runners and compile workers as actors of a Ray cluster.

`[cluster] executor = "ray"` with `address`: the engine connects to a cluster started
elsewhere (`ray start --head`, nodes joined with `ray start --address`) as a driver, and
stays the owner of everything a job decides (its store, events, outputs and bank writes
are this process's). What runs in the cluster:

- One measuring actor per device, placed by a custom resource the node that has the
  device offers: `device_resource(device)`, e.g. `aoe_device_cann0` for `cann:0`,
  `aoe_device_cpu0` for `cpu:0` (`ray start --resources '{"aoe_device_cann0": 1}'`). It
  holds that device's lock (devlock.py) on its node for each request, so a daemon or an
  `aoe tune` there never measures at the same time.
- Compile workers as actors of one CPU each, wherever the cluster has one free.

Both run the same code as the local children (the runner's and the worker's
`line_handler`) over the same wire format: a request travels as the JSON line a local
child would read, its answer as the line it would write (bytes as Ray's call argument and
return value; never a pickled engine object), and `_child.read_answer` reads it just as
strictly. A CPU core-set device's actor pins itself to those cores when its node has
them all, and says so in the engine's log when it does not.

Paths (a limit, checked at start): requests name files (a candidate's model, its inputs,
a workspace), and a remote actor opens them at the same path. So every node must see the
engine's state and output directories at the same paths: one machine, or a shared
filesystem mounted alike. Sending the bytes instead would mean rewriting every request
that names a file (models with external data, workspaces workers write into); so each
actor, when it starts, reads a probe file the engine wrote into its log directory, and
one that cannot is refused naming the path. The same start checks the device's
fingerprint on the node against the engine's: a decision measured there must be valid
for the bank key this engine writes.

Who may use the cluster (checked at start, rayauth.py): whoever holds its token runs
code as the nodes' user, and in this process. The engine reads the token from `[cluster]
token_file` (its own user's, mode 0600), and connects only to a head that refuses calls
without it and takes ours, unless `[cluster] allow_unauthenticated = true` says a head
that asks no token may be used.

Failures: an actor that dies mid-request (its node left, it was killed) is a crashed
child (ChildDiedError): the request in flight fails as a crashed runner's does, and the
next request starts a fresh actor; when the node went with it, the device set measures
the request again on another device of its kind (devices.py). When no live node offers the device's resource (its
node left), or no node takes the actor within START_TIMEOUT_S, the device is unusable
(`RayChild.unusable`) for RETRY_S: the device set sends work to the others meanwhile, and
then tries it again (a node that came back is used again). An unreachable head at start
is one DeviceError naming the address. A head lost later (HEAD_MISSES refused
connections in a row, polled every HEAD_POLL_S) fails every call waiting on an actor and
every call after, at once, until it answers again: without its head Ray neither reports
an actor's death nor places a new one, so the alternative is requests that wait for
their time limits. Ray's own reaction to a lost head, ending the driver's process after
60 s, is turned off (`_GCS_RECONNECT`): the daemon keeps running and serving.

Not applied on a node: the children's memory limit (RLIMIT_AS would bound Ray's own
worker process too) and pausing compile work while a device measures; give measuring
nodes their own cores (a CPU device's actor asks Ray for as many CPUs as it has cores).

Fork rule: `ray.init(address=...)` to an existing cluster starts no process here, it
only starts threads. Checked two ways: `strace -f -e trace=clone,clone3,fork,vfork,execve`
of a driver connecting from a thread as `_connect` does (ray 2.60: 28 clones, every one
CLONE_THREAD, no execve but the driver's own), and tests/test_cluster.py, where a daemon
on the ray executor has no child process at all once connected and after a job. Given
no address ray.init would start a cluster of its own, forking: `[cluster] address` is
required for that reason.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from aoe.config import CLUSTER_EXTRA, Config
from aoe.device import Device
from aoe.errors import DeviceError, OptionError
from aoed.engine._child import ChildDiedError, read_answer
from aoed.engine.devlock import DeviceLock
from aoed.engine.messages import Answer, Call, Request, encode
from aoed.engine.rayauth import check_head, read_token, use_token

__all__ = [
    "CONNECT_TIMEOUT_S",
    "HEAD_MISSES",
    "HEAD_POLL_S",
    "RETRY_S",
    "START_TIMEOUT_S",
    "DeviceActor",
    "RayChild",
    "RayExecutor",
    "WorkerActor",
    "device_resource",
    "open_ray",
    "require_ray",
]

log = logging.getLogger(__name__)

#: Seconds an actor may take to be placed and to load its code before its device is
#: called unusable (a fresh worker process importing onnxruntime takes a few).
START_TIMEOUT_S = 60.0
#: Seconds an unusable device is passed over before it is tried again.
RETRY_S = 30.0


def require_ray() -> Any:
    """The `ray` module; OptionError naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise OptionError(f'[cluster] executor = "ray": {CLUSTER_EXTRA}') from None
    return ray


def device_resource(device: Device) -> str:
    """The custom resource a node offers for `device`: `aoe_device_` and the device's
    name without its colon (`cann:0` -> aoe_device_cann0, `cpu:0-7` -> aoe_device_cpu0-7)."""
    return "aoe_device_" + device.name.replace(":", "")


class LineActor:
    """What runs in the cluster: one child's code behind `call(line) -> line`. Made a Ray
    actor class by `RayExecutor`; plain data in (module name, cores, the lock's place)."""

    def __init__(
        self,
        module: str,
        kwargs: dict[str, Any],
        device: tuple[str, dict[str, str]] | None,
        lock: tuple[str, str, int | None] | None,
    ):
        self._device = Device.parse(device[0], device[1]) if device is not None else None
        self.pinned = False
        cores = set(self._device.cores) if self._device is not None else set()
        if cores and cores <= os.sched_getaffinity(0):
            os.sched_setaffinity(0, cores)
            self.pinned = True
        self._answer: Callable[[bytes], bytes] = importlib.import_module(module).line_handler(
            **kwargs
        )
        self._lock = DeviceLock(Path(lock[0]), lock[1], lock[2]) if lock is not None else None

    def hello(self, probe: str, token: str) -> dict[str, Any]:
        """Who and where this actor is, whether it reads the engine's probe file (its
        paths are ours), and its device's fingerprint as this node sees it."""
        try:
            shared = (
                ""
                if Path(probe).read_text(encoding="utf-8") == token
                else "it holds another engine's token"
            )
        except OSError as exc:
            shared = exc.strerror or str(exc)
        digest = ""
        if self._device is not None:
            try:
                digest = self._device.fingerprint().digest
            except DeviceError as exc:
                digest = f"error: {exc}"
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pinned": self.pinned,
            "unshared": shared,
            "fingerprint": digest,
        }

    def call(self, line: bytes) -> bytes:
        if self._lock is None:
            return self._answer(line)
        with self._lock.hold_sync():
            return self._answer(line)


class DeviceActor(LineActor):
    """A device's measuring actor (its own class: `ray::DeviceActor` in a node's process
    list and in `ray status`)."""


class WorkerActor(LineActor):
    """A compile worker's actor."""


class RayChild:
    """A `ChildLike` (executor.py) served by a Ray actor, started on first use and again
    after one died. `unusable` says why no actor could be started, or is empty."""

    def __init__(
        self,
        executor: RayExecutor,
        module: str,
        name: str,
        *,
        kwargs: dict[str, Any] | None = None,
        device: Device | None = None,
        resources: dict[str, float] | None = None,
        num_cpus: float = 0,
        lock: tuple[str, str, int | None] | None = None,
    ):
        self._ex = executor
        self._module = module
        self._kwargs = kwargs or {}
        self._device = device
        self._resources = resources or {}
        self._num_cpus = num_cpus
        self._lock = lock
        self.name = name
        self.restarts = -1
        self._unusable = ""
        self._unusable_at = 0.0
        self.host = ""
        self._pid: int | None = None
        self._actor: Any = None
        self._seq = 0

    @property
    def unusable(self) -> str:
        """Why no actor could be started for this child, for RETRY_S after it happened;
        else empty."""
        return self._unusable if trio.current_time() - self._unusable_at < RETRY_S else ""

    def _refuse(self, why: str) -> ChildDiedError:
        self._unusable, self._unusable_at = why, trio.current_time()
        return ChildDiedError(f"{self.name}: {why}")

    @property
    def pid(self) -> int | None:
        """The actor's process id on its node (not this machine's, unless the node is)."""
        return self._pid if self._actor is not None else None

    async def _get(self, ref: Any) -> Any:
        # ray.get blocks: in a thread, abandoned on cancellation (killing the actor then
        # makes it return at once).
        return await trio.to_thread.run_sync(self._ex.ray.get, ref, abandon_on_cancel=True)

    async def _missing(self) -> list[str]:
        """The resources this child needs that no live node offers now (all of them when
        the head does not answer within CONNECT_TIMEOUT_S)."""
        if not self._resources:
            return []
        with trio.move_on_after(CONNECT_TIMEOUT_S):
            offered = await trio.to_thread.run_sync(
                self._ex.ray.cluster_resources, abandon_on_cancel=True
            )
            return [r for r in self._resources if r not in offered]  # the live nodes'
        return list(self._resources)

    async def _start(self) -> Any:
        ray = self._ex.ray
        if self._ex.lost:
            raise self._refuse(self._ex.lost)
        if missing := await self._missing():
            raise self._refuse(f"no live node of the Ray cluster offers {', '.join(missing)}")
        device = (
            (self._device.name, dict(self._device.options)) if self._device is not None else None
        )
        actor = (
            self._ex.actor_classes[self._device is not None]
            .options(
                resources=self._resources,
                num_cpus=self._num_cpus,
                max_restarts=0,
                max_concurrency=1,
            )
            .remote(self._module, self._kwargs, device, self._lock)
        )
        wants = f"resources {self._resources}" if self._resources else f"{self._num_cpus:g} CPU"
        try:
            with trio.fail_after(START_TIMEOUT_S):
                hello = await self._get(actor.hello.remote(str(self._ex.probe), self._ex.token))
        except trio.TooSlowError:
            await self._drop(actor)
            raise self._refuse(
                f"no node of the Ray cluster took it ({wants}) within {START_TIMEOUT_S:g}s"
            ) from None
        except ray.exceptions.RayError as exc:
            await self._drop(actor)
            raise self._refuse(f"its actor did not start: {_first_line(exc)}") from None
        problem = ""
        if hello["unshared"]:
            problem = (
                f"node {hello['host']} cannot read {self._ex.probe} ({hello['unshared']}): every node must see "
                "the engine's directories at the same paths (one machine, or a shared filesystem)"
            )
        elif self._device is not None and hello["fingerprint"] != self._ex.fingerprint(
            self._device
        ):
            problem = (
                f"{self._device} on node {hello['host']} is not the device this engine keys its bank for "
                f"(fingerprint {hello['fingerprint']}): its decisions would be wrong here"
            )
        if problem:
            await self._drop(actor)
            raise self._refuse(problem)
        if self._device is not None and self._device.cores and not hello["pinned"]:
            log.warning(
                "%s: node %s lacks core(s) %s: measuring unpinned",
                self.name,
                hello["host"],
                ",".join(map(str, self._device.cores)),
            )
        self._actor, self._pid, self.host, self._unusable = actor, hello["pid"], hello["host"], ""
        self.restarts += 1
        return actor

    async def call(self, request: Request) -> Answer:
        """Send `request` to the actor; return its answer, the reply decoded when it was
        served. Raises ChildDiedError (the actor died, could not start, or broke the
        protocol); kills the actor when cancelled mid-request."""
        if self._ex.lost:
            await self.aclose()
            raise self._refuse(self._ex.lost)
        actor = self._actor if self._actor is not None else await self._start()
        self._seq += 1
        line = json.dumps(encode(Call(self._seq, request))).encode() + b"\n"
        with trio.CancelScope() as waiting:
            self._ex.waiting.add(waiting)
            try:
                raw = await self._get(actor.call.remote(line))
            except self._ex.ray.exceptions.RayError as exc:
                await self.aclose()
                if missing := await self._missing():  # its node left: unusable from now on
                    raise self._refuse(
                        f"its actor died and no live node offers {', '.join(missing)}"
                    ) from None
                raise ChildDiedError(f"{self.name}: its actor died: {_first_line(exc)}") from None
            except BaseException:
                await self.aclose()
                raise
            finally:
                self._ex.waiting.discard(waiting)
            return read_answer(raw, request, self.name)
        await self.aclose()  # the head was lost while we waited (head_lost cancelled us)
        raise self._refuse(self._ex.lost or "the Ray head was lost")

    def pause(self) -> None:
        """Nothing: compile work on a node is not stopped while a device measures."""

    def resume(self) -> None:
        """Nothing (see `pause`)."""

    async def _drop(self, actor: Any) -> None:
        self._actor = actor
        await self.aclose()

    async def aclose(self) -> None:
        """Kill the actor (its node's worker process goes with it); shielded, bounded:
        without a head the kill may never be answered."""
        actor, self._actor = self._actor, None
        if actor is not None:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(5),
                contextlib.suppress(Exception),
            ):
                await trio.to_thread.run_sync(self._ex.kill, actor, abandon_on_cancel=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class RayExecutor:
    """Children as actors of the connected cluster (module docstring)."""

    name = "ray"
    remote = True

    def __init__(self, ray: Any, config: Config, probe: Path, token: str):
        self.ray = ray
        #: by whether the actor serves a device: compile worker, measuring actor
        self.actor_classes = (ray.remote(WorkerActor), ray.remote(DeviceActor))
        self.probe = probe
        self.token = token
        self._runtime_dir = str(config.runtime_dir)
        self._fingerprints: dict[Device, str] = {}
        #: why the head is lost (every call fails at once while it is), or empty
        self.lost = ""
        #: the calls waiting on an actor now: cancelled when the head is lost
        self.waiting: set[trio.CancelScope] = set()

    def head_lost(self, why: str) -> None:
        """Fail every call waiting on an actor, and every call until the head is back:
        without its head, Ray neither reports an actor's death nor places a new one."""
        log.warning("ray executor: %s; its devices and workers fail until it does", why)
        self.lost = why
        for scope in self.waiting:
            scope.cancel()

    def kill(self, actor: Any) -> None:
        self.ray.kill(actor, no_restart=True)

    def fingerprint(self, device: Device) -> str:
        if device not in self._fingerprints:
            self._fingerprints[device] = device.fingerprint().digest
        return self._fingerprints[device]

    def runner(
        self,
        device: Device,
        module: str,
        name: str,
        log_path: Path,
        *,
        cpus: Sequence[int] = (),
        memory_mb: int = 0,
        lock_group: int | None = None,
    ) -> RayChild:
        # A CPU device's actor claims its cores in Ray's count, so compile actors do not
        # land on them; an accelerator's claims its resource only.
        num_cpus = len(device.cores) if device.is_cpu and device.cores else 0
        return RayChild(
            self,
            module,
            f"{name} (ray: {device_resource(device)})",
            device=device,
            resources={device_resource(device): 1},
            num_cpus=num_cpus,
            lock=(self._runtime_dir, device.lock_name, lock_group),
        )

    def worker(
        self,
        module: str,
        name: str,
        log_path: Path,
        *,
        cpus: Sequence[int] = (),
        memory_mb: int = 0,
        plugins: Sequence[str] = (),
    ) -> RayChild:
        return RayChild(
            self,
            module,
            f"{name} (ray)",
            kwargs={"plugins": list(plugins)},
            num_cpus=1,
        )

    def lock_name(self, device: Device) -> str:
        """This machine's lock for a device elsewhere: distinct from a local device of the
        same name (the actor holds the device's own lock, on its node)."""
        return f"ray-{device_resource(device)}"


#: Seconds to reach the head: a TCP connection to it, then ray.init (which, given an
#: address nothing answers at, waits for it for minutes).
CONNECT_TIMEOUT_S = 30.0


#: The head is asked every HEAD_POLL_S whether it still accepts connections; after
#: HEAD_MISSES refusals in a row it is lost (`RayExecutor.head_lost`).
HEAD_POLL_S = 5.0
HEAD_MISSES = 3


def _host_port(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


async def _reachable(address: str) -> None:
    """OSError when nothing accepts a connection at `address` (HOST:PORT); "auto" and
    other spellings are left to ray.init. Callers bound the wait."""
    if (where := _host_port(address)) is None:
        return
    stream = await trio.open_tcp_stream(*where)
    await stream.aclose()


async def _watch_head(executor: RayExecutor, address: str) -> None:
    """Mark the head lost after HEAD_MISSES refused connections in a row, and found
    again when it answers (a cluster restarted under it is another matter: its actors'
    starts fail, and their devices are unusable)."""
    misses = 0
    while True:
        await trio.sleep(HEAD_POLL_S)
        try:
            with trio.fail_after(HEAD_POLL_S):
                await _reachable(address)
        except (OSError, trio.TooSlowError):
            misses += 1
            if misses == HEAD_MISSES:
                executor.head_lost(f"the Ray head at {address} does not answer")
            continue
        misses = 0
        if executor.lost:
            log.warning("ray executor: the head at %s answers again", address)
            executor.lost = ""


#: How long this process's Ray core keeps trying to reach a head it lost. Ray's own
#: default (60 s) ends the whole process after that, daemon and all: the engine would
#: rather see its devices fail and its jobs go on failing clearly.
_GCS_RECONNECT = ("RAY_gcs_rpc_server_reconnect_timeout_s", str(10 * 365 * 86400))


def _connect(ray: Any, address: str) -> None:
    # In a worker thread: ray.init installs no signal handlers off the main thread, so the
    # daemon's own SIGTERM/SIGHUP handling stays as it is.
    ray.init(
        address=address,
        namespace="aoed",
        log_to_driver=False,
        configure_logging=False,
        ignore_reinit_error=True,
    )


def _unreachable(config: Config, exc: Exception) -> DeviceError:
    if isinstance(exc, trio.TooSlowError):
        return DeviceError(
            f"[cluster] address {config.ray_address}: the Ray cluster did not answer within "
            f"{CONNECT_TIMEOUT_S:g}s"
        )
    return DeviceError(
        f"[cluster] address {config.ray_address}: cannot reach the Ray cluster: {_first_line(exc)}"
    )


@contextlib.asynccontextmanager
async def open_ray(config: Config, probe_dir: Path) -> AsyncIterator[RayExecutor]:
    """Connect to the cluster at `config.ray_address` for the block; yields the executor.
    OptionError when ray is not installed or the token file is unfit (rayauth.read_token);
    PermissionDeniedError when the head asks no token and that is not allowed, or refuses
    ours (rayauth.check_head); DeviceError when the head cannot be reached."""
    token_file = config.ray_token_file
    secret = read_token(token_file) if token_file is not None else None
    use_token(token_file)  # before ray is imported: Ray reads its mode then
    # Also before the import: Ray's config reads the environment once, early, and a GCS
    # client made then keeps Ray's 60 s; set at ray.init, the limit was seen only by the
    # message that ended the process ("within 315360000 seconds", 60 s after the loss).
    os.environ.setdefault(*_GCS_RECONNECT)
    ray = require_ray()
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            await _reachable(config.ray_address)
    except (OSError, trio.TooSlowError) as exc:
        raise _unreachable(config, exc) from None
    if _host_port(config.ray_address) is not None:
        await trio.to_thread.run_sync(check_head, config, secret, abandon_on_cancel=True)
    else:  # "auto", allowed only without a token (aoe.config): nothing to ask it
        log.warning(
            "ray executor: [cluster] allow_unauthenticated = true: the cluster at %s is used "
            "without a token, unchecked",
            config.ray_address,
        )
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            await trio.to_thread.run_sync(_connect, ray, config.ray_address, abandon_on_cancel=True)
    except Exception as exc:  # TooSlowError, and ray's ConnectionError, RuntimeError, ValueError
        raise _unreachable(config, exc) from None
    # Not awaited: a cancel here, before the `try` below, would leave ray connected.
    probe_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240
    token = secrets.token_hex(16)
    probe = probe_dir / f"ray-probe-{os.getpid()}"
    probe.write_text(token, encoding="utf-8")  # noqa: ASYNC240
    executor = RayExecutor(ray, config, probe, token)
    try:
        async with trio.open_nursery() as nursery:
            if _host_port(config.ray_address) is not None:
                nursery.start_soon(_watch_head, executor, config.ray_address)
            yield executor
            nursery.cancel_scope.cancel()
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
        with trio.CancelScope(shield=True), trio.move_on_after(10):  # a lost head may never answer
            await trio.to_thread.run_sync(ray.shutdown, abandon_on_cancel=True)
