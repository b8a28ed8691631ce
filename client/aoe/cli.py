"""The `aoe` command.

    aoe tune MODEL [--precision exact] [--input-shape x:1,3,224,224] [--bank DIR]
                   [--repeat-tune] [--parallel N] [--output DIR] [--job-type opat]
    aoe --framework 5 --model MODEL --job_type 2        (AOE's spelling, same job)

`aoe tune` runs the engine embedded: no daemon needed. Environment variables honoured as
in AOE: TUNE_BANK_PATH (custom bank), REPEAT_TUNE (True/False), TE_PARALLEL_COMPILER
(compile processes, 1-32), ASCEND_DEVICE_ID (device id). Errors end with a one-line
message on stderr and the error's exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from aoe.errors import AoedError, OptionError

__all__ = ["main"]

_JOB_TYPES = {"1": "sgat", "2": "opat", "sgat": "sgat", "opat": "opat"}
_SUBCOMMANDS = ("tune", "compile", "bank")


def _env_bool(name: str) -> bool | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    low = raw.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise OptionError(f"{name}={raw!r}: expected True or False")


def _parallel(value: str | None, source: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except ValueError:
        raise OptionError(f"{source}={value!r}: expected a number of compile processes (1-32)") from None
    if not 1 <= n <= 32:
        raise OptionError(f"{source}={n}: compile processes must be between 1 and 32")
    return n


def _tune_parser(prog: str = "aoe tune") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Tune an ONNX model by measurement, embedded (no daemon).")
    p.add_argument("model", type=Path, help="the .onnx model to tune")
    p.add_argument("--precision", default="exact", help="precision policy: exact (default) or int8")
    p.add_argument("--calibration", type=Path, help="calibration samples: a folder of .npz/.npy (int8)")
    p.add_argument("--min-cosine", type=float, help="end-to-end accuracy budget: lowest output cosine (int8: 0.999)")
    p.add_argument("--max-rel-error", type=float,
                   help="end-to-end accuracy budget: largest error relative to the output range (int8: 0.25)")
    p.add_argument(
        "--input-shape", action="append", default=[], metavar="NAME:D1,D2,...",
        help="static shape for an input with dynamic dimensions; repeat or join with ';'",
    )
    p.add_argument("--bank", type=Path, help="custom bank directory (default: TUNE_BANK_PATH or the user data dir)")
    p.add_argument(
        "--bank-layer", action="append", type=Path, default=[], metavar="DIR",
        help="read-only bank consulted after the custom one (repeatable; also AOED_BANK_LAYERS)",
    )
    p.add_argument("--repeat-tune", action="store_true", default=None, help="re-tune tasks the bank already knows")
    p.add_argument("--parallel", help="compile processes (default: TE_PARALLEL_COMPILER or cores-1)")
    p.add_argument("--output", type=Path, default=Path("."), help="where aoe_workspace/ and the result JSON go")
    p.add_argument("--job-type", default="opat", help="opat (2); sgat (1) is not available yet")
    p.add_argument("--device", default=None, help="device: cpu (default; ASCEND_DEVICE_ID is recorded)")
    p.add_argument(
        "--keep-initializer-inputs", action="store_true",
        help="treat initializers that old exporters list as graph inputs as real inputs",
    )
    p.add_argument("--budget", type=float, default=20.0, help="device seconds for per-task measurement (default 20)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _aoe_parser() -> argparse.ArgumentParser:
    """AOE's own spelling: `aoe --framework 5 --model m.onnx --job_type 2`."""
    p = argparse.ArgumentParser(prog="aoe", description="AOE-compatible invocation of aoe tune.")
    p.add_argument("-f", "--framework", default="5")
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("-j", "--job_type", "--job-type", dest="job_type", default="2")
    p.add_argument("--output", type=Path, default=Path("."))
    p.add_argument("--input_shape", "--input-shape", dest="input_shape", action="append", default=[])
    p.add_argument("--device", default=None)
    p.add_argument("--precision", default="exact")
    p.add_argument("--calibration", type=Path)
    p.add_argument("--bank", type=Path)
    p.add_argument("--progress_bar", default="on", choices=["on", "off"])
    return p


def _from_aoe(argv: Sequence[str]) -> argparse.Namespace:
    a = _aoe_parser().parse_args(argv)
    if str(a.framework) != "5":
        raise OptionError(f"--framework {a.framework}: only ONNX (5) models can be tuned here")
    return argparse.Namespace(
        model=a.model, precision=a.precision, input_shape=a.input_shape, bank=a.bank,
        calibration=a.calibration, min_cosine=None, max_rel_error=None, bank_layer=[],
        repeat_tune=None, parallel=None, output=a.output, job_type=a.job_type, device=a.device,
        keep_initializer_inputs=False, budget=20.0, no_progress=a.progress_bar == "off",
    )


