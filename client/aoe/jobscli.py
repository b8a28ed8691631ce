"""`aoe submit|jobs|status|watch|cancel|fetch|devices|daemon`: jobs on a running daemon.

    aoe submit MODEL [--precision exact|int8] [--input-shape x:1,3,224,224] [--priority N]
                     [--budget S] [--repeat-tune] [--device D] [--watch] [--on-server]
    aoe jobs   [--state S]...
    aoe status ID
    aoe watch  ID
    aoe cancel ID
    aoe fetch  ID -o DIR
    aoe devices
    aoe daemon

Each picks its daemon with --socket PATH or --address HOST:PORT (TLS: --tls-ca,
--tls-cert, --tls-key); by default the unix socket AOED_SOCKET names, else aoed.sock in
the runtime dir. No daemon there: exit 7; the daemon's queue full: exit 8. `submit`
uploads the local file unless --on-server (the daemon reads the path itself). `watch`
(and `submit --watch`) exits 0 when the job succeeded, the status of its error's class
when it failed (3 for a model, as `aoe tune` would), 130 when it was cancelled. Everything goes through `aoe.Client`: this module never imports the daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aoe import specargs
from aoe.errors import AoedError, JobCancelledError, OptionError
from aoe.outcome import summary_lines
from aoe.spec import JobSpec

if TYPE_CHECKING:
    from aoe.client import Client
    from aoe.ovdevices import Offer
    from aoe.v1 import tuning_pb2

__all__ = ["add_parsers", "client_for", "tune_on_daemon"]

_STATES = ("queued", "preparing", "tuning", "verifying", "succeeded", "failed", "cancelled")
#: Characters of a failure's reason `aoe jobs` shows (cut at a word, with an ellipsis);
#: `aoe status` shows it whole.
_REASON_WIDTH = 60


def _connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("daemon")
    q = g.add_mutually_exclusive_group()
    q.add_argument(
        "--socket",
        type=Path,
        metavar="PATH",
        help="the daemon's unix socket (default: AOED_SOCKET, else aoed.sock in the runtime dir)",
    )
    q.add_argument("--address", metavar="HOST:PORT", help="the daemon's TCP address")
    g.add_argument(
        "--tls-ca", type=Path, metavar="FILE", help="PEM root certificates: TLS to --address"
    )
    g.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="PEM client certificate chain (with --tls-key)",
    )
    g.add_argument(
        "--tls-key", type=Path, metavar="FILE", help="PEM client private key (with --tls-cert)"
    )


def client_for(args: argparse.Namespace) -> Client:
    """The Client that --socket / --address / --tls-* select (default: the default socket)."""
    from aoe.client import Client

    tls: dict[str, bytes] = {}
    for opt, key in (
        ("tls_ca", "root_certificates"),
        ("tls_cert", "certificate_chain"),
        ("tls_key", "private_key"),
    ):
        path = getattr(args, opt, None)
        if path is not None:
            try:
                tls[key] = path.read_bytes()
            except OSError as exc:
                raise OptionError(
                    f"--{opt.replace('_', '-')} {path}: {exc.strerror or exc}"
                ) from None
    address = getattr(args, "address", None)
    if tls and not address:
        raise OptionError("--tls-ca/--tls-cert/--tls-key: TLS needs --address HOST:PORT")
    if ("certificate_chain" in tls) != ("private_key" in tls):
        raise OptionError("--tls-cert and --tls-key go together")
    return Client(
        address or getattr(args, "socket", None),
        root_certificates=tls.get("root_certificates"),
        private_key=tls.get("private_key"),
        certificate_chain=tls.get("certificate_chain"),
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the daemon's job commands to the `aoe` parser."""
    p = sub.add_parser(
        "submit", help="queue a model on the daemon", description="Queue a model on the daemon."
    )
    p.add_argument(
        "model", type=Path, help="the .onnx model (a local file, uploaded; see --on-server)"
    )
    specargs.add_arguments(p, where="the daemon", entry=False)
    p.add_argument(
        "--watch",
        action="store_true",
        help="follow the job until it ends (exit status as aoe watch)",
    )
    p.add_argument(
        "--on-server",
        action="store_true",
        help="MODEL is a path on the daemon's host: do not upload",
    )
    p.set_defaults(run=_submit)
    p = sub.add_parser(
        "jobs", help="list the daemon's jobs", description="List the daemon's jobs, newest first."
    )
    p.add_argument(
        "--state", action="append", choices=_STATES, help="only jobs in this state (repeatable)"
    )
    p.set_defaults(run=_jobs)
    for name, run, text in (
        ("status", _status, "a job's details and result"),
        ("watch", _watch, "follow a job's progress until it ends"),
        ("cancel", _cancel, "stop a queued or running job"),
    ):
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("job_id", metavar="ID")
        p.set_defaults(run=run)
    p = sub.add_parser(
        "fetch",
        help="download a finished job's tuned model and result JSON",
        description="Download a finished job's tuned model and result JSON.",
    )
    p.add_argument("job_id", metavar="ID")
    p.add_argument(
        "-o", "--output", type=Path, default=Path("."), help="directory to write to (default: .)"
    )
    p.set_defaults(run=_fetch)
    for name, run, text in (
        ("devices", _devices, "the devices the daemon tunes on, and the others it could"),
        ("daemon", _daemon, "the daemon's version, paths, limits and load"),
    ):
        sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".").set_defaults(
            run=run
        )
    sub.choices["devices"].add_argument(
        "--local",
        action="store_true",
        help="list what this machine offers onnxruntime (CPU, GPUs through nvidia-smi) and OpenVINO (its devices, or why it cannot be used), without a daemon",
    )
    for name in ("submit", "jobs", "status", "watch", "cancel", "fetch", "devices", "daemon"):
        _connection_args(sub.choices[name])


