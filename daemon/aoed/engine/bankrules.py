"""AOE's bank rules, written once: what a lookup answers, and what tuning writes back.

Reading (`answer`): an entry measured on this device answers ("hit"); a record that the
task was tuned and the default stayed fastest answers too ("default": nothing to apply,
nothing to measure); an entry from another device, or a record that is not one this
tuner writes (aoe.recordcheck: a bank is data, whoever wrote it), is never applied
("ignored"); otherwise it is a "miss". Without REPEAT_TUNE a hit or default is used
as-is.

Writing, after a task was tuned (`after_tuning`), per AOE:
  no entry, better than the default  -> add          (entry written)
  no entry, the default stays best   -> unsatisfied  (default record written)
  entry, something clearly better    -> update       (entry replaced)
  entry, nothing clearly better      -> reserved     (entry kept)
A model-level record (session options and the tasks a verification reverted in this
model's context) follows the same rules under the model's signature.

Used by the tuner, `aoe compile` and `aoe bank verify`, so they never disagree.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aoe.bankrecord import BankRecord, Measured
from aoe.errors import ModelError
from aoe.keys import DeviceFingerprint, TaskSignature, bank_key
from aoe.ovartifact import RuntimeDecision
from aoe.partition import Task
from aoe.recordcheck import RecordError, Vocabulary, check_default_doc, check_record
from aoed import __version__
from aoed.engine.decisions import clearly_faster
from aoed.engine.messages import Measurement
from aoed.engine.registry import DEFAULT

__all__ = [
    "CONFIRMED_JOB_TYPES",
    "BankAnswer",
    "Outcome",
    "after_tuning",
    "answer",
    "choices_digest",
    "confirmed",
    "confirmed_job_type",
    "key_for",
    "make_record",
    "reverted_digests",
    "runtime_of",
]


@dataclass(frozen=True)
class BankAnswer:
    kind: str  # hit | default | ignored | miss
    record: BankRecord | None = None
    layer: str = ""
    default: Mapping[str, Any] | None = None
    reason: str = ""

    def usable(self, repeat_tune: bool, resumes: str = "") -> bool:
        """True when the bank settles the task without measuring (AOE: no REPEAT_TUNE).

        With REPEAT_TUNE, what the job `resumes` (an interrupted run of the same job, by
        its id) decided before it stopped still settles the task: a resumed job never
        measures a task twice."""
        if self.kind not in ("hit", "default"):
            return False
        if not repeat_tune:
            return True
        return bool(resumes) and self.job_id == resumes

    @property
    def job_id(self) -> str:
        """The job that wrote this answer's record."""
        if self.kind == "hit" and self.record is not None:
            return self.record.job_id
        return str((self.default or {}).get("job", ""))

    @property
    def default_us(self) -> float:
        return float((self.default or {}).get("default_us", 0.0))


def answer(
    record: BankRecord | None,
    layer: str,
    default: Mapping[str, Any] | None,
    default_layer: str,
    device: DeviceFingerprint,
    vocabulary: Vocabulary | None = None,
) -> BankAnswer:
    """What the bank says about one key (its entry and "default stays best" record),
    each checked against what the tuner of `vocabulary` writes before it is used."""
    if record is not None:
        if record.device.digest != device.digest:
            return BankAnswer(
                "ignored", None, layer, None, f"entry in {layer} was measured on another device"
            )
        try:
            check_record(record, vocabulary)
        except RecordError as exc:
            return BankAnswer(
                "ignored",
                None,
                layer,
                None,
                f"entry in {layer} is not one this tuner writes ({exc}): never applied",
            )
        return BankAnswer("hit", record, layer)
    if default is not None:
        try:
            check_default_doc(dict(default))
        except RecordError as exc:
            return BankAnswer(
                "ignored",
                None,
                default_layer,
                None,
                f"default record in {default_layer} is not one this tuner writes ({exc})",
            )
        return BankAnswer("default", None, default_layer, default)
    return BankAnswer("miss")


def reverted_digests(ans: BankAnswer) -> set[str]:
    """Signature digests a model-level record says were reverted in this model's context."""
    if ans.record is not None:
        return {d for d in ans.record.params.get("reverted", "").split(",") if d}
    return set((ans.default or {}).get("reverted", []))


