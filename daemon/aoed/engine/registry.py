"""The strategy registry: which ways to run a task the engine may try, per family.

A strategy is a real, different way to run a task that stock onnxruntime accepts: a
graph rewrite of the task's nodes. Each declares its family and its precision; the
engine asks its registry for a task's candidates and never names one itself, so a new
strategy plugs in by registering alone. Every family's first strategy is `DEFAULT`,
the task as the model has it: the incumbent to beat.

A strategy may take a parameter, spelled `name:param` (e.g. `int8_region:f3.7`: the
region in int8 but its Convs 3 and 7): `with_param` builds the rewrite for one, and
`propose` (run in a worker, where the task's real inputs can be run) names the variants
worth trying for a task.

A strategy also names the device kinds it is for (`kinds`; default: the CPU): a rewrite
into the CPU provider's contrib kernels is no alternative on a GPU, where those nodes
would fall back to the CPU. The default strategy is for every kind. A bank entry stores the full name, so the rewrite it describes
is reproduced exactly wherever it is applied.

A registry is a value, not a module global: an engine and each of its worker processes
build the same one (the runtime's `registry(plugins)`, runtime.py, from the same plugin
list), and tests build their own. A plugin is a module with a `register(registry)`
function, named in the config (`plugins`) or AOED_PLUGINS.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aoe.errors import OptionError
from aoe.recordcheck import Vocabulary
from aoed.engine.tasks import Rewrite, TaskView

__all__ = ["APPROX", "DEFAULT", "Strategy", "StrategyRegistry"]

DEFAULT = "default"
#: the precision of a strategy that approximates a formula in float: lossy, but no
#: quantization; offered under every lossy policy
APPROX = "approx"
#: The lossy policies a looser one admits as well: int4's budget (cosine >= 0.99) takes
#: an 8-bit grid, finer than its own; on CPUs with int8 dot products (VNNI, AMX), an int8
#: product with the activation quantized at run time is as fast as a 4-bit one at one
#: row and faster at more, and the gate keeps whichever passes.
FINER: dict[str, tuple[str, ...]] = {"int4": ("int8",)}

#: a strategy's rewrite: the task's view -> its rewrite, or None where it does not apply
RewriteFn = Callable[[TaskView], Rewrite | None]


@dataclass(frozen=True)
class Strategy:
    """A named rewrite for one family; `apply(view)` returns `None` where it does not apply."""

    name: str
    family: str
    precision: str
    rewrite: RewriteFn
    doc: str = ""
    #: the rewrite for `name:param` (None: the strategy takes no parameter)
    with_param: Callable[[TaskView, str], Rewrite | None] | None = None
    #: (view, evaluate, notes) -> the `name:param` variants to try for a task, where
    #: evaluate(rewrite or None) runs the task model (rewritten) on its real inputs and
    #: returns its output; what was measured goes to `notes`
    propose: Callable[[TaskView, Callable[[Rewrite | None], Any], list[str]], list[str]] | None = (
        None
    )
    #: the device kinds it is a real alternative on (aoe.device.KINDS); None: every kind
    kinds: frozenset[str] | None = frozenset({"cpu"})

    def for_kind(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds

    def apply(self, view: TaskView) -> Rewrite | None:
        return self.rewrite(view)


def _unchanged(view: TaskView) -> Rewrite:
    """The task as the model has it."""
    return Rewrite(tuple(view.nodes))


class StrategyRegistry:
    """Strategies by (family, name), in registration order."""

    def __init__(self, families: Iterable[str] = ()):
        self._by_key: dict[tuple[str, str], Strategy] = {}
        #: the model-wide option space on accelerators: (device, precision, op_types,
        #: cache options) -> [(dimension, [options, ...])] (see aoed.engine.session);
        #: the backend sets it, the engine only calls it
        self.session_space: Callable[..., list[tuple[str, list[dict[str, Any]]]]] | None = None
        self._vocabulary: Vocabulary | None = None
        for family in families:
            self.register(
                Strategy(
                    DEFAULT, family, "exact", _unchanged, "the task as the model has it", kinds=None
                )
            )

    def register(self, strategy: Strategy) -> Strategy:
        """Add `strategy` (a new name within its family); returns it. ValueError on a clash."""
        key = (strategy.family, strategy.name)
        if key in self._by_key and self._by_key[key] is not strategy:
            raise ValueError(
                f"strategy {strategy.name!r} is already registered for {strategy.family}"
            )
        self._by_key[key] = strategy
        self._vocabulary = None
        return strategy

    def strategy(
        self, name: str, family: str, precision: str = "exact", kinds: Iterable[str] = ("cpu",)
    ) -> Callable[[RewriteFn], RewriteFn]:
        """Decorator registering a rewrite function as strategy `name` of `family`, for
        devices of `kinds`."""

        def deco(fn: RewriteFn) -> RewriteFn:
            self.register(
                Strategy(
                    name, family, precision, fn, (fn.__doc__ or "").strip(), kinds=frozenset(kinds)
                )
            )
            return fn

        return deco

    def get(self, family: str, name: str) -> Strategy:
        """The strategy `name` of `family` (or `base:param` of a base that takes one);
        KeyError when there is none."""
        found = self._by_key.get((family, name))
        if found is not None:
            return found
        base_name, sep, param = name.partition(":")
        base = self._by_key.get((family, base_name)) if sep else None
        if base is None or base.with_param is None:
            raise KeyError(f"unknown strategy {name!r} for {family}")
        build = base.with_param
        return Strategy(
            name,
            family,
            base.precision,
            lambda view: build(view, param),
            base.doc,
            kinds=base.kinds,
        )

    def strategies_for(
        self, family: str, precision: str = "exact", kind: str = "cpu"
    ) -> Iterator[Strategy]:
        """The strategies of `family` allowed under `precision` on a device of `kind`, in
        registration order: exact ones always; under a lossy policy also its own and the
        `approx` ones (a formula approximated in float, e.g. GELU's erf by tanh), which
        every lossy policy's gates judge like any other lossy candidate, and the forms of
        the policies it admits (`FINER`: int4 admits int8)."""
        if precision == "exact":
            allowed = {"exact"}
        else:
            allowed = {"exact", precision, APPROX, *FINER.get(precision, ())}
        for s in self._by_key.values():
            if s.family == family and s.precision in allowed and s.for_kind(kind):
                yield s

    def has_choice(self, family: str, precision: str, kind: str = "cpu") -> bool:
        """True when a task of `family` has more than the default to try under `precision`
        on a device of `kind`."""
        return sum(1 for _ in self.strategies_for(family, precision, kind)) > 1

    def families(self) -> list[str]:
        return list(dict.fromkeys(f for f, _ in self._by_key))

    def vocabulary(self, knobs: Mapping[str, Iterable[str]] | None = None) -> Vocabulary:
        """The strategy names of every family, as the bank's record checks take them
        (aoe.recordcheck), with GDAT's process-group `knobs` (variable -> values)."""
        if knobs is None and self._vocabulary is not None:
            return self._vocabulary
        names: dict[str, set[str]] = {}
        with_param: dict[str, set[str]] = {}
        for (family, name), s in self._by_key.items():
            names.setdefault(family, set()).add(name)
            if s.with_param is not None:
                with_param.setdefault(family, set()).add(name)
        vocabulary = Vocabulary(
            {f: frozenset(n) for f, n in names.items()},
            {f: frozenset(n) for f, n in with_param.items()},
            {k: frozenset(v) for k, v in (knobs or {}).items()},
        )
        if knobs is None:
            self._vocabulary = vocabulary
        return vocabulary

    def load_plugins(self, modules: Iterable[str]) -> None:
        """Import each module and call its `register(registry)`; OptionError names a
        module that cannot be imported or has no such function."""
        for name in (m.strip() for m in modules):
            if not name:
                continue
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                raise OptionError(
                    f"plugin {name!r}: cannot import strategy plugin: {exc}"
                ) from None
            register = getattr(module, "register", None)
            if not callable(register):
                raise OptionError(f"plugin {name!r}: has no register(registry) function")
            register(self)
