"""A GDAT world: N rank processes started together and spoken to in lockstep.

Invariants:
- Ranks start through exec (`python -m aoed.backends.torch.rank`, engine/_child.py;
  their messages: engine/rankmessages.py),
  never by forking a process that may have started gRPC; each dies with its parent
  (PR_SET_PDEATHSIG) and inherits no service-manager variables.
- A world is all or nothing: every request goes to every rank (each runs the same
  collectives in the same order), and when one rank dies, hangs past the caller's limit
  or breaks the protocol, every rank is killed and reaped before the call raises
  WorldError. The next call starts a fresh world (a new generation: new processes, a new
  rendezvous), so a broken world costs the request in flight, never the job.
- Rendezvous is a FileStore in the job's workspace: loopback only, no port to choose or
  to race for. gloo's own connections are bound to the loopback interface.
- A process that loads a .pt2 is confined (aoed.sandbox, its policy on its command
  line): it writes only the world's folder, reads only the program besides Python and
  the system, and its network closes once the world has formed. User code (`entry`,
  embedded runs only) runs unconfined.
- The world holds the device lock of every device it runs on (engine/devlock.py, in
  name order, so two worlds never wait on each other) for each request it serves, and
  lets go in between: a daemon, an embedded `aoe tune` and `aoe bank verify` take turns.
- Options that must be set before the process group exists (the backend's environment
  knobs) are the world's: another setting is another world.
- Cancellation kills every rank (Child.call kills its child when cancelled) and
  `aclose()` reaps whatever is left, shielded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from aoe.errors import CandidateError, ModelError, OptionError
from aoe.gradlayout import BACKENDS
from aoed.engine._child import Child, ChildDiedError
from aoed.engine.devlock import DeviceLock
from aoed.engine.messages import Answer, Request, encode
from aoed.engine.rankmessages import (
    RankExport,
    RankExportRequest,
    RankInitRequest,
    RankInspectRequest,
)
from aoed.sandbox import Policy

__all__ = [
    "RANK_MODULE",
    "World",
    "WorldError",
    "WorldSpec",
    "export_model",
    "inspect_model",
    "lock_names",
]

RANK_MODULE = "aoed.backends.torch.rank"
#: Errors a rank reports that are the job's (a bad model, a missing backend), not the
#: world's: every rank meets them alike, and a fresh world would too.
_JOB_ERRORS: dict[str, type[Exception]] = {"ModelError": ModelError, "OptionError": OptionError}


class WorldError(CandidateError):
    """The world broke during a request (a rank died, hung or failed); it was torn down."""


@dataclass(frozen=True)
class WorldSpec:
    #: {"kind": "pt2", "path": ..., "shown": what messages call it} or {"kind": "entry",
    #: "path": ..., "function": ...}
    source: Mapping[str, str]
    world_size: int
    backend: str
    #: environment of every rank, set before the process group exists (backend knobs)
    env: tuple[tuple[str, str], ...] = field(default=())
    #: load a .pt2 unconfined where the kernel cannot confine (else the job fails)
    unconfined_ok: bool = False


def lock_names(backend: str, world_size: int) -> list[str]:
    """The devices (as aoe.device names them, so the same lock files) a world of
    `world_size` on `backend` runs on: the CPU for gloo, one accelerator per rank else."""
    kind = BACKENDS[backend]
    return ["cpu"] if kind == "cpu" else [f"{kind}:{i}" for i in range(world_size)]


def _cores(world_size: int) -> tuple[list[list[int]], int]:
    """(cores per rank, threads per rank): disjoint core sets when there are enough
    cores for every rank, else no pinning and one thread each."""
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // world_size
    if per < 1:
        return [[] for _ in range(world_size)], 1
    return [cores[r * per : (r + 1) * per] for r in range(world_size)], per


def _rank_env(spec: WorldSpec, threads: int) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(threads), "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}
    if spec.backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env | dict(spec.env)


def _sandbox_args(
    source: Mapping[str, str], backend: str, workdir: Path, *, world: bool, unconfined_ok: bool
) -> list[str]:
    """The command-line policy of a process that loads `source` (none for user code)."""
    if source.get("kind") == "entry":
        return []
    kind = BACKENDS.get(backend, "cpu")
    policy = Policy(
        read=(str(source["path"]),),
        write=(str(workdir),),
        devices="" if kind == "cpu" else kind,
        keep_network=world,
        unconfined_ok=unconfined_ok,
    )
    return ["--sandbox", policy.to_arg()]


def _failure(answer: Answer, who: str) -> Exception:
    cls = _JOB_ERRORS.get(answer.error_class)
    message = answer.error or "failed without a message"
    return cls(message) if cls is not None else WorldError(f"{who}: {message}")


class World:
    def __init__(
        self,
        spec: WorldSpec,
        workdir: Path,
        runtime_dir: Path,
        *,
        name: str = "world",
        on_wait: Callable[[str], None] | None = None,
        init_limit_s: float = 300.0,
    ):
        self.spec = spec
        self.workdir = workdir
        self.name = name
        self.on_wait = on_wait
        self.init_limit_s = init_limit_s
        self._locks = [
            DeviceLock(runtime_dir, d) for d in sorted(lock_names(spec.backend, spec.world_size))
        ]
        self._ranks: list[Child] = []
        self.generation = 0
        self.layout: dict[str, Any] = {}
        self.restarts = 0

    @property
    def pids(self) -> list[int]:
        """The live rank processes' ids (rank order)."""
        return [c.pid for c in self._ranks if c.pid is not None]

    @property
    def running(self) -> bool:
        return bool(self._ranks)

    @contextlib.asynccontextmanager
    async def _held(self) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for lock in self._locks:
                await stack.enter_async_context(lock.hold(self.on_wait))
            yield

    async def _all(self, requests: Sequence[Request], limit_s: float) -> list[dict[str, Any]]:
        """Send request r to rank r, all at once; the replies in rank order, each read
        strictly as its request's reply type and handed on as plain data. On any
        failure every rank is killed and WorldError (or the job's own error) raised."""
        replies: list[dict[str, Any] | None] = [None] * len(self._ranks)
        failures: list[Exception] = []

        async def one(r: int, child: Child, request: Request, cancel: trio.CancelScope) -> None:
            try:
                answer = await child.call(request)
            except ChildDiedError as exc:
                failures.append(WorldError(f"{self.name}: rank {r} died: {exc}"))
                cancel.cancel()
                return
            if not answer.ok:
                # The others may wait for this rank in a collective that never comes.
                failures.append(_failure(answer, f"{self.name}: rank {r}"))
                cancel.cancel()
                return
            replies[r] = encode(answer.reply)

        try:
            with trio.move_on_after(limit_s) as timer:
                async with trio.open_nursery() as nursery:
                    for r, (child, request) in enumerate(zip(self._ranks, requests, strict=True)):
                        nursery.start_soon(one, r, child, request, nursery.cancel_scope)
            if timer.cancelled_caught and not failures:
                failures.append(
                    WorldError(
                        f"{self.name}: no answer from every rank within {limit_s:.0f} s (a rank "
                        "hung in a collective?)"
                    )
                )
        except BaseException:
            await self.aclose()
            raise
        if failures:
            await self.aclose()
            raise next((f for f in failures if not isinstance(f, WorldError)), failures[0])
        return [rep for rep in replies if rep is not None]

    async def start(self) -> dict[str, Any]:
        """Start the ranks and form the world (rendezvous, model loaded on every rank);
        returns rank 0's layout reply. Raises WorldError, or ModelError/OptionError when
        the model or backend is at fault."""
        if self._ranks:
            return self.layout
        self.generation += 1
        self.workdir.mkdir(parents=True, exist_ok=True)
        store = self.workdir / f"{self.name}-{self.generation}.store"
        store.unlink(missing_ok=True)
        cores, threads = (
            _cores(self.spec.world_size)
            if self.spec.backend == "gloo"
            else ([[] for _ in range(self.spec.world_size)], 1)
        )
        env = _rank_env(self.spec, threads)
        policy = _sandbox_args(
            self.spec.source,
            self.spec.backend,
            self.workdir,
            world=True,
            unconfined_ok=self.spec.unconfined_ok,
        )
        self._ranks = [
            Child(
                RANK_MODULE,
                f"{self.name} rank {r}",
                self.workdir / f"{self.name}-rank{r}.log",
                cpus=cores[r],
                args=policy,
                env=env,
                restart=False,
            )
            for r in range(self.spec.world_size)
        ]
        requests = [
            RankInitRequest(
                rank=r,
                world_size=self.spec.world_size,
                backend=self.spec.backend,
                source=dict(self.spec.source),
                store=str(store),
                threads=threads,
            )
            for r in range(self.spec.world_size)
        ]
        # The ranks start one at a time, each after a checkpoint: a cancel (a stop of the
        # daemon) is seen between two of them, and the daemon's other tasks run between
        # them, however large the world. Started all at once, every start ran in one
        # batch of trio's loop before it looked at anything else.
        for r, child in enumerate(self._ranks):
            try:
                await child.start()
            except OSError as exc:
                await self.aclose()
                raise WorldError(
                    f"{self.name}: rank {r} of {len(self._ranks)} could not start "
                    f"({exc.strerror or exc})"
                ) from None
            except BaseException:
                await self.aclose()
                raise
        async with self._held():
            replies = await self._all(requests, self.init_limit_s)
        if any(rep.get("params") != replies[0].get("params") for rep in replies):
            await self.aclose()
            raise ModelError(
                f"{self.spec.source.get('path')}: the ranks loaded different models (gradient layouts "
                "differ): every rank must build the same model"
            )
        self.layout = replies[0]
        return self.layout

    async def call(self, request: Request, limit_s: float) -> list[dict[str, Any]]:
        """Send `request` to every rank (starting the world first when it is not
        running) while holding its devices; the replies in rank order. Raises
        WorldError when the world broke (it is torn down; the next call starts anew)."""
        if not self._ranks:
            if self.generation:
                self.restarts += 1
            await self.start()
        async with self._held():
            return await self._all([request] * len(self._ranks), limit_s)

    async def aclose(self) -> None:
        """Kill and reap every rank (shielded)."""
        ranks, self._ranks = self._ranks, []
        with trio.CancelScope(shield=True):
            for child in ranks:
                await child.aclose()

    def close_locks(self) -> None:
        for lock in self._locks:
            lock.close()


