"""The `aoe` command: one parser, one subcommand per thing to do, one error style.

    aoe tune MODEL [--precision exact|int8|int4] [--input-shape x:1,3,224,224] [--bank DIR]
                   [--repeat-tune] [--parallel N] [--output DIR] [--job-type opat|sgat|sgat+opat]
                   [--local | --socket PATH]
    aoe compile MODEL -o OUT [--bank DIR] ...
    aoe bank stats|lookup|export|import|prune|verify ...
    aoe submit|jobs|status|watch|cancel|fetch|devices|daemon ...   (a running daemon: jobscli)
    aoe --framework 5 --model MODEL --job_type 2        (AOE's spelling of aoe tune)

`aoe tune` sends the job to the daemon when one answers at --socket (else the default
socket) and the options ask for nothing only an embedded run does (--bank,
--bank-layer, --keep-initializer-inputs, --keep-workspace, a bank or plugins from the
environment or config file); otherwise, or with --local, it runs the engine embedded.
Settings come from the environment as in AOE (TUNE_BANK_PATH, REPEAT_TUNE,
TE_PARALLEL_COMPILER, ASCEND_DEVICE_ID) and from an optional TOML file (`--config`), all
read by `aoe.config`; options on the command line win. Every error ends with one line on
stderr, `aoe: error: ...`, and the exit status of its class (2 options, 3 model, 4 bank,
5 device, 7 no daemon, 8 daemon at a limit), never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from aoe.errors import AoedError, OptionError

__all__ = ["main"]

#: Options only AOE's spelling uses: their presence without a command means `tune`.
_AOE_FLAGS = ("-f", "--framework", "-m", "--model", "-j", "--job_type", "--job-type")


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("aoed")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+local"


class Parser(argparse.ArgumentParser):
    """argparse with the project's error style: an OptionError, not an exit."""

    def error(self, message: str) -> NoReturn:
        if "invalid choice" in message and ("argument COMMAND" in message or "argument SUBCOMMAND" in message):
            bad = message.split("invalid choice: ", 1)[1].split(" (", 1)[0]
            choices = message.split("(choose from ", 1)[1].rstrip(")").replace("'", "")
            message = f"unknown command {bad} (commands: {choices}; see {self.prog} --help)"
        where = self.prog.removeprefix("aoe").strip()
        raise OptionError(f"{where}: {message}" if where else message)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="tune a model by measurement, embedded or on a daemon",
                       description="Tune an ONNX model by measurement: on the daemon when one answers, "
                                   "else embedded on this machine.")  # fmt: skip
    p.add_argument("model", type=Path, nargs="?",
                   help="the .onnx model to tune (GDAT: a torch.export program, .pt2)")  # fmt: skip
    p.add_argument("--precision", default="exact", help="precision policy: exact (default), int8, or int4 (weight-only 4-bit products)")
    p.add_argument("--calibration", type=Path, help="calibration samples: a folder of .npz/.npy (int8)")
    p.add_argument("--min-cosine", type=float, help="end-to-end accuracy budget: lowest output cosine (int8: 0.999)")
    p.add_argument("--max-rel-error", type=float,
                   help="end-to-end accuracy budget: largest error relative to the output range (int8: 0.25)")  # fmt: skip
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME:D1,D2,...",
                   help="static shape for an input with dynamic dimensions; repeat or join with ';'")  # fmt: skip
    p.add_argument("--bank", type=Path, help="custom bank directory (default: TUNE_BANK_PATH or the user data dir)")
    p.add_argument("--bank-layer", action="append", type=Path, default=[], metavar="DIR",
                   help="read-only bank consulted after the custom one (repeatable; also AOED_BANK_LAYERS)")  # fmt: skip
    p.add_argument("--repeat-tune", action="store_true", default=None, help="re-tune tasks the bank already knows")
    p.add_argument("--reload", action="store_true",
                   help="resume an interrupted run: what the bank already decided is used, not measured again "
                        "(overrides REPEAT_TUNE)")  # fmt: skip
    p.add_argument("--parallel", help="compile processes, 1-32 (default: TE_PARALLEL_COMPILER or cores-1)")
    p.add_argument("--output", type=Path, default=Path("."), help="where aoe_workspace/ and the result JSON go")
    p.add_argument("--job-type", default=None,
                   help="opat (2): operators; sgat (1): subgraphs (attention, layernorm, gelu); "
                        "sgat+opat: both in one job; gdat (AOE_MODE=4): gradient communication of "
                        "data-parallel training (PyTorch DDP)")  # fmt: skip
    g = p.add_argument_group("GDAT (--job-type gdat)")
    g.add_argument("--world-size", type=int, default=None,
                   help="ranks of the measured world (default: 2 on gloo, one per device on nccl/hccl)")  # fmt: skip
    g.add_argument("--backend", default=None, help="collective backend: gloo (default, CPU), nccl, hccl")
    g.add_argument("--gradient-precision", default=None,
                   help="exact (default); fp16, bf16 or lowrank allow compression hooks of that class and "
                        "the less lossy ones, each gated against exact all-reduce")  # fmt: skip
    g.add_argument("--entry", metavar="FILE.py:FUNCTION",
                   help="your own training code instead of a .pt2: FUNCTION returns (model, batch, loss_fn)")  # fmt: skip
    p.add_argument("--device", default=None,
                   help="cpu (default), cuda:N, tensorrt:N or cann:N (ASCEND_DEVICE_ID selects cann:N)")  # fmt: skip
    p.add_argument("--keep-initializer-inputs", action="store_true",
                   help="treat initializers that old exporters list as graph inputs as real inputs")  # fmt: skip
    p.add_argument("--budget", type=float, default=None,
                   help="device seconds for search, session options and verification together "
                        "(default: fitted to the model's profiled latency)")  # fmt: skip
    p.add_argument("--keep-workspace", action="store_true",
                   help="keep the scratch files (task models, samples) under aoe_workspace/ after success")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    q = p.add_mutually_exclusive_group()
    q.add_argument("--local", action="store_true", help="run embedded even when a daemon answers")
    q.add_argument("--socket", type=Path, metavar="PATH",
                   help="the daemon to tune on (default: AOED_SOCKET, else aoed.sock in the runtime dir)")  # fmt: skip
    p.set_defaults(run=_tune)


