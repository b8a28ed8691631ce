"""Resume: what a run of a job decided, kept in the bank until the run ends, so that the
job run again after an interruption (kill -9, a daemon's shutdown, ^C) measures nothing
twice, whatever its precision, job type or calibration.

    run key   sha256 of what the decisions depend on: the prepared model's bytes, the
              samples (the user's calibration or the synthetic ones), precision, job
              type, accuracy budget, device and aoed's version
    record    run key + "/" + the task's bank key -> the task's whole decision (its
              choice, fallback, the bank writes still to make, and the report row with
              its candidates), committed in the same transaction as its trials

A run of the same model with the same options finds the records (the daemon's resumed
job, `aoe tune` run again) and nothing else does. The invariant that makes this needed:
a lossy choice reaches the bank's entries only once the model as a whole met its accuracy
budget (pipeline.py), so until then its record is all the bank holds of it. With
REPEAT_TUNE a run takes only the records of the job it resumes (`JobRun.resumes`).
A run whose outputs are written forgets its records; a failed or interrupted one leaves
them for the next run (`aoe bank prune` drops them).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from aoe.bankrecord import decode, encode
from aoe.errors import AoedError
from aoed import __version__
from aoed.bank.writer import BankWrite
from aoed.engine.context import JobContext

__all__ = [
    "forget",
    "key_for",
    "key_of",
    "records",
    "run_key",
    "takes",
    "write_from_doc",
    "write_to_doc",
]

log = logging.getLogger(__name__)


def key_for(depends: Mapping[str, Any]) -> bytes:
    """The key every record of a run starts with (hex digest + "/"), for a run whose
    decisions depend on `depends` (JSON) and aoed's version. Each job kind says what
    its decisions depend on: `run_key` for the ONNX pipeline, aoed.gdat for GDAT."""
    doc = {**depends, "version": __version__}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest().encode() + b"/"


def takes(doc: Mapping[str, Any], repeat_tune: bool, resumes: str) -> bool:
    """Whether a run may take the record `doc`: every one, or with REPEAT_TUNE only
    those of the job it resumes (`resumes`, a job id; none for a fresh run)."""
    return not repeat_tune or (bool(resumes) and doc.get("job") == resumes)


def run_key(ctx: JobContext, model_digest: str, samples_digest: str) -> bytes:
    """The key every record of this ONNX run starts with (`key_for`)."""
    p = ctx.policy
    return key_for(
        {
            "model": model_digest,
            "samples": samples_digest,
            "precision": ctx.spec.precision,
            "job_type": ctx.spec.job_type,
            "device": ctx.fingerprint.digest,
            "budget": [
                p.task_min_cosine,
                p.task_max_rel_error,
                p.e2e_min_cosine,
                p.e2e_max_rel_error,
            ],
        }
    )


def key_of(ctx: JobContext, bank_key: bytes) -> bytes:
    """The record key of the task whose bank key is `bank_key`, in this run."""
    return ctx.run_key + bank_key


async def records(ctx: JobContext, bank_keys: Iterable[bytes]) -> dict[bytes, Mapping[str, Any]]:
    """This run's records for `bank_keys` (bank key -> document) that it may take: every
    one, or with REPEAT_TUNE only those of the job it resumes."""
    wanted = set(bank_keys)
    found = await ctx.bank.decisions(ctx.run_key)
    out: dict[bytes, Mapping[str, Any]] = {}
    for key, doc in found:
        bank_key = key[len(ctx.run_key) :]
        if bank_key in wanted and takes(doc, ctx.spec.repeat_tune, ctx.run.resumes):
            out[bank_key] = doc
    return out


async def forget(ctx: JobContext) -> None:
    """Delete this run's records: its outputs are written, nothing is left to resume.
    Never raises: records left behind only make a later run of the same job (same
    model, options and samples) take what this one decided instead of measuring it."""
    try:
        await ctx.write_bank(BankWrite(forget=(ctx.run_key,)))
    except AoedError as exc:
        log.warning("job %s: its task decisions stay in the bank (%s)", ctx.job_id, exc)


def write_to_doc(w: BankWrite | None) -> dict[str, Any] | None:
    """A bank write still to make, as JSON (entries as their stored bytes, base64)."""
    if w is None:
        return None
    return {
        "entries": [base64.b64encode(encode(r)).decode() for r in w.entries],
        "defaults": [[k.decode(), doc] for k, doc in w.defaults],
    }


def write_from_doc(doc: Mapping[str, Any] | None) -> BankWrite | None:
    """The inverse of `write_to_doc`."""
    if doc is None:
        return None
    return BankWrite(
        entries=tuple(decode(base64.b64decode(e)) for e in doc.get("entries", ())),
        defaults=tuple((k.encode(), dict(d)) for k, d in doc.get("defaults", ())),
    )
