"""The command line's edge of `aoe.spec.JobSpec`: the flags `aoe tune` and `aoe submit`
share, parsed into a spec (`from_args`) and written back (`to_argv`).

    --precision P  --job-type T  --input-shape NAME:D1,D2 (repeat, or join with ';';
    a dimension may be a range lo~hi, or -1 for one --dynamic-dims "1,16;4,64" fills)
    --runtime auto|onnxruntime|openvino
    --repeat-tune  --device D  --budget S  --min-cosine C  --max-rel-error E
    --calibration DIR  --priority N  --label KEY=VALUE (repeat)  --keep-initializer-inputs
    GDAT: --world-size N  --backend B  --gradient-precision P  --entry FILE.py:FUNCTION

A flag not given leaves the spec's default (or, for `aoe tune`, the setting from the
environment or config file). Errors name the flag as typed, not the spec's field.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from aoe.errors import OptionError
from aoe.shapes import ShapeError, ShapeProfile, is_static, parse_dims
from aoe.spec import DEFAULT_JOB_TYPE, JobSpec, SpecError

__all__ = [
    "FLAGS",
    "add_arguments",
    "entry_of",
    "from_args",
    "parse_shapes",
    "split_shapes",
    "to_argv",
]

#: The flag of each spec field.
FLAGS = {
    "precision": "--precision",
    "job_type": "--job-type",
    "input_shapes": "--input-shape",
    "shape_profile": "--input-shape",
    "repeat_tune": "--repeat-tune",
    "device": "--device",
    "budget_s": "--budget",
    "min_cosine": "--min-cosine",
    "max_rel_error": "--max-rel-error",
    "calibration_dir": "--calibration",
    "priority": "--priority",
    "labels": "--label",
    "keep_initializer_inputs": "--keep-initializer-inputs",
    "runtime": "--runtime",
    "world_size": "--world-size",
    "backend": "--backend",
    "gradient_precision": "--gradient-precision",
    "entry": "--entry",
}
#: Names an error may give that are not fields of their own.
_ERROR_FLAGS = {**FLAGS, "dynamic_dims": "--dynamic-dims"}


def add_arguments(
    p: argparse.ArgumentParser,
    *,
    where: str = "on this machine or the daemon",
    many_devices: bool = False,
    entry: bool = True,
) -> None:
    """Add the spec's flags to `p` (each defaults to None: not given). `many_devices`:
    `--device` may be repeated, or `all` (a run that measures on several devices; the
    spec names the first, the run's configuration all of them). `entry`: offer --entry,
    the user's own training code, which only an embedded run loads (a daemon never runs
    user code), so a command that always goes to a daemon leaves it out."""
    p.add_argument(
        "--precision",
        metavar="P",
        help="precision policy: exact (default), int8, int4 (4-bit weight-only products, int8 forms too), "
        "or on a GPU/NPU fp16 or bf16",
    )
    p.add_argument(
        "--job-type",
        metavar="T",
        help=f"{DEFAULT_JOB_TYPE} (the default): subgraphs, then operators over the nodes "
        "they left, in one job; opat (2): operators alone; sgat (1): subgraphs alone "
        "(attention, layernorm, gelu, glu, conv regions); gdat (4, also AOE_MODE=4): "
        "the gradient communication of data-parallel training (PyTorch DDP)",
    )
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME:D1,D2,...",
        help="shapes of an input with dynamic dimensions: sizes (one shape), ranges lo~hi "
        "(e.g. input_ids:1~4,16~256), or -1 where --dynamic-dims gives the sizes; repeat or "
        "join with ';' (default: a profile derived from the model)",
    )
    p.add_argument(
        "--dynamic-dims",
        metavar="G1;G2",
        help="gears, as ATC writes them: the sizes of the -1 dimensions of --input-shape, "
        'one group per shape measured (e.g. "1,16;4,64")',
    )
    p.add_argument(
        "--repeat-tune",
        action="store_true",
        default=None,
        help="re-tune tasks the bank already knows",
    )
    if many_devices:
        p.add_argument(
            "--device",
            action="append",
            metavar="D",
            help=f"cpu, cpu:FIRST-LAST (a set of cores), cuda:N, tensorrt:N or cann:N (default: the "
            f"device {where} measures on); repeat it to measure on several devices, or give `all`: "
            "the config's [tuning] devices, else every usable accelerator",
        )
    else:
        p.add_argument(
            "--device",
            metavar="D",
            help=f"cpu, cuda:N, tensorrt:N or cann:N (default: the device {where} measures on)",
        )
    p.add_argument(
        "--budget",
        metavar="S",
        type=float,
        help="device seconds for search, session options, verification and the "
        "runtime comparison together (default: fitted to the model's profiled latency)",
    )
    p.add_argument(
        "--runtime",
        metavar="R",
        help="what the result may ship on: auto (default: OpenVINO competes with "
        "onnxruntime where it is installed), onnxruntime (never OpenVINO), openvino",
    )
    p.add_argument(
        "--min-cosine",
        metavar="X",
        type=float,
        help="end-to-end accuracy budget: lowest output cosine (int8: 0.999)",
    )
    p.add_argument(
        "--max-rel-error",
        metavar="X",
        type=float,
        help="end-to-end accuracy budget: largest error relative to the output range (int8: 0.25)",
    )
    p.add_argument(
        "--calibration",
        metavar="DIR",
        type=Path,
        help="calibration samples: a folder of .npz/.npy (lossy precisions)",
    )
    p.add_argument(
        "--priority",
        type=int,
        metavar="N",
        help="-10 (background) to 10 (urgent); default 0 (a daemon's queue)",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label for the job (repeatable)",
    )
    p.add_argument(
        "--keep-initializer-inputs",
        action="store_true",
        default=None,
        help="treat initializers that old exporters list as graph inputs as real inputs",
    )
    g = p.add_argument_group("GDAT (--job-type gdat: a torch.export program, .pt2)")
    g.add_argument(
        "--world-size",
        metavar="N",
        type=int,
        help="ranks of the measured world (default: 2 on gloo, one per device on nccl/hccl)",
    )
    g.add_argument(
        "--backend", metavar="B", help="collective backend: gloo (default, CPU), nccl, hccl"
    )
    g.add_argument(
        "--gradient-precision",
        metavar="P",
        help="exact (default); fp16, bf16 or lowrank allow compression hooks of that class and the less "
        "lossy ones, each gated against exact all-reduce",
    )
    if not entry:
        return
    g.add_argument(
        "--entry",
        metavar="FILE.py:FUNCTION",
        help="your own training code instead of a .pt2 (embedded runs only): FUNCTION returns "
        "(model, batch, loss_fn)",
    )


def split_shapes(
    items: str | Iterable[str], gears: str | None = None, where: str = "--input-shape"
) -> tuple[dict[str, tuple[int, ...]], ShapeProfile]:
    """(fixed shapes, profile) of `--input-shape` items and `--dynamic-dims`: an input
    whose dimensions are all sizes is fixed (one point, as it always was), one with a
    range or -1 joins the profile. OptionError naming `where` (or --dynamic-dims) and the
    item."""
    static: list[str] = []
    ranged: list[str] = []
    for item in [items] if isinstance(items, str) else (items or ()):
        for part in filter(None, (p.strip() for p in item.split(";"))):
            name, sep, dims = part.rpartition(":")
            if sep and name and ("~" in dims or "-" in dims):
                try:
                    parsed = parse_dims(dims, name)
                except ShapeError as exc:
                    raise OptionError(f"{where} {exc.detail}") from None
                (static if is_static(parsed) else ranged).append(f"{name}:{dims}")
            else:
                static.append(part)
    try:
        profile = ShapeProfile.parse(ranged, gears)
    except ShapeError as exc:
        flag = _ERROR_FLAGS.get(exc.field, where)
        raise OptionError(
            f"{flag}{exc.detail}" if exc.detail.startswith(":") else f"{flag} {exc.detail}"
        ) from None
    return parse_shapes(static, where), profile


def parse_shapes(
    items: str | Iterable[str], where: str = "--input-shape"
) -> dict[str, tuple[int, ...]]:
    """{name: dims} from `NAME:D1,D2,...` items (also `;`-joined, AOE style). OptionError
    naming `where` and the item."""
    out: dict[str, tuple[int, ...]] = {}
    for item in [items] if isinstance(items, str) else (items or ()):
        for part in filter(None, (p.strip() for p in item.split(";"))):
            name, sep, dims = part.rpartition(":")
            if not sep or not name:
                raise OptionError(f"{where} {part!r}: expected NAME:D1,D2,... e.g. x:1,3,224,224")
            try:
                shape = tuple(int(d) for d in dims.split(",") if d.strip())
            except ValueError:
                raise OptionError(f"{where} {part!r}: dimensions must be integers") from None
            if not shape or any(d <= 0 for d in shape):
                raise OptionError(f"{where} {part!r}: dimensions must be positive integers")
            out[name] = shape
    return out


def _labels(items: Iterable[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OptionError(f"--label {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _first_device(given: str | list[str] | None) -> str | None:
    """The device a spec names from `--device` given once or repeated (the first; none
    for `all`, which the run's configuration resolves)."""
    if isinstance(given, list):
        given = given[0] if given and given[0] != "all" else None
    return given


def entry_of(raw: str) -> tuple[Path, str]:
    """(file, function) of an --entry FILE.py:FUNCTION. OptionError naming it."""
    path, sep, function = str(raw).rpartition(":")
    if not sep or not path or not function.isidentifier() or not path.endswith(".py"):
        raise OptionError(f"--entry {raw}: expected FILE.py:FUNCTION")
    return Path(path), function


def from_args(args: argparse.Namespace) -> JobSpec:
    """The spec the flags in `args` describe (attributes of the names `add_arguments`
    gives; a missing one counts as not given). OptionError naming the flag."""
    entry = getattr(args, "entry", None)
    static, profile = split_shapes(
        getattr(args, "input_shape", None) or [], getattr(args, "dynamic_dims", None)
    )
    given = {
        "precision": getattr(args, "precision", None),
        "job_type": getattr(args, "job_type", None),
        "input_shapes": static,
        "shape_profile": profile if profile else None,
        "repeat_tune": getattr(args, "repeat_tune", None),
        "device": _first_device(getattr(args, "device", None)),
        "budget_s": getattr(args, "budget", None),
        "min_cosine": getattr(args, "min_cosine", None),
        "max_rel_error": getattr(args, "max_rel_error", None),
        "calibration_dir": getattr(args, "calibration", None),
        "priority": getattr(args, "priority", None),
        "labels": _labels(getattr(args, "label", None) or []),
        "keep_initializer_inputs": getattr(args, "keep_initializer_inputs", None),
        "runtime": getattr(args, "runtime", None),
        "world_size": getattr(args, "world_size", None),
        "backend": getattr(args, "backend", None),
        "gradient_precision": getattr(args, "gradient_precision", None),
        "entry": entry_of(entry)[1] if entry else None,
    }
    try:
        return JobSpec(**{k: v for k, v in given.items() if v is not None})
    except SpecError as exc:
        flag = _ERROR_FLAGS.get(exc.field, exc.field)
        raise OptionError(
            f"{flag}{exc.detail}" if exc.detail.startswith(":") else f"{flag} {exc.detail}"
        ) from None


def to_argv(spec: JobSpec) -> list[str]:
    """The flags that give `spec` back through `from_args` (defaults left out; so is
    `entry`, whose flag names the model file too, which the caller gives)."""
    default, argv = JobSpec(), []
    for name, flag in FLAGS.items():
        value = getattr(spec, name)
        if value == getattr(default, name):
            continue
        if name == "input_shapes":
            argv += [f"{flag}={n}:{','.join(map(str, dims))}" for n, dims in value.items()]
        elif name == "shape_profile":
            argv += [f"{flag}={item}" for item in value.argv_items()]
            if value.gears:
                argv.append(f"--dynamic-dims={value.gears}")
        elif name == "labels":
            argv += [f"{flag}={k}={v}" for k, v in value.items()]
        elif name == "entry":
            continue  # the function alone: the file is the model, which the caller names
        elif isinstance(value, bool):
            argv.append(flag)
        else:
            argv.append(f"{flag}={value}")
    return argv
