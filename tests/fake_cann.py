"""A fake CANN provider at onnxruntime's seam, for a machine without an Ascend NPU:
`python -m tests.fake_cann` is aoed's own measurement runner, unchanged, over an
onnxruntime that claims `CANNExecutionProvider`.

It lies only where the hardware is missing: the provider is listed as available; a
session asked for it checks the options against those the CANN provider documents
(onnxruntime's CANN-ExecutionProvider page and OrtCANNProviderOptions: the real provider
refuses other names), writes what it was given to $AOED_FAKE_CANN_LOG, and then runs on
the CPU; OrtValues placed on "cann" live in host memory. The timings are the CPU's: what
this checks is the plumbing, never a speed.
"""

from __future__ import annotations

import json
import os
import sys

import onnxruntime as ort

PROVIDER = "CANNExecutionProvider"
#: what the CANN provider takes, as onnxruntime's documentation names it
DOCUMENTED = {
    "device_id",
    "npu_mem_limit",
    "arena_extend_strategy",
    "enable_cann_graph",
    "dump_graphs",
    "dump_om_model",
    "precision_mode",
    "op_select_impl_mode",
    "optypelist_for_implmode",
}
PRECISION_MODES = {
    "force_fp32",
    "cube_fp16in_fp32out",
    "force_fp16",
    "allow_fp32_to_fp16",
    "must_keep_origin_dtype",
    "allow_mix_precision",
}

_available = ort.get_available_providers
_Session = ort.InferenceSession
_from_numpy = ort.OrtValue.ortvalue_from_numpy
_bind_output = ort.IOBinding.bind_output


def _providers() -> list[str]:
    return [*_available(), PROVIDER]


class _Session(_Session):  # type: ignore[no-redef,misc]
    def __init__(self, model, sess_options=None, providers=None, provider_options=None, **kw):
        kept = []
        for p in providers or []:
            name, opts = p if isinstance(p, tuple) else (p, {})
            if name != PROVIDER:
                kept.append(p)
                continue
            unknown = set(opts) - DOCUMENTED
            if unknown:
                raise RuntimeError(
                    f"[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Unknown CANN option {sorted(unknown)}"
                )
            if "precision_mode" in opts and opts["precision_mode"] not in PRECISION_MODES:
                raise RuntimeError(
                    f"[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : precision_mode {opts['precision_mode']}"
                )
            with open(os.environ["AOED_FAKE_CANN_LOG"], "a", encoding="utf-8") as log:
                log.write(json.dumps({"pid": os.getpid(), "options": dict(opts)}) + "\n")
        super().__init__(model, sess_options, providers=kept or None, **kw)


def _on_host(device: str) -> str:
    return "cpu" if device == "cann" else device


ort.get_available_providers = _providers
ort.InferenceSession = _Session
ort.OrtValue.ortvalue_from_numpy = staticmethod(
    lambda a, device="cpu", index=0, *r: _from_numpy(a, _on_host(device), 0)
)
ort.IOBinding.bind_output = lambda self, name, device_type="cpu", device_id=0, *r: _bind_output(
    self, name, _on_host(device_type), 0, *r
)


if __name__ == "__main__":
    from aoed.backends.ort.runner import main

    sys.exit(main())