# --------------------------------------------------------------------------- output


def _enum_name(enum: Any, value: int, prefix: str) -> str:
    try:
        return enum.Name(value).removeprefix(prefix).lower()
    except ValueError:
        return str(value)


def _state(state: int) -> str:
    from aoe.v1 import tuning_pb2

    return _enum_name(tuning_pb2.JobState, state, "JOB_STATE_")


def _time(ts: Any) -> str:
    if not ts.seconds and not ts.nanos:
        return "-"
    return ts.ToDatetime(tzinfo=datetime.timezone.utc).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _progress(job: tuning_pb2.Job) -> str:
    name, p = _state(job.state), job.progress
    if name == "queued":
        return f"{job.queue_position} ahead"
    if name == "succeeded":
        from aoe.figures import short_text
        from aoe.wire import figures_from_pb

        return short_text(figures_from_pb(job.result))
    if name in ("failed", "cancelled"):
        return _shorten(job.error, _REASON_WIDTH) or "-"
    return f"{p.tasks_done}/{p.tasks_total} tasks" if p.tasks_total else name


def _shorten(text: str, width: int) -> str:
    """`text` on one line, cut at the last word boundary within `width` characters with
    an ellipsis (mid-word only when its first word alone is longer)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[: width - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > 0 else cut).rstrip(" ,;:") + "…"


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:  # the last column unpadded: no width for it
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])


def print_result(job: tuning_pb2.Job, files: list[Path] | None = None) -> None:
    """The summary of a finished job, from its Job proto (as `aoe tune` words one run
    embedded: aoe.outcome.summary_lines); `files` are the downloaded artifacts (else the
    paths on the daemon's host are shown)."""
    from aoe.wire import outcome_from_pb

    took = (
        (job.finished.ToNanoseconds() - job.started.ToNanoseconds()) / 1e9
        if job.started.seconds
        else 0.0
    )
    model, report = (files[0], files[1]) if files else (None, None)
    outcome = outcome_from_pb(job.result, job.job_id)
    if not outcome.model:  # a daemon from before results named the model
        outcome = dataclasses.replace(outcome, model=job.model_name)
    for line in summary_lines(outcome, where=" on the daemon", took_s=took, files=(model, report)):
        print(line)


@dataclass
class _Shown:
    """A JobEvent as aoe._progress.Progress renders the embedded engine's events."""

    kind: str
    message: str = ""
    done: int = 0
    total: int = 0


def _shown(event: tuning_pb2.JobEvent) -> _Shown | None:
    from aoe.v1 import tuning_pb2

    kind = event.WhichOneof("event")
    if kind == "state_change":
        sc = event.state_change
        if sc.state == tuning_pb2.JOB_STATE_QUEUED and sc.previous:  # requeued (a daemon restart)
            return _Shown("wait", f"job {event.job_id} is queued again: {sc.message}")
        if sc.state == tuning_pb2.JOB_STATE_QUEUED:  # the bar says what it waits for
            return _Shown("stage", f"queued on the daemon: job {event.job_id}")
        return _Shown("stage", _state(sc.state) + (f": {sc.message}" if sc.message else ""))
    if kind == "progress":
        return _Shown("progress", done=event.progress.tasks_done, total=event.progress.tasks_total)
    if kind == "log" and event.log.level >= tuning_pb2.LOG_LEVEL_WARNING:
        return _Shown("wait", event.log.message)
    return None


def _line(event: tuning_pb2.JobEvent) -> str:
    from aoe.v1 import tuning_pb2

    kind, head = event.WhichOneof("event"), f"{_time(event.time)} #{event.sequence}"
    if kind == "state_change":
        sc = event.state_change
        change = f"{_state(sc.previous)} -> {_state(sc.state)}" if sc.previous else _state(sc.state)
        return f"{head} state {change}" + (f": {sc.message}" if sc.message else "")
    if kind == "progress":
        p = event.progress
        now = f", tuning {p.current_op_type} {p.current_task}" if p.current_task else ""
        return f"{head} progress {p.tasks_done}/{p.tasks_total} tasks{now}"
    if kind == "task_result":
        t = event.task_result
        what = t.error or f"{t.strategy.name or 'default'} {t.improvement:+.1%}"
        return f"{head} task {t.task_id} {t.op_type}: {what} ({t.update_mode or '-'})"
    if kind == "log":
        level = _enum_name(tuning_pb2.LogLevel, event.log.level, "LOG_LEVEL_")
        return f"{head} {level} {event.log.logger}: {event.log.message}"
    if kind == "result":
        from aoe.figures import event_text
        from aoe.wire import figures_from_pb

        return f"{head} result {event_text(figures_from_pb(event.result))}"
    return f"{head} {kind}"


def follow(
    client: Client, job_id: str, *, bar: bool = True, lines: bool = False, verbose: int = 0
) -> tuning_pb2.Job:
    """Follow the job's events until it ends and return its final snapshot: a rich bar on
    stderr when it is a terminal (and `bar`), else one line per event on stdout when
    `lines`, else only what the user must know (queued, warnings)."""
    from aoe._progress import Progress
    from aoe.v1 import tuning_pb2

    progress = Progress(enabled=bar)
    lines = lines and not progress.enabled
    with progress:
        for event in client.watch(job_id, include_logs=True):
            if lines:
                if (
                    event.WhichOneof("event") != "log"
                    or event.log.level >= tuning_pb2.LOG_LEVEL_INFO
                    or verbose
                ):
                    print(_line(event), flush=True)
            elif (shown := _shown(event)) is not None:
                progress.emit(shown)
    return client.get(job_id)


def _finished(job: tuning_pb2.Job) -> tuning_pb2.Job:
    """The job when it succeeded; else the error its end means."""
    name = _state(job.state)
    if name == "cancelled":
        raise JobCancelledError(f"job {job.job_id} was cancelled")
    if name == "failed":
        import aoe.errors

        # The daemon names the error's class: exit with that class's status.
        cls = getattr(aoe.errors, job.error_kind, None)
        if not (isinstance(cls, type) and issubclass(cls, AoedError)):
            cls = AoedError
        raise cls(f"job {job.job_id} failed: {job.error or 'no reason given'}")
    if name != "succeeded":
        raise AoedError(
            f"job {job.job_id} is {name}, but its event stream ended; see aoe status {job.job_id}"
        )
    return job


def tune_on_daemon(client: Client, model: Path, spec: JobSpec, output: Path, progress: bool) -> int:
    """`aoe tune` on the daemon: upload, follow, download into `output`, summarize; 0.
    Ctrl-C cancels the job on the daemon, as it would stop an embedded run."""
    job = client.submit_file(model, spec)
    try:
        job = _finished(follow(client, job.job_id, bar=progress))
    except KeyboardInterrupt:
        with contextlib.suppress(AoedError):
            client.cancel(job.job_id)
            print(f"aoe: cancelled job {job.job_id} on the daemon", file=sys.stderr)
        raise
    files = [client.download(job.job_id, artifact, output) for artifact in _artifacts(job)]
    print_result(job, files)
    print("Aoe process finished")
    return 0


# --------------------------------------------------------------------------- commands


def _submit(args: argparse.Namespace) -> int:
    spec = specargs.from_args(args)
    with client_for(args) as client:
        if args.on_server:  # a relative path means nothing to a daemon with another cwd
            model = args.model.absolute() if client.socket is not None else args.model
            job = client.submit(model, options=spec)
        else:
            job = client.submit_file(args.model, spec)
        ahead = f", {job.queue_position} ahead" if _state(job.state) == "queued" else ""
        print(
            f"aoe: submitted {job.model_name or args.model.name} as job {job.job_id} ({_state(job.state)}{ahead})"
        )
        if args.watch:
            return _report(follow(client, job.job_id, lines=True, verbose=args.verbose))
    return 0


def _report(job: tuning_pb2.Job) -> int:
    print_result(_finished(job))
    return 0


def _jobs(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        jobs = client.jobs(args.state)
    if not jobs:
        print("no jobs" + (f" in state {', '.join(args.state)}" if args.state else ""))
        return 0
    rows = [("ID", "STATE", "MODEL", "CREATED", "PROGRESS")]
    rows += [
        (j.job_id, _state(j.state), j.model_name, _time(j.created), _progress(j)) for j in jobs
    ]
    _table(rows)
    return 0


def _status(args: argparse.Namespace) -> int:
    from aoe.v1 import bank_pb2

    with client_for(args) as client:
        job = client.get(args.job_id)
    o, p = job.options, job.progress
    print(f"job       {job.job_id}")
    # A failure's reason is shown whole on its own line, not cut as in `aoe jobs`.
    print(f"state     {_state(job.state)}" + ("" if job.error else f" ({_progress(job)})"))
    print(f"model     {job.model_name}  ({job.model_path})")
    print(
        f"source    {job.source or 'rpc'}"
        + (f", {job.joined} joined submissions" if job.joined else "")
    )
    opts = [
        f"precision {_enum_name(bank_pb2.Precision, o.precision, 'PRECISION_')}"
        if o.precision
        else "",
        f"device {o.device}" if o.device else "",
        f"priority {o.priority}" if o.priority else "",
        f"budget {o.budget_s:g} s" if o.budget_s else "",
        "repeat-tune" if o.repeat_tune else "",
        "shapes "
        + "; ".join(f"{s.name}:{s.profile or ','.join(map(str, s.dims))}" for s in o.input_shapes)
        if o.input_shapes
        else "",
        f"gears {o.dynamic_dims}" if o.dynamic_dims else "",
    ]
    print(f"options   {', '.join(filter(None, opts)) or 'the daemon defaults'}")
    print(
        f"times     created {_time(job.created)}, started {_time(job.started)}, finished {_time(job.finished)}"
    )
    if p.tasks_total:
        print(
            f"progress  {p.tasks_done}/{p.tasks_total} tasks"
            + (f", tuning {p.current_op_type} {p.current_task}" if p.current_task else "")
        )
    if job.error:
        print(f"error     {job.error}")
    if job.HasField("result"):
        print_result(job)
    return 0


def _watch(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        return _report(follow(client, args.job_id, lines=True, verbose=args.verbose))


def _cancel(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        job = client.cancel(args.job_id)
    print(
        f"aoe: asked the daemon to cancel job {job.job_id or args.job_id} (now {_state(job.state)})"
    )
    return 0


def _fetch(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        for artifact in _artifacts(client.get(args.job_id)):
            print(f"aoe: wrote {client.download(args.job_id, artifact, args.output)}")
    return 0


def _artifacts(job: tuning_pb2.Job) -> tuple[str, ...]:
    """What to download of a finished `job`: the model and the result JSON, then an
    OpenVINO IR's weights and compile config, which `aoe.session` opens beside it."""
    ir = job.result.runtime == "openvino"
    return ("model", "json", "weights", "config") if ir else ("model", "json")


def _devices(args: argparse.Namespace) -> int:
    rows = [("ID", "PROVIDER", "STATE", "DESCRIPTION")]
    if args.local:
        from aoe.accelerators import local_devices

        rows += [
            (
                d.device.name,
                d.device.provider,
                "unusable" if d.unusable else "usable",
                d.describe() + (f"; {d.unusable}" if d.unusable else ""),
            )
            for d in local_devices()
        ]
        from aoe.ovdevices import find

        rows += _openvino_rows(find())
        _table(rows)
        return 0
    with client_for(args) as client:
        devices = client.devices()
    # A daemon from before `configured` lists only the device it tunes on.
    older = not any(d.configured for d in devices)
    for d in devices:
        measured = ""
        if d.configured or older:
            state = (f"busy ({d.running_job_id})" if d.busy else "idle") + (
                f", {d.queued_jobs} queued" if d.queued_jobs else ""
            )
            if d.requests:
                measured = f" [{d.device_seconds:.1f} device s, duty {d.duty_cycle:.0%}, {d.trials} trials]"
        else:
            state = "unusable" if d.unusable else "not configured"
        rows.append(
            (
                d.id,
                d.execution_provider,
                state,
                d.description + (f"; {d.unusable}" if d.unusable else "") + measured,
            )
        )
    _table(rows)
    return 0


def _openvino_rows(offer: Offer) -> list[tuple[str, str, str, str]]:
    """`aoe devices --local`'s rows for OpenVINO's `offer`: each device it lists (`usable`
    where aoe tunes on it, `listed` elsewhere), and one row saying why where it cannot be
    used."""
    runtime = f"OpenVINO {offer.version}".rstrip()
    rows = [
        (f"openvino:{d.name}", runtime, "usable" if d.tuned else "listed", d.describe())
        for d in offer.hardware
    ]
    if offer.why_not:
        rows.append(("openvino", runtime, "unusable", offer.why_not))
    return rows


def _daemon(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        i = client.info()
    print(f"aoed {i.version} (pid {i.pid}, started {_time(i.started)})")
    print(f"  listen      {', '.join(i.listen) or '-'}")
    print(
        f"  bank        {i.bank_path}"
        + (f" (layers: {', '.join(i.bank_layers)})" if i.bank_layers else "")
    )
    print(f"  state       {i.state_dir}")
    print(
        f"  jobs        {i.running_jobs} running (at most {i.max_running_jobs}), "
        f"{i.queued_jobs} queued (at most {i.max_queued_jobs})"
    )
    print(
        f"  uploads     up to {i.max_upload_bytes / 2**20:.0f} MiB; compile workers {i.compile_workers}"
    )
    print(f"  allowed     {', '.join(i.allowed_dirs) or '-'}")
    for box in i.inboxes:
        print(f"  inbox       {box.path} -> {box.outbox} (failed: {box.failed})")
    return 0
