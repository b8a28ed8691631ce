"""One rank of a GDAT world: `python -m aoed.backends.torch.rank`, one process per rank.

The world (world.py) sends every rank the same requests, one JSON object per line
(aoed.backends._wire), so the ranks run their collectives in lockstep:

  inspect  load the model and say its gradient layout (no process group: the job asks
           this of one process before it decides whether to start a world at all)
  init     join the world (a FileStore rendezvous, the backend, the world's options set
           in the environment before the group exists) and load the model
  measure  one round: for each configuration in the given order, DDP built over a fresh
           copy of the model (aoe.gdat.wrap, as the training helper builds it), warm-up
           steps, then measured steps; per step its time and its communication tail
  gate     a lossy configuration against exact all-reduce: the reduced gradients of one
           step from the same weights and batches, or the loss over K steps
  export   (no world) the program exported to ONNX, its dynamic dimensions kept, for an
           ONNX job to tune it for inference (engine/world.py, `export_model`)

A step is zero_grad, forward, the loss, backward and an SGD step. Its *communication
tail* is the time from the end of the last gradient's computation to the end of
backward: every parameter carries a post-accumulate-grad hook that takes a timestamp
when its gradient is ready, and DDP's backward returns only once every bucket's
all-reduce has finished and its results are in place. On accelerators the timestamps
are device events on the compute stream, read after a synchronize at the end of the
step, so queued work is not mistaken for finished work.

Inputs: a `torch.export` program (.pt2) with its example inputs. The process that loads
one is confined (aoed.sandbox: the policy comes on the command line, `--sandbox`, and is
applied before anything else, torch included, is imported): it reads only Python, the
system's libraries and the program, writes only its world's folder in the job's
workspace, and a rank's network is closed once its world has formed (`init` joins the
world first, then loads). The program is opened once, checked as data (archive.py:
nothing in it that torch would unpickle, evaluate or import) and handed, as that same
open file, to `torch.export.load`, with
TORCH_FORCE_WEIGHTS_ONLY_LOAD set so that what torch does unpickle (the example inputs)
goes through its weights-only loader. The loss is synthetic (the mean square of the float
outputs: gradient shapes and timing do not depend on labels). Or, for embedded runs
only, `file.py:function` returning (model, batch, loss_fn): the user's own code, run
unconfined, as the user who runs it. Each rank perturbs its batch (float inputs
get rank-seeded noise, integer inputs are rolled), so the ranks' gradients differ as in
training and a gate sees real reductions.
"""

from __future__ import annotations

import os

# Before torch is imported anywhere in this process: torch.export.load unpickles tensor
# subclasses and example inputs; with this set, only torch's weights-only loader does.
os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"

import sys  # noqa: E402

from aoed import sandbox  # noqa: E402

#: How this process is confined (None: started without a policy, for user code).
_confinement: sandbox.Confinement | sandbox.SandboxError | None = None
if __name__ == "__main__":
    # First, while this process has one thread: the imports below start threads (numpy's
    # BLAS pool), and a thread that exists before confinement would stay unconfined.
    _confinement = sandbox.enter(sys.argv)

import copy  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from aoe.errors import ModelError, OptionError  # noqa: E402
from aoe.gdat import DDPConfig, hook_class, layout_of, supports_first_bucket, wrap  # noqa: E402
from aoed.backends.torch.archive import check_pt2  # noqa: E402

#: Step size of the SGD step in measured steps: small, so weights barely move.
_MEASURE_LR = 1e-4
#: Step size of Adam in a loss gate's K steps (Adam: a step of about this size whatever
#: the gradients' scale, so the loss moves on any model).
_GATE_LR = 1e-3
#: A gradient tensor smaller than this fraction of the largest one is judged against it.
_TINY = 1e-3

_state: dict[str, Any] = {}


# --------------------------------------------------------------------------- loading


def _flat(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flat(o)]
    return []


