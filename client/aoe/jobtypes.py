"""Job types: what one tuning job tunes, and how it may be spelled.

AOE numbers its job types (`--job_type 1` SGAT, `2` OPAT); aoed adds a third that runs
both in one job. Light on purpose: the gRPC client and the CLI parse job types without
importing onnx.
"""

from __future__ import annotations

from aoe.errors import OptionError

__all__ = ["JOB_TYPES", "parse_job_type", "result_slug"]

#: What a job tunes: operator tasks (AOE's OPAT, --job_type 2), subgraph tasks (SGAT,
#: --job_type 1), or subgraphs first and operators over what they left, in one job.
JOB_TYPES = ("opat", "sgat", "sgat+opat")
_JOB_TYPE_SPELLINGS = {"2": "opat", "1": "sgat", "opat+sgat": "sgat+opat", "1+2": "sgat+opat", "2+1": "sgat+opat"}


def parse_job_type(raw: object, where: str = "--job-type") -> str:
    """A job type from any of its spellings (opat or 2, sgat or 1, sgat+opat or 1+2)."""
    text = str(raw).strip().lower().replace(",", "+").replace(" ", "")
    job_type = _JOB_TYPE_SPELLINGS.get(text, text)
    if job_type == "gdat":
        raise OptionError(f"{where} {raw}: expected opat (2), sgat (1) or sgat+opat here; GDAT jobs (data-parallel "
                          "training) run embedded for now: aoe tune MODEL.pt2 --job-type gdat")  # fmt: skip
    if job_type not in JOB_TYPES:
        raise OptionError(f"{where} {raw}: expected opat (2), sgat (1) or sgat+opat (both in one job)")
    return job_type


def result_slug(job_type: str) -> str:
    """The job type as result files spell it: aoe_result_{slug}_{ts}_{pid}.json."""
    return job_type.replace("+", "_")
