"""The process that converts a TensorFlow SavedModel to ONNX:
`python -m aoed.backends.tensorflow.convert`, started by the engine (engine/tfconvert.py)
for one request (engine/tfmessages.py, one JSON object per line: aoed.backends._wire).

It is confined before anything else is imported (aoed.sandbox: the policy comes on the
command line, `--sandbox`): it reads only Python, the system's libraries and the
SavedModel, writes only the job's `converted/` folder, and has no network. TensorFlow
runs what the SavedModel's graph says while tf2onnx freezes it; the confinement is what
keeps that inside.

A SavedModel comes as a directory, or as a plain .tar archive of one (aoe.savedmodel),
which is checked member by member before anything is unpacked: only files and folders,
relative names that stay inside, none sparse (so nothing unpacks to more than it takes
in the archive), at most MAX_FILES of them; then unpacked with tarfile's
`data` filter into the scratch folder. The archive is read here, never by the daemon.

The conversion is tf2onnx's for a SavedModel (`python -m tf2onnx.convert --saved-model`):
the serving signature (`serving_default`, else the only one) frozen and converted at
tf2onnx's preferred opset. A dimension the signature leaves unknown (None) stays a named
dynamic dimension of the ONNX model.
"""

from __future__ import annotations

import sys

from aoed import sandbox

#: How this process is confined (None: started without a policy).
_confinement: sandbox.Confinement | sandbox.SandboxError | None = None
if __name__ == "__main__":
    # First, while this process has one thread: TensorFlow starts threads at import, and
    # a thread that exists before confinement would stay unconfined.
    _confinement = sandbox.enter(sys.argv)

import os  # noqa: E402
import tarfile  # noqa: E402
from pathlib import Path, PurePosixPath  # noqa: E402
from typing import Any  # noqa: E402

from aoe.errors import ModelError, OptionError  # noqa: E402
from aoe.savedmodel import MAX_FILES, SAVED_MODEL_PB, check_saved_model  # noqa: E402

#: The tag of the meta graph a SavedModel serves with (tf.saved_model.SERVING).
_SERVE = "serve"
#: The signature converted when the SavedModel has it (tf.saved_model's default key).
_DEFAULT_SIGNATURE = "serving_default"
_EXTRA = "aoed[tensorflow]"


def _confined() -> sandbox.Confinement:
    """How this process is confined; OptionError when it is not and may not load a
    SavedModel (no policy was given, or the kernel could not confine it)."""
    if isinstance(_confinement, sandbox.SandboxError):
        raise OptionError(str(_confinement))
    if _confinement is None:
        raise OptionError("the converter was started without a sandbox policy, and loads nothing")
    return _confinement


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else 'no message'}"


# --------------------------------------------------------------------------- archives


def _unpack(archive: Path, dest: Path, shown: str) -> Path:
    """The SavedModel directory in the plain .tar `archive`, unpacked under `dest` after
    every member was checked (see the module doc). ModelError naming the archive and the
    member otherwise."""
    members: list[tarfile.TarInfo] = []
    try:
        with tarfile.open(archive, "r:") as tar:  # "r:": uncompressed only
            for m in tar:
                if len(members) >= MAX_FILES:
                    raise ModelError(f"{shown}: more than {MAX_FILES} members; not a SavedModel")
                parts = PurePosixPath(m.name).parts
                if m.name.startswith("/") or ".." in parts:
                    raise ModelError(
                        f"{shown}: member {m.name!r} names a path outside the archive's folder"
                    )
                # A sparse member unpacks to more than it takes in the archive.
                if m.issparse() or not (m.isfile() or m.isdir()):
                    kind = (
                        "a link"
                        if m.issym() or m.islnk()
                        else "a sparse file"
                        if m.issparse()
                        else "not a file or folder"
                    )
                    raise ModelError(
                        f"{shown}: member {m.name!r} is {kind}; a SavedModel archive holds only "
                        "files and folders (tar it without links)"
                    )
                members.append(m)
            dest.mkdir(parents=True, exist_ok=True)
            tar.extractall(dest, members=members, filter="data")
    except tarfile.TarError as exc:
        raise ModelError(
            f"{shown}: not a readable tar archive ({_first_line(exc)}); pack the SavedModel's "
            "directory with tar -cf (uncompressed)"
        ) from None
    if (dest / SAVED_MODEL_PB).exists():
        return dest
    tops = list(dest.iterdir())
    if len(tops) == 1 and tops[0].is_dir() and not tops[0].is_symlink():
        root = tops[0]
        check_saved_model(root, f"{shown}: {root.name}/")
        return root
    check_saved_model(dest, shown)  # raises, naming saved_model.pb
    return dest


