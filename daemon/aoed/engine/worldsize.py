"""How many ranks a GDAT world may have here: `WorldLimits`, checked where a world size
enters (SubmitJob, a drop folder's aoed.toml, `aoe tune --job-type gdat`) and again
before a stored job starts, so that no rank process starts for a world over them.

Each rank is a process of its own (a Python interpreter that imports torch: about 320
MiB resident for a small model, measured with a world of 2 on gloo) and a log file, and
a world starts all its ranks together. A world of 100000 asked for 100000 of each; the
limits keep it to what the machine can run:

    max_world_size        ranks of one world, on any backend; default: the cores this
                          process may run on, at least 2 (GDAT's default world on gloo)
    max_ranks_per_device  ranks that share one device. On gloo a rank's device is a CPU
                          core (a world of 4 on 2 cores puts 2 on each, and they measure
                          each other's contention); on nccl and hccl it is its
                          accelerator, where torch runs one rank per device anyway.
                          Default 2, so the default world of 2 runs on one core.

A daemon takes both from `[limits]`; an embedded run (`aoe tune`) uses the defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aoe.errors import OptionError

__all__ = [
    "DEFAULT_RANKS_PER_DEVICE",
    "MIN_WORLD_SIZE",
    "WorldLimits",
    "cores",
    "default_max_world_size",
]

#: GDAT's default world on gloo, which every machine can run.
MIN_WORLD_SIZE = 2
DEFAULT_RANKS_PER_DEVICE = 2


def cores() -> int:
    """The CPU cores this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except OSError:  # pragma: no cover - every Linux has it
        return max(1, os.cpu_count() or 1)


def default_max_world_size() -> int:
    """The default `max_world_size`: this machine's cores, at least MIN_WORLD_SIZE."""
    return max(MIN_WORLD_SIZE, cores())


@dataclass(frozen=True)
class WorldLimits:
    max_world_size: int
    max_ranks_per_device: int = DEFAULT_RANKS_PER_DEVICE
    #: how messages name where the limits are set (a daemon's "[limits] "; "" embedded)
    section: str = ""

    @classmethod
    def of_machine(cls) -> WorldLimits:
        """The defaults, for a run with no daemon configuration."""
        return cls(default_max_world_size(), DEFAULT_RANKS_PER_DEVICE)

    def _key(self, key: str) -> str:
        return f"{self.section}{key}" if self.section else f"this machine's {key}"

    def check(self, world_size: int | None, backend: str, name: str = "world_size") -> None:
        """OptionError naming `name` (the field as its edge spells it), the size and the
        limit, when a world of `world_size` ranks on `backend` is over a limit. None is
        the default world: 2 on gloo; one rank per device elsewhere, which the backend
        itself bounds."""
        n = world_size if world_size is not None else (MIN_WORLD_SIZE if backend == "gloo" else 0)
        if n > self.max_world_size:
            raise OptionError(
                f"{name} {n}: over the limit of {self.max_world_size} ranks "
                f"({self._key('max_world_size')}); every rank is a process of its own: ask for "
                f"{self.max_world_size} or fewer"
                + (", or raise the limit in the daemon's configuration" if self.section else "")
            )
        per_core = self.max_ranks_per_device
        if backend == "gloo" and n > cores() * per_core:
            raise OptionError(
                f"{name} {n}: a gloo world runs on this machine's {cores()} CPU core(s), at most "
                f"{per_core} rank(s) on each ({self._key('max_ranks_per_device')}), so at most "
                f"{cores() * per_core} ranks"
            )
