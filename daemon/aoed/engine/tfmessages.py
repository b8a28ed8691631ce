"""What the engine (engine/tfconvert.py) and the process that converts a TensorFlow
SavedModel to ONNX (aoed.backends.tensorflow.convert) say to each other, read as
strictly as every other child's messages (engine/messages.py)."""

from __future__ import annotations

from aoed.engine.messages import Message, Request

__all__ = ["TfConverted", "TfConvertRequest"]


class TfConverted(Message, frozen=True):
    """An ONNX model converted from a SavedModel: the serving signature converted, the
    ONNX opset, its inputs' dims by name (a dynamic dimension by its symbol), and the
    versions and confinement of the process that converted it."""

    signature: str
    opset: int
    inputs: dict[str, list[int | str]]
    tensorflow: str = ""
    tf2onnx: str = ""
    sandbox: str = ""


class TfConvertRequest(Request, tag="tf-convert", frozen=True):
    """Convert the SavedModel at `path` (a directory, or a .tar archive of one, which is
    unpacked into `scratch` first) to ONNX at `out`. `shown`: what messages call it;
    `expect`: "dev:ino" the directory or archive must still have ("" to skip)."""

    reply = TfConverted
    path: str
    shown: str
    out: str
    scratch: str
    expect: str = ""
