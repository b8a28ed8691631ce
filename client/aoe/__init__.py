"""aoe: the client side of aoed.

`aoe.session(path)` opens a tuned model in onnxruntime with the session options it was
measured under; `aoe.signature` computes bank keys; `aoe.v1` holds the generated API;
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
    """The session options a tuned model carries in its metadata (empty when none)."""
    import onnx

    from aoe._session import METADATA_KEY, normalize_options

    model = onnx.load(os.fspath(path), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            return normalize_options(prop.value)
    return {}


def session(path: str | os.PathLike[str], providers: list[str] | None = None, **overrides: Any):
    """Return an `onnxruntime.InferenceSession` for `path`, set up as the tuner measured it.

    `overrides` replace individual session options (e.g. `intra_op_num_threads=4`).
    Raises ValueError when the model's stored options are malformed.
    """
    import onnxruntime as ort

    from aoe._session import make_session_options
    from aoe.device import CPU

    options = {**session_options_of(path), **overrides}
    return ort.InferenceSession(
        os.fspath(path),
        make_session_options(options),
        providers=providers or [CPU.provider],
    )
