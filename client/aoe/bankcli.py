"""`aoe compile` and `aoe bank ...`: the bank's part of the `aoe` command line.

    aoe compile MODEL -o OUT [--bank DIR] [--bank-layer DIR] [--input-shape x:1,3,224,224]
                             [--precision exact|int8] [--calibration DIR] [--json]
    aoe bank stats   [--bank DIR] [--bank-layer DIR] [--json]
    aoe bank lookup  (--key KEY | --signature-digest HEX [--device-digest HEX]
                      [--precision exact]) [--bank DIR] [--bank-layer DIR] [--json]
    aoe bank export  [--bank DIR] [--layer NAME] [--output FILE.jsonl] [--entries-only | --no-history]
    aoe bank import  FILE.jsonl [--bank DIR] [--policy keep-faster|overwrite|keep-existing]
                     [--wait]
    aoe bank prune   [--bank DIR | --socket PATH] [--dry-run] [--yes] [--wait]
    aoe bank check   [--bank DIR] [--bank-layer DIR]
    aoe bank verify  [--bank DIR] [--sample N] [--op-type T] [--seed S] [--budget SECONDS]
                     [--layer NAME|all] [--no-record] [--wait] [--json]
    aoe bank sync    PEER [--bank DIR | --socket PATH] [--ca FILE [--cert FILE --key FILE]] [--wait]

The custom bank is --bank, else the configured one (TUNE_BANK_PATH, the config file, the
user data dir); read-only layers come from --bank-layer (repeatable), then the configured
ones (AOED_BANK_LAYERS, os.pathsep separated). Reads never need the daemon and never
wait. Import, prune and verify (its history) write the custom bank directly, and a bank
has one writer at a time: while another process writes it (a tune, the daemon) they stop
with an error naming that process, or with --wait wait until it is done. `verify` exits
1 when an entry regressed, is inaccurate or could not be measured (error); an
inconclusive verdict (a tie, busy cores, inputs unlike the task's) and a skipped entry
condemn nothing, and say why.

With `--socket PATH` (or AOED_SOCKET set and no --bank), stats, lookup, export, import,
prune, verify and sync work on the daemon's bank through its API instead: the daemon is
then the one writer, so nothing waits for it.

`prune` deletes: it names the bank it acts on before it acts. Through a daemon it
deletes only with `--yes`, or when `--bank` names the daemon's own bank (then it goes
through the daemon, that bank's writer): AOED_SOCKET alone, set for other commands,
never prunes a daemon's history unseen.

`check` reads every page of each bank's data file without LMDB (aoe.lmdbcheck), then
every record through LMDB, and says what is damaged and what to do; it exits 4
(BankDamagedError) when a bank is damaged, 0 when every bank is whole. It reads the
files themselves, beside a daemon that writes them if need be.

`sync PEER` applies what the bank of the daemon at PEER (a gRPC target: unix:///PATH,
dns:///HOST:PORT) wrote since this bank last did, with the rules of `[bank] follow`
(aoed.bank.follow), once: up to the peer's last write when the pass began.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from aoe.errors import OptionError

__all__ = ["add_parsers"]

_POLICIES = ("keep-faster", "overwrite", "keep-existing")
#: Refused records listed one by one; the rest are counted (a foreign history is long).
_SHOW_REFUSED = 50


#: Where the bank comes from without --bank, for commands that can work through a daemon.
_DEFAULT_WITH_SOCKET = (
    "default: the daemon's bank with --socket or AOED_SOCKET set, else TUNE_BANK_PATH, the "
    "config file's or the user data dir"
)
_DEFAULT_LOCAL = "default: TUNE_BANK_PATH, the config file's or the user data dir"


def _bank_args(p: argparse.ArgumentParser, layers: bool = True, socket: bool = True) -> None:
    """--bank (and --bank-layer), with a help that says the default once: through the
    daemon first for commands that take --socket (`socket`)."""
    p.add_argument(
        "--bank",
        type=Path,
        metavar="DIR",
        help=f"custom bank directory ({_DEFAULT_WITH_SOCKET if socket else _DEFAULT_LOCAL})",
    )
    if layers:
        p.add_argument(
            "--bank-layer",
            type=Path,
            action="append",
            default=[],
            metavar="DIR",
            help="read-only bank layered under the custom bank (repeatable)",
        )


def _socket_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        type=Path,
        metavar="PATH",
        help="work on the bank of the daemon at this socket (AOED_SOCKET, when set and --bank is not given)",
    )


def _daemon(args: argparse.Namespace):
    """The Client for the daemon whose bank to use, or None to use a bank directly."""
    import os

    path = getattr(args, "socket", None)
    if (
        path is None
        and os.environ.get("AOED_SOCKET", "").strip()
        and getattr(args, "bank", None) is None
    ):
        from aoe.config import default_socket

        path = default_socket()
    if path is None:
        return None
    if getattr(args, "bank", None) is not None or getattr(args, "bank_layer", None):
        raise OptionError(
            "--socket works on the daemon's own bank: drop --bank/--bank-layer or --socket"
        )
    from aoe.client import Client

    return Client(path)


def _wait_arg(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument(
        "--wait",
        action="store_true",
        help=f"when another process writes the bank, wait for it to finish{what} (default: fail)",
    )


def _say_waiting(message: str) -> None:
    print(f"aoe: {message}", file=sys.stderr, flush=True)


def _config(args: argparse.Namespace):
    from aoe.config import load_config

    return load_config(getattr(args, "config", None))


def _bank_path(args: argparse.Namespace) -> Path:
    return args.bank or _config(args).bank


def _reader(args: argparse.Namespace):
    from aoe.bank import open_bank

    config = _config(args)
    return open_bank(
        args.bank or config.bank, layers=[*args.bank_layer, *config.bank_layers], use_env=False
    )


# --------------------------------------------------------------------------- compile


def _add_compile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compile",
        help="build the tuned model from the bank alone (no tuning; one short A/B of its session options)",
        description="Build the tuned model from the bank alone: nothing is tuned, and the only "
        "measurement is one short A/B of the session options the bank holds, with and without "
        "them (--no-check skips it).",
    )
    p.add_argument("model", type=Path, help="the .onnx model the bank was tuned for")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="FILE",
        help="where to write the tuned .onnx",
    )
    _bank_args(p, socket=False)
    p.add_argument(
        "--input-shape", action="append", help="NAME:D1,D2,... for dynamic inputs (as for aoe tune)"
    )
    p.add_argument(
        "--precision", help="precision policy the bank entries were tuned under (default: exact)"
    )
    p.add_argument(
        "--keep-initializer-inputs",
        action="store_true",
        help="keep initializers listed as graph inputs overridable (as for aoe tune)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        help="calibration samples the tuning run used (lossy precisions; as for aoe tune)",
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="apply the bank's session options without re-checking them (no measurement at all)",
    )
    p.add_argument(
        "--job-type",
        metavar="T",
        help="form the model's tasks as a job of this type does (sgat+opat, opat or sgat; "
        "default: the job type the bank's confirmation names, else sgat+opat)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_compile)


def _compile(args: argparse.Namespace) -> int:
    from aoe.spec import JobSpec
    from aoe.specargs import from_args
    from aoed import embedded  # the engine's assembly, in this process

    spec = from_args(args)  # checks the precision and shapes before any work starts
    if args.precision is None:
        args.precision = str(JobSpec().precision)
    config = _config(args)
    with _reader(args) as reader:
        asm = embedded.apply_bank(
            args.model,
            args.output,
            reader,
            input_shapes=dict(spec.input_shapes),
            precision=spec.precision,
            calibration=args.calibration,
            keep_initializer_inputs=spec.keep_initializer_inputs,
            plugins=config.plugins,
            check_options=not args.no_check,
            runtime_dir=config.runtime_dir,
            job_type=str(spec.job_type) if args.job_type is not None else None,
        )
        layers = [name for name, _ in reader.layers]
    rows = [*asm.tasks, asm.session]
    if args.json:
        doc = {
            "model": str(args.model),
            "tuned_model": asm.output or str(args.output),
            "runtime": asm.runtime.runtime
            if asm.runtime and asm.output.endswith(".xml")
            else "onnxruntime",
            "precision": args.precision,
            "job_type": asm.job_type,
            "layers": layers,
            "hits": asm.hits,
            "misses": asm.misses,
            "session_options": asm.session_options,
            "tasks": [vars(t) for t in rows],
            "notes": asm.notes,
        }
        print(json.dumps(doc, indent=2))
        return 0
    out = sys.stdout
    print(
        f"aoe: compiled {args.model.name} from the bank: {asm.hits} hits, {asm.misses} misses "
        f"of {len(rows)} ({args.precision}, tasks as {asm.job_type} forms them; layers: "
        f"{', '.join(layers)})",
        file=out,
    )
    for t in rows:
        timing = (
            f"{t.before_us:.1f} -> {t.after_us:.1f} us" if t.status == "hit" and t.before_us else ""
        )
        print(
            f"  {t.task_id:<32} {t.op_type:<18} x{t.instances:<3} {t.status:<8} "
            f"{t.strategy if t.status == 'hit' else '-':<24} {t.layer or '-':<10} {timing}",
            file=out,
        )
        if t.reason:
            print(f"      {t.reason}", file=out)
    if asm.session_options:
        print(f"  session options  {asm.session_options}", file=out)
    for note in asm.notes:
        print(f"  note         {note}", file=out)
    print(f"  tuned model  {asm.output or args.output}", file=out)
    return 0


# --------------------------------------------------------------------------- bank


def _add_bank(top: argparse._SubParsersAction) -> None:
    p = top.add_parser(
        "bank",
        help="inspect, exchange and maintain the knowledge bank",
        description="Inspect, exchange and maintain the knowledge bank.",
    )
    sub = p.add_subparsers(dest="cmd", metavar="SUBCOMMAND", required=True, parser_class=type(p))

    s = sub.add_parser("stats", help="entries, history, defaults, sizes per layer")
    s.set_defaults(run=_stats)
    _bank_args(s)
    _socket_arg(s)
    s.add_argument("--json", action="store_true")

    s = sub.add_parser("lookup", help="print the entry for a key, or why nothing matched")
    s.set_defaults(run=_lookup)
    _bank_args(s)
    _socket_arg(s)
    q = s.add_mutually_exclusive_group(required=True)
    q.add_argument("--key", help="bank key v1/<signature>/<device>/<precision>")
    q.add_argument("--signature-digest", help="task signature digest (hex)")
    s.add_argument("--device-digest", help="device digest (default: this machine's CPU)")
    s.add_argument("--precision", default="exact")
    s.add_argument("--json", action="store_true", help="print the entry as one JSON line")

    s = sub.add_parser(
        "export", help="write the bank's records as JSON Lines (entries, defaults, history)"
    )
    s.set_defaults(run=_export)
    _bank_args(s)
    _socket_arg(s)
    s.add_argument(
        "--layer", default="custom", help="layer to export: custom (default), a layer path, or all"
    )
    s.add_argument("--output", "-o", type=Path, help="file to write (default: standard output)")
    q = s.add_mutually_exclusive_group()
    q.add_argument(
        "--entries-only",
        action="store_true",
        help="only the winner entries (no default records, no history)",
    )
    q.add_argument(
        "--no-history", action="store_true", help="leave the history (measured trials) out"
    )

    s = sub.add_parser("import", help="merge JSON Lines records into the custom bank")
    s.set_defaults(run=_import)
    _bank_args(s, layers=False)
    _socket_arg(s)
    s.add_argument("file", type=Path, help="JSON Lines file ('-' for standard input)")
    s.add_argument("--policy", default="keep-faster", choices=_POLICIES)
    # Records of every device are kept (each is served to its own device): the flag of
    # older scripts is taken, and changes nothing.
    s.add_argument("--allow-foreign", action="store_true", help=argparse.SUPPRESS)
    _wait_arg(s)

    s = sub.add_parser("prune", help="drop the measurement history, keep winners")
    s.set_defaults(run=_prune)
    _bank_args(s, layers=False)
    _socket_arg(s)
    s.add_argument(
        "--dry-run", action="store_true", help="say what would be removed, remove nothing"
    )
    s.add_argument(
        "--yes",
        action="store_true",
        help="prune a daemon's bank without naming it with --bank (needed with --socket or AOED_SOCKET)",
    )
    _wait_arg(s)

    s = sub.add_parser(
        "check", help="read every page and record of the bank's files; say what is damaged"
    )
    s.set_defaults(run=_check)
    _bank_args(s, socket=False)

    s = sub.add_parser("verify", help="re-measure a sample of entries on this device")
    s.set_defaults(run=_verify)
    _bank_args(s)
    _socket_arg(s)
    s.add_argument(
        "--layer", default="custom", help="layer to verify: custom (default), a layer path, or all"
    )
    s.add_argument(
        "--sample", type=int, default=10, help="entries to re-measure, chosen at random (0 = all)"
    )
    s.add_argument("--op-type", default="", help="only tasks anchored by this op type, e.g. Conv")
    s.add_argument("--seed", type=int, default=0, help="seed of the sample (0 = pick one)")
    s.add_argument("--budget", type=float, default=1.0, help="device seconds per entry (default 1)")
    s.add_argument(
        "--no-record", action="store_true", help="do not append the measurements to the history"
    )
    s.add_argument(
        "--model",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a model whose session options (its model-level entry) to re-check too (repeatable)",
    )
    _wait_arg(s, " before recording the measurements")
    s.add_argument("--json", action="store_true")

    s = sub.add_parser(
        "sync", help="apply what a peer daemon's bank wrote since the last time, once"
    )
    s.set_defaults(run=_sync)
    _bank_args(s, layers=False)
    _socket_arg(s)
    s.add_argument("peer", help="the peer daemon: unix:///PATH/aoed.sock or dns:///HOST:PORT")
    s.add_argument("--ca", type=Path, help="CA of the peer's server certificate (TCP peers: TLS)")
    s.add_argument("--cert", type=Path, help="client certificate, for a peer that wants mutual TLS")
    s.add_argument("--key", type=Path, help="client key, with --cert")
    _wait_arg(s)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `compile` and `bank` (with its subcommands) to the `aoe` parser."""
    _add_compile(sub)
    _add_bank(sub)


