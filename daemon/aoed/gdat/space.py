"""The GDAT search space: which DDP configurations a stage of the search measures.

  ladder   DDP's defaults and bucket caps from `LADDER_MB`
  refine   caps between the best rung and its neighbours (geometric midpoints), and
           first-bucket caps (`FIRST_MB`) under the best cap, where this torch's DDP
           takes per-bucket caps
  flags    gradient_as_bucket_view and static_graph on the best, alone and together
  hooks    the comm hooks the gradient precision allows (least lossy class first), on
           the best; each gated against exact all-reduce before it is measured
  rebucket when a hook was adopted: the ladder's caps again, with the hook and flags kept
           (a hook that shrinks the traffic moves the best cap: smaller buckets overlap
           more of backward once each costs less to send)
  world    the backend's own knobs (`BACKEND_KNOBS`: environment set before the process
           group exists), each in a world of its own, with the best configuration

Configurations that give DDP the same buckets (`aoe.gradlayout.bucket_sizes`) are one
configuration: only the first is measured, so a small model's ladder is short.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from aoe.errors import OptionError
from aoe.gdat import BUILTIN_HOOKS, DDPConfig, hook_class
from aoe.gradlayout import PRECISIONS, GradientLayout, bucket_sizes

__all__ = [
    "BACKEND_KNOBS",
    "FIRST_MB",
    "LADDER_MB",
    "distinct",
    "flags",
    "hooks",
    "ladder",
    "rebucket",
    "refine",
    "skipped_hooks",
    "world_knobs",
]

_MB = 1 << 20
#: Bucket caps of the first stage, in MiB (DDP's default, 25, is among them).
LADDER_MB = (0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0)
#: First-bucket caps tried under the best cap, in MiB (DDP's own is 1 with its defaults).
FIRST_MB = (0.25, 1.0, 4.0)
#: PowerSGD's ranks tried under the lowrank policy, and the iteration it starts at.
POWERSGD_RANKS = (1, 4)
POWERSGD_START = 2
#: The backend's knobs: each a set of environment variables a world starts with. gloo in
#: torch's builds has none that matter (its transport is TCP, its threads are fixed).
BACKEND_KNOBS: dict[str, tuple[tuple[tuple[str, str], ...], ...]] = {
    "gloo": (),
    "nccl": (
        (("NCCL_ALGO", "Tree"),),
        (("NCCL_ALGO", "Ring"),),
        (("NCCL_PROTO", "Simple"),),
        (("NCCL_PROTO", "LL128"),),
    ),
    "hccl": ((("HCCL_BUFFSIZE", "400"),), (("HCCL_BUFFSIZE", "100"),)),
}
#: Comm hooks a backend cannot run (torch refuses them when registered), and why.
_UNSUPPORTED = {
    ("gloo", "bf16"): "bf16_compress_hook needs NCCL 2.10+ (or XCCL): not available on gloo"
}


def _buckets(layout: GradientLayout, config: DDPConfig) -> tuple[int, ...]:
    sizes = layout.sizes_bytes()
    cap = int(config.cap_mb * _MB)
    if config.first_bucket_mb is not None:
        first: int | None = int(config.first_bucket_mb * _MB)
    elif config.bucket_cap_mb is None:
        first = _MB  # DDP's rule with its default cap: a 1 MiB first bucket
    else:
        first = None
    return bucket_sizes(sizes, cap, first)


def distinct(
    layout: GradientLayout, configs: Iterable[DDPConfig], seen: Iterable[DDPConfig] = ()
) -> list[DDPConfig]:
    """`configs` without those that give the same buckets, with the same other options,
    as an earlier one or one of `seen`; DDP's defaults are kept whenever given."""
    keys = {
        (_buckets(layout, c), c.replace(bucket_cap_mb=None, first_bucket_mb=None)) for c in seen
    }
    out = []
    for c in configs:
        key = (_buckets(layout, c), c.replace(bucket_cap_mb=None, first_bucket_mb=None))
        if key in keys and not c.is_default:
            continue
        keys.add(key)
        out.append(c)
    return out


def ladder(layout: GradientLayout) -> list[DDPConfig]:
    """DDP's defaults, then the ladder's caps up to the first that holds every gradient
    in one bucket."""
    return distinct(layout, [DDPConfig(), *(DDPConfig(bucket_cap_mb=c) for c in _caps(layout))])