def _aoe_spelling(argv: Sequence[str]) -> argparse.Namespace:
    """AOE's own spelling: `aoe --framework 5 --model m.onnx --job_type 2`, as `tune`."""
    p = Parser(prog="aoe", description="AOE-compatible invocation of aoe tune.")
    p.add_argument("-f", "--framework", default="5")
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("-j", "--job_type", "--job-type", dest="job_type", default="2")
    p.add_argument("--output", type=Path, default=Path("."))
    p.add_argument("--input_shape", "--input-shape", dest="input_shape", action="append", default=[])
    p.add_argument("--device", default=None)
    p.add_argument("--precision", default="exact")
    p.add_argument("--calibration", type=Path)
    p.add_argument("--bank", type=Path)
    p.add_argument("--config", type=Path)
    p.add_argument("--progress_bar", default="on", choices=["on", "off"])
    p.add_argument("--reload", action="store_true")
    a = p.parse_args(argv)
    from aoe.config import job_type_from_env

    gdat = job_type_from_env() == "gdat"  # AOE's GDAT: the model is a torch.export program, any framework
    if str(a.framework) != "5" and not gdat:
        raise OptionError(f"--framework {a.framework}: only ONNX (5) models can be tuned here")
    return argparse.Namespace(
        model=a.model, precision=a.precision, input_shape=a.input_shape, bank=a.bank, config=a.config,
        calibration=a.calibration, min_cosine=None, max_rel_error=None, bank_layer=[], verbose=0,
        repeat_tune=None, reload=a.reload, parallel=None, output=a.output, job_type=None if gdat else a.job_type,
        device=a.device, keep_initializer_inputs=False, budget=None, keep_workspace=False,
        no_progress=a.progress_bar == "off", local=False, socket=None, run=_tune,
        world_size=None, backend=None, gradient_precision=None, entry=None,
    )  # fmt: skip


