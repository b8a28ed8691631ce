"""Calibration samples: the inputs lossy strategies are calibrated and judged on.

From the user (`--calibration DIR`):
  - DIR/*.npz: one sample per file, arrays keyed by input name;
  - DIR/*.npy: one sample per file, for a model with a single input;
  - DIR/<input name>/*.npy: one folder per input, files paired in sorted order.
A leading batch axis of 1 is added where a sample lacks it. Arrays are read with
`allow_pickle=False`: a pickled (object) array is refused, never unpickled. Every file
and per-input folder must resolve, symlinks included, inside DIR, and every file have a
single link (a hard link is a file from elsewhere), so a daemon that confines DIR to its
allowed directories reads nothing outside them.

Otherwise synthetic: floats drawn from N(0, 1); integers in a plausible range, which for
an input that indexes a constant table (Gather over an embedding, as token ids do) is
the table's size along the gathered axis, else [0, 8).

At most `MAX_SAMPLES` are read, the first by file name: every sample is held in memory
while the job calibrates, and a folder's count is the user's, not the machine's.

Samples are split: the last `HELD_BACK` (32; half of a small folder) are held back to
judge accuracy end to end, the rest calibrate ranges, so the gate never grades on the
data it calibrated on. Ranges
themselves are computed by onnxruntime in a worker (backends/ort/probe.py).
"""

from __future__ import annotations

import contextlib
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx

from aoe.errors import OptionError
from aoe.signature import TensorInfo
from aoed.engine.prep import make_inputs

__all__ = [
    "HELD_BACK",
    "MAX_SAMPLES",
    "SYNTHETIC_SAMPLES",
    "Samples",
    "integer_ranges",
    "load_samples",
]

#: Samples held back to judge a lossy model end to end (fewer only when the user's
#: folder is small: then half of it).
HELD_BACK = 32
#: Synthetic samples that calibrate (plus HELD_BACK more that judge).
SYNTHETIC_SAMPLES = 8
#: The most samples read from a user's folder (the first by name); the rest are left.
MAX_SAMPLES = 1024


class Samples:
    """A job's samples, split into those that calibrate and those held back to judge."""

    @classmethod
    def single(cls, sample: dict[str, np.ndarray], source: str) -> Samples:
        """One sample that serves as both (exact jobs calibrate nothing)."""
        out = cls.__new__(cls)
        out.source, out.calibrate, out.held_back = source, [], [sample]
        return out

    def __init__(self, samples: list[dict[str, np.ndarray]], source: str):
        self.source = source
        held = HELD_BACK if len(samples) >= HELD_BACK + 8 else len(samples) // 2
        if held >= 1:
            self.calibrate, self.held_back = samples[:-held], samples[-held:]
            if held < HELD_BACK:
                self.source += (
                    f" (only {held} held back to judge accuracy: give {HELD_BACK + 8} or more)"
                )
        else:  # one sample: calibrate and judge on the same data, and say so
            self.calibrate = self.held_back = samples
            self.source += " (too few samples to hold any back)"


def integer_ranges(model: onnx.ModelProto, inputs: Mapping[str, TensorInfo]) -> dict[str, int]:
    """Upper bounds for integer inputs that index a constant table via Gather."""
    consts = {t.name: tuple(t.dims) for t in model.graph.initializer}
    out: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] in inputs:
            table = consts.get(node.input[0])
            if table:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                out[node.input[1]] = min(out.get(node.input[1], 1 << 62), table[axis])
    return out


def _synthetic(
    inputs: Mapping[str, TensorInfo], highs: Mapping[str, int], n: int
) -> list[dict[str, np.ndarray]]:
    return [make_inputs(inputs, seed=1000 + i, int_high=highs) for i in range(n)]


def _fit(name: str, arr: np.ndarray, info: TensorInfo, where: Path) -> np.ndarray:
    if tuple(arr.shape) != info.shape and tuple((1, *arr.shape)) == info.shape:
        arr = arr[None]
    if tuple(arr.shape) != info.shape:
        raise OptionError(
            f"--calibration {where}: {name!r} has shape {list(arr.shape)}, the model wants {list(info.shape)}"
        )
    return arr.astype(np.dtype(info.dtype), copy=False)