def confirmed(ans: BankAnswer) -> dict[str, Any] | None:
    """The confirming A/B a model-level record carries (see confirm.py), or None."""
    raw = (
        ans.record.params.get("confirmed")
        if ans.record is not None
        else (ans.default or {}).get("confirmed")
    )
    if not raw:
        return None
    try:
        doc = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def runtime_of(ans: BankAnswer) -> RuntimeDecision | None:
    """The runtime whose build shipped, as a model-level record carries it (its
    `runtime` parameter, aoe.ovartifact.RuntimeDecision), or None: onnxruntime's model,
    or a parameter this version cannot read."""
    raw = (
        ans.record.params.get("runtime")
        if ans.record is not None
        else (ans.default or {}).get("runtime")
    )
    if not raw:
        return None
    try:
        return RuntimeDecision.checked(raw)
    except ModelError:
        return None


#: The job types whose tasks a model-level confirmation names (GDAT keeps its own records).
CONFIRMED_JOB_TYPES = ("opat", "sgat", "sgat+opat")


def confirmed_job_type(doc: Mapping[str, Any]) -> str | None:
    """The job type whose tasks the confirmation `doc` (`confirmed`) was made for: the
    tasks its choices were applied to. None when it names none of `CONFIRMED_JOB_TYPES`
    (stored before confirmations named one)."""
    job_type = doc.get("job_type")
    return job_type if job_type in CONFIRMED_JOB_TYPES else None


def choices_digest(
    tasks: Iterable[Task], choices: Mapping[str, str], options: Mapping[str, Any]
) -> str:
    """What a confirmation is valid for: the strategy chosen per task (`choices`: task id
    -> name; absent or default left out), keyed by the task's signature so any model
    with these tasks agrees, and the session options. The device, runtime and precision
    are in the record's key already."""
    by_sig = {
        t.signature.digest: choices[t.id] for t in tasks if choices.get(t.id, DEFAULT) != DEFAULT
    }
    text = json.dumps(
        {"tasks": dict(sorted(by_sig.items())), "options": dict(options)}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Outcome:
    mode: str  # add | update | reserved | unsatisfied
    strategy: str  # what the task runs now
    write_entry: bool  # an entry for `strategy` is to be written
    write_default: bool  # a "default stays best" record is to be written


def after_tuning(
    hit: BankRecord | None,
    best: str,
    measured: Mapping[str, Measurement],
    gate: Callable[[Measurement], bool],
) -> Outcome:
    """AOE's decision for a task just measured: `best` won this run; `hit` is the bank's
    entry when there was one (REPEAT_TUNE)."""
    if hit is None:
        if best != DEFAULT:
            return Outcome("add", best, True, False)
        return Outcome("unsatisfied", DEFAULT, False, True)
    old = measured.get(hit.strategy)
    if old is not None and old.ok and gate(old):
        old_ok, better = True, best != hit.strategy and clearly_faster(measured[best], old)
    else:  # the entry was not measured, failed or broke the gate: this run's winner replaces it
        old_ok, better = False, True
    if better and best != DEFAULT:
        return Outcome("update", best, True, False)
    return Outcome("reserved", hit.strategy if old_ok else best, False, False)


def make_record(
    key: bytes,
    signature: TaskSignature,
    device: DeviceFingerprint,
    strategy: str,
    family: str,
    precision: str,
    winner: Measurement,
    baseline: Measurement,
    job_id: str,
    model: str,
    params: Mapping[str, str] | None = None,
) -> BankRecord:
    """The bank entry for `strategy` winning on a task, with its evidence and provenance."""
    return BankRecord(
        key=key,
        signature=signature,
        device=device,
        strategy=strategy,
        family=family,
        precision=precision,
        winner=Measured(winner.median_us, winner.spread, winner.repeats, winner.min_us),
        baseline=Measured(baseline.median_us, baseline.spread, baseline.repeats, baseline.min_us),
        max_abs_error=winner.max_abs_error,
        max_rel_error=winner.max_rel_error,
        cosine=winner.cosine,
        params=dict(params or {}),
        host=socket.gethostname(),
        aoed_version=__version__,
        created_unix=time.time(),
        job_id=job_id,
        model=model,
    )


def key_for(signature: TaskSignature, device: DeviceFingerprint, precision: str) -> bytes:
    """The bank key of a task (or a model's record) on `device` under `precision`."""
    return bank_key(signature.digest, device.digest, precision)
