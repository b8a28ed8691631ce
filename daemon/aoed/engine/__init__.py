"""The tuning engine: agents shared by many jobs, and the pipeline of one job.

Public names are loaded on first use, so a child process that needs one module (the
messages, the registry) does not import the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT": "aoed.engine.registry",
    "Engine": "aoed.engine.engine",
    "JobEvent": "aoed.engine.messages",
    "JobHandle": "aoed.engine.job",
    "JobKind": "aoed.engine.kind",
    "JobRun": "aoed.engine.job",
    "Strategy": "aoed.engine.registry",
    "StrategyRegistry": "aoed.engine.registry",
    "TaskResult": "aoed.engine.job",
    "open_engine": "aoed.engine.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aoed.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
