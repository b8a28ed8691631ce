"""The `aoe` command: one parser, one subcommand per thing to do, one error style.

    aoe tune MODEL [--precision exact|int8|int4|fp16|bf16] [--input-shape x:1,3,224,224] [--bank DIR]
                   [--repeat-tune] [--parallel N] [--output DIR] [--job-type sgat+opat|opat|sgat]
                   [--local | --socket PATH]
    aoe compile MODEL -o OUT [--bank DIR] ...
    aoe bank stats|lookup|export|import|prune|check|verify|sync ...
    aoe submit|jobs|status|watch|cancel|fetch|devices|daemon ...   (a running daemon: jobscli)
    aoe --framework 5 --model MODEL --job_type 2        (AOE's spelling: 2 OPAT alone, 1 SGAT;
                                                         --framework 3: a TensorFlow SavedModel)

`aoe tune` sends the job to the daemon when one answers at --socket (else the default
socket) and the options ask for nothing only an embedded run does (--bank,
--bank-layer, --keep-workspace, a bank or plugins from the environment or config file);
otherwise, or with --local, it runs the engine embedded, through `aoed.embedded`. The
job's options are one `aoe.spec.JobSpec`, read from the flags by `aoe.specargs`.
Settings come from the environment as in AOE (TUNE_BANK_PATH, REPEAT_TUNE,
TE_PARALLEL_COMPILER, ASCEND_DEVICE_ID) and from an optional TOML file (`--config`), all
read by `aoe.config`; options on the command line win. Every error ends with one line on
stderr, `aoe: error: ...`, and the exit status of its class (2 options, 3 model, 4 bank,
5 device, 7 no daemon, 8 daemon at a limit), never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from aoe import specargs
from aoe.errors import AoedError, DeviceError, OptionError
from aoe.outcome import summary_lines
from aoe.spec import JobType, check_model_kind, parse_job_type

if TYPE_CHECKING:
    from aoe.device import Device

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
        if "invalid choice" in message and (
            "argument COMMAND" in message or "argument SUBCOMMAND" in message
        ):
            bad = message.split("invalid choice: ", 1)[1].split(" (", 1)[0]
            choices = message.split("(choose from ", 1)[1].rstrip(")").replace("'", "")
            message = f"unknown command {bad} (commands: {choices}; see {self.prog} --help)"
        where = self.prog.removeprefix("aoe").strip()
        raise OptionError(f"{where}: {message}" if where else message)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    from aoe.config import EXECUTORS

    p = sub.add_parser(
        "tune",
        help="tune a model by measurement, embedded or on a daemon",
        description="Tune an ONNX model by measurement: on the daemon when one answers, "
        "else embedded on this machine.",
    )
    p.add_argument(
        "model",
        type=Path,
        nargs="?",
        help="the .onnx model to tune, a torch.export program (.pt2) or a TensorFlow SavedModel "
        "(its directory, or a .tar of it), tuned for inference as its ONNX export (--job-type "
        "gdat: a .pt2's data-parallel training)",
    )
    specargs.add_arguments(
        p,
        where="this machine (cpu; ASCEND_DEVICE_ID selects cann:N) or the daemon",
        many_devices=True,
    )
    p.add_argument(
        "--bank",
        type=Path,
        metavar="DIR",
        help="custom bank directory (default: TUNE_BANK_PATH or the user data dir)",
    )
    p.add_argument(
        "--bank-layer",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="read-only bank consulted after the custom one (repeatable; also AOED_BANK_LAYERS)",
    )
    p.add_argument(
        "--reload",
        action="store_true",
        help="resume an interrupted run: what the bank already decided is used, not measured again "
        "(overrides REPEAT_TUNE)",
    )
    p.add_argument(
        "--parallel",
        metavar="N",
        help="compile processes, 1-32 (default: TE_PARALLEL_COMPILER or cores-1)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="where aoe_workspace/ and the result JSON go",
    )
    p.add_argument(
        "--keep-workspace",
        action="store_true",
        help="keep the scratch files (task models, samples) under aoe_workspace/ after success",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--executor",
        choices=EXECUTORS,
        default=None,
        help="where the embedded run measures and compiles: local child processes, or the actors of "
        "a Ray cluster (the cluster extra; runs embedded; default: [cluster] executor)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="the Ray head for --executor ray (default: [cluster] address)",
    )
    q = p.add_mutually_exclusive_group()
    q.add_argument("--local", action="store_true", help="run embedded even when a daemon answers")
    q.add_argument(
        "--socket",
        type=Path,
        metavar="PATH",
        help="the daemon to tune on (default: AOED_SOCKET, else aoed.sock in the runtime dir)",
    )
    p.set_defaults(run=_tune)


def _aoe_spelling(argv: Sequence[str]) -> argparse.Namespace:
    """AOE's own spelling: `aoe --framework 5 --model m.onnx --job_type 2` (or
    `--framework 3 --model SAVED_MODEL_DIR`), as `tune`."""
    p = Parser(prog="aoe", description="AOE-compatible invocation of aoe tune.")
    # 5 ONNX, 3 TensorFlow (a SavedModel); not given, the model says which it is.
    p.add_argument("-f", "--framework", default=None)
    p.add_argument("-m", "--model", type=Path, required=True)
    # 2 and 1 mean what they mean to AOE (OPAT alone, SGAT alone); naming none gets
    # aoe tune's default.
    p.add_argument("-j", "--job_type", "--job-type", dest="job_type")
    p.add_argument("--output", type=Path, default=Path("."))
    p.add_argument(
        "--input_shape", "--input-shape", dest="input_shape", action="append", default=[]
    )
    p.add_argument("--dynamic_dims", "--dynamic-dims", dest="dynamic_dims")
    p.add_argument("--device", default=None)
    p.add_argument("--precision")
    p.add_argument("--calibration", type=Path)
    p.add_argument("--bank", type=Path)
    p.add_argument("--config", type=Path)
    p.add_argument("--progress_bar", default="on", choices=["on", "off"])
    p.add_argument("--reload", action="store_true")
    a = p.parse_args(argv)
    from aoe.config import job_type_from_env

    # AOE's GDAT (AOE_MODE=4) tunes a torch.export program, whatever --framework says.
    if a.framework is not None and job_type_from_env() != "gdat":
        _check_framework(str(a.framework), a.model)
    return argparse.Namespace(
        model=a.model,
        precision=a.precision,
        input_shape=a.input_shape,
        dynamic_dims=a.dynamic_dims,
        bank=a.bank,
        config=a.config,
        calibration=a.calibration,
        bank_layer=[],
        verbose=0,
        reload=a.reload,
        repeat_tune=None,
        parallel=None,
        output=a.output,
        job_type=a.job_type,
        device=a.device,
        keep_workspace=False,
        no_progress=a.progress_bar == "off",
        local=False,
        socket=None,
        run=_tune,
        entry=None,
    )


def _check_framework(framework: str, model: Path) -> None:
    """OptionError unless `model` is what AOE's --framework `framework` names: ONNX (5)
    a model file, TensorFlow (3) a SavedModel (a directory with saved_model.pb, or a
    .tar of one; it is converted to ONNX with tf2onnx and tuned as that)."""
    from aoe.savedmodel import check_saved_model, is_saved_model, is_saved_model_archive

    if framework not in ("5", "3"):
        raise OptionError(
            f"--framework {framework}: only ONNX (5) models and TensorFlow SavedModels (3) can be "
            "tuned here"
        )
    saved = is_saved_model(model) or is_saved_model_archive(model)
    if framework == "3" and not saved:
        raise OptionError(
            f"--framework 3 --model {model}: TensorFlow models are taken as a SavedModel "
            "directory (tf.saved_model.save), or a .tar of one; pass that directory"
        )
    if framework == "3" and is_saved_model(model):
        check_saved_model(model)
    if framework == "5" and saved:
        raise OptionError(
            f"--framework 5 --model {model}: a TensorFlow SavedModel, not an ONNX model; "
            "pass --framework 3"
        )


def _job_type(args: argparse.Namespace) -> None:
    """--job-type, else AOE's AOE_MODE (4 is GDAT); OptionError when they contradict.
    With --entry the model is the entry's file."""
    from aoe.config import job_type_from_env

    env = job_type_from_env()
    if (
        env is not None
        and args.job_type
        and (parse_job_type(args.job_type) == JobType.GDAT) != (env == "gdat")
    ):
        raise OptionError(
            f"AOE_MODE selects {env}, --job-type {args.job_type} another job type: drop one"
        )
    args.job_type = args.job_type or env
    if getattr(args, "entry", None):
        path, _function = specargs.entry_of(args.entry)
        if args.model is not None:
            raise OptionError(
                f"--entry {args.entry} and {args.model}: give the model or the entry, not both"
            )
        args.model = path
    if args.model is None:
        raise OptionError("tune: the following arguments are required: model")


