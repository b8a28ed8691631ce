"""Precision policies: what accuracy a candidate must keep to be chosen.

Every candidate's outputs are compared with the fp32 reference on the same inputs, per
task and end to end. `exact` allows float-rounding differences only (reassociation in a
different kernel); lossy policies (int8 and later) come with their own budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

from aoe.errors import OptionError

__all__ = ["POLICIES", "PrecisionPolicy", "policy"]


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    task_max_rel_error: float  # max |y - ref| / max |ref|, per task
    task_min_cosine: float
    e2e_max_rel_error: float  # the same over the model's outputs
    e2e_min_cosine: float

    def task_ok(self, acc: dict[str, float]) -> bool:
        return (
            acc.get("max_rel_error", float("inf")) <= self.task_max_rel_error
            and acc.get("cosine", 0.0) >= self.task_min_cosine
        )

    def e2e_ok(self, acc: dict[str, float]) -> bool:
        return (
            acc.get("max_rel_error", float("inf")) <= self.e2e_max_rel_error
            and acc.get("cosine", 0.0) >= self.e2e_min_cosine
        )


POLICIES = {
    "exact": PrecisionPolicy("exact", 1e-4, 0.99999, 1e-3, 0.9999),
}


def policy(name: str) -> PrecisionPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise OptionError(
            f"--precision {name}: not supported (choose from: {', '.join(POLICIES)})"
        ) from None
