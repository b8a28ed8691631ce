"""Bank exchange: merge JSON Lines (as `aoe bank export` writes them) under a policy.

One line per `aoe.v1.BankEntry` (proto field names, sorted keys), so an export is
readable, diffable and greppable. An import merges entry by entry under a policy:

  keep-faster    the entry with the faster winner median wins (ties keep the existing)
  overwrite      the incoming entry replaces the existing one
  keep-existing  an existing entry is never replaced

Keys include the device digest, so two entries under one key were measured on the same
device fingerprint and their medians compare. Provenance is part of the entry and is
stored as it arrives. An entry measured on a device that is not this machine is refused
unless `allow_foreign` (it would never be applied here, but a team bank built on one
machine for others may want it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from aoe.errors import OptionError
from aoe.signature import device_fingerprint
from aoed.bank._codec import Incoming, parse_line, winner_us
from aoed.bank.store import BankStore

__all__ = ["POLICIES", "ImportReport", "import_lines"]

POLICIES = ("keep-faster", "overwrite", "keep-existing")


@dataclass
class ImportReport:
    added: int = 0
    updated: int = 0
    kept: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)  # (key or line, reason)


def _replace(policy: str):
    if policy == "overwrite":
        return lambda old, new: True
    if policy == "keep-existing":
        return lambda old, new: False
    if policy == "keep-faster":
        return lambda old, new: winner_us(new) < winner_us(old)
    raise OptionError(f"--policy {policy}: expected one of {', '.join(POLICIES)}")


def _is_local(inc: Incoming) -> bool:
    fp = device_fingerprint(inc.execution_provider or "CPUExecutionProvider", inc.device_options)
    return fp.digest == inc.device_digest


def import_lines(
    store: BankStore, lines: Iterable[str], policy: str = "keep-faster", allow_foreign: bool = False
) -> ImportReport:
    """Merge the JSON Lines `lines` into `store` under `policy`; returns what happened.

    Blank lines are skipped; a line that is not a valid entry, or (without
    `allow_foreign`) one measured on another device, is refused and reported.
    Raises OptionError for an unknown policy, BankError when the store fails.
    """
    replace = _replace(policy)
    report = ImportReport()

    def accepted() -> Iterator[tuple[bytes, bytes]]:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            inc = parse_line(line)
            label = inc.key.decode() if inc.key else f"line {n}"
            if inc.problem:
                report.refused.append((label, inc.problem))
            elif not allow_foreign and not _is_local(inc):
                report.refused.append(
                    (label, f"measured on another device ({inc.hardware}, onnxruntime "
                            f"{inc.runtime_version}, device {inc.device_digest[:32]}); "
                            "pass --allow-foreign to import it anyway")
                )  # fmt: skip
            else:
                yield inc.key, inc.data

    counts = store.merge(accepted(), replace)
    report.added, report.updated, report.kept = counts.added, counts.updated, counts.kept
    return report

