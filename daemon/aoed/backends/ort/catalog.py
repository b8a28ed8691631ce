"""The strategy registry for ONNX Runtime's CPU provider: built-ins, then plugins."""

from __future__ import annotations

from collections.abc import Iterable

from aoe.partition import FAMILIES
from aoed.backends.ort import quant, strategies
from aoed.engine.registry import StrategyRegistry

__all__ = ["build_registry"]


def build_registry(plugins: Iterable[str] = ()) -> StrategyRegistry:
    """A registry with every family's default, the exact and the int8 strategies, then
    those the `plugins` modules register. Raises OptionError for a broken plugin."""
    registry = StrategyRegistry(FAMILIES)
    strategies.register(registry)
    quant.register(registry)
    registry.load_plugins(plugins)
    return registry
