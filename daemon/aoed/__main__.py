"""`aoed`: the tuning daemon's entry point: configuration, logging, trio.run(Daemon).

    aoed [--config FILE] [--check-config] [--log-level LEVEL]

gRPC core does not survive fork(): `GRPC_ENABLE_FORK_SUPPORT` is switched off here,
before anything imports grpc, and every child process the daemon starts is a fresh
interpreter started through exec (see aoed.engine._child), which also drops the service
manager's variables (NOTIFY_SOCKET, WATCHDOG_*) from its environment.

The process umask is set here too (027), before anything creates a file.
"""

from __future__ import annotations

import os

os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"  # before grpc is imported, by anything

import argparse  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from aoed import __version__  # noqa: E402

#: Nothing the daemon creates is open to other users; its group may read.
DAEMON_UMASK = 0o027


def build_parser() -> argparse.ArgumentParser:
    """The `aoed` command line."""
    parser = argparse.ArgumentParser(
        prog="aoed", description="aoed: the tuning daemon (gRPC, watched folders)"
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="path to aoed.toml (default: AOED_CONFIG, else built-in defaults)",
    )
    parser.add_argument(
        "--check-config", action="store_true", help="validate the configuration, print it, and exit"
    )
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: [log] level, else info)",
    )
    parser.add_argument("--version", action="version", version=f"aoed {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Whatever umask started us (000 from a careless shell), the daemon's files are for
    # itself and its group: 0640 files, 0750 folders. Set before anything is created.
    os.umask(DAEMON_UMASK)

    from aoe.errors import AoedError, OptionError, first_error
    from aoed.config import load_daemon_config

    try:
        cfg = load_daemon_config(args.config)
    except OptionError as exc:
        if len(exc.problems) == 1:
            print(f"aoed: error: {exc}", file=sys.stderr)
        else:  # the file was checked whole: every problem on a line of its own
            print(
                f"aoed: error: {len(exc.problems)} problems in the configuration:", file=sys.stderr
            )
            for problem in exc.problems:
                print(f"  {problem}", file=sys.stderr)
        return exc.exit_code
    except AoedError as exc:
        print(f"aoed: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.check_config:
        print(f"aoed: configuration {cfg.source} is valid")
        print(f"  listen      {', '.join(cfg.listen_addresses())}")
        print(f"  state dir   {cfg.state_dir}")
        print(
            f"  bank        {cfg.engine.bank}"
            + (
                f" (layers: {', '.join(map(str, cfg.engine.bank_layers))})"
                if cfg.engine.bank_layers
                else ""
            )
        )
        print(f"  device      {cfg.engine.device}, {cfg.engine.parallel} compile workers")
        if cfg.engine.executor != "local":
            auth = (
                f"token in {cfg.engine.ray_token_file}"
                if cfg.engine.ray_token_file is not None
                else "NO TOKEN (allow_unauthenticated)"
            )
            print(f"  executor    {cfg.engine.executor} at {cfg.engine.ray_address}, {auth}")
        print(f"  jobs        {cfg.max_running_jobs} at once, {cfg.max_queued_jobs} queued at most")
        e = cfg.engine
        print(
            f"  models      up to {e.max_model_mb} MiB, {e.max_nodes} nodes, {e.max_tensor_mb} MiB per tensor"
        )
        print(
            f"  time        {e.compile_timeout_s:g} s per compile, {e.stage_timeout_s:g} s per other worker stage, "
            "each x (1 + model MiB/256)"
        )
        from aoed.engine.memory import plan_memory

        print(f"  memory      {plan_memory(e).describe()}")
        for inbox in cfg.inboxes:
            print(f"  inbox       {inbox.path} -> {inbox.outbox} (failed: {inbox.failed})")
        print(f"  allowed     {', '.join(map(str, cfg.allowed_dirs)) or '(no daemon-side paths)'}")
        print(f"  follows     {', '.join(cfg.follow) or '(no peer banks)'}")
        print(
            f"  metrics     {f'http://{cfg.metrics_listen}/metrics' if cfg.metrics_listen else 'off'}"
        )
        return 0
    level = args.log_level or (
        cfg.engine.log_level if "log_level" in cfg.engine.sources else "info"
    )
    from aoed.logs import configure

    configure(level)
    from aoed.fdlimit import raise_soft_limit

    # Before anything opens a descriptor that counts: the service manager's soft limit
    # (1024) is far below what gRPC, the store, the bank and the inboxes may need.
    raise_soft_limit()

    import trio

    from aoed.daemon import Daemon

    try:
        trio.run(Daemon(cfg, args.config).run)
    except AoedError as exc:
        print(f"aoed: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BaseExceptionGroup as group:
        match = first_error(group, AoedError)
        if not isinstance(match, AoedError):
            raise
        print(f"aoed: error: {match}", file=sys.stderr)
        return match.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