#: Options of ONNX jobs and of GDAT jobs alone: given with the other kind, they are refused.
_ONNX_ONLY = (("precision", "exact", "--precision"), ("input_shape", [], "--input-shape"),
              ("calibration", None, "--calibration"), ("min_cosine", None, "--min-cosine"),
              ("max_rel_error", None, "--max-rel-error"), ("parallel", None, "--parallel"),
              ("device", None, "--device"), ("keep_initializer_inputs", False, "--keep-initializer-inputs"))  # fmt: skip
_GDAT_ONLY = (("world_size", "--world-size"), ("backend", "--backend"),
              ("gradient_precision", "--gradient-precision"), ("entry", "--entry"))  # fmt: skip


def _job_type(args: argparse.Namespace) -> str:
    """The job type asked for: --job-type, else AOE's AOE_MODE (4 is GDAT), else opat.
    OptionError when the two contradict."""
    from aoe.config import job_type_from_env

    env = job_type_from_env()
    given = str(args.job_type).strip().lower() if args.job_type else ""
    if env is not None and given and (given == "gdat") != (env == "gdat"):
        raise OptionError(f"AOE_MODE selects {env}, --job-type {args.job_type} another job type: drop one")
    return given or env or "opat"


def _tune(args: argparse.Namespace) -> int:
    args.job_type = _job_type(args)
    if args.job_type == "gdat":
        return _tune_gdat(args)
    given = [flag for attr, flag in _GDAT_ONLY if getattr(args, attr, None) is not None]
    if given:
        raise OptionError(f"{given[0]} applies to --job-type gdat (data-parallel training), not to ONNX models")
    if args.model is None:
        raise OptionError("tune: the following arguments are required: model")
    if args.model.suffix == ".pt2":
        raise OptionError(f"{args.model}: a torch.export program; tune its data-parallel training with --job-type gdat")
    return _tune_onnx(args)


