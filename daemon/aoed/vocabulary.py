"""What this tuner writes, as the checks of bank records from outside take it
(aoe.recordcheck.Vocabulary): the strategy names of its registry (built-ins and the
configured plugins) and the process-group knobs GDAT's search sets on each backend.

Imports, followed peers, SyncBank and `aoe compile` refuse a record naming anything
else, so a record can only ask for what this tuner could itself have chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

from aoe.recordcheck import Vocabulary
from aoed.engine.registry import StrategyRegistry

__all__ = ["gdat_knobs", "tuner_vocabulary"]


def gdat_knobs() -> dict[str, set[str]]:
    """Every process-group knob GDAT's search sets, on any backend: variable -> values."""
    from aoed.gdat.space import BACKEND_KNOBS

    knobs: dict[str, set[str]] = {}
    for settings in BACKEND_KNOBS.values():
        for world in settings:
            for name, value in world:
                knobs.setdefault(name, set()).add(value)
    return knobs


def tuner_vocabulary(
    registry: StrategyRegistry | None = None, plugins: Sequence[str] = ()
) -> Vocabulary:
    """The vocabulary of `registry` (default: the built-in one with `plugins`), with
    GDAT's knobs. Raises OptionError for a broken plugin."""
    if registry is None:
        from aoed.backends.runtimes import load_runtime

        registry = load_runtime().registry(plugins)
    return registry.vocabulary(gdat_knobs())
