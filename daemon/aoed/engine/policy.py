"""Precision policies: what accuracy a candidate must keep to be chosen.

Every candidate's outputs are compared with the fp32 reference on the same inputs, per
task and end to end. `exact` allows float-rounding differences only (reassociation in a
different kernel); `int8` accepts the error of 8-bit quantization within a budget
(default: cosine >= 0.999 and max error <= 25% of the output range, end to end; max
error is a worst case over every element, cosine the overall agreement); `int4`
(weight-only 4-bit products, and int8's forms, a finer grid) the same with cosine >=
0.99; `fp16` and `bf16` (float16 / bfloat16 compute on accelerators) cosine >= 0.999
and max error <= 5% (bf16: 10%).
"""

from __future__ import annotations

import math
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

    @property
    def lossy(self) -> bool:
        return self.name != "exact"


POLICIES = {
    "exact": PrecisionPolicy("exact", 1e-4, 0.99999, 1e-3, 0.9999),
    # Per task a little tighter than end to end: errors of several tasks add up.
    "int8": PrecisionPolicy("int8", 0.25, 0.9995, 0.25, 0.999),
    # Weight-only 4-bit: a coarser grid than int8, so a looser default (override it with
    # --min-cosine); measured on the task and end to end like the others.
    "int4": PrecisionPolicy("int4", 0.25, 0.99, 0.25, 0.99),
    # Reduced float precisions on accelerators (tasks computed in float16 / bfloat16,
    # TensorRT's and CANN's reduced-precision modes): cosine >= 0.999 end to end, as for
    # int8. bfloat16 keeps 8 significant bits to float16's 11, so its max error is looser.
    "fp16": PrecisionPolicy("fp16", 0.05, 0.9995, 0.05, 0.999),
    "bf16": PrecisionPolicy("bf16", 0.1, 0.9995, 0.1, 0.999),
}


def policy(
    name: str, min_cosine: float | None = None, max_rel_error: float | None = None
) -> PrecisionPolicy:
    """The policy `name`, with the end-to-end budget overridden where given.

    A per-task limit is never looser than the end-to-end one. Raises OptionError."""
    try:
        p = POLICIES[name]
    except KeyError:
        raise OptionError(
            f"--precision {name}: not supported (choose from: {', '.join(POLICIES)})"
        ) from None
    # NaN fails every comparison, so each range is written to refuse it.
    if min_cosine is not None and not 0.0 < min_cosine <= 1.0:
        raise OptionError(f"--min-cosine {min_cosine}: must be in (0, 1]")
    if max_rel_error is not None and not 0.0 < max_rel_error < math.inf:
        raise OptionError(f"--max-rel-error {max_rel_error}: must be a finite positive number")
    e2e_cos = p.e2e_min_cosine if min_cosine is None else min_cosine
    e2e_rel = p.e2e_max_rel_error if max_rel_error is None else max_rel_error
    return PrecisionPolicy(
        p.name,
        min(p.task_max_rel_error, e2e_rel),
        max(p.task_min_cosine, e2e_cos),
        e2e_rel,
        e2e_cos,
    )