# --------------------------------------------------------------------------- conversion


def _signature(root: Path, shown: str) -> str:
    """The serving signature to convert: serving_default, else the only one."""
    from tensorflow.core.protobuf import saved_model_pb2

    doc = saved_model_pb2.SavedModel()
    try:
        doc.ParseFromString((root / SAVED_MODEL_PB).read_bytes())
    except Exception as exc:  # protobuf's DecodeError, or what the file's size makes of it
        raise ModelError(
            f"{shown}: {SAVED_MODEL_PB} is not a readable SavedModel ({_first_line(exc)}); save it "
            "with tf.saved_model.save"
        ) from None
    graphs = [g for g in doc.meta_graphs if _SERVE in g.meta_info_def.tags]
    if not graphs:
        raise ModelError(f"{shown}: no meta graph tagged {_SERVE!r}; save it for serving")
    names = sorted(k for k in graphs[0].signature_def if not k.startswith("__"))
    if _DEFAULT_SIGNATURE in names:
        return _DEFAULT_SIGNATURE
    if len(names) == 1:
        return names[0]
    raise ModelError(
        f"{shown}: no {_DEFAULT_SIGNATURE} signature, and "
        + (f"several ({', '.join(names)})" if names else "none at all")
        + f": save it with signatures={{'{_DEFAULT_SIGNATURE}': ...}}"
    )


def _convert(req: dict[str, Any]) -> dict[str, Any]:
    said = _confined().describe()
    path, shown = Path(req["path"]), str(req["shown"])
    if req["expect"]:
        st = os.stat(path)
        if f"{st.st_dev}:{st.st_ino}" != req["expect"]:
            raise ModelError(f"{shown}: replaced since it was submitted; submit it again")
    if path.is_dir():
        root = path
        check_saved_model(root, shown)
    else:
        root = _unpack(path, Path(req["scratch"]), shown)
    try:
        import tensorflow as tf
        import tf2onnx
        from tf2onnx import convert, tf_loader
    except ImportError as exc:
        raise OptionError(
            f"{shown}: converting a SavedModel needs tensorflow and tf2onnx ({exc}): "
            f"pip install '{_EXTRA}'"
        ) from None
    signature = _signature(root, shown)
    try:
        graph_def, inputs, outputs, tables, renamed = tf_loader.from_saved_model(
            str(root),
            None,
            None,
            [_SERVE],
            [signature],
            None,
            False,
            return_initialized_tables=True,
            return_tensors_to_rename=True,
        )
        # What `python -m tf2onnx.convert --saved-model` runs (tf2onnx.convert.main):
        # tf2onnx's Python API has no public call for a SavedModel.
        with tf.device("/cpu:0"):
            model, _ = convert._convert_common(
                graph_def,
                name=shown,
                input_names=inputs,
                output_names=outputs,
                tensors_to_rename=renamed,
                initialized_tables=tables,
                output_path=req["out"],
            )
    except Exception as exc:  # TensorFlow's and tf2onnx's errors share no class
        raise ModelError(
            f"{shown}: tf2onnx could not convert signature {signature!r} to ONNX "
            f"({_first_line(exc)}); convert it with python -m tf2onnx.convert and tune the .onnx"
        ) from None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    dims = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in model.graph.input
    }
    return {
        "signature": signature,
        "opset": int(opset),
        "inputs": dims,
        "tensorflow": str(tf.__version__),
        "tf2onnx": str(tf2onnx.__version__),
        "sandbox": said,
    }


def _handle(request: Any) -> dict[str, Any]:
    import msgspec

    return _convert(msgspec.structs.asdict(request))


def main() -> int:
    from aoed.backends._wire import child_main, serve
    from aoed.engine.tfmessages import TfConvertRequest

    child_main()
    return serve(_handle, [TfConvertRequest])


if __name__ == "__main__":
    sys.exit(main())
