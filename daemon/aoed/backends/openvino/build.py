"""OpenVINO's candidates of a model: the IR and the compile properties of each variant.

Run in a compile worker (backends/ort/worker.py, `runtime_build`). The input model is
read once by OpenVINO's ONNX frontend and saved as IR with its weights in f32
(`compress_to_fp16=False`: `ov.save_model` halves them by default, which is already a
lossy change); the float variants share that IR and differ in their compile config:

  f32   INFERENCE_PRECISION_HINT f32: float32 compute (every policy; within float
        rounding of onnxruntime, measured 1e-6 relative on the samples)
  bf16  INFERENCE_PRECISION_HINT bf16: what OpenVINO does by default on a CPU with
        AMX or AVX512-BF16 (reduced-float and int8 policies, where the CPU has BF16)
  f16   INFERENCE_PRECISION_HINT f16 (the fp16 policy, where the CPU has FP16)
  int8  NNCF post-training quantization (`nncf.quantize`) of the IR on the job's
        calibration samples (as a transformer where the model has attention), saved
        as an IR of its own, run with the f32 hint for what it leaves in float (the
        int8 policy, where the CPU has INT8)
  int8_bf16  the same int8 IR, run with the bf16 hint for what it leaves in float, as
        OpenVINO runs an NNCF model by default on such a CPU (the int8 policy, where
        the CPU has INT8 and BF16); built once with int8 when both are asked for
  int8_general  for a model with attention only: NNCF's general preset (as for a model
        without attention), run with the bf16 hint: NNCF's and OpenVINO's defaults.
        Faster than the transformer flavour on some models (a ViT), outside the int8
        gate on others (a BERT); the gate and the measurement choose

Every variant is compiled with PERFORMANCE_HINT LATENCY: one request at a time, as a
server answers one caller and as the measurement runs it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from aoed.backends.openvino.discover import find
from aoed.engine.messages import RuntimeArtifact, RuntimeBuildReply, RuntimeBuildRequest

__all__ = ["CAPABILITY", "PROPERTIES", "build"]

log = logging.getLogger(__name__)

#: The CPU capabilities each variant needs (OPTIMIZATION_CAPABILITIES).
CAPABILITY: dict[str, tuple[str, ...]] = {
    "f32": ("FP32",),
    "bf16": ("BF16",),
    "f16": ("FP16",),
    "int8": ("INT8",),
    "int8_bf16": ("INT8", "BF16"),
    "int8_general": ("INT8", "BF16"),
}
#: The variants whose IR is one of NNCF's int8 models, and whether that is NNCF's general
#: preset whatever the model (else the transformer flavour where the model has attention).
QUANTIZED = {"int8": False, "int8_bf16": False, "int8_general": True}
#: The compile properties of each variant (checked again by aoe.ovartifact on open).
PROPERTIES: dict[str, dict[str, Any]] = {
    "f32": {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"},
    "bf16": {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY"},
    "f16": {"INFERENCE_PRECISION_HINT": "f16", "PERFORMANCE_HINT": "LATENCY"},
    "int8": {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"},
    "int8_bf16": {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY"},
    "int8_general": {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY"},
}


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def build(req: RuntimeBuildRequest) -> RuntimeBuildReply:
    """The variants of `req.variants` this CPU computes in, each an artifact under
    `req.out`; a variant that fails to build carries its error, one the CPU lacks is
    named in the notes."""
    offer = find()
    if not offer.usable:
        return RuntimeBuildReply(offer.to_dict(), (), (f"OpenVINO not used: {offer.why_not}",))
    if not req.variants:  # only asked what this OpenVINO is (and whether there is one)
        return RuntimeBuildReply(offer.to_dict(), (), ())
    import openvino as ov

    notes: list[str] = []
    wanted = []
    for v in req.variants:
        if v not in PROPERTIES:
            raise ValueError(f"variant {v!r}: not one of {', '.join(PROPERTIES)}")
        missing = [c for c in CAPABILITY[v] if not offer.has(c)]
        if not missing or v == "f32":
            wanted.append(v)
        else:
            notes.append(
                f"OpenVINO {v} not tried: this CPU's plugin does not list {' or '.join(missing)}"
            )
    req.out.mkdir(parents=True, exist_ok=True)
    xml = req.out / "openvino_f32.xml"
    try:
        model = ov.Core().read_model(str(req.source))
        ov.save_model(model, str(xml), compress_to_fp16=False)
    except Exception as exc:  # the frontend refused the model: every variant with it
        why = f"OpenVINO could not read the model: {_line(exc)}"
        return RuntimeBuildReply(
            offer.to_dict(),
            tuple(RuntimeArtifact(v, "openvino", error=why) for v in wanted),
            tuple(notes),
        )
    out = []
    attention = any(op.get_type_name().lower() == "softmax" for op in model.get_ops())
    # NNCF's IRs by flavour (True: the transformer flavour), or why one failed: each made once
    int8: dict[bool, Path | str] = {}
    for v in wanted:
        if v not in QUANTIZED:
            out.append(RuntimeArtifact(v, "openvino", xml, dict(PROPERTIES[v])))
            continue
        flavour = attention and not QUANTIZED[v]
        if QUANTIZED[v] and not attention:
            continue  # the general preset is what int8_bf16 is for such a model
        if flavour not in int8:
            try:
                name = "openvino_int8_general.xml" if QUANTIZED[v] else "openvino_int8.xml"
                int8[flavour] = _int8(model, req.calibrate, req.out / name, flavour)
            except Exception as exc:  # NNCF fails on some graphs: those variants only
                log.info("NNCF int8 failed: %s", _line(exc))
                int8[flavour] = f"NNCF int8: {_line(exc)}"
        got = int8[flavour]
        if isinstance(got, str):
            out.append(RuntimeArtifact(v, "openvino", error=got))
        else:
            out.append(RuntimeArtifact(v, "openvino", got, dict(PROPERTIES[v])))
    return RuntimeBuildReply(offer.to_dict(), tuple(out), tuple(notes))


def _int8(model: Any, samples: tuple[Path, ...], xml: Path, transformer: bool) -> Path:
    """`model` quantized by NNCF on `samples` (.npz feeds), as a transformer or by the
    general preset, saved as the IR `xml`; ValueError without samples."""
    from aoe.ovartifact import port_name
    from aoe.ovdevices import quiet

    quiet()  # before nncf's import: no usage telemetry from a compile worker
    import nncf
    import openvino as ov

    if not samples:
        raise ValueError("no calibration samples")
    names = [port_name(p, i, "input") for i, p in enumerate(model.inputs)]
    feeds = []
    for path in samples:
        with np.load(path, allow_pickle=False) as data:
            feeds.append({n: data[n] for n in names if n in data.files})
    # The transformer flavour: SmoothQuant, and the attention's own products left in
    # float. On the bert sample (random weights) NNCF's general preset missed the int8
    # gate (cosine 0.9989); this met it (0.9996) and ran as fast.
    kind = nncf.ModelType.TRANSFORMER if transformer else None
    data = nncf.Dataset(feeds)  # a clone: the other flavour starts from the float model too
    quantized = nncf.quantize(model.clone(), data, subset_size=len(feeds), model_type=kind)
    ov.save_model(quantized, str(xml), compress_to_fp16=False)
    return xml
