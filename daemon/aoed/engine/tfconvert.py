"""A TensorFlow SavedModel converted to ONNX by tf2onnx, in a process of its own:
`convert_saved_model()`.

Invariants:
- The conversion never runs in the engine's process: TensorFlow is heavy, and what it
  loads is the user's. It runs in one exec'd child (`python -m
  aoed.backends.tensorflow.convert`, engine/_child.py: it dies with its parent and
  inherits no service-manager variables), confined as a process that loads a .pt2 is
  (aoed.sandbox, the policy on its command line): it reads the SavedModel (a directory,
  or a .tar archive of one) besides Python and the system, writes only the job's
  `converted/` folder, and has no network.
- The child serves one request and is killed and reaped when it returns, fails or the
  caller is cancelled (Child.call kills its child when cancelled; `aclose()` reaps it,
  shielded).
- Without the tensorflow extra nothing is started: the job fails at once saying what to
  install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from aoe.errors import ModelError, OptionError
from aoed.engine._child import Child, ChildDiedError
from aoed.engine.tfmessages import TfConverted, TfConvertRequest
from aoed.sandbox import Policy

__all__ = ["CONVERT_MODULE", "EXTRA", "convert_saved_model", "missing_extra"]

CONVERT_MODULE = "aoed.backends.tensorflow.convert"
#: What a user installs for SavedModel inputs.
EXTRA = "aoed[tensorflow]"
_ERRORS: dict[str, type[Exception]] = {"ModelError": ModelError, "OptionError": OptionError}


def missing_extra(shown: str) -> OptionError | None:
    """The OptionError a SavedModel job fails with when TensorFlow or tf2onnx is not
    installed (found without importing either), else None."""
    missing = [m for m in ("tensorflow", "tf2onnx") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return OptionError(
        f"{shown}: a TensorFlow SavedModel is converted to ONNX with tensorflow and tf2onnx, and "
        f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
        f"pip install '{EXTRA}'"
    )


async def convert_saved_model(
    path: Path,
    shown: str,
    out: Path,
    workdir: Path,
    *,
    expect: tuple[int, int] | None = None,
    unconfined_ok: bool = False,
) -> TfConverted:
    """The SavedModel at `path` (a directory, or a .tar archive of one; `shown` in
    messages) converted to ONNX at `out`, in `workdir` (its scratch, its log), by one
    confined child; what was converted. `expect`: the (device, inode) `path` must still
    have. Raises OptionError (the extra is not installed; no confinement where it is
    required), ModelError (not a SavedModel, an archive refused, what tf2onnx cannot
    convert, or the converter died on it: each in one line)."""
    if (err := missing_extra(shown)) is not None:
        raise err
    policy = Policy(read=(str(path),), write=(str(workdir),), unconfined_ok=unconfined_ok)
    child = Child(
        CONVERT_MODULE,
        "convert",
        workdir / "convert.log",
        args=["--sandbox", policy.to_arg()],
        env={
            # TensorFlow's C++ logging (oneDNN banners, absl) says nothing a job needs.
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "CUDA_VISIBLE_DEVICES": "",
            # Keras (imported with TensorFlow) and matplotlib (imported by tf2onnx's
            # dependencies) write their settings and caches under their homes, which
            # must be where this process may write (not ~/.keras, ~/.cache).
            "KERAS_HOME": str(workdir / "keras"),
            "MPLCONFIGDIR": str(workdir / "matplotlib"),
        },
        restart=False,
    )
    request = TfConvertRequest(
        path=str(path),
        shown=shown,
        out=str(out),
        scratch=str(workdir / "savedmodel"),
        expect="{}:{}".format(*expect) if expect is not None else "",
    )
    try:
        try:
            answer = await child.call(request)
        except ChildDiedError as exc:
            raise ModelError(f"{shown}: converting it to ONNX: {exc}") from None
        if not answer.ok:
            cls = _ERRORS.get(answer.error_class)
            message = answer.error or "failed without a message"
            if cls is not None:
                raise cls(message)
            raise ModelError(f"{shown}: converting it to ONNX: {message}")
        reply: TfConverted = answer.reply
        return reply
    finally:
        await child.aclose()
