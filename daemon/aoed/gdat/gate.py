"""The accuracy gate of lossy comm hooks: what a hook must keep to be measured at all.

A hook of class fp16 or bf16 is judged on one training step: from the same weights and
the same per-rank batches, the gradients it reduces are compared with those of exact
all-reduce (the same configuration without the hook). Per gradient tensor, the L2 norm
of the difference over the tensor's norm (a tensor smaller than 1e-3 of the largest is
judged against that floor, so a gradient that is zero up to rounding does not decide);
the largest of these must stay within the class's bound: four units of the format's
rounding (fp16 2^-11, bf16 2^-8), the error of rounding each rank's gradient once and the
sum once more, with room for a world of a few ranks.

A lowrank hook (PowerSGD) changes gradients by design and pays it back over steps (error
feedback), so it is judged on training: K steps of Adam from the same weights on the
same batches, with and without the hook; the gap between the two final losses must stay
within `LOWRANK_BOUND` of the loss the exact run shed over those steps.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["BOUNDS", "LOSS_STEPS", "LOWRANK_BOUND", "judge"]

#: Largest per-tensor relative error of reduced gradients, per hook class.
BOUNDS = {"fp16": 4 * 2.0**-11, "bf16": 4 * 2.0**-8}
#: Largest loss gap after LOSS_STEPS steps, as a fraction of the exact run's loss decrease.
LOWRANK_BOUND = 0.10
LOSS_STEPS = 8


def judge(cls: str, figures: dict[str, Any]) -> tuple[bool, str]:
    """(passes, the figures and bound in words) for a gate reply of hook class `cls`."""
    if figures.get("error"):
        return False, f"could not run: {figures['error']}"
    if cls == "lowrank":
        gap = float(figures.get("loss_gap", math.inf))
        exact, hooked = figures.get("loss_exact") or [0.0], figures.get("loss_hooked") or [0.0]
        words = (
            f"loss after {len(exact) - 1} steps {hooked[-1]:.6g} vs exact {exact[-1]:.6g} (from {exact[0]:.6g}): "
            f"gap {gap:.3g} of the exact decrease, bound {LOWRANK_BOUND:g}"
        )
        return gap <= LOWRANK_BOUND, words
    bound = BOUNDS[cls]
    err = float(figures.get("max_rel_error", math.inf))
    words = (
        f"largest relative gradient error {err:.3g} (tensor {figures.get('worst_param')}; all gradients "
        f"{float(figures.get('global_rel_error', math.inf)):.3g}), bound {bound:.3g}"
    )
    return err <= bound, words