def _tune_onnx(args: argparse.Namespace) -> int:
    import trio

    from aoe.config import load_config, parse_parallel
    from aoe.jobtypes import parse_job_type
    from aoe.device import Device
    from aoe.errors import DeviceError
    from aoed.backends.ort.catalog import build_registry
    from aoed.engine.engine import open_engine
    from aoed.engine.job import JobOptions
    from aoed.engine.policy import policy
    from aoed.engine.prep import parse_input_shapes

    job_type = parse_job_type(args.job_type)
    if args.reload and args.repeat_tune:
        raise OptionError("--reload and --repeat-tune contradict each other: resume, or tune again")
    policy(args.precision, args.min_cosine, args.max_rel_error)  # validates before any work starts
    if args.calibration is not None and not args.calibration.is_dir():
        raise OptionError(f"--calibration {args.calibration}: not a directory")
    if args.budget is not None and args.budget <= 0:
        raise OptionError("--budget must be a positive number of seconds")
    shapes = parse_input_shapes(args.input_shape)
    config = load_config(args.config)
    parallel = parse_parallel(args.parallel, "--parallel") if args.parallel is not None else None
    config = config.replace(
        bank=args.bank, parallel=parallel, repeat_tune=False if args.reload else args.repeat_tune,
        device=Device.parse(args.device) if args.device else None,
        bank_layers=(*args.bank_layer, *config.bank_layers) if args.bank_layer else None,
    )  # fmt: skip
    output: Path = args.output
    _writable_output(output)
    opts = JobOptions(
        model=args.model,
        output=output,
        precision=args.precision,
        job_type=job_type,
        input_shapes=shapes,
        repeat_tune=config.repeat_tune,
        keep_initializer_inputs=args.keep_initializer_inputs,
        device=config.device,
        budget_s=args.budget,
        calibration=args.calibration,
        min_cosine=args.min_cosine,
        max_rel_error=args.max_rel_error,
        keep_workspace=args.keep_workspace,
    )
    daemon = _daemon_for(args, config)
    if daemon is not None:
        from aoe.jobscli import tune_on_daemon

        options = {
            "precision": args.precision, "job_type": job_type, "input_shapes": shapes or None,
            "budget_s": args.budget, "min_cosine": args.min_cosine, "max_rel_error": args.max_rel_error,
            "calibration_dir": args.calibration.absolute() if args.calibration else None,
            # the daemon's own defaults unless the user set these (environment, file or flag)
            "repeat_tune": config.repeat_tune if "repeat_tune" in config.sources else None,
            "parallel": config.parallel if "parallel" in config.sources else None,
            "device": config.device.name if "device" in config.sources else None,
        }  # fmt: skip
        with daemon:
            return tune_on_daemon(daemon, args.model, options, output, progress=not args.no_progress)
    if config.bank is not None and config.bank.exists() and not config.bank.is_dir():
        from aoe.errors import BankError

        raise BankError(f"bank {config.bank}: not a directory (a file is in the way); pass a directory for --bank")
    registry = build_registry(config.plugins)

    from aoe._progress import Progress

    progress = Progress(enabled=not args.no_progress)

    async def run():
        async with open_engine(config, registry, output / "aoe_workspace" / "logs") as engine:
            with progress:
                return await engine.run_job(opts, progress.emit)

    try:
        try:
            result = trio.run(run)
        except BaseExceptionGroup as group:
            raise _single(group) from None
    except DeviceError as exc:
        source = config.sources.get("device", "")
        raise DeviceError(f"{source} selects {config.device}: {exc}" if source.startswith("ASCEND") else str(exc)) from None
    _summary(result)
    return 0


# --------------------------------------------------------------------------- GDAT
# The CLI's one meeting with GDAT jobs: options in, aoed.gdat.run_gdat embedded, the
# result printed. Jobs through the daemon come later.


def _tune_gdat(args: argparse.Namespace) -> int:
    import trio

    from aoe._progress import Progress
    from aoe.config import load_config
    from aoed.gdat import GdatOptions, run_gdat

    given = [flag for attr, default, flag in _ONNX_ONLY if getattr(args, attr, default) not in (default, None)]
    if given:
        extra = "; GDAT uses --gradient-precision" if given[0] == "--precision" else ""
        raise OptionError(f"{given[0]} applies to ONNX jobs, not to --job-type gdat{extra}")
    if args.socket is not None:
        raise OptionError("--job-type gdat runs embedded (not on a daemon yet): drop --socket")
    model, entry = args.model, ""
    if args.entry:
        path, sep, entry = str(args.entry).rpartition(":")
        if not sep or not path or not entry.isidentifier():
            raise OptionError(f"--entry {args.entry}: expected FILE.py:FUNCTION")
        if model is not None:
            raise OptionError(f"--entry {args.entry} and {model}: give the model or the entry, not both")
        model = Path(path)
    if model is None:
        raise OptionError("tune: the following arguments are required: model (or --entry FILE.py:FUNCTION)")
    if args.reload and args.repeat_tune:
        raise OptionError("--reload and --repeat-tune contradict each other: resume, or tune again")
    config = load_config(args.config)
    config = config.replace(
        bank=args.bank, repeat_tune=False if args.reload else args.repeat_tune,
        bank_layers=(*args.bank_layer, *config.bank_layers) if args.bank_layer else None,
    )  # fmt: skip
    opts = GdatOptions(
        model=model, output=args.output, entry=entry, world_size=args.world_size,
        backend=args.backend or "gloo", precision=args.gradient_precision or "exact",
        repeat_tune=config.repeat_tune, budget_s=args.budget, keep_workspace=args.keep_workspace,
    ).check()  # fmt: skip
    _writable_output(args.output)
    progress = Progress(enabled=not args.no_progress)

    async def run():
        with progress:
            return await run_gdat(opts, config, progress.emit)

    try:
        result = trio.run(run)
    except BaseExceptionGroup as group:
        raise _single(group) from None
    _gdat_summary(result)
    return 0


