"""`aoe compile` and `aoe bank ...`: the bank's command line (not available yet)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str]) -> int:
    print(f"aoe: error: 'aoe {argv[0]}' is not available in this version", file=sys.stderr)
    return 2
