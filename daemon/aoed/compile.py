"""`aoe compile`: the tuned model a bank describes, built with no measurement.

    prepare (as tuning does) -> the bank's answer for every task and for the model
    (engine/assemble.from_bank, through AOE's bank rules) -> the strategies applied
    -> the tuned model, with the metadata the tuner writes

A task's entry is applied only when it was measured on this device fingerprint and its
strategy still applies to the task (and to each of its twins); anything else is a miss,
and the report says why. The result equals the tuning run's model when the bank holds
what that run chose. Runs in the caller's process (it measures nothing), onnxruntime
only for the calibration a lossy precision needs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aoe.bank import BankReader
from aoe.signature import DeviceFingerprint
from aoed.bank._codec import BankRecord, decode
from aoed.engine.assemble import Assembly, apply_choices, from_bank, set_metadata, tuned_metadata
from aoed.engine.calibration import integer_ranges, load_samples
from aoed.engine.modelio import load_model, save_model
from aoed.engine.policy import policy
from aoed.engine.prep import prepare
from aoed.engine.tasks import Constants

__all__ = ["compile_model"]


class _ReaderLookup:
    """A BankReader seen as the engine's `Lookup` (records decoded by the bank codec)."""

    def __init__(self, reader: BankReader):
        self.reader = reader

    def record(self, key: bytes) -> tuple[BankRecord | None, str]:
        raw, layer = self.reader.lookup_raw(key)
        return (decode(raw), layer) if raw is not None else (None, "")

    def default(self, key: bytes) -> tuple[dict[str, Any] | None, str]:
        return self.reader.lookup_default(key)

    def explain(self, key: bytes) -> str:
        return self.reader.lookup_explain(key).reason


def compile_model(
    model_path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    reader: BankReader,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    precision: str = "exact",
    keep_initializer_inputs: bool = False,
    calibration: Path | None = None,
    plugins: Sequence[str] = (),
) -> Assembly:
    """Prepare `model_path` as tuning does, apply the bank, save the tuned model at
    `output` (with the tuner's metadata); returns the assembly with its per-task report.
    Under a lossy policy the activations are calibrated as tuning does (`calibration`:
    the same sample folder the tuning run used; None: the same synthetic samples).

    Raises ModelError/OptionError from preparation, AoedError when `output` cannot be
    written. Blocking.
    """
    from aoed.backends.ort.catalog import build_registry

    registry = build_registry(plugins)
    device: DeviceFingerprint = reader.device
    with tempfile.TemporaryDirectory(prefix="aoe-compile-") as work:
        prep = prepare(model_path, work, dict(input_shapes or {}), keep_initializer_inputs)
        ranges = None
        if policy(precision).lossy:
            from aoed.backends.ort.probe import activation_ranges

            samples = load_samples(prep.inputs, calibration, integer_ranges(prep.model, prep.inputs))
            ranges = activation_ranges(prep.model, prep.ctx.tensors, samples.calibrate)
        consts = Constants(prep.model.graph, list(prep.model.opset_import))
        asm, tasks = from_bank(prep.model, prep.ctx, consts, _ReaderLookup(reader), device, registry, precision, ranges)
        if asm.ship_input:
            model = load_model(Path(model_path))
        else:
            model = apply_choices(prep.model, prep.ctx, consts, tasks, asm.choices, registry, ranges)
    set_metadata(model, tuned_metadata(asm.session_options, precision, device.digest))
    save_model(model, Path(output))
    asm.notes = [*prep.notes, *asm.notes]
    return asm