def _gdat_summary(r: Any) -> None:
    out = sys.stdout
    lo, hi = r.improvement_ci95
    conf = r.confirmation
    print(f"aoe: tuned {Path(r.model).name} in {r.tuning_time_s:.1f} s (gdat, {r.precision} gradients, world of "
          f"{r.world_size} on {r.backend})", file=out)  # fmt: skip
    where = (f"from the bank: confirmed by {r.from_bank}" if r.from_bank
             else f"confirming A/B, {conf.get('rounds', 0)} interleaved rounds")  # fmt: skip
    print(f"  baseline     {r.baseline_ms:.4f} ms per step, tail {r.baseline_tail_ms:.4f} ms   (DDP's defaults; "
          f"{where})", file=out)  # fmt: skip
    if r.shipped.is_default:
        print(f"  result       the baseline: DDP's defaults ship (two instances of them lay {lo:+.1%} to {hi:+.1%} "
              "apart in these rounds: their noise)", file=out)  # fmt: skip
    else:
        print(f"  result       {r.result_ms:.4f} ms per step, tail {r.result_tail_ms:.4f} ms   (improvement "
              f"{r.improvement:+.1%}: the median of the paired round ratios, 95% interval {lo:+.1%} to {hi:+.1%})",
              file=out)  # fmt: skip
    shipped = "DDP's defaults ship" if r.shipped.is_default else "the tuned configuration ships"
    print(f"  verdict      {r.verdict}: {shipped}", file=out)
    print(f"  ddp          {r.shipped.label}: {r.shipped.to_json()['ddp_kwargs'] or 'no options'}"
          + (f", comm hook {r.shipped.hook}" if r.shipped.hook else ""), file=out)  # fmt: skip
    if not r.from_bank:
        measured = {c["name"] for c in r.configurations if c.get("step_ms") is not None}
        failed = sum(c["status"] == "failed" for c in r.configurations)
        rejected = sum(c["status"] == "rejected" for c in r.configurations)
        b = r.budget
        print(f"  search       {len(measured)} configurations in {r.resources.get('worlds', 1)} world(s)"
              + (f", {failed} failed" if failed else "") + (f", {rejected} rejected by the gradient gate" if rejected else "")
              + (f", {len(r.broken_turns)} broken turns" if r.broken_turns else "")
              + f"; {b.get('spent_s', 0):.1f} s of a {b.get('budget_s', 0):.0f} s budget, plus "
              f"{b.get('confirm_s', 0):.1f} s confirming", file=out)  # fmt: skip
    for g in r.gates:
        print(f"  gate         {g['config']}: {'passed' if g['passed'] else 'rejected'}: {g['why']}", file=out)
    s = r.repo
    print(
        f"  bank         add {s['repo_add_num']}, hit {s['repo_hit_num']}, reserved {s['repo_reserved_num']}, "
        f"unsatisfied {s['repo_unsatisfied_num']}, update {s['repo_update_num']}, total {s['total_num']}",
        file=out,
    )
    for note in r.notes:
        print(f"  note         {note}", file=out)
    print(f"  ddp config   {r.ddp_config}", file=out)
    print(f"  report       {r.result_json}", file=out)
    print("Aoe process finished", file=out)