def _caps(layout: GradientLayout) -> list[float]:
    """The ladder's caps up to the first that holds every gradient in one bucket."""
    total_mb = layout.grad_bytes / _MB
    caps = []
    for cap in LADDER_MB:
        caps.append(cap)
        if cap >= total_mb:
            break
    return caps


def rebucket(layout: GradientLayout, best: DDPConfig, seen: Sequence[DDPConfig]) -> list[DDPConfig]:
    """`best` (a configuration with a comm hook) at DDP's default cap and at each of the
    ladder's caps up to one bucket, its flags and hook kept, its first-bucket cap dropped;
    without those that repeat the buckets of `seen`."""
    caps: list[float | None] = [None, *_caps(layout)]
    out = [best.replace(bucket_cap_mb=c, first_bucket_mb=None) for c in caps]
    return distinct(layout, [c for c in out if c != best], [best, *seen])


def _round2(x: float) -> float:
    """`x` to two significant digits (caps people can read)."""
    if x <= 0:
        return x
    digits = 1 - int(math.floor(math.log10(x)))
    return round(x, digits)


def refine(
    layout: GradientLayout, best: DDPConfig, first_bucket: bool, seen: Sequence[DDPConfig]
) -> list[DDPConfig]:
    """Caps between `best`'s and its neighbours on the ladder, and first-bucket caps
    under it (when `first_bucket`: this torch's DDP takes per-bucket caps); without those
    that repeat the buckets of `seen`."""
    cap = best.cap_mb
    below = max((c for c in LADDER_MB if c < cap), default=None)
    above = min((c for c in LADDER_MB if c > cap), default=None)
    out = [
        best.replace(bucket_cap_mb=_round2(math.sqrt(cap * n)))
        for n in (below, above)
        if n is not None
    ]
    if first_bucket:
        out += [best.replace(bucket_cap_mb=cap, first_bucket_mb=f) for f in FIRST_MB if f < cap]
    return distinct(layout, out, seen)


def flags(best: DDPConfig) -> list[DDPConfig]:
    """`best` with gradient_as_bucket_view, static_graph, and both."""
    out = [
        best.replace(gradient_as_bucket_view=True),
        best.replace(static_graph=True),
        best.replace(gradient_as_bucket_view=True, static_graph=True),
    ]
    return [c for c in out if c != best]


def _allowed(precision: str) -> set[str]:
    """The hook classes a gradient precision allows: its own and the less lossy ones."""
    return set(PRECISIONS[1 : PRECISIONS.index(precision) + 1])


def hooks(
    best: DDPConfig, precision: str, backend: str, plugins: Sequence[str] = ()
) -> list[DDPConfig]:
    """`best` with each comm hook `precision` allows on `backend`: built-in ones first
    (fp16, bf16, PowerSGD at each of POWERSGD_RANKS), then installed plugins'."""
    allowed = _allowed(precision)
    out = []
    for name, cls in BUILTIN_HOOKS.items():
        if cls not in allowed or (backend, name) in _UNSUPPORTED:
            continue
        if name == "powersgd":
            out += [
                best.replace(hook=name, powersgd_rank=r, powersgd_start=POWERSGD_START)
                for r in POWERSGD_RANKS
            ]
        else:
            out.append(best.replace(hook=name))
    for name in plugins:
        try:
            cls = hook_class(name)
        except OptionError:
            continue
        if cls in allowed:
            out.append(best.replace(hook=name))
    return out


def skipped_hooks(precision: str, backend: str, plugins: Sequence[str] = ()) -> list[str]:
    """Why hooks were left out: the precision's classes that this backend cannot run, and
    installed hooks the precision does not allow or whose name gives no class."""
    allowed = _allowed(precision)
    out = [
        f"{name}: {why}"
        for (b, name), why in _UNSUPPORTED.items()
        if b == backend and BUILTIN_HOOKS[name] in allowed
    ]
    for name in plugins:
        try:
            cls = hook_class(name)
        except OptionError as exc:
            out.append(f"{name}: {exc}")
            continue
        if cls not in allowed:
            out.append(f"{name}: a {cls} hook, beyond --gradient-precision {precision}")
    return out


def world_knobs(backend: str) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The backend's knob settings, each a world's environment."""
    return BACKEND_KNOBS.get(backend, ())
