"""DDP with the gradient communication the bank chose: the helper for training scripts.

    import aoe.gdat
    dist.init_process_group("gloo")                  # or nccl, hccl: as before
    model = aoe.gdat.ddp(model)                      # instead of DistributedDataParallel(model)

`ddp()` computes the model's gradient layout (the shapes and dtypes of the parameters
that require a gradient, the world size and the backend: `aoe.gradlayout`), looks it up
in the bank (`aoe.bank`: the custom bank of TUNE_BANK_PATH and the layers, as every
reader), and returns a `DistributedDataParallel` built with the options `aoe tune
--job-type gdat` chose and measured for that layout on this kind of host, its comm hook
registered. When the bank has nothing for the layout, or recorded that DDP's defaults
stayed fastest, it returns DDP with its defaults and says so in one line on stderr (rank
0 only). Keyword arguments you pass win over the bank's.

`DDPConfig` is one configuration of the GDAT search space, and `wrap()` builds DDP from
it: the tuner's rank processes and this helper build DDP the same way, so what the bank
records is what the helper applies.

Importing this module imports neither torch, trio, onnxruntime nor the daemon; torch is
imported when `ddp()` or `wrap()` is called (the training script has it already).

Comm hooks: `fp16` and `bf16` (torch's compress hooks: gradients are cast before the
all-reduce and back after), `fp16_scaled` (fp16 that keeps small gradients: each bucket
is scaled by a power of two before the cast, so that the world's largest gradient lands
just under fp16's range, and unscaled after; one 4-byte all-reduce per bucket agrees on
the scale), `powersgd` (PowerSGD with a rank and a start iteration),
and hooks from installed packages: an entry point in the group `aoed.gdat_hooks` named
`<class>-<name>`, where the class is fp16, bf16 or lowrank (which gate judges it), whose
object is a factory `f(process_group) -> (state, hook)` as `register_comm_hook` takes.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aoe.errors import AoedError, OptionError
from aoe.gradlayout import PRECISIONS, GradientLayout, gdat_key, host_fingerprint

__all__ = ["HOOK_GROUP", "DDPConfig", "ddp", "hook_class", "layout_of", "lookup", "wrap"]

#: Entry point group of comm hooks from installed packages.
HOOK_GROUP = "aoed.gdat_hooks"
#: Built-in comm hooks and their precision class.
BUILTIN_HOOKS = {"fp16": "fp16", "fp16_scaled": "fp16", "bf16": "bf16", "powersgd": "lowrank"}
#: DDP's default bucket cap (MiB) when none is given.
DEFAULT_BUCKET_MB = 25.0

_BOOL = {"true": True, "false": False}


def hook_class(hook: str) -> str:
    """The precision class of a comm hook ("exact" for none): a built-in's, or the prefix
    of a plugin's name. OptionError for a plugin name without a known class."""
    if not hook:
        return "exact"
    if hook in BUILTIN_HOOKS:
        return BUILTIN_HOOKS[hook]
    cls, sep, _ = hook.partition("-")
    if not sep or cls not in PRECISIONS[1:]:
        raise OptionError(
            f"comm hook {hook!r}: a plugin hook is named <class>-<name>, class fp16, bf16 or lowrank"
        )
    return cls