def _writable_output(output: Path) -> None:
    """Make sure `output` is a directory this process can write: the result JSON goes
    there and aoe_workspace/ under it. OptionError naming it otherwise, before any
    engine starts (the engine's own log folder would otherwise be the first to fail)."""
    try:
        output.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OptionError(f"--output {output}: not a directory; pass a directory for the outputs") from None
    except OSError as exc:
        raise OptionError(f"--output {output}: cannot create it ({exc.strerror or exc}); pass a directory you may "
                          "write") from None  # fmt: skip
    try:
        # Root passes every permission check, so try instead of asking (os.access).
        with tempfile.TemporaryFile(dir=output):
            pass
        (output / "aoe_workspace" / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OptionError(f"--output {output}: cannot write there ({exc.strerror or exc}); pass a directory you may "
                          "write") from None  # fmt: skip


def _daemon_for(args: argparse.Namespace, config: Any) -> Any:
    """The Client to tune on, or None to run embedded: --local; an option only an embedded
    run honours (the bank, plugins, workspace choices); no daemon answering. A missing
    socket file costs no dial, so without a daemon `aoe tune` is as fast as before."""
    flags = [flag for flag, given in (("--bank", args.bank), ("--bank-layer", args.bank_layer),
             ("--keep-initializer-inputs", args.keep_initializer_inputs),
             ("--keep-workspace", args.keep_workspace)) if given]  # fmt: skip
    if args.socket is not None and flags:
        raise OptionError(f"--socket tunes on the daemon, which uses its own bank and workspace: drop {flags[0]} "
                          "or --socket")  # fmt: skip
    settings = [config.sources[k] for k in ("bank", "bank_layers", "plugins") if k in config.sources]
    if args.local or flags or (settings and args.socket is None):
        return None
    from aoe.config import default_socket

    path = args.socket or default_socket()
    if path.exists():
        from aoe.client import Client

        client = Client(path)
        if client.ping():
            print(f"aoe: tuning on the daemon at {client.target}", file=sys.stderr, flush=True)
            if settings:
                print(f"aoe: the daemon tunes with its own bank and plugins ({', '.join(settings)} not used)",
                      file=sys.stderr)  # fmt: skip
            return client
        client.close()
    print(f"aoe: tuning embedded (no daemon at {path})", file=sys.stderr, flush=True)
    return None


def _single(group: BaseExceptionGroup) -> BaseException:
    """The error to report from a task group: the first AoedError or interrupt in it."""
    for cls in (KeyboardInterrupt, AoedError):
        match, _ = group.split(cls)
        while isinstance(match, BaseExceptionGroup):
            match = match.exceptions[0]
        if match is not None:
            return match
    return group


def _summary(r: Any) -> None:
    tuned = sum(t.update_mode in ("add", "update", "reserved", "unsatisfied") for t in r.tasks)
    hits = sum(t.update_mode == "hit" for t in r.tasks)
    failed = sum(t.update_mode == "failed" for t in r.tasks)
    skipped = sum(t.update_mode == "skipped" for t in r.tasks)
    changed = [t for t in r.tasks if t.strategy != "default" and t.applied]
    res, conf, budget = r.resources, r.confirmation, r.device_budget
    out = sys.stdout
    print(f"aoe: tuned {Path(r.model).name} in {r.tuning_time_s:.1f} s ({r.precision} on {r.device})", file=out)
    where = (f"from the bank: confirmed by {conf['from_bank']}" if conf.get("from_bank")
             else f"confirming A/B, {conf.get('rounds', 0)} interleaved rounds")  # fmt: skip
    lo, hi = conf.get("improvement_ci95", (0.0, 0.0))
    print(f"  baseline     {r.baseline_ms:.4f} ms   ({where})", file=out)
    print(f"  result       {r.tuned_ms:.4f} ms   (improvement {r.improvement:+.1%}: the median of the paired "
          f"round ratios, 95% interval {lo:+.1%} to {hi:+.1%})", file=out)  # fmt: skip
    shipped = {"tuned": "the tuned model ships", "options only": "the input model with session options ships",
               "input": "the input model ships unchanged"}.get(conf.get("shipped", ""), "")  # fmt: skip
    print(f"  verdict      {conf.get('verdict', '?')}: {shipped}", file=out)
    print(
        f"  tasks        {len(r.tasks)}: {tuned} measured, {hits} from the bank"
        + (f", {failed} failed" if failed else "") + (f", {skipped} not tuned (budget)" if skipped else "")
        + f"; {len(changed)} changed",
        file=out,
    )
    print(f"  device       {res.get('trials', 0)} trials, {res.get('failed_candidates', 0)} failed candidates; "
          f"{budget.get('spent_s', 0):.1f} s of a {budget.get('budget_s', 0):.0f} s budget, plus "
          f"{budget.get('profile_s', 0) + budget.get('confirm_s', 0):.1f} s profiling and confirming; "
          f"busy {r.duty_cycle:.0%} of the job", file=out)  # fmt: skip
    if changed:
        print("  changed      (each task's own figure, from the search that chose it)", file=out)
    for t in changed:
        print(f"    {t.op_name:<40} {t.op_type:<14} {t.strategy:<22} {t.improvement:+.1%}", file=out)
    if r.session_options:
        print(f"  session      {r.session_options}", file=out)
    if r.precision != "exact" and conf.get("shipped") == "input":
        print("  accuracy     the input model ships: its outputs are the reference", file=out)
        print(f"  calibration  {r.calibration}", file=out)
    elif r.precision != "exact":
        acc = r.accuracy
        top1 = acc.get("top1_agreement")
        print(f"  accuracy     over {acc.get('samples', 1)} held-back samples: cosine min {acc.get('cosine', 0):.5f}, "
              f"5th percentile {acc.get('cosine_p5', acc.get('cosine', 0)):.5f}, max rel error "
              f"{acc.get('max_rel_error', 0):.3g}" + (f", top-1 agreement {top1:.1%}" if top1 is not None else "")
              + f" (budget: cosine >= {r.budget.get('min_cosine')}, max rel error <= {r.budget.get('max_rel_error')})",
              file=out)  # fmt: skip
        print(f"  calibration  {r.calibration}", file=out)
    if r.precision != "exact":
        for t in r.tasks:
            if t.rejected and not t.strategy.startswith("int8"):
                print(f"    {t.op_name:<40} kept {t.strategy}: {t.rejected[0]}", file=out)
    s = r.repo
    print(
        f"  bank         add {s['repo_add_num']}, hit {s['repo_hit_num']}, reserved {s['repo_reserved_num']}, "
        f"unsatisfied {s['repo_unsatisfied_num']}, update {s['repo_update_num']}, total {s['total_num']}",
        file=out,
    )
    for note in r.notes:
        print(f"  note         {note}", file=out)
    print(f"  tuned model  {r.tuned_model}", file=out)
    print(f"  report       {r.result_json}", file=out)
    print("Aoe process finished", file=out)


COMMANDS = ("tune", "compile", "bank", "submit", "jobs", "status", "watch", "cancel", "fetch", "devices", "daemon")


def build_parser() -> Parser:
    """The whole `aoe` command line."""
    from aoe import bankcli, jobscli

    p = Parser(
        prog="aoe",
        description="Tune ONNX models by measurement and keep what is learned in a knowledge bank.",
        epilog="AOE's spelling also works: aoe --framework 5 --model MODEL --job_type 2 (= aoe tune MODEL).",
    )
    p.add_argument("--version", action="version", version=f"aoe {_version()}")
    p.add_argument("--config", type=Path, help="TOML settings file (default: AOED_CONFIG, else none)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser, required=True)
    _add_tune(sub)
    bankcli.add_parsers(sub)
    jobscli.add_parsers(sub)
    return p


def _logging(verbose: int) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose == 1 else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("aoe: %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(level)
    for name in ("aoe", "aoed"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        if logger.level == logging.NOTSET or logger.level > level:
            logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and any(a.split("=", 1)[0] in _AOE_FLAGS for a in argv) and not set(argv) & set(COMMANDS):
            args = _aoe_spelling(argv)
        else:
            args = build_parser().parse_args(argv)
        _logging(args.verbose)
        return args.run(args)
    except AoedError as exc:
        print(f"aoe: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("aoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
