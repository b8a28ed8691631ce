"""Values inside a model: activation ranges for calibration, task inputs for measurement.

Both run the prepared model in onnxruntime with extra graph outputs, once per sample.
They run in compile workers (and in `aoe compile`), never in the engine's own process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx

from aoe.signature import TensorInfo
from aoed.backends.ort.sessions import session

__all__ = ["activation_ranges", "capture", "float_activations"]


def _probe(model: onnx.ModelProto, infos: Mapping[str, TensorInfo], names: Iterable[str]):
    """An onnxruntime session over `model` that also outputs `names`."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output} | {i.name for i in m.graph.input}
    for name in sorted(set(names) - have):
        info = infos[name]
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
        m.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, list(info.shape)))
    # No optimization: every tensor asked for must survive as the graph has it.
    return session(m.SerializeToString(), {"graph_optimization_level": "disable"})


def capture(
    model: onnx.ModelProto,
    infos: Mapping[str, TensorInfo],
    names: Iterable[str],
    sample: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """The values of `names` (and of the inputs) when `model` runs `sample`."""
    sess = _probe(model, infos, names)
    values = dict(
        zip([o.name for o in sess.get_outputs()], sess.run(None, dict(sample)), strict=True)
    )
    values.update(sample)
    return values


def float_activations(model: onnx.ModelProto, infos: Mapping[str, TensorInfo]) -> set[str]:
    """Every float tensor a node of `model` writes and shape inference knows."""
    return {
        o
        for n in model.graph.node
        for o in n.output
        if o in infos and np.dtype(infos[o].dtype).kind == "f"
    }


def activation_ranges(
    model: onnx.ModelProto,
    infos: Mapping[str, TensorInfo],
    samples: Iterable[Mapping[str, np.ndarray]],
) -> dict[str, tuple[float, float]]:
    """(min, max) of every float activation of `model` (and float input) over `samples`."""
    sess = _probe(model, infos, float_activations(model, infos))
    outs = [o.name for o in sess.get_outputs()]
    ranges: dict[str, tuple[float, float]] = {}
    for sample in samples:
        values = dict(zip(outs, sess.run(None, dict(sample)), strict=True))
        values.update(sample)
        for k, v in values.items():
            if v.dtype.kind == "f" and v.size:
                lo, hi = float(v.min()), float(v.max())
                old = ranges.get(k)
                ranges[k] = (min(lo, old[0]), max(hi, old[1])) if old else (lo, hi)
    return ranges
