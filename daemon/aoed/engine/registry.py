"""The strategy registry: which ways to run a task the engine may try, per family.

A strategy is a real, different way to run a task that stock onnxruntime accepts: a
graph rewrite of the task's nodes. Each declares its family and its precision; the
engine asks its registry for a task's candidates and never names one itself, so a new
strategy plugs in by registering alone. Every family's first strategy is `DEFAULT`,
the task as the model has it: the incumbent to beat.

A registry is a value, not a module global: an engine and each of its worker processes
build the same one (`aoed.backends.ort.catalog.build_registry`, from the same plugin
list), and tests build their own. A plugin is a module with a `register(registry)`
function, named in the config (`plugins`) or AOED_PLUGINS.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from aoe.errors import OptionError
from aoed.engine.tasks import Rewrite, TaskView

__all__ = ["DEFAULT", "Strategy", "StrategyRegistry"]

DEFAULT = "default"


@dataclass(frozen=True)
class Strategy:
    """A named rewrite for one family; `apply(view)` returns `None` where it does not apply."""

    name: str
    family: str
    precision: str
    rewrite: Callable[[TaskView], Rewrite | None]
    doc: str = ""

    def apply(self, view: TaskView) -> Rewrite | None:
        return self.rewrite(view)


def _unchanged(view: TaskView) -> Rewrite:
    """The task as the model has it."""
    return Rewrite(tuple(view.nodes))


class StrategyRegistry:
    """Strategies by (family, name), in registration order."""

    def __init__(self, families: Iterable[str] = ()):
        self._by_key: dict[tuple[str, str], Strategy] = {}
        for family in families:
            self.register(Strategy(DEFAULT, family, "exact", _unchanged, "the task as the model has it"))

    def register(self, strategy: Strategy) -> Strategy:
        """Add `strategy` (a new name within its family); returns it. ValueError on a clash."""
        key = (strategy.family, strategy.name)
        if key in self._by_key and self._by_key[key] is not strategy:
            raise ValueError(f"strategy {strategy.name!r} is already registered for {strategy.family}")
        self._by_key[key] = strategy
        return strategy

    def strategy(self, name: str, family: str, precision: str = "exact"):
        """Decorator registering a rewrite function as strategy `name` of `family`."""

        def deco(fn: Callable[[TaskView], Rewrite | None]):
            self.register(Strategy(name, family, precision, fn, (fn.__doc__ or "").strip()))
            return fn

        return deco

    def get(self, family: str, name: str) -> Strategy:
        """The strategy `name` of `family`; KeyError when there is none."""
        try:
            return self._by_key[(family, name)]
        except KeyError:
            raise KeyError(f"unknown strategy {name!r} for {family}") from None

    def strategies_for(self, family: str, precision: str = "exact") -> Iterator[Strategy]:
        """The strategies of `family` allowed under `precision`, in registration order."""
        allowed = {"exact"} if precision == "exact" else {"exact", precision}
        for s in self._by_key.values():
            if s.family == family and s.precision in allowed:
                yield s

    def has_choice(self, family: str, precision: str) -> bool:
        """True when a task of `family` has more than the default to try under `precision`."""
        return sum(1 for _ in self.strategies_for(family, precision)) > 1

    def families(self) -> list[str]:
        return list(dict.fromkeys(f for f, _ in self._by_key))

    def load_plugins(self, modules: Iterable[str]) -> None:
        """Import each module and call its `register(registry)`; OptionError names a
        module that cannot be imported or has no such function."""
        for name in (m.strip() for m in modules):
            if not name:
                continue
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                raise OptionError(f"plugin {name!r}: cannot import strategy plugin: {exc}") from None
            register = getattr(module, "register", None)
            if not callable(register):
                raise OptionError(f"plugin {name!r}: has no register(registry) function")
            register(self)