@dataclass(frozen=True)
class DDPConfig:
    """One way to build DDP. None/False/"" is DDP's own default for each field."""

    bucket_cap_mb: float | None = None
    #: the first bucket's cap (the gradients ready last); None: DDP's rule (1 MiB with
    #: the default cap, else the cap itself)
    first_bucket_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    hook: str = ""
    powersgd_rank: int = 1
    powersgd_start: int = 2
    #: options of the process group (backend knobs): set before the group exists, so a
    #: configuration with other world options is measured in another world
    world: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise OptionError(f"bucket_cap_mb {self.bucket_cap_mb}: must be positive")
        if self.first_bucket_mb is not None and not self.first_bucket_mb > 0:
            raise OptionError(f"first_bucket_mb {self.first_bucket_mb}: must be positive")
        hook_class(self.hook)
        if self.hook == "powersgd" and not (self.powersgd_rank >= 1 and self.powersgd_start >= 2):
            raise OptionError("powersgd: the rank must be >= 1 and the start iteration >= 2")

    @property
    def is_default(self) -> bool:
        return self.label == "default"

    @property
    def cap_mb(self) -> float:
        return DEFAULT_BUCKET_MB if self.bucket_cap_mb is None else self.bucket_cap_mb

    @property
    def label(self) -> str:
        """A short stable name (the bank's strategy name): "default", or the fields that
        differ from DDP's defaults."""
        parts = []
        if self.bucket_cap_mb is not None:
            parts.append(f"bucket={self.bucket_cap_mb:g}MB")
        if self.first_bucket_mb is not None:
            parts.append(f"first={self.first_bucket_mb:g}MB")
        if self.gradient_as_bucket_view:
            parts.append("view")
        if self.static_graph:
            parts.append("static")
        if self.hook == "powersgd":
            parts.append(f"powersgd(rank={self.powersgd_rank},start={self.powersgd_start})")
        elif self.hook:
            parts.append(f"hook={self.hook}")
        parts += [f"{k}={v}" for k, v in self.world]
        return ",".join(parts) or "default"

    def replace(self, **changes: Any) -> DDPConfig:
        return dataclasses.replace(self, **changes)

    def to_params(self) -> dict[str, str]:
        """The configuration as a bank entry's strategy params (strings)."""
        out = {
            "bucket_cap_mb": "" if self.bucket_cap_mb is None else f"{self.bucket_cap_mb:g}",
            "first_bucket_mb": "" if self.first_bucket_mb is None else f"{self.first_bucket_mb:g}",
            "gradient_as_bucket_view": str(self.gradient_as_bucket_view).lower(),
            "static_graph": str(self.static_graph).lower(),
            "hook": self.hook,
        }
        if self.hook == "powersgd":
            out["powersgd_rank"] = str(self.powersgd_rank)
            out["powersgd_start"] = str(self.powersgd_start)
        for k, v in self.world:
            out[f"world.{k}"] = v
        return out

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> DDPConfig:
        """The inverse of `to_params` (other keys are ignored); OptionError when a value
        is malformed."""
        try:
            return cls(
                bucket_cap_mb=float(params["bucket_cap_mb"])
                if params.get("bucket_cap_mb")
                else None,
                first_bucket_mb=float(params["first_bucket_mb"])
                if params.get("first_bucket_mb")
                else None,
                gradient_as_bucket_view=_BOOL[params.get("gradient_as_bucket_view", "false")],
                static_graph=_BOOL[params.get("static_graph", "false")],
                hook=params.get("hook", ""),
                powersgd_rank=int(params.get("powersgd_rank") or 1),
                powersgd_start=int(params.get("powersgd_start") or 2),
                world=tuple(
                    sorted(
                        (k.removeprefix("world."), v)
                        for k, v in params.items()
                        if k.startswith("world.")
                    )
                ),
            )
        except (KeyError, ValueError) as exc:
            raise OptionError(f"not a DDP configuration: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        """The configuration as `ddp_config.json` writes it: DDP's keyword arguments, the
        comm hook and the process group's options."""
        hook: dict[str, Any] = {"name": self.hook or None}
        if self.hook == "powersgd":
            hook.update(
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start,
            )
        return {
            "label": self.label,
            "ddp_kwargs": self.ddp_kwargs(),
            "comm_hook": hook,
            "process_group": dict(self.world),
        }

    def ddp_kwargs(self) -> dict[str, Any]:
        """DDP's keyword arguments for this configuration (those that differ from its
        defaults). A first bucket cap is given as `bucket_cap_mb_list` [first, cap]: DDP's
        per-bucket limits, the last repeated."""
        out: dict[str, Any] = {}
        if self.first_bucket_mb is not None:
            out["bucket_cap_mb_list"] = [self.first_bucket_mb, self.cap_mb]
        elif self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        if self.gradient_as_bucket_view:
            out["gradient_as_bucket_view"] = True
        if self.static_graph:
            out["static_graph"] = True
        return out


def supports_first_bucket() -> bool:
    """Whether this torch's DDP takes per-bucket caps (`bucket_cap_mb_list`)."""
    from torch.nn.parallel import DistributedDataParallel

    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


def _plugin_hooks() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=HOOK_GROUP)}