async def inspect_model(
    source: Mapping[str, str],
    backend: str,
    world_size: int,
    workdir: Path,
    *,
    unconfined_ok: bool = False,
) -> dict[str, Any]:
    """The model's gradient layout (and what this torch supports), from one rank process
    that loads it without joining any world (confined, with no network at all). Raises
    ModelError/OptionError for the model or backend, WorldError when the process fails."""
    child = Child(
        RANK_MODULE,
        "inspect",
        workdir / "inspect.log",
        args=_sandbox_args(source, backend, workdir, world=False, unconfined_ok=unconfined_ok),
        env={"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"},
        restart=False,
    )
    try:
        try:
            answer = await child.call(
                RankInspectRequest(source=dict(source), backend=backend, world_size=world_size)
            )
        except ChildDiedError as exc:
            raise WorldError(f"loading the model: {exc}") from None
        if not answer.ok:
            raise _failure(answer, "loading the model")
        layout: dict[str, Any] = encode(answer.reply)
        return layout
    finally:
        await child.aclose()


async def export_model(
    source: Mapping[str, str], out: Path, workdir: Path, *, unconfined_ok: bool = False
) -> RankExport:
    """The program `source` (kind pt2) exported to ONNX at `out` (in `workdir`), by one
    rank process that joins no world (confined as `inspect_model`'s: it reads the program
    and writes only `workdir`); the ONNX model's inputs' dims, and the ranges the program
    declared for its dynamic ones. Raises ModelError (the
    program, or what the exporter cannot take), OptionError (no confinement where it is
    required), WorldError when the process fails otherwise."""
    child = Child(
        RANK_MODULE,
        "export",
        workdir / "export.log",
        args=_sandbox_args(source, "gloo", workdir, world=False, unconfined_ok=unconfined_ok),
        env={"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"},
        restart=False,
    )
    try:
        try:
            answer = await child.call(RankExportRequest(source=dict(source), out=str(out)))
        except ChildDiedError as exc:
            raise WorldError(f"exporting the program to ONNX: {exc}") from None
        if not answer.ok:
            raise _failure(answer, "exporting the program to ONNX")
        reply: RankExport = answer.reply
        return reply
    finally:
        await child.aclose()
