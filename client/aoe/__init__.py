"""aoe: the client side of aoed.

`aoe.session(path)` opens a tuned model in onnxruntime with the session options it was
measured under; `aoe.signature` and `aoe.fingerprint` compute the two halves of bank keys
(task and device); `aoe.bank` reads a bank; `aoe.v1` holds the generated API;
`aoe.Client` talks to a running daemon (imported on first use: `import aoe` stays light).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["Client", "session", "session_options_of"]


def __getattr__(name: str) -> Any:
    if name == "Client":  # grpc is loaded only by those who use it
        from aoe.client import Client

        return Client
    raise AttributeError(f"module 'aoe' has no attribute {name!r}")


def session_options_of(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The session options a tuned model carries in its metadata (empty when none).
    They are data: ValueError (naming the option) for any the tuner never sets, among
    them every one that names a file (aoe.recordcheck)."""
    import onnx

    from aoe.sessionopts import METADATA_KEY, normalize_options

    model = onnx.load(os.fspath(path), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            return normalize_options(prop.value)
    return {}


def session(
    path: str | os.PathLike[str],
    providers: list[Any] | None = None,
    *,
    device_id: int = 0,
    trt_cache: str | os.PathLike[str] | None = None,
    **overrides: Any,
):
    """Return an `onnxruntime.InferenceSession` for `path`, set up as the tuner measured it:
    its session options and the providers it was tuned on (with their options), on
    accelerator `device_id`, then the CPU for what they do not take. A model's metadata
    never makes the session read or write a file; on TensorRT, `trt_cache` (a folder of
    yours) keeps its built engines and timing cache, so later sessions skip the build.

    An OpenVINO IR (`name.xml`, shipped when OpenVINO ran the model fastest) opens in
    OpenVINO with the compile config beside it (`name.ovconfig.json`, checked: ModelError
    naming the file otherwise), as an object with the same `run(output_names, feeds)`,
    `get_inputs()` and `get_outputs()` (aoe.ovartifact.OvSession); `overrides` there
    replace its compile properties (e.g. `INFERENCE_NUM_THREADS=4`), and `providers`
    does not apply.

    `overrides` replace individual session options (e.g. `intra_op_num_threads=4`);
    `providers` replaces the stored providers (onnxruntime's own argument: the model then
    runs as you choose, not as it was measured). Raises ValueError when the model's stored
    options are malformed, and DeviceError when it was tuned on a provider this
    onnxruntime does not have: it does not quietly run a GPU-tuned model on the CPU,
    whose speed and accuracy were never measured.
    """
    from aoe.ovartifact import is_artifact

    if is_artifact(path):
        return _openvino_session(path, providers, overrides)
    import onnxruntime as ort

    from aoe.sessionopts import make_session_options, session_providers, trt_files

    options = {**session_options_of(path), **overrides}
    if providers is None:
        providers = session_providers(
            options, device_id, trt_files(trt_cache) if trt_cache is not None else None
        )
        available = ort.get_available_providers()
        missing = [name for name, _ in providers if name not in available]
        if missing:
            from aoe.device import Device, kind_of
            from aoe.errors import DeviceError

            need = sorted({Device(kind_of(m)).distribution for m in missing})
            raise DeviceError(
                f"{os.fspath(path)} was tuned on {', '.join(missing)}, which this onnxruntime {ort.__version__} "
                f"does not have (it has {', '.join(available)}); install {' or '.join(need)} on a machine with that "
                "device, or pass providers=[...] to run it elsewhere, unmeasured"
            )
    return ort.InferenceSession(os.fspath(path), make_session_options(options), providers=providers)


def _openvino_session(
    path: str | os.PathLike[str], providers: Any, overrides: dict[str, Any]
) -> Any:
    """`session` of an OpenVINO IR (aoe.ovartifact)."""
    import dataclasses

    from aoe.ovartifact import OvSession, check_properties, read_config

    if providers is not None:
        raise ValueError(
            f"{os.fspath(path)} is an OpenVINO IR: providers are onnxruntime's and do not apply"
        )
    config = read_config(path)
    if overrides:
        props = check_properties({**config.config, **overrides}, "overrides")
        config = dataclasses.replace(config, config=props)
    return OvSession(path, config)