def plugin_hook_names() -> list[str]:
    """Names of the comm hooks installed packages provide (without importing them)."""
    return sorted(_plugin_hooks())


#: fp16_scaled brings the world's largest gradient to at most this: a sum of the world's
#: shares stays below fp16's largest finite value (65504), and a gradient 2^-24 of the
#: largest still has fp16's full precision.
_FP16_PEAK = 2.0**15


def fp16_scale(peak: float) -> float:
    """The power of two that brings magnitude `peak` to at most `_FP16_PEAK` and above half
    of it (1 for a peak that is zero or not finite: nothing to keep, or nothing to save)."""
    if not math.isfinite(peak) or peak <= 0.0:
        return 1.0
    return 2.0 ** max(-120, min(120, math.floor(math.log2(_FP16_PEAK / peak))))


def fp16_scaled_hook(process_group, bucket):  # torch checks the annotations: none
    """A DDP comm hook: the bucket's all-reduce in fp16, scaled so small gradients keep
    their precision. torch's `fp16_compress_hook` casts gradients as they are, and those
    below 2^-14 (6.1e-5, common in layers far from the loss) lose bits as fp16 subnormals
    or vanish below 2^-24. Here the ranks first agree on the largest magnitude in the
    bucket (a MAX all-reduce of one float), scale by a power of two (exact in binary) so
    it lands just under 2^15, divide by the world size, cast, sum in fp16, and undo the
    scale in the bucket's own dtype. (Unannotated: `register_comm_hook` refuses any
    annotation but its own classes', which this module does not import.)"""
    import torch
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    world = group.size()
    buffer = bucket.buffer()
    peak = buffer.detach().abs().max().to(torch.float32).reshape(1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    scale = fp16_scale(float(peak))
    compressed = buffer.mul(scale / world).to(torch.float16)

    def decompress(fut: Any) -> Any:
        buffer.copy_(fut.value()[0])
        return buffer.div_(scale)

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def comm_hook(config: DDPConfig, process_group: Any) -> tuple[Any, Any] | None:
    """(state, hook) for `register_comm_hook`, or None for DDP's own all-reduce.
    OptionError when the hook is unknown here."""
    if not config.hook:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if config.hook == "fp16":
        return process_group, default_hooks.fp16_compress_hook
    if config.hook == "fp16_scaled":
        return process_group, fp16_scaled_hook
    if config.hook == "bf16":
        return process_group, default_hooks.bf16_compress_hook
    if config.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=config.powersgd_start,
        )
        return state, powerSGD_hook.powerSGD_hook
    ep = _plugin_hooks().get(config.hook)
    if ep is None:
        raise OptionError(
            f"comm hook {config.hook!r}: no installed package provides it (entry points {HOOK_GROUP})"
        )
    return ep.load()(process_group)


def wrap(module: Any, config: DDPConfig, *, process_group: Any = None, **ddp_kwargs: Any) -> Any:
    """`DistributedDataParallel(module)` built as `config` says, its comm hook registered;
    `ddp_kwargs` (e.g. device_ids) are added and win over the configuration's."""
    from torch.nn.parallel import DistributedDataParallel

    kwargs = {**config.ddp_kwargs(), **ddp_kwargs}
    if "bucket_cap_mb" in ddp_kwargs:  # the caller's cap replaces the whole bucket setting
        kwargs.pop("bucket_cap_mb_list", None)
    model = DistributedDataParallel(module, process_group=process_group, **kwargs)
    hook = comm_hook(config, process_group)
    if hook is not None:
        model.register_comm_hook(*hook)
    return model


def layout_of(module: Any, world_size: int, backend: str) -> GradientLayout:
    """The gradient layout of `module` in a world of `world_size` on `backend`."""
    return GradientLayout.of(
        ((str(p.dtype), tuple(p.shape)) for p in module.parameters() if p.requires_grad),
        world_size,
        backend,
    )


