"""`aoed`: the tuning daemon's entry point.

The long-running service (gRPC on a unix socket, watched inbox folders, systemd
notification) is not part of this version. Until it is, `aoed` says so plainly
instead of pretending to serve; the same engine runs embedded through `aoe tune`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from aoed import __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aoed", description="aoed tuning daemon")
    parser.add_argument("--config", help="path to aoed.toml")
    parser.add_argument("--version", action="version", version=f"aoed {__version__}")
    parser.parse_args(argv)
    print(
        "aoed: the daemon (gRPC service, watched folders) is not available in this version; "
        "run `aoe tune MODEL` to tune embedded",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
