"""Executors: where the engine's children run, the device runners and the compile workers.

The modules the children run are the runtime's (runtime.py: its worker and runner); an
executor only places them. The engine talks to each child through one small interface, `ChildLike`: `call()` one
request and get its `Answer` (aoed.engine.messages), `pause()`/`resume()`, `aclose()`.
`Child` (_child.py) is the local one: a process exec'd on this machine, spoken to in JSON
lines over a pipe. An executor makes them:

  local  `LocalExecutor`: today's children, on this machine (the default).
  ray    `aoed.engine.rayexec.RayExecutor`: one Ray actor per device, placed on the node
         that offers the device's resource, and compile workers as actors anywhere in the
         cluster; the same lines travel as bytes through Ray (`[cluster] executor`).

Device agents (device.py), the device set (devices.py) and the compile pool (pool.py) sit
above this interface and do not know which executor made their children: a crashed
actor reads as a crashed child (ChildDiedError), and costs the request in flight.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol

from aoe.config import Config
from aoe.device import Device
from aoed.engine._child import Child
from aoed.engine.messages import Answer, Request

__all__ = ["ChildLike", "Executor", "LOCAL", "LocalExecutor", "open_executor"]


class ChildLike(Protocol):
    name: str
    restarts: int

    @property
    def pid(self) -> int | None: ...

    async def call(self, request: Request) -> Answer: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    async def aclose(self) -> None: ...


class Executor(Protocol):
    #: "local" or "ray", for logs and `aoe devices`
    name: str
    #: True when children run elsewhere: nothing to pin or pause on this machine
    remote: bool

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
    ) -> ChildLike: ...

    def worker(
        self,
        module: str,
        name: str,
        log_path: Path,
        *,
        cpus: Sequence[int] = (),
        memory_mb: int = 0,
        plugins: Sequence[str] = (),
    ) -> ChildLike: ...

    def lock_name(self, device: Device) -> str: ...


class LocalExecutor:
    """Children exec'd on this machine (`_child.Child`)."""

    name = "local"
    remote = False

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
    ) -> Child:
        # The lock is the device agent's own here (`lock_group` is for a remote runner's).
        return Child(module, name, log_path, cpus=cpus, memory_mb=memory_mb)

    def worker(
        self,
        module: str,
        name: str,
        log_path: Path,
        *,
        cpus: Sequence[int] = (),
        memory_mb: int = 0,
        plugins: Sequence[str] = (),
    ) -> Child:
        args = ["--plugins", ",".join(plugins)] if plugins else []
        return Child(module, name, log_path, cpus=cpus, memory_mb=memory_mb, args=args)

    def lock_name(self, device: Device) -> str:
        return device.lock_name


LOCAL = LocalExecutor()


@contextlib.asynccontextmanager
async def open_executor(config: Config, probe_dir: Path) -> AsyncIterator[Executor]:
    """The executor `config.executor` names, connected for the block. `probe_dir` is a
    directory of this engine's that a remote executor checks its nodes can read (the
    paths requests carry must be theirs too). Raises DeviceError when the cluster cannot
    be reached, OptionError when its extra is missing (aoed.engine.rayexec)."""
    if config.executor != "ray":
        yield LOCAL
        return
    from aoed.engine.rayexec import open_ray

    async with open_ray(config, probe_dir) as executor:
        yield executor