def _inside(root: Path, p: Path) -> Path:
    """`p` resolved, if it stays inside the calibration folder `root` (resolved) and, a
    file, has one link: a hard link is a file from elsewhere under a name inside, which
    no path check sees (checked before the file is opened)."""
    real = p.resolve()
    if not real.is_relative_to(root):
        raise OptionError(
            f"--calibration {p}: a link that leads outside the calibration folder {root}; "
            "copy the sample into the folder instead"
        )
    st = real.stat()
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        raise OptionError(
            f"--calibration {p}: the file has {st.st_nlink} hard links, so it may be a file from "
            "elsewhere; copy the sample into the folder (cp, not ln)"
        )
    return real


@contextlib.contextmanager
def _reading(f: Path) -> Iterator[None]:
    """numpy's errors while reading `f` as OptionErrors naming it."""
    try:
        yield
    except ValueError as exc:
        if "pickle" in str(exc):
            raise OptionError(
                f"--calibration {f}: holds a pickled (object) array, which aoed never loads; "
                "save plain numeric arrays (numpy.save / numpy.savez)"
            ) from None
        raise OptionError(f"--calibration {f}: cannot be read as numpy arrays ({exc})") from None
    except OSError as exc:
        raise OptionError(f"--calibration {f}: {exc.strerror or exc}") from None


def _load_dir(d: Path, inputs: Mapping[str, TensorInfo]) -> tuple[list[dict[str, np.ndarray]], int]:
    """(the samples read, at most MAX_SAMPLES; how many the folder holds)."""
    root = d.resolve()
    samples: list[dict[str, np.ndarray]] = []
    npzs = sorted(d.glob("*.npz"))
    found = len(npzs)
    for f in npzs[:MAX_SAMPLES]:
        with _reading(f), np.load(_inside(root, f), allow_pickle=False) as data:
            missing = set(inputs) - set(data.files)
            if missing:
                raise OptionError(
                    f"--calibration {f}: no array for input(s) {', '.join(sorted(missing))}"
                )
            samples.append({k: _fit(k, data[k], inputs[k], f) for k in inputs})
    npys = sorted(d.glob("*.npy"))
    found += len(npys)
    npys = npys[: max(0, MAX_SAMPLES - len(samples))]
    if npys:
        if len(inputs) != 1:
            raise OptionError(
                f"--calibration {d}: .npy files need a single-input model; use .npz or one folder per input"
            )
        (name,) = inputs
        for f in npys:
            with _reading(f):
                samples.append(
                    {
                        name: _fit(
                            name, np.load(_inside(root, f), allow_pickle=False), inputs[name], f
                        )
                    }
                )
    folders = [d / name for name in inputs if (d / name).is_dir()]
    if folders:
        if len(folders) != len(inputs):
            raise OptionError(
                f"--calibration {d}: needs one folder per input ({', '.join(inputs)})"
            )
        for folder in folders:
            _inside(root, folder)
        files = {name: sorted((d / name).glob("*.npy")) for name in inputs}
        count = min(len(v) for v in files.values())
        found += count
        for i in range(min(count, max(0, MAX_SAMPLES - len(samples)))):
            sample = {}
            for k in inputs:
                f = files[k][i]
                with _reading(f):
                    sample[k] = _fit(k, np.load(_inside(root, f), allow_pickle=False), inputs[k], f)
            samples.append(sample)
    return samples, found


def load_samples(
    inputs: Mapping[str, TensorInfo],
    calibration: Path | None,
    int_high: Mapping[str, int] | None = None,
) -> Samples:
    """The calibration samples for a job (`int_high`: bounds of token-id inputs, see
    `integer_ranges`); raises OptionError on an unusable directory."""
    if calibration is None:
        n = SYNTHETIC_SAMPLES + HELD_BACK
        return Samples(
            _synthetic(inputs, int_high or {}, n), f"synthetic ({n} samples, random inputs)"
        )
    if not calibration.is_dir():
        raise OptionError(f"--calibration {calibration}: not a directory")
    try:
        samples, found = _load_dir(calibration, inputs)
    except (OSError, ValueError) as exc:
        raise OptionError(f"--calibration {calibration}: {exc}") from None
    if not samples:
        raise OptionError(f"--calibration {calibration}: no .npz or .npy samples found")
    cut = (
        f", the first {len(samples)} of {found} by name (the limit)" if found > len(samples) else ""
    )
    return Samples(samples, f"user ({len(samples)} samples from {calibration}{cut})")