def _human(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def _stats(args: argparse.Namespace) -> int:
    """Counts and sizes per layer: the same fields, lines and JSON locally and through a
    daemon (whose answer carries its layers; its host's paths)."""
    daemon = _daemon(args)
    if daemon is not None:
        from aoe.wire import layer_stats_from_pb

        with daemon:
            layers = [layer_stats_from_pb(m) for m in daemon.bank_stats().layers]
        where = f" ({daemon.target})"
    else:
        with _reader(args) as reader:
            layers = reader.stats()
        where = ""
    if args.json:
        print(
            json.dumps(
                {
                    "layers": [vars(s) for s in layers],
                    "entries": sum(s.entries for s in layers),
                    "defaults": sum(s.defaults for s in layers),
                },
                indent=2,
            )
        )
        return 0
    for s in layers:
        print(f"{s.name}: {s.path}{where if s.name == 'custom' else ''}")
        print(f"  entries {s.entries}, defaults {s.defaults}, history {s.history} trials")
        print(
            f"  map {_human(s.map_size)} (address space), used {s.used_bytes / 2**20:.2f} MiB, "
            f"schema {s.schema_version}"
        )
    return 0


def _lookup(args: argparse.Namespace) -> int:
    from aoe.exchange import entry_to_json

    daemon = _daemon(args)
    if daemon is not None:
        if not args.key:
            raise OptionError("--socket: look up by --key (the daemon's device decides the rest)")
        with daemon:
            r = daemon.bank_lookup(args.key)
        if not r.found:
            print(f"no match for {args.key}: {r.reason}")
            return 1
        line = entry_to_json(r.entry)
        print(
            json.dumps({"layer": r.layer, "entry": json.loads(line)}, sort_keys=True)
            if args.json
            else f"layer: {r.layer}\n" + json.dumps(json.loads(line), indent=2, sort_keys=True)
        )
        return 0

    with _reader(args) as reader:
        ex = reader.lookup_explain(
            args.key,
            signature_digest=args.signature_digest,
            device_digest=args.device_digest,
            precision=args.precision,
        )
        entry = reader.lookup(ex.key)[0] if ex.found else None
    if entry is None:
        print(f"no match for {ex.key}: {ex.reason}")
        return 1
    line = entry_to_json(entry)
    if args.json:
        print(json.dumps({"layer": ex.layer, "entry": json.loads(line)}, sort_keys=True))
    else:
        print(f"layer: {ex.layer}")
        print(json.dumps(json.loads(line), indent=2, sort_keys=True))
    return 0


def _export(args: argparse.Namespace) -> int:
    from aoe.exchange import record_to_json

    daemon = _daemon(args)
    if daemon is not None:
        if args.output is None:
            raise OptionError("--socket: export to a file (--output FILE.jsonl)")
        with daemon:
            n = daemon.bank_export(
                args.output, entries_only=args.entries_only, no_history=args.no_history
            )
        print(
            f"aoe: exported {n.get('entry', 0)} entries, {n.get('default_record', 0)} default records, "
            f"{n.get('trial', 0)} trials from the daemon's bank",
            file=sys.stderr,
        )
        return 0

    with _reader(args) as reader, contextlib.ExitStack() as stack:
        names = [n for n, _ in reader.layers]
        if args.layer != "all" and args.layer not in names:
            raise OptionError(
                f"--layer {args.layer}: no such layer (layers: {', '.join(names)}, or all)"
            )
        out = sys.stdout
        if args.output is not None:
            try:
                out = stack.enter_context(open(args.output, "w", encoding="utf-8"))
            except OSError as exc:
                raise OptionError(f"--output {args.output}: {exc.strerror or exc}") from None
        n = {"entry": 0, "default_record": 0, "trial": 0}
        records = reader.records(
            None if args.layer == "all" else args.layer,
            entries_only=args.entries_only,
            history=not args.no_history,
        )
        for _layer, record in records:
            out.write(record_to_json(record) + "\n")
            n[record.WhichOneof("record")] += 1
    print(
        f"aoe: exported {n['entry']} entries, {n['default_record']} default records, "
        f"{n['trial']} trials",
        file=sys.stderr,
    )
    return 0


def _check(args: argparse.Namespace) -> int:
    from aoe.errors import BankError
    from aoe.lmdbcheck import damaged, find_damage
    from aoe.lmdbenv import read_every_record

    config = _config(args)
    paths = dict.fromkeys([args.bank or config.bank, *args.bank_layer, *config.bank_layers])
    refused = []
    for path in paths:
        if not (path / "data.mdb").is_file():
            raise BankError(f"bank {path}: no bank here (no data.mdb); check the path")
        problems = find_damage(path, walk=True)
        if not problems:
            counts = read_every_record(path)
            size = (path / "data.mdb").stat().st_size
            print(
                f"bank {path}: whole: {_human(size)} of pages walked, "
                f"{sum(counts.values())} records read in {len(counts)} databases"
            )
            continue
        print(f"bank {path}: damaged, {len(problems)} problems in {path / 'data.mdb'}:")
        for problem in problems:
            print(f"  {problem}")
        refused.append(damaged(path, problems))
    if refused:
        raise refused[0]
    return 0


def _import(args: argparse.Namespace) -> int:
    daemon = _daemon(args)
    if daemon is not None:
        if str(args.file) == "-":
            raise OptionError("--socket: import from a file, not standard input")
        with daemon:
            r = daemon.bank_import(args.file, args.policy)
        print(
            f"aoe: imported into the daemon's bank: {r.added} added, {r.updated} updated, {r.kept} kept, "
            f"{r.refused} refused ({args.policy})"
        )
        for ref in list(r.refused_entries)[:_SHOW_REFUSED]:
            print(f"  refused {ref.key}: {ref.reason}")
        return 0

    from aoed import embedded  # the bank's writer, in this process

    if str(args.file) == "-":
        lines = sys.stdin
        ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    else:
        try:
            lines = ctx = open(args.file, encoding="utf-8")
        except OSError as exc:
            raise OptionError(f"{args.file}: {exc.strerror or exc}") from None
    path = _bank_path(args)
    with ctx:
        report = embedded.import_bank(
            path,
            lines,
            args.policy,
            wait=args.wait,
            on_wait=_say_waiting,
            plugins=_config(args).plugins,
        )
    print(
        f"aoe: imported into {path}: {report.added} added, {report.updated} updated, "
        f"{report.kept} kept, {len(report.refused)} refused ({args.policy})"
    )
    for kind, name in (("entry", "entries"), ("default", "default records"), ("trial", "trials")):
        c = report.counts[kind]
        updated = "" if kind == "trial" else f"{c.updated} updated, "
        print(f"  {name + ':':<17}{c.added} added, {updated}{c.kept} kept")
    for label, reason in report.refused[:_SHOW_REFUSED]:
        print(f"  refused {label}: {reason}")
    if len(report.refused) > _SHOW_REFUSED:
        print(f"  ... and {len(report.refused) - _SHOW_REFUSED} more refused")
    return 0


def _prune(args: argparse.Namespace) -> int:
    daemon, named = _prune_daemon(args)
    verb = "would remove" if args.dry_run else "removed"
    if daemon is None:
        path = _bank_path(args)
        print(
            f"aoe: {'dry run: ' if args.dry_run else ''}pruning the history of the bank at {path}"
        )
        sys.stdout.flush()
        r = _prune_local(args)
        where = str(path)
    else:
        with daemon:
            st = daemon.bank_stats()
            where = f"{st.path} (the daemon's at {daemon.target})"
            if not (args.dry_run or args.yes or named):
                raise OptionError(
                    f"aoe bank prune would delete the {st.history_trials} history trials of the bank at "
                    f"{where}: pass --yes to prune it, or name it with --bank {st.path}"
                )
            print(
                f"aoe: {'dry run: ' if args.dry_run else ''}pruning the history of the bank at {where}"
            )
            sys.stdout.flush()
            r = daemon.bank_prune(args.dry_run)
    print(
        f"aoe: {verb} {r.trials_removed} history trials, kept {r.entries_kept} entries in {where}; "
        f"used {r.used_bytes_before / 2**20:.2f} MiB -> {r.used_bytes_after / 2**20:.2f} MiB"
    )
    return 0


def _prune_daemon(args: argparse.Namespace):
    """(the Client of the daemon whose bank to prune, whether --bank named that bank), or
    (None, False) to prune --bank (or the configured bank) in this process. With a daemon
    (--socket, or AOED_SOCKET set) and --bank, the daemon's own bank goes through the
    daemon, its writer; another bank is pruned here (refused with --socket, which names
    the daemon's). Raises OptionError, DaemonUnavailableError (--socket)."""
    if args.bank is None:
        return _daemon(args), False
    import os

    from aoe.client import Client
    from aoe.config import default_socket
    from aoe.errors import DaemonUnavailableError

    explicit = args.socket is not None
    if not explicit and not os.environ.get("AOED_SOCKET", "").strip():
        return None, False
    daemon = Client(args.socket or default_socket())
    try:
        path = Path(daemon.bank_stats().path)
    except DaemonUnavailableError:
        daemon.close()
        if explicit:
            raise
        return None, False  # no daemon there: --bank is pruned here, under its writer lock
    if path.resolve() == args.bank.resolve():
        return daemon, True
    daemon.close()
    if explicit:
        raise OptionError(
            f"--socket {args.socket} works on the daemon's bank {path}, not --bank {args.bank}: "
            "drop one of them"
        )
    return None, False


def _prune_local(args: argparse.Namespace):
    path = _bank_path(args)
    if not (path / "data.mdb").is_file():
        raise OptionError(f"--bank {path}: no bank here")
    from aoed import embedded  # the bank's writer, in this process

    return embedded.prune_bank(path, args.dry_run, wait=args.wait, on_wait=_say_waiting)


def _verify(args: argparse.Namespace) -> int:
    import random

    if args.sample < 0 or args.budget <= 0:
        raise OptionError("--sample must be >= 0 and --budget > 0")
    daemon = _daemon(args)
    if daemon is not None:
        return _verify_on(daemon, args)
    from aoed import embedded  # the engine, in this process

    seed = args.seed or random.SystemRandom().randrange(1, 1 << 31)
    config = _config(args)
    with _reader(args) as reader:
        names = [n for n, _ in reader.layers]
        if args.layer != "all" and args.layer not in names:
            raise OptionError(
                f"--layer {args.layer}: no such layer (layers: {', '.join(names)}, or all)"
            )
        custom = reader.layers[0][1]
        # Fails before measuring, not after, when the history could not be written.
        report = embedded.verify_bank(
            reader,
            config=config,
            sample=args.sample,
            seed=seed,
            budget_s=args.budget,
            op_type=args.op_type,
            layer=args.layer,
            models=args.model,
            check_writable=None if args.no_record or args.wait else custom,
        )
    verdicts = report.verdicts
    bad = [v for v in verdicts if v.verdict in ("regressed", "inaccurate", "error")]
    if args.json:
        print(
            json.dumps(
                {
                    "seed": seed,
                    "sampled": report.sampled,
                    "of": report.of,
                    "verdicts": [vars(v) for v in verdicts],
                },
                indent=2,
                default=str,
            )
        )
    else:
        print(
            f"aoe: verified {report.sampled} of {report.of} entries (seed {seed}, {args.budget:g} s each)"
        )
        for v in verdicts:
            print(f"  {v.verdict:<10} {v.op_type:<18} {v.strategy:<24} {v.key}")
            if v.detail:
                print(f"      {v.detail}")
        counts = {
            k: sum(v.verdict == k for v in verdicts)
            for k in ("confirmed", "regressed", "inaccurate", "inconclusive", "skipped", "error")
        }
        print("  " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    sys.stdout.flush()
    if report.trials and not args.no_record:
        # after the verdicts: a busy bank loses only the record
        embedded.record_trials(custom, report.trials, wait=args.wait, on_wait=_say_waiting)
    return 1 if bad else 0


def _sync(args: argparse.Namespace) -> int:
    daemon = _daemon(args)
    if daemon is not None:
        if args.ca or args.cert or args.key:
            raise OptionError(
                "--ca/--cert/--key: with a daemon, it connects with its own [bank] follow_* files"
            )
        with daemon:
            r = daemon.bank_sync(args.peer)
        counts = {"entries": r.entries, "default records": r.default_records, "trials": r.trials}
        _print_sync(args.peer, r.peer_bank_id, r.from_seq, r.to_seq, counts, r.refused)
        return 0
    report = _sync_local(args)
    counts = {
        name: report.counts[kind]
        for name, kind in (
            ("entries", "entry"),
            ("default records", "default"),
            ("trials", "trial"),
        )
    }
    _print_sync(
        args.peer, report.peer_bank_id, report.from_seq, report.to_seq, counts, report.refused
    )
    return 0


def _print_sync(
    peer: str, bank_id: str, from_seq: int, to_seq: int, counts: dict, refused: int
) -> None:
    print(f"aoe: synced from {peer} (bank {bank_id}): its writes {from_seq} -> {to_seq}")
    for name, c in counts.items():
        print(f"  {name:<16} added {c.added}, updated {c.updated}, kept {c.kept}")
    if refused:
        print(f"  refused {refused} (not records this tuner writes; each is logged)")


def _sync_local(args: argparse.Namespace):
    """One follow pass into the bank at --bank (or the configured one), in this process."""
    from aoe.client import Client

    if args.cert and not args.key or args.key and not args.cert:
        raise OptionError("--cert and --key go together")
    if args.cert and not args.ca:
        raise OptionError("--cert needs --ca")
    try:
        tls = (
            [p.read_bytes() if p else None for p in (args.ca, args.key, args.cert)]
            if args.ca
            else None
        )
    except OSError as exc:
        raise OptionError(f"{exc.filename}: {exc.strerror or exc}") from None
    config = _config(args)

    def connect(target: str) -> Client:
        if tls is None:
            return Client(target, timeout=30)
        return Client(
            target,
            timeout=30,
            root_certificates=tls[0],
            private_key=tls[1],
            certificate_chain=tls[2],
        )

    from aoed import embedded  # the bank's writer and follower, in this process

    return embedded.sync_bank(
        _bank_path(args),
        args.peer,
        connect,
        wait=args.wait,
        on_wait=_say_waiting,
        plugins=config.plugins,
    )


def _verify_on(daemon, args: argparse.Namespace) -> int:
    """`aoe bank verify` by the daemon, on its device (1 s per entry), its bank recording."""
    from aoe.v1 import bank_pb2

    names = {
        v: k.removeprefix("VERIFY_VERDICT_").lower() for k, v in bank_pb2.VerifyVerdict.items()
    }
    bad = 0
    with daemon:
        print(f"aoe: verifying on the daemon at {daemon.target}")
        for v in daemon.bank_verify(args.sample, args.op_type, args.seed):
            verdict = names.get(v.verdict, "?")
            bad += verdict in ("regressed", "inaccurate", "error")
            print(
                f"  {verdict:<10} {v.op_type:<18} {v.key}"
                + (f"\n      {v.detail}" if v.detail else "")
            )
    return 1 if bad else 0