def _tune(args: argparse.Namespace) -> int:
    import trio

    from aoed.bank.store import default_bank_path
    from aoed.engine.engine import default_parallel, open_engine
    from aoed.engine.job import JobOptions
    from aoed.engine.policy import policy
    from aoed.engine.prep import parse_input_shapes

    job_type = _JOB_TYPES.get(str(args.job_type).lower())
    if job_type is None:
        raise OptionError(f"--job-type {args.job_type}: expected opat (2) or sgat (1)")
    if job_type == "sgat":
        raise OptionError("--job-type sgat (1): subgraph tuning is not available yet; use opat (2)")
    policy(args.precision, args.min_cosine, args.max_rel_error)  # validates before any work starts
    if args.calibration is not None and not args.calibration.is_dir():
        raise OptionError(f"--calibration {args.calibration}: not a directory")
    device = args.device or "cpu"
    if os.environ.get("ASCEND_DEVICE_ID") and args.device is None:
        device = "cpu"  # no NPU here; the id is kept for the report
    if device != "cpu":
        raise OptionError(f"--device {device}: only the cpu device is available on this machine")
    if args.budget <= 0:
        raise OptionError("--budget must be a positive number of seconds")
    shapes = parse_input_shapes(args.input_shape)
    repeat = args.repeat_tune if args.repeat_tune is not None else bool(_env_bool("REPEAT_TUNE"))
    parallel = _parallel(args.parallel, "--parallel") or _parallel(
        os.environ.get("TE_PARALLEL_COMPILER"), "TE_PARALLEL_COMPILER"
    ) or default_parallel()
    bank = args.bank or default_bank_path()
    output: Path = args.output
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OptionError(f"--output {output}: {exc.strerror or exc}") from None
    opts = JobOptions(
        model=args.model,
        output=output,
        precision=args.precision,
        job_type=job_type,
        input_shapes=shapes,
        repeat_tune=repeat,
        keep_initializer_inputs=args.keep_initializer_inputs,
        device=device,
        budget_s=args.budget,
        calibration=args.calibration,
        min_cosine=args.min_cosine,
        max_rel_error=args.max_rel_error,
        job_id=f"local-{os.getpid()}",
    )

    from aoe._progress import Progress

    progress = Progress(enabled=not args.no_progress)

    async def run():
        from aoe.bank import layer_paths_from_env

        layers = [*args.bank_layer, *layer_paths_from_env()]
        async with open_engine(bank, output / "aoe_workspace" / "logs", parallel, bank_layers=layers) as engine:
            with progress:
                return await engine.run_job(opts, progress.emit)

    try:
        result = trio.run(run)
    except BaseExceptionGroup as group:
        raise _single(group) from None
    _summary(result)
    return 0


def _single(group: BaseExceptionGroup) -> BaseException:
    """The error to report from a task group: the first AoedError or interrupt in it."""
    for cls in (KeyboardInterrupt, AoedError):
        match, _ = group.split(cls)
        while isinstance(match, BaseExceptionGroup):
            match = match.exceptions[0]
        if match is not None:
            return match
    return group


def _summary(r) -> None:
    tuned = sum(t.update_mode in ("add", "update", "reserved", "unsatisfied") for t in r.tasks)
    hits = sum(t.update_mode == "hit" for t in r.tasks)
    changed = [t for t in r.tasks if t.strategy != "default" and t.applied]
    out = sys.stdout
    print(f"aoe: tuned {Path(r.model).name} in {r.tuning_time_s:.1f} s ({r.precision}, verified: {r.verified})", file=out)
    print(f"  baseline     {r.baseline_ms:.4f} ms", file=out)
    print(f"  tuned        {r.tuned_ms:.4f} ms   ({r.improvement:+.1%})", file=out)
    print(
        f"  tasks        {len(r.tasks)} ({tuned} measured, {hits} from the bank, {len(changed)} changed); "
        f"{r.trials} trials, {r.failed_candidates} failed candidates; device busy {r.duty_cycle:.0%}",
        file=out,
    )
    for t in changed:
        print(f"    {t.op_name:<40} {t.op_type:<14} {t.strategy:<22} {t.improvement:+.1%}", file=out)
    if r.session_options:
        print(f"  session      {r.session_options}", file=out)
    if r.precision != "exact":
        acc = r.accuracy
        print(f"  accuracy     cosine {acc.get('cosine', 0):.5f}, max rel error {acc.get('max_rel_error', 0):.3g} "
              f"(budget {r.budget.get('min_cosine')} / {r.budget.get('max_rel_error')}); calibration: {r.calibration}",
              file=out)
        kept = [t for t in r.tasks if t.rejected and not any(t.strategy.startswith(p) for p in ("int8",))]
        for t in kept:
            print(f"    {t.op_name:<40} kept {t.strategy}: {t.rejected[0]}", file=out)
    s = r.repo
    print(
        f"  bank         add {s['repo_add_num']}, hit {s['repo_hit_num']}, reserved {s['repo_reserved_num']}, "
        f"unsatisfied {s['repo_unsatisfied_num']}, update {s['repo_update_num']}, total {s['total_num']}",
        file=out,
    )
    print(f"  tuned model  {r.tuned_model}", file=out)
    print(f"  report       {r.result_json}", file=out)
    print("Aoe process finished", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in ("bank", "compile"):
            from aoe import bankcli

            return bankcli.main(argv)
        if argv and argv[0] == "tune":
            args = _tune_parser().parse_args(argv[1:])
        elif argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            args = _from_aoe(argv)
        else:
            print("usage: aoe tune MODEL [options]   |   aoe --framework 5 --model MODEL --job_type 2", file=sys.stderr)
            print("commands: " + ", ".join(_SUBCOMMANDS), file=sys.stderr)
            return 0 if argv and argv[0] in ("-h", "--help") else 2
        return _tune(args)
    except AoedError as exc:
        print(f"aoe: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("aoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