def accelerator_name(module: Any) -> str:
    """The name of the accelerator `module`'s parameters live on ("" on CPU): part of the
    host fingerprint."""
    import torch

    for p in module.parameters():
        kind = p.device.type
        if kind == "cpu":
            return ""
        if kind == "cuda":
            return torch.cuda.get_device_name(p.device)
        mod = getattr(torch, kind, None)
        get = getattr(mod, "get_device_name", None)
        return str(get(p.device)) if get is not None else kind
    return ""


def lookup(
    layout: GradientLayout,
    precision: str = "exact",
    bank: str | os.PathLike[str] | None = None,
    accelerator: str = "",
) -> tuple[DDPConfig | None, str]:
    """What the bank says for `layout` on this host: (the configuration, a line saying
    where it comes from), or (None, why DDP's defaults are used). BankError when the
    bank cannot be read."""
    from aoe.bank import open_bank

    host = host_fingerprint(layout.backend, accelerator)
    key = gdat_key(layout, host, precision)
    with open_bank(bank) as reader:
        entry, layer = reader.lookup(key)
        if entry is not None:
            config = DDPConfig.from_params(dict(entry.strategy.params))
            gain = (
                entry.baseline.median_us / entry.winner.median_us - 1
                if entry.winner.median_us > 0
                else 0.0
            )
            return config, (
                f"{config.label} from the bank (layer {layer}, job {entry.provenance.job_id}: "
                f"{gain:+.1%} per step over DDP's defaults when tuned)"
            )
        default, layer = reader.lookup_default(key)
        if default is not None:
            return (
                None,
                f"DDP's defaults: tuned (layer {layer}, job {default.get('job', '?')}) and they stayed fastest",
            )
    return None, (
        f"DDP's defaults: the bank has nothing for this gradient layout ({len(layout.params)} gradients, "
        f"world of {layout.world_size} on {layout.backend}, {precision}); tune it with aoe tune "
        "--job-type gdat"
    )


def ddp(
    model: Any,
    *,
    precision: str = "exact",
    bank: str | os.PathLike[str] | None = None,
    process_group: Any = None,
    quiet: bool = False,
    **ddp_kwargs: Any,
) -> Any:
    """`DistributedDataParallel(model, **ddp_kwargs)` with the options and comm hook the
    bank holds for the model's gradient layout in this world (under the gradient
    `precision` the layout was tuned for), else DDP's defaults; one line on rank 0's
    stderr says which (unless `quiet`). Needs an initialized process group. A bank that
    cannot be read is reported in that line and DDP's defaults are used: a training job
    never fails for want of a tuning record."""
    import torch.distributed as dist

    if precision not in PRECISIONS:
        raise OptionError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    layout = layout_of(
        model, dist.get_world_size(process_group), str(dist.get_backend(process_group))
    )
    try:
        config, note = lookup(layout, precision, bank, accelerator_name(model))
    except AoedError as exc:
        config, note = None, f"DDP's defaults: {exc}"
    if config is not None:
        missing = [f"{k}={v}" for k, v in config.world if k.isupper() and os.environ.get(k) != v]
        if missing:
            note += (
                f"; the tuned world also set {', '.join(missing)} before the process group was made"
            )
        elif config.world and not all(k.isupper() for k, _ in config.world):
            note += (
                f"; the tuned world's process group had {dict(config.world)} (see ddp_config.json)"
            )
    overridden = sorted(
        set(ddp_kwargs) & {"bucket_cap_mb", "gradient_as_bucket_view", "static_graph"}
    )
    if config is not None and overridden:
        note += f"; your {', '.join(overridden)} kept"
    if not quiet and dist.get_rank(process_group) == 0:
        print(f"aoe.gdat: {note}", file=sys.stderr, flush=True)
    return wrap(model, config or DDPConfig(), process_group=process_group, **ddp_kwargs)


def read_config(path: str | os.PathLike[str]) -> DDPConfig:
    """The configuration a `ddp_config.json` (a GDAT job's output) holds. OptionError
    naming the file when it is not one."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        return DDPConfig.from_params(doc["params"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OptionError(
            f"{path}: not a ddp_config.json written by aoe tune --job-type gdat ({exc})"
        ) from None
