"""What a GDAT world (engine/world.py) and its rank processes
(aoed.backends.torch.rank) say to each other, read as strictly as every other child's
messages (engine/messages.py): one request type per op, each with its reply type.

The measure and gate replies carry a rank's figures as plain data: a gate's figures
differ by hook class (gradients or a loss curve), and the search reads them by name.
"""

from __future__ import annotations

from typing import Any

from msgspec import field

from aoed.engine.protocol import Message, Request

__all__ = [
    "RankExport",
    "RankExportRequest",
    "RankGateRequest",
    "RankInitRequest",
    "RankInspectRequest",
    "RankLayout",
    "RankMeasureReply",
    "RankMeasureRequest",
    "RankTurn",
]


class RankLayout(Message, frozen=True):
    """A model's gradient layout as a rank loaded it: (dtype, shape) of each parameter
    that needs a gradient, in registration order; whether this torch's DDP takes a
    first bucket cap; the accelerator's name ("" on CPU). `inspect` adds the torch
    version and how many devices of the backend's kind there are. `sandbox`: how the
    process that loaded the model is confined (aoed.sandbox.Confinement.describe)."""

    params: list[tuple[str, list[int]]]
    grad_bytes: int
    first_bucket: bool
    accelerator: str
    torch: str = ""
    devices: int = 0
    sandbox: str = ""


class RankInspectRequest(Request, tag="rank-inspect", frozen=True):
    """Load the model and say its layout, joining no world."""

    reply = RankLayout
    #: {"kind": "pt2", "path": ..., "shown": what messages call it} or {"kind": "entry",
    #: "path": ..., "function": ...}
    source: dict[str, str]
    backend: str
    world_size: int


class RankExport(Message, frozen=True):
    """An ONNX model exported from a program: its inputs' dims, by name (a dynamic
    dimension by its symbol)."""

    inputs: dict[str, list[int | str]]
    #: each dynamic dimension's range as the program declared it (its torch.export.Dim),
    #: by symbol: (lowest, highest) sizes
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    torch: str = ""
    sandbox: str = ""


class RankExportRequest(Request, tag="rank-export", frozen=True):
    """Load the program (`source`, kind pt2) and export it to ONNX at `out` for
    inference tuning (torch.onnx's exporter, its dynamic dimensions kept), joining no
    world."""

    reply = RankExport
    source: dict[str, str]
    out: str


class RankInitRequest(Request, tag="rank-init", frozen=True):
    """Join the world (a FileStore rendezvous at `store`) and load the model."""

    reply = RankLayout
    rank: int
    world_size: int
    backend: str
    source: dict[str, str]
    store: str
    threads: int = 1
    timeout_s: float = 120.0


class RankTurn(Message, frozen=True):
    """One configuration's turn on one rank: each measured step's time and
    communication tail (microseconds), DDP's bucket sizes, or why it could not run."""

    step_us: list[float] = field(default_factory=list)
    tail_us: list[float] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)
    error: str = ""


class RankMeasureReply(Message, frozen=True):
    results: dict[str, RankTurn]


class RankMeasureRequest(Request, tag="rank-measure", frozen=True):
    """Measure configurations (DDPConfig.to_params, by name) in `order`."""

    reply = RankMeasureReply
    configs: dict[str, dict[str, str]]
    order: list[str]
    warmup: int = 2
    steps: int = 5


class RankGateRequest(Request, tag="rank-gate", frozen=True):
    """A lossy configuration against exact all-reduce (the gate's figures by name)."""

    reply = dict[str, Any]
    config: dict[str, str]
    steps: int = 8
