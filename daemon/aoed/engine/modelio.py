"""Reading and writing model files safely, at any size.

`load_model` reads a user's model and its external data only from beside it (a
location that escapes the model's directory, by `..`, an absolute path or a symlink,
is refused). `save_model` writes a model atomically (temp file + rename) and puts its
tensors in a side file when the whole would not fit a protobuf (2 GiB), so large models
round-trip.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx import external_data_helper

from aoe.errors import AoedError, ModelError

__all__ = ["EXTERNAL_THRESHOLD", "load_model", "save_model", "tensor_bytes"]

#: Above this many tensor bytes a model is saved with external data (protobuf's limit
#: is 2 GiB for the whole message; leave room for the graph).
EXTERNAL_THRESHOLD = 1 << 30


def load_model(path: Path) -> onnx.ModelProto:
    """Load the model at `path` with its external data; ModelError naming the file and
    the tensor when anything is wrong."""
    if not path.is_file():
        raise ModelError(f"{path}: no such model file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})".splitlines()[0]) from None
    base = path.parent.resolve()
    for tensor in external_data_helper._get_all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = external_data_helper.ExternalDataInfo(tensor)
        target = (base / info.location).resolve()
        if os.path.isabs(info.location) or not target.is_relative_to(base):
            raise ModelError(
                f"{path}: tensor {tensor.name!r} points outside the model's directory "
                f"({info.location!r}); external data must sit beside the model"
            )
        if not target.is_file():
            raise ModelError(f"{path}: external data file {info.location!r} of {tensor.name!r} is missing")
    try:
        external_data_helper.load_external_data_for_model(model, str(base))
    except Exception as exc:
        raise ModelError(f"{path}: cannot load external data ({exc})".splitlines()[0]) from None
    return model


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes of tensor data a model holds inline (initializers and Constant values)."""
    return sum(
        len(t.raw_data) or t.ByteSize()
        for t in external_data_helper._get_all_tensors(model)
        if not external_data_helper.uses_external_data(t)
    )


def save_model(model: onnx.ModelProto, path: Path, external_above: int = EXTERNAL_THRESHOLD) -> int:
    """Write `model` at `path` atomically, with external data beside it (`NAME.data`)
    when its tensors exceed `external_above` bytes; returns the bytes written. AoedError
    naming the file when it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    data = path.with_name(f"{path.name}.data")
    external = tensor_bytes(model) > external_above
    try:
        if external:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            tmp_data = data.with_name(f".{data.name}.tmp")
            onnx.save_model(
                copy, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                location=tmp_data.name, size_threshold=1024,
            )  # fmt: skip
            # The model names the final data file; write it so, then move both in place.
            for t in external_data_helper._get_all_tensors(copy):
                if external_data_helper.uses_external_data(t):
                    for entry in t.external_data:
                        if entry.key == "location":
                            entry.value = data.name
            onnx.save_model(copy, str(tmp), save_as_external_data=False)
            os.replace(tmp_data, data)
        else:
            onnx.save(model, str(tmp))
        os.replace(tmp, path)
    except OSError as exc:
        for leftover in (tmp, data.with_name(f".{data.name}.tmp")):
            leftover.unlink(missing_ok=True)
        raise AoedError(f"{path}: cannot write the model ({exc.strerror or exc})") from None
    return path.stat().st_size + (data.stat().st_size if external else 0)