def _tune(args: argparse.Namespace) -> int:
    from aoe.modelfile import check_model_file
    from aoe.savedmodel import check_saved_model, is_saved_model

    _job_type(args)
    # Before the engine's imports (about a second): a mistyped path is answered at once.
    # Whether it parses, the engine says in more detail (a daemon run checks it before
    # the upload: Client.submit_file).
    if is_saved_model(args.model):
        check_saved_model(args.model)
    else:
        check_model_file(args.model, onnx=False)

    from aoe.config import load_config, parse_parallel

    spec = specargs.from_args(args)
    if args.reload and args.repeat_tune:
        raise OptionError("--reload and --repeat-tune contradict each other: resume, or tune again")
    if spec.calibration_dir is not None and not spec.calibration_dir.is_dir():
        raise OptionError(f"--calibration {spec.calibration_dir}: not a directory")
    config = load_config(args.config)
    parallel = parse_parallel(args.parallel, "--parallel") if args.parallel is not None else None
    devices = _devices_given(args.device, config.all_devices)
    config = config.replace(
        bank=args.bank,
        parallel=parallel,
        repeat_tune=False if args.reload else args.repeat_tune,
        device=devices[0] if devices else None,
        devices=devices if len(devices) > 1 else None,
        bank_layers=(*args.bank_layer, *config.bank_layers) if args.bank_layer else None,
        executor=getattr(args, "executor", None),
        ray_address=getattr(args, "ray_address", None),
    )
    # The environment's settings (REPEAT_TUNE, ASCEND_DEVICE_ID) are the user's too; a
    # GDAT job's devices are its world's.
    gdat = spec.job_type == JobType.GDAT
    spec = spec.replace(
        repeat_tune=config.repeat_tune,
        device=config.device.name if "device" in config.sources and not gdat else None,
    )
    check_model_kind(args.model, spec.job_type, spec.entry)
    output: Path = args.output
    made = _writable_output(output)
    # The user's own code (--entry) runs embedded only: a daemon loads no user code.
    if spec.entry is not None and args.socket is not None:
        raise OptionError(
            "--entry runs your own code, which only an embedded run does: drop --socket"
        )
    # An executor named here is this run's: it runs embedded (a daemon has its own).
    embedded_only = spec.entry is not None or any(
        getattr(args, k, None) is not None for k in ("executor", "ray_address")
    )
    daemon = None if embedded_only else _daemon_for(args, config)
    if daemon is not None:
        from aoe.jobscli import tune_on_daemon

        if spec.calibration_dir is not None:
            spec = spec.replace(calibration_dir=spec.calibration_dir.absolute())
        with daemon:
            return tune_on_daemon(daemon, args.model, spec, output, progress=not args.no_progress)
    if config.bank is not None and config.bank.exists() and not config.bank.is_dir():
        from aoe.errors import BankError

        raise BankError(
            f"bank {config.bank}: not a directory (a file is in the way); pass a directory for --bank"
        )

    from aoe._progress import Progress
    from aoed import embedded  # the engine, in this process: the one door the CLI has into aoed

    if not (output / "aoe_workspace").exists():
        made.insert(0, output / "aoe_workspace")
    try:
        with Progress(enabled=not args.no_progress) as progress:
            outcome = embedded.tune(
                args.model,
                spec,
                output,
                config=config,
                progress=progress.emit,
                keep_workspace=args.keep_workspace,
            )
    except DeviceError as exc:
        source = config.sources.get("device", "")
        raise DeviceError(
            f"{source} selects {config.device}: {exc}" if source.startswith("ASCEND") else str(exc)
        ) from None
    finally:
        # A run that failed before tuning left no workspace and the engine no empty
        # log: the folders made for them go too.
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
    for line in summary_lines(outcome):
        print(line)
    print("Aoe process finished")
    return 0


