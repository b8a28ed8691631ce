"""GDAT: gradient-communication tuning for data-parallel training on PyTorch DDP.

A GDAT job measures real worlds of rank processes (aoed.backends.torch) running DDP
steps under configurations from its search space (space.py), races them in interleaved
rounds (race.py), gates lossy comm hooks against exact all-reduce (gate.py), confirms
its proposal against DDP's defaults (search.py), and keeps what it learned in the bank
under the model's gradient layout (aoe.gradlayout), where `aoe.gdat.ddp()` finds it.
A GDAT job enters by the engine's door as every job does: `GdatKind` (kind.py).
"""

from __future__ import annotations

from aoed.gdat.job import MISSING_TORCH, GdatOptions, run_gdat
from aoed.gdat.kind import GdatKind
from aoed.gdat.outcome import GdatResult, to_outcome

__all__ = ["MISSING_TORCH", "GdatKind", "GdatOptions", "GdatResult", "run_gdat", "to_outcome"]