def synthetic_loss(out: Any) -> Any:
    """The mean square of every float output that carries a gradient, summed."""
    terms = [
        (t.float() ** 2).mean() for t in _flat(out) if t.is_floating_point() and t.requires_grad
    ]
    if not terms:
        raise ModelError(
            "the model's outputs carry no gradient: nothing for data-parallel training to reduce"
        )
    return sum(terms)


def _confined() -> sandbox.Confinement:
    """How this process is confined, for loading a program; OptionError when it is not
    and may not load one (no policy was given, or the kernel could not confine it)."""
    if isinstance(_confinement, sandbox.SandboxError):
        raise OptionError(str(_confinement))  # the class the world reports as the job's
    if _confinement is None:
        raise OptionError(
            "this rank process was started without a sandbox policy, and loads no program"
        )
    return _confinement


def _load_pt2(path: Path, shown: str) -> tuple[Any, tuple, dict, Any]:
    """The program at `path`, named `shown` in messages (as its submitter knows it), as
    (module, args, kwargs, loss)."""
    ep = _load_program(path, shown)
    if ep.example_inputs is None:
        raise ModelError(
            f"{shown}: saved without example inputs; export with torch.export.export(model, args) "
            "and save that program"
        )
    args, kwargs = ep.example_inputs
    return ep.module(), tuple(args), dict(kwargs), synthetic_loss


