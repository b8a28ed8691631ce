"""Apply a bank to a whole model: what `aoe compile` does, as a function.

    from aoe.bank import open_bank
    from aoe.compile import apply_bank
    with open_bank() as bank:
        report = apply_bank("model.onnx", "tuned.onnx", bank)

Unlike the lookups in `aoe.bank`, this prepares the model as tuning does and builds the
tuned graph, so it loads the tuning engine's assembly code (and, for a lossy precision,
onnxruntime for calibration) when called.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aoe.bank import BankReader

__all__ = ["apply_bank"]


def apply_bank(
    model: str | os.PathLike[str],
    output: str | os.PathLike[str],
    bank: BankReader,
    *,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    precision: str = "exact",
    calibration: str | os.PathLike[str] | None = None,
    keep_initializer_inputs: bool = False,
):
    """Write at `output` the tuned model `bank` describes for `model` on the bank's
    device: prepared as tuning prepares it, every task's banked strategy applied, the
    banked session options in its metadata. No measurement. Returns the per-task report
    (`aoed.engine.assemble.Assembly`). Raises ModelError/OptionError/AoedError."""
    from aoed.compile import compile_model

    return compile_model(
        model, output, bank, input_shapes, precision, keep_initializer_inputs,
        calibration=Path(calibration) if calibration is not None else None,
    )  # fmt: skip