def _writable_output(output: Path) -> list[Path]:
    """Make sure `output` is a directory this process can write: the result JSON goes
    there and aoe_workspace/ under it. OptionError naming it otherwise, before any
    engine starts (the engine's own log folder would otherwise be the first to fail).
    Returns the folders it made, deepest first."""
    made = [p for p in (output, *output.parents) if not p.exists()]
    try:
        output.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OptionError(
            f"--output {output}: not a directory; pass a directory for the outputs"
        ) from None
    except OSError as exc:
        raise OptionError(
            f"--output {output}: cannot create it ({exc.strerror or exc}); pass a directory you may "
            "write"
        ) from None
    try:
        # Root passes every permission check, so try instead of asking (os.access).
        with tempfile.TemporaryFile(dir=output):
            pass
    except OSError as exc:
        raise OptionError(
            f"--output {output}: cannot write there ({exc.strerror or exc}); pass a directory you may "
            "write"
        ) from None
    return made


def _daemon_for(args: argparse.Namespace, config: Any) -> Any:
    """The Client to tune on, or None to run embedded: --local; an option only an embedded
    run honours (the bank, plugins, workspace choices); no daemon answering. A missing
    socket file costs no dial, so without a daemon `aoe tune` is as fast as before."""
    flags = [
        flag
        for flag, given in (
            ("--bank", args.bank),
            ("--bank-layer", args.bank_layer),
            ("--keep-workspace", args.keep_workspace),
        )
        if given
    ]
    if args.socket is not None and flags:
        raise OptionError(
            f"--socket tunes on the daemon, which uses its own bank and workspace: drop {flags[0]} "
            "or --socket"
        )
    settings = [
        config.sources[k] for k in ("bank", "bank_layers", "plugins") if k in config.sources
    ]
    if args.local or flags or (settings and args.socket is None):
        return None
    from aoe.config import default_socket
    from aoe.sockets import check_socket

    path = args.socket or default_socket()
    if check_socket(path, alternative="use --local"):
        from aoe.client import Client

        client = Client(path)
        if client.ping():
            print(f"aoe: tuning on the daemon at {client.target}", file=sys.stderr, flush=True)
            if settings:
                print(
                    f"aoe: the daemon tunes with its own bank and plugins ({', '.join(settings)} not used)",
                    file=sys.stderr,
                )
            return client
        client.close()
    print(f"aoe: tuning embedded (no daemon at {path})", file=sys.stderr, flush=True)
    return None