def _load_program(path: Path, shown: str, expect: str = "") -> Any:
    """The torch.export program at `path`, read as data first (archive.check_pt2); with
    `expect` ("DEV:INO"), only if the file opened is still the one its submitter's checks
    passed, with one link."""
    import torch

    _confined()
    try:
        f = open(path, "rb")  # noqa: SIM115 (torch reads it after the check, below)
    except FileNotFoundError:
        raise ModelError(f"{shown}: no such file") from None
    except OSError as exc:
        raise ModelError(f"{shown}: cannot be read: {exc.strerror}") from None
    with f:
        st = os.fstat(f.fileno())
        if expect and (f"{st.st_dev}:{st.st_ino}" != expect or st.st_nlink != 1):
            raise ModelError(
                f"{shown}: the file changed since it was checked; submit it again once nobody "
                "changes it"
            )
        # The bytes checked are the bytes torch reads: one open file, not the path twice.
        check_pt2(f, name=shown)
        f.seek(0)
        try:
            ep = torch.export.load(f)
        except Exception as exc:  # torch raises many kinds for a file it cannot read
            raise ModelError(
                f"{shown}: not a torch.export program this torch ({torch.__version__}) can load: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
    return ep


def _load_entry(path: Path, function: str) -> tuple[Any, tuple, dict, Any]:
    import torch

    if not path.is_file():
        raise OptionError(f"--entry {path}:{function}: no such file")
    spec = importlib.util.spec_from_file_location("aoe_gdat_entry", path)
    if spec is None or spec.loader is None:
        raise OptionError(f"--entry {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise OptionError(f"--entry {path}:{function}: no such function in {path.name}")
    built = fn()
    if not (isinstance(built, tuple) and len(built) == 3):
        raise OptionError(f"--entry {path}:{function}: must return (model, batch, loss_fn)")
    model, batch, loss_fn = built
    if not isinstance(model, torch.nn.Module):
        raise OptionError(
            f"--entry {path}:{function}: the model is a {type(model).__name__}, not a torch.nn.Module"
        )
    args: tuple[Any, ...]
    if isinstance(batch, dict):
        args, kwargs = (), dict(batch)
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        args, kwargs = (batch,), {}
    if loss_fn is not None and not callable(loss_fn):
        raise OptionError(
            f"--entry {path}:{function}: loss_fn must be callable (or None for the synthetic loss)"
        )
    return model, args, kwargs, loss_fn or synthetic_loss


def _load(source: dict[str, Any]) -> tuple[Any, tuple, dict, Any]:
    if source.get("kind") == "entry":
        return _load_entry(Path(source["path"]), str(source["function"]))
    return _load_pt2(Path(source["path"]), str(source.get("shown") or source["path"]))


def _perturbed(obj: Any, rank: int, gen: Any) -> Any:
    """`obj` as rank `rank` feeds it: floats with rank-seeded noise, integers rolled."""
    import torch

    if rank == 0:
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            scale = float(obj.float().std()) if obj.numel() > 1 else 1.0
            noise = torch.randn(obj.shape, generator=gen, dtype=torch.float32).to(
                obj.device, obj.dtype
            )
            return obj + noise * 0.1 * (scale if math.isfinite(scale) and scale > 0 else 1.0)
        if obj.numel() > 1 and obj.dtype != torch.bool:
            return obj.flatten().roll(rank).reshape(obj.shape)
        return obj
    if isinstance(obj, tuple):
        return tuple(_perturbed(o, rank, gen) for o in obj)
    if isinstance(obj, list):
        return [_perturbed(o, rank, gen) for o in obj]
    if isinstance(obj, dict):
        return {k: _perturbed(v, rank, gen) for k, v in obj.items()}
    return obj


def _device(backend: str, rank: int) -> Any:
    """The torch device rank `rank` runs on. OptionError naming what is missing."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise OptionError("this torch has no torch.distributed; install a build with it")
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise OptionError("backend gloo: this torch was built without gloo")
        return torch.device("cpu")
    if backend == "nccl":
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise OptionError(
                "backend nccl: this torch has no NCCL or sees no CUDA device; install a CUDA build of "
                "torch (the package torch from the CUDA index) on a machine with NVIDIA GPUs"
            )
        if rank >= torch.cuda.device_count():
            raise OptionError(
                f"backend nccl: rank {rank} needs GPU {rank}, this machine has {torch.cuda.device_count()}"
            )
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    if backend == "hccl":
        if importlib.util.find_spec("torch_npu") is None:
            raise OptionError(
                "backend hccl: needs the package torch_npu (Ascend's torch adapter), which is not installed"
            )
        import torch_npu  # noqa: F401  (registers the npu device and hccl)

        if rank >= torch.npu.device_count():
            raise OptionError(
                f"backend hccl: rank {rank} needs NPU {rank}, this machine has "
                f"{torch.npu.device_count()}"
            )
        torch.npu.set_device(rank)
        return torch.device("npu", rank)
    raise OptionError(f"backend {backend}: expected gloo, nccl or hccl")


# --------------------------------------------------------------------------- clocks


class _HostClock:
    """Timestamps in ns from the host's monotonic clock (gloo: the work is on the host)."""

    def __init__(self) -> None:
        self.ready = 0

    def grad_ready(self, _param: Any) -> None:
        self.ready = time.perf_counter_ns()

    def now(self) -> Any:
        return time.perf_counter_ns()

    def step(self, begin: Any, backward_end: Any, end: Any) -> tuple[float, float]:
        """(step us, tail us)."""
        return (end - begin) / 1e3, max(
            0.0, (backward_end - self.ready) / 1e3
        ) if self.ready else 0.0


class _EventClock:
    """Device events on the compute stream; a step is read after synchronizing."""

    def __init__(self, mod: Any) -> None:
        self._mod = mod
        self.ready: Any = None

    def _event(self) -> Any:
        e = self._mod.Event(enable_timing=True)
        e.record()
        return e

    def grad_ready(self, _param: Any) -> None:
        self.ready = self._event()

    def now(self) -> Any:
        return self._event()

    def step(self, begin: Any, backward_end: Any, end: Any) -> tuple[float, float]:
        self._mod.synchronize()
        tail = self.ready.elapsed_time(backward_end) * 1e3 if self.ready is not None else 0.0
        return begin.elapsed_time(end) * 1e3, max(0.0, tail)


def _clock() -> Any:
    import torch

    kind = _state["device"].type
    return _HostClock() if kind == "cpu" else _EventClock(getattr(torch, kind))


# --------------------------------------------------------------------------- requests


def _layout_reply(module: Any, world_size: int, backend: str) -> dict[str, Any]:
    from aoe.gdat import accelerator_name

    layout = layout_of(module, world_size, backend)
    return {
        "params": [[d, list(s)] for d, s in layout.params],
        "grad_bytes": layout.grad_bytes,
        "first_bucket": supports_first_bucket(),
        "accelerator": accelerator_name(module),
    }


def _inspect(req: dict[str, Any]) -> dict[str, Any]:
    import torch

    backend = str(req.get("backend", "gloo"))
    world_size = int(req.get("world_size") or 0)
    devices = 0
    if backend != "gloo":
        device = _device(backend, 0)  # say what is missing before any world starts
        devices = int(getattr(torch, device.type).device_count())
        if world_size > devices:
            raise OptionError(
                f"--world-size {world_size}: backend {backend} runs one rank per device, and this "
                f"machine has {devices}"
            )
    module, _args, _kwargs, _loss = _load(req["source"])
    reply = _layout_reply(module, world_size, backend)
    reply["torch"] = str(torch.__version__)
    reply["devices"] = devices
    reply["sandbox"] = _sandbox_said(req["source"])
    if not reply["params"]:
        raise ModelError(
            f"{req['source'].get('path')}: the model has no parameter that requires a gradient"
        )
    return reply


def _init(req: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rank, world_size, backend = int(req["rank"]), int(req["world_size"]), str(req["backend"])
    torch.set_num_threads(max(1, int(req.get("threads", 1))))
    device = _device(backend, rank)
    pt2 = req["source"].get("kind") != "entry"
    if pt2:
        _confined()  # before joining: a rank that may load nothing says so, alike on every rank
    store = dist.FileStore(str(req["store"]), world_size)
    timeout = datetime.timedelta(seconds=float(req.get("timeout_s", 120)))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    # The world's connections exist once every rank has passed a collective (gloo's mesh
    # forms in init_process_group, an accelerator's communicator at its first
    # collective); no new one is made after, so the network closes before the program
    # is opened.
    if backend == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    if pt2 and _confined().confined:
        sandbox.close_network()
    module, args, kwargs, loss_fn = _load(req["source"])
    module = module.to(device)
    gen = torch.Generator().manual_seed(1234 + rank)

    def mine(t: Any) -> Any:
        return _perturbed(t.to(device) if isinstance(t, torch.Tensor) else t, rank, gen)

    args = tuple(mine(a) for a in args)
    kwargs = {k: mine(v) for k, v in kwargs.items()}
    _state.update(module=module, args=args, kwargs=kwargs, loss=loss_fn, device=device, rank=rank)
    # What is loaded now (torch, the model) lives as long as the rank: out of the
    # collector's sight, each turn's collection scans only that turn's objects (a full
    # collection over torch's took about 70 ms a turn, a quarter of a small model's).
    gc.freeze()
    return {**_layout_reply(module, world_size, backend), "sandbox": _sandbox_said(req["source"])}


def _sandbox_said(source: dict[str, Any]) -> str:
    """How the process that loaded `source` is confined, in words."""
    if source.get("kind") == "entry":
        return "unconfined: your own training code (--entry) runs as you"
    return _confined().describe()


def _build(config: DDPConfig) -> Any:
    """DDP over a fresh copy of the model, with the configuration's options and hook."""
    device = _state["device"]
    extra = {"device_ids": [device.index]} if device.type != "cpu" else {}
    return wrap(copy.deepcopy(_state["module"]), config, **extra)


def _step(model: Any, opt: Any) -> Any:
    opt.zero_grad(set_to_none=True)
    loss = _state["loss"](model(*_state["args"], **_state["kwargs"]))
    loss.backward()
    return loss


def _measure_one(config: DDPConfig, warmup: int, steps: int) -> dict[str, Any]:
    import torch

    model = _build(config)
    clock = _clock()
    handles = [
        p.register_post_accumulate_grad_hook(clock.grad_ready)
        for p in model.module.parameters()
        if p.requires_grad
    ]
    opt = torch.optim.SGD(model.parameters(), lr=_MEASURE_LR)
    if config.hook == "powersgd":  # measured once PowerSGD compresses, not while it warms up
        warmup = max(warmup, config.powersgd_start + 1)
    step_us, tail_us = [], []
    try:
        for i in range(warmup + steps):
            begin = clock.now()
            opt.zero_grad(set_to_none=True)
            loss = _state["loss"](model(*_state["args"], **_state["kwargs"]))
            loss.backward()
            backward_end = clock.now()
            opt.step()
            end = clock.now()
            if i >= warmup:
                s, t = clock.step(begin, backward_end, end)
                step_us.append(s)
                tail_us.append(t)
        buckets = str(model._get_ddp_logging_data().get("rebuilt_bucket_sizes") or "")
    finally:
        for h in handles:
            h.remove()
    return {
        "step_us": step_us,
        "tail_us": tail_us,
        "buckets": [int(b) for b in buckets.split(",") if b.strip()],
    }


def _measure(req: dict[str, Any]) -> dict[str, Any]:
    configs = {name: DDPConfig.from_params(p) for name, p in req["configs"].items()}
    out: dict[str, Any] = {}
    for name in req["order"]:
        try:
            out[name] = _measure_one(
                configs[name], int(req.get("warmup", 2)), int(req.get("steps", 5))
            )
        except Exception as exc:  # a configuration this torch refuses costs that configuration
            out[name] = {
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            }
        # DDP keeps reference cycles (its reducer, logger and hooks): without a collection
        # each turn's model copy, gradients and buckets would pile up until the next one.
        gc.collect()
    return {"results": out}


def _grad_errors(ref: Any, hooked: Any) -> dict[str, Any]:
    """How far `hooked`'s reduced gradients are from `ref`'s: per gradient tensor, the
    L2 norm of the difference over the tensor's own norm, or over `_TINY` of the largest
    tensor's norm when the tensor's is smaller (a gradient that is zero up to rounding,
    such as a bias before a normalization, is judged against the gradients that matter);
    the largest of these (`max_rel_error`, what the gate bounds) and the relative error
    of all gradients together (`global_rel_error`)."""
    import torch

    diffs, norms = [], []
    for a, b in zip(ref.module.parameters(), hooked.module.parameters(), strict=True):
        if not a.requires_grad:
            continue
        ga = (
            a.grad.double()
            if a.grad is not None
            else torch.zeros(a.shape, dtype=torch.float64, device=a.device)
        )
        gb = (
            b.grad.double()
            if b.grad is not None
            else torch.zeros(b.shape, dtype=torch.float64, device=b.device)
        )
        diffs.append(float((gb - ga).norm()))
        norms.append(float(ga.norm()))
    floor = _TINY * max(norms, default=0.0)
    worst, worst_i = 0.0, -1
    for i, (d, n) in enumerate(zip(diffs, norms, strict=True)):
        scale = max(n, floor)
        err = d / scale if scale > 0 and math.isfinite(d) else (0.0 if d == 0 else math.inf)
        if worst_i < 0 or err > worst:
            worst, worst_i = err, i
    d2, n2 = sum(d * d for d in diffs), sum(n * n for n in norms)
    total = math.sqrt(d2 / n2) if n2 > 0 else (0.0 if d2 == 0 else math.inf)
    return {"max_rel_error": worst, "global_rel_error": total, "worst_param": worst_i}


def _gate(req: dict[str, Any]) -> dict[str, Any]:
    """The gate's figures for a lossy configuration against the same one without its
    hook: gradients of one step (fp16, bf16 classes) or the loss over `steps` (lowrank)."""
    import torch

    config = DDPConfig.from_params(req["config"])
    exact = config.replace(hook="")
    if hook_class(config.hook) != "lowrank":
        try:
            ref, hooked = _build(exact), _build(config)
        except (
            Exception
        ) as exc:  # every rank refuses a hook alike, before any collective of its own
            return {
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            }
        for m in (ref, hooked):
            _step(m, torch.optim.SGD(m.parameters(), lr=0.0))
        return {"kind": "gradients", **_grad_errors(ref, hooked)}
    steps = int(req.get("steps", 8))
    curves = []
    for cfg in (exact, config):
        try:
            m = _build(cfg)
        except Exception as exc:
            return {
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            }
        opt = torch.optim.Adam(m.parameters(), lr=_GATE_LR)
        losses = []
        for _ in range(steps + 1):
            loss = _step(m, opt)
            losses.append(float(loss.detach()))
            opt.step()
        curves.append(losses)
        del m, opt
        gc.collect()
    (e0, ek), pk = (curves[0][0], curves[0][-1]), curves[1][-1]
    drop = e0 - ek
    gap = abs(pk - ek) / drop if drop > 0 else math.inf
    return {"kind": "loss", "loss_exact": curves[0], "loss_hooked": curves[1], "loss_gap": gap}


def _export(req: dict[str, Any]) -> dict[str, Any]:
    """The program exported to ONNX at req["out"] (inside the workspace this process may
    write): torch.onnx's exporter takes the program as it is, so each dimension it left
    dynamic stays a named dimension of the ONNX model."""
    import contextlib

    import onnx
    import torch

    source = req["source"]
    if source.get("kind") != "pt2":
        raise OptionError("only a torch.export program (.pt2) is exported to ONNX")
    said = _confined().describe()
    shown = str(source.get("shown") or source["path"])
    ep = _load_program(Path(source["path"]), shown, str(source.get("expect") or ""))
    out = Path(req["out"])
    try:
        # The exporter reports its steps on stdout, which carries this process's answers.
        with contextlib.redirect_stdout(sys.stderr):
            torch.onnx.export(ep, (), dynamo=True, verbose=False).save(str(out))
    except Exception as exc:  # the exporter's errors share no class
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "no message"
        raise ModelError(
            f"{shown}: torch.onnx could not export it to ONNX ({type(exc).__name__}: {first}); "
            "export it with torch.onnx.export(..., dynamo=True) and tune the .onnx"
        ) from None
    model = onnx.load(str(out), load_external_data=False)
    inputs = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in model.graph.input
    }
    ranges = {
        str(sym): (max(1, int(r.lower)), int(r.upper))
        for sym, r in ep.range_constraints.items()
        if r.upper.is_finite and int(r.upper) >= max(1, int(r.lower))
    }
    return {"inputs": inputs, "ranges": ranges, "torch": str(torch.__version__), "sandbox": said}


def _handle(request: Any) -> dict[str, Any]:
    import msgspec

    from aoed.engine import rankmessages as rm

    handlers: dict[type[Any], Callable[..., dict[str, Any]]] = {
        rm.RankInspectRequest: _inspect,
        rm.RankExportRequest: _export,
        rm.RankInitRequest: _init,
        rm.RankMeasureRequest: _measure,
        rm.RankGateRequest: _gate,
    }
    fn = handlers[type(request)]
    if fn in (_measure, _gate) and "module" not in _state:
        raise RuntimeError(f"{type(request).__name__} before init")
    return fn(msgspec.structs.asdict(request))


def main() -> int:
    from aoed.backends._wire import child_main, serve
    from aoed.engine import rankmessages as rm

    child_main()
    try:
        return serve(
            _handle,
            [
                rm.RankInspectRequest,
                rm.RankExportRequest,
                rm.RankInitRequest,
                rm.RankMeasureRequest,
                rm.RankGateRequest,
            ],
        )
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
