"""Size limits of what a submission carries, checked once, when it is submitted.

Every free-text field of a job is stored with it and sent back in each answer about it
(GetJob, each page of ListJobs, the watch stream) for as long as the job is kept
(`retention_days`); `aoe.spec.JobSpec` checks its fields against these limits where a
spec is built. Unbounded, a few submissions with megabytes of labels made every
ListJobs answer larger than a gRPC message may be, for every client, until they expired.
Bounded, a job's options stay a few tens of KiB at most, and ListJobs pages by bytes
(the daemon's `api.tuning.LIST_PAGE_BYTES`). Sizes are counted in UTF-8 bytes, as stored and sent.
A field over its limit is an OptionError (INVALID_ARGUMENT) naming the field and the
limit.
"""

from __future__ import annotations

from aoe.errors import OptionError

__all__ = [
    "MAX_DIM",
    "MAX_DIMS",
    "MAX_INPUT_SHAPES",
    "MAX_LABEL_KEY_BYTES",
    "MAX_LABEL_VALUE_BYTES",
    "MAX_LABELS",
    "MAX_NAME_BYTES",
    "MAX_PATH_BYTES",
    "check_text",
]

#: labels per job, and the bytes of each key and each value
MAX_LABELS = 64
MAX_LABEL_KEY_BYTES = 128
MAX_LABEL_VALUE_BYTES = 1024
#: a path the client names (model_path, output_dir, calibration_dir): Linux's PATH_MAX
MAX_PATH_BYTES = 4096
#: an input's name in input_shapes, the device's name, an upload's id
MAX_NAME_BYTES = 1024
#: inputs given a shape, and the dimensions of one shape
MAX_INPUT_SHAPES = 1024
MAX_DIMS = 64
#: one dimension's extent: ONNX and the API hold dimensions as int64 (how many elements an
#: input may have is the daemon's [engine] max_tensor_mb, checked at submit)
MAX_DIM = (1 << 63) - 1


def _cut(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def check_text(field: str, value: str, limit: int) -> None:
    """OptionError naming `field` when `value` is longer than `limit` UTF-8 bytes."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise OptionError(f"{field}: {size} bytes, over the limit of {limit} bytes")
