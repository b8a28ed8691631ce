"""The strategy registry for ONNX Runtime's CPU provider: built-ins, then plugins."""

from __future__ import annotations

from collections.abc import Iterable

from aoe.partition import FAMILIES
from aoe.subgraphs import SUBGRAPH_FAMILIES
from aoed.backends.ort import accel, attention, fusions, glu, quant, strategies
from aoed.engine.registry import StrategyRegistry

__all__ = ["build_registry"]


def build_registry(plugins: Iterable[str] = ()) -> StrategyRegistry:
    """A registry with every family's default (operator and subgraph families), the exact,
    subgraph and int8 strategies, then those the `plugins` modules register. Raises
    OptionError for a broken plugin."""
    registry = StrategyRegistry((*FAMILIES, *SUBGRAPH_FAMILIES))
    strategies.register(registry)
    attention.register(registry)
    fusions.register(registry)
    glu.register(registry)
    quant.register(registry)
    accel.register(registry)
    registry.session_space = accel.dimensions
    registry.load_plugins(plugins)
    return registry