def _devices_given(
    given: str | list[str] | None, configured: tuple[Device, ...]
) -> tuple[Device, ...]:
    """The devices `--device` names (repeated, or `all`); () when it was not given.
    OptionError when one is malformed."""
    from aoe.device import Device

    names = [given] if isinstance(given, str) else list(given or [])
    if names == ["all"]:
        if len(configured) > 1:
            return configured
        from aoe.accelerators import local_devices

        usable = tuple(d.device for d in local_devices() if not d.unusable and not d.device.is_cpu)
        return usable or configured
    if "all" in names:
        raise OptionError("--device all: names every device; give it alone")
    return tuple(Device.parse(n) for n in names)


COMMANDS = (
    "tune",
    "compile",
    "bank",
    "submit",
    "jobs",
    "status",
    "watch",
    "cancel",
    "fetch",
    "devices",
    "daemon",
)


def build_parser() -> Parser:
    """The whole `aoe` command line."""
    from aoe import bankcli, jobscli

    p = Parser(
        prog="aoe",
        description="Tune ONNX models by measurement and keep what is learned in a knowledge bank.",
        epilog="AOE's spelling also works: aoe --framework 5 --model MODEL [--job_type 2] "
        "(2: OPAT alone, as aoe tune --job-type opat; 1: SGAT; none: aoe tune's default, sgat+opat); "
        "--framework 3 --model DIR tunes a TensorFlow SavedModel, converted to ONNX with tf2onnx.",
    )
    p.add_argument("--version", action="version", version=f"aoe {_version()}")
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML settings file (default: AOED_CONFIG, else none)",
    )
    p.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
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


#: The exit status of a command whose reader went away (`aoe jobs | head`), as a shell
#: reports one killed by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            if (
                argv
                and any(a.split("=", 1)[0] in _AOE_FLAGS for a in argv)
                and not set(argv) & set(COMMANDS)
            ):
                args = _aoe_spelling(argv)
            else:
                args = build_parser().parse_args(argv)
            _logging(args.verbose)
            return args.run(args)
        finally:
            # Flushed here, a closed pipe raises where it is handled below, not in the
            # interpreter's exit (which prints "Exception ignored ... BrokenPipeError").
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped reading: stop quietly, as a pipeline expects. The standard
        # library's advice: point stdout at devnull so the exit's own flush cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except AoedError as exc:
        print(f"aoe: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("aoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
