"""Records from outside, checked field by field against what the tuner itself writes.

A bank record that comes from elsewhere (`aoe bank import`, ImportEntries, a followed
peer, SyncBank) is someone else's data, and so is a record already in a bank when it is
read to be applied (`aoe compile`, a tuning run's bank hits) and the session options a
tuned model carries for `aoe.session`. Each field is checked against what the tuner can
write: session options and onnxruntime config entries from an allowlist with their
value types and ranges, provider options likewise, strategy names from the strategy
registry (`Vocabulary`), finite timings within bounds, bounded strings, and JSON of
bounded size and nesting. Anything else raises `RecordError` naming the field (as the
exchange format spells it) and the reason, and the record is refused whole.

Invariants:
- No data names a file. Session config entries come only from `SESSION_CONFIG`, provider
  options only from `PROVIDER_VALUES`: no option that names a path or makes onnxruntime
  or a provider read or write one (`FILE_OPTIONS`, and config keys such as
  `session.collect_node_memory_stats_to_file`, which no table lists) is ever accepted
  here. Options that name files (TensorRT's caches) are the caller's own, passed apart
  from the data (aoe.sessionopts.session_providers' `files`).
- JSON in a record (trial_json, canonical JSON, a confirmation, a session record's
  options) is parsed only after a linear scan has bounded its size and nesting depth
  (`loads`): no parse recurses deeper than MAX_DEPTH, whatever the input.
- Light: protobuf and the client's own tables only (no trio, no onnxruntime, no daemon).
  The daemon supplies the strategy names its registry holds (aoed.bank.vocabulary).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aoe.device import CPU, KINDS, Device
from aoe.keys import PRECISION_NAMES, SCHEMA_VERSION
from aoe.provider_options import BOOL, CHOICES, OPTIONS
from aoe.v1 import bank_pb2

__all__ = [
    "FILE_OPTIONS",
    "GDAT_FAMILY",
    "MAX_DEPTH",
    "MAX_US",
    "MIN_US",
    "PROVIDER_VALUES",
    "SESSION_CONFIG",
    "SESSION_FAMILY",
    "RecordError",
    "Vocabulary",
    "check_default",
    "check_default_doc",
    "check_entry",
    "check_record",
    "check_session_options",
    "check_trial",
    "loads",
]

#: The family of a model-level record, whose strategy is the JSON of its session options.
SESSION_FAMILY = "session"
#: The family of a GDAT record, whose strategy is a DDP configuration's label.
GDAT_FAMILY = "gdat"

#: JSON nesting deeper than this is refused before it is parsed (the deepest the tuner
#: writes is a session trial's options: about 5).
MAX_DEPTH = 32
#: Timings in microseconds, where one is required: a nanosecond up to 11.6 days. Zero,
#: negative, subnormal, infinite and NaN times are refused.
MIN_US, MAX_US = 1e-3, 1e12
#: Characters of names, hosts, versions, job ids, model names and other short text.
MAX_TEXT = 1024
#: Characters of a task strategy's name (with its parameter).
MAX_NAME = 256
#: Characters of one exchange line (a gRPC message's size): a longer one is no record.
MAX_LINE = 8 << 20
#: Sizes of the JSON a record carries, in characters.
MAX_OPTIONS_JSON = 64 << 10  # a model-level record's session options
MAX_SIGNATURE_JSON = 1 << 20
MAX_DEVICE_JSON = 64 << 10
MAX_CONFIRMED_JSON = 256 << 10
MAX_TRIAL_JSON = 1 << 20
#: Entries of a record's lists and maps.
MAX_ISA_FLAGS = 512
MAX_PARAMS = 64
MAX_REVERTED = 100_000
MAX_PROVIDERS = 8
#: Session threads: 0 (onnxruntime's choice) up to this many.
MAX_THREADS = 1024

#: graph optimization levels and execution modes, as options spell them (aoe.sessionopts
#: maps each to onnxruntime's enum)
LEVELS = ("disable", "basic", "extended", "all")
MODES = ("sequential", "parallel")
#: the session options the tuner sets
SESSION_KEYS = frozenset(
    (
        "intra_op_num_threads",
        "inter_op_num_threads",
        "execution_mode",
        "graph_optimization_level",
        "config",
        "providers",
    )
)

#: onnxruntime session config entries data may set, and the values each takes: those the
#: tuner sets (its measuring runner turns intra-op spinning off; a user's session may
#: set either back), and weight prepacking, a switch of speed alone that a model-level
#: record may carry. Every other key is refused, among them those that name a file
#: (`session.collect_node_memory_stats_to_file`, `session.save_model_format`,
#: `ep.context_file_path`, `session.optimized_model_external_initializers_file_name`).
SESSION_CONFIG: Mapping[str, tuple[str, ...]] = {
    "session.intra_op.allow_spinning": BOOL,
    "session.inter_op.allow_spinning": BOOL,
    "session.disable_prepacking": BOOL,
}

#: Provider options that name a file or a library, or make the provider read or write
#: files (engine and timing caches, calibration tables, dumps, plugins). Never taken
#: from data; a caller that wants them passes its own (`session_providers(files=)`).
FILE_OPTIONS: frozenset[tuple[str, str]] = frozenset(
    [
        *(
            ("tensorrt", k)
            for k in (
                "trt_engine_cache_enable",
                "trt_engine_cache_path",
                "trt_engine_cache_prefix",
                "trt_timing_cache_enable",
                "trt_timing_cache_path",
                "trt_force_timing_cache",
                "trt_int8_calibration_table_name",
                "trt_int8_use_native_calibration_table",
                "trt_dump_subgraphs",
                "trt_extra_plugin_lib_paths",
            )
        ),
        ("cann", "dump_graphs"),
        ("cann", "dump_om_model"),
    ]
)


@dataclass(frozen=True)
class _Int:
    lo: int
    hi: int


_BIG = 1 << 50  # bytes: a petabyte, far above any device's memory
#: (kind, provider option) -> what data may set it to: a tuple of choices, or an integer
#: range. The enumerated options onnxruntime documents (aoe.provider_options.CHOICES)
#: but FILE_OPTIONS, the booleans it documents without listing them there, and the
#: integer sizes and counts a device's options may carry. The tuner's own strategy
#: spaces write only enumerated ones. String-valued options (tactic sources, profile
#: shapes, op lists) and `device_id` (the session's) are not settable from data.
PROVIDER_VALUES: Mapping[tuple[str, str], tuple[str, ...] | _Int] = {
    **{k: v for k, v in CHOICES.items() if k not in FILE_OPTIONS},
    **{
        ("cuda", k): BOOL
        for k in (
            "cudnn_conv1d_pad_to_nc1d",
            "enable_skip_layer_norm_strict_mode",
            "use_ep_level_unified_stream",
            "fuse_conv_bias",
        )
    },
    **{
        ("tensorrt", k): BOOL
        for k in (
            "trt_dla_enable",
            "trt_force_sequential_engine_build",
            "trt_context_memory_sharing_enable",
            "trt_build_heuristics_enable",
            "trt_sparsity_enable",
            "trt_detailed_build_log",
        )
    },
    ("cuda", "gpu_mem_limit"): _Int(0, _BIG),
    ("cuda", "tunable_op_max_tuning_duration_ms"): _Int(0, 10**7),
    ("cuda", "sdpa_kernel"): _Int(0, 1 << 16),
    ("tensorrt", "trt_max_workspace_size"): _Int(0, _BIG),
    ("tensorrt", "trt_max_partition_iterations"): _Int(0, 10**6),
    ("tensorrt", "trt_min_subgraph_size"): _Int(0, 10**6),
    ("tensorrt", "trt_dla_core"): _Int(0, 64),
    ("tensorrt", "trt_auxiliary_streams"): _Int(-1, 64),
    ("cann", "npu_mem_limit"): _Int(0, _BIG),
}

#: accelerator provider name -> device kind (the names are aoe.device's)
_PROVIDER_KIND = {Device(kind).provider: kind for kind in KINDS if kind != "cpu"}
_CPU_PROVIDER = CPU.provider
_GDAT_PROVIDER = "torch.distributed"  # aoe.gradlayout.GDAT_PROVIDER
_PRECISIONS = PRECISION_NAMES

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"v(\d{1,9})/([0-9a-f]{32})/([0-9a-f]{32})/([a-z0-9]{1,16})")
#: a strategy name as the registry spells it, `name` or `name:param`
_STRATEGY = re.compile(r"([A-Za-z0-9_]{1,64})(?::([A-Za-z0-9._,=+-]{1,190}))?")
_FAMILY = re.compile(r"[A-Za-z0-9_]{1,64}")
_PARAM_KEY = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_ISA_FLAG = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: GDAT: a comm hook from a package (`<class>-<name>`, aoe.gdat), a process group's knob
_PLUGIN_HOOK = re.compile(r"(fp16|bf16|lowrank)-[A-Za-z0-9_.-]{1,64}")
_KNOB = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
_KNOB_VALUE = re.compile(r"[A-Za-z0-9_.-]{0,64}")
_GDAT_PARAMS = frozenset(
    (
        "bucket_cap_mb",
        "first_bucket_mb",
        "gradient_as_bucket_view",
        "static_graph",
        "hook",
        "powersgd_rank",
        "powersgd_start",
        "confirmed",
        "tail_before_ms",
        "tail_after_ms",
    )
)
_SESSION_PARAMS = frozenset(("reverted", "confirmed", "runtime"))
_DEFAULT_DOC = frozenset(("default_us", "job", "reverted", "confirmed", "runtime"))


class RecordError(ValueError):
    """A record is not one the tuner writes: `field` (as the exchange format spells it,
    e.g. `strategy.name`, `winner.median_us`) and `reason`."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True)
class Vocabulary:
    """What the tuner reading a record can itself write beyond this module's own tables:
    the strategy names of each task family (`strategies`: family -> names; a strategy
    that takes a parameter, as `name:param`, is listed in `with_param`), and GDAT's
    process-group knobs (`knobs`: variable -> values). The daemon builds one from its
    registry (aoed.bank.vocabulary); without one, task strategy names are checked for
    their shape only, and applying one asks the registry."""

    strategies: Mapping[str, frozenset[str]] = field(default_factory=dict)
    with_param: Mapping[str, frozenset[str]] = field(default_factory=dict)
    knobs: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def check_strategy(self, family: str, name: str) -> None:
        known = self.strategies.get(family)
        if known is None:
            raise RecordError(
                "strategy.family",
                f"{family!r} is no family this tuner has (it has: {', '.join(sorted(self.strategies))})",
            )
        base, sep, _param = name.partition(":")
        if (not sep and name not in known) or (sep and base not in self.with_param.get(family, ())):
            raise RecordError(
                "strategy.name", f"{_show(name)} is no strategy of family {family} in this tuner"
            )


# --------------------------------------------------------------------------- JSON


def _nesting(text: str, limit: int) -> int:
    """The deepest nesting of arrays and objects in the JSON `text` (strings skipped),
    or limit + 1 as soon as it passes `limit`. Linear in len(text)."""
    find = re.compile(r'["\[\]{}]').search
    depth = peak = 0
    i = 0
    while (m := find(text, i)) is not None:
        c, i = m.group(), m.end()
        if c == '"':
            j = i
            while True:
                k = text.find('"', j)
                if k < 0:
                    return peak  # unterminated: the parser says so
                b = k
                while b > i and text[b - 1] == "\\":
                    b -= 1
                if (k - b) % 2 == 0:
                    break
                j = k + 1
            i = k + 1
        elif c in "[{":
            depth += 1
            if depth > peak:
                peak = depth
                if peak > limit:
                    return peak
        else:
            depth -= 1
    return peak


def loads(text: str | bytes, what: str, max_chars: int, max_depth: int = MAX_DEPTH) -> Any:
    """`text` parsed as JSON once its size (at most `max_chars`) and nesting (at most
    `max_depth`) are known to be bounded; RecordError naming `what` otherwise, or when
    it is not JSON. NaN and Infinity parse (the tuner's trials hold infinite errors);
    callers check the numbers they use."""
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as exc:
            raise RecordError(what, f"not UTF-8 ({exc.reason})") from None
    if len(text) > max_chars:
        raise RecordError(what, f"{len(text)} characters of JSON, more than {max_chars}")
    if _nesting(text, max_depth) > max_depth:
        raise RecordError(what, f"JSON nested more than {max_depth} deep")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RecordError(what, f"not JSON ({exc})") from None


def _object(text: str | bytes, what: str, max_chars: int) -> dict[str, Any]:
    doc = loads(text, what, max_chars)
    if not isinstance(doc, dict):
        raise RecordError(what, "not a JSON object")
    return doc


# --------------------------------------------------------------------------- values


def _show(text: str) -> str:
    """`text` for a reason: repr'd, its middle cut when long."""
    return repr(text if len(text) <= 80 else f"{text[:40]}…({len(text)} characters)…{text[-20:]}")


def _text(value: str, what: str, limit: int = MAX_TEXT, required: bool = False) -> None:
    if len(value) > limit:
        raise RecordError(what, f"{len(value)} characters, more than {limit}")
    if "\x00" in value:
        raise RecordError(what, "holds a NUL character")
    if required and not value:
        raise RecordError(what, "empty")


def _time(value: float, what: str, zero: bool = False) -> None:
    """A time in microseconds within [MIN_US, MAX_US] (or 0 where `zero` allows none)."""
    if zero and value == 0:
        return
    if not (isinstance(value, (int, float)) and MIN_US <= value <= MAX_US):
        raise RecordError(
            what, f"{value!r} is not a time the tuner measures ({MIN_US:g} to {MAX_US:g} us)"
        )


def _finite(value: float, what: str, lo: float, hi: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
        raise RecordError(what, f"{value!r} is not a finite number from {lo:g} to {hi:g}")


def _key(key: str, what: str = "key") -> tuple[str, str, str]:
    """(signature part, device part, precision) of a bank key of this schema."""
    _text(key, what, 128)
    m = _KEY.fullmatch(key)
    if m is None:
        raise RecordError(
            what,
            f"{_show(key)} is not a bank key (v{SCHEMA_VERSION}/<32 hex>/<32 hex>/<precision>)",
        )
    if int(m.group(1)) != SCHEMA_VERSION:
        raise RecordError(what, f"schema version {m.group(1)}, this bank uses {SCHEMA_VERSION}")
    if m.group(4) not in _PRECISIONS.values():
        raise RecordError(what, f"unknown precision {m.group(4)!r}")
    return m.group(2), m.group(3), m.group(4)


# --------------------------------------------------------------------------- session options


def check_session_options(options: Any, where: str = "session options") -> dict[str, Any]:
    """A plain copy of `options` (a dict) when it holds only what the tuner sets: the
    keys of aoe.sessionopts, threads from 0 to MAX_THREADS, known modes and levels,
    config entries of SESSION_CONFIG, providers with options of PROVIDER_VALUES. Raises
    RecordError naming `where` and the option otherwise."""
    if not isinstance(options, dict):
        raise RecordError(where, "not a JSON object of session options")
    unknown = sorted(set(options) - SESSION_KEYS)
    if unknown:
        raise RecordError(
            f"{where}: {_show(str(unknown[0]))}",
            f"not a session option the tuner sets (it sets: {', '.join(sorted(SESSION_KEYS))})",
        )
    out = dict(options)
    for k in ("intra_op_num_threads", "inter_op_num_threads"):
        if k in out:
            n = out[k]
            if type(n) is not int or not 0 <= n <= MAX_THREADS:
                raise RecordError(f"{where}: {k}", f"{n!r} is not a count from 0 to {MAX_THREADS}")
    for k, allowed in (("execution_mode", MODES), ("graph_optimization_level", LEVELS)):
        if k in out and out[k] not in allowed:
            raise RecordError(f"{where}: {k}", f"{out[k]!r} is not one of {', '.join(allowed)}")
    if "config" in out:
        config = out["config"]
        if not isinstance(config, dict):
            raise RecordError(f"{where}: config", "not an object of config entries")
        for k, v in config.items():
            values = SESSION_CONFIG.get(k)
            if values is None:
                raise RecordError(
                    f"{where}: config {_show(str(k))}",
                    "not a config entry the tuner sets (it sets: "
                    f"{', '.join(sorted(SESSION_CONFIG))})",
                )
            if v not in values:
                raise RecordError(
                    f"{where}: config {k}", f"{v!r} is not one of {', '.join(values)}"
                )
        out["config"] = dict(config)
    if "providers" in out:
        out["providers"] = _providers(out["providers"], f"{where}: providers")
    return out


def _providers(value: Any, where: str) -> list[list[Any]]:
    if not isinstance(value, list) or len(value) > MAX_PROVIDERS:
        raise RecordError(
            where, f"not a list of at most {MAX_PROVIDERS} [provider, {{option: value}}] pairs"
        )
    out: list[list[Any]] = []
    for item in value:
        if not (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], dict)
        ):
            raise RecordError(where, "an item is not a [provider, {option: value}] pair")
        name, opts = item
        kind = _PROVIDER_KIND.get(name)
        if kind is None:
            raise RecordError(
                where,
                f"{_show(name)} is not an accelerator provider (one of {', '.join(_PROVIDER_KIND)}; "
                "the CPU's is always last and named by none)",
            )
        if any(name == seen for seen, _ in out):
            raise RecordError(where, f"{name} is listed twice")
        for opt, v in opts.items():
            _provider_value(kind, opt, v, f"{where}: {name}")
        out.append([name, dict(opts)])
    return out


def _provider_value(kind: str, option: Any, value: Any, where: str) -> None:
    allowed = PROVIDER_VALUES.get((kind, option))
    if allowed is None:
        why = (
            "names or writes files, which a record never sets"
            if (kind, option) in FILE_OPTIONS
            else "not an option the tuner sets"
            if option in OPTIONS.get(kind, ())
            else "not an option of this provider"
        )
        raise RecordError(f"{where}: {_show(str(option))}", why)
    if not isinstance(value, str):
        raise RecordError(f"{where}: {option}", f"{value!r} is not a string")
    if isinstance(allowed, _Int):
        if not (re.fullmatch(r"-?\d{1,20}", value) and allowed.lo <= int(value) <= allowed.hi):
            raise RecordError(
                f"{where}: {option}",
                f"{_show(value)} is not an integer from {allowed.lo} to {allowed.hi}",
            )
    elif value not in allowed:
        raise RecordError(
            f"{where}: {option}", f"{_show(value)} is not one of {', '.join(allowed)}"
        )


# --------------------------------------------------------------------------- records


def check_entry(e: bank_pb2.BankEntry, vocabulary: Vocabulary | None = None) -> None:
    """Raise RecordError unless every field of `e` is one the tuner writes (see the
    module doc); `vocabulary` holds the strategy names and knobs of the tuner that reads
    it. The key's agreement with the digests is the bank codec's check."""
    if e.schema_version != SCHEMA_VERSION:
        raise RecordError("schema_version", f"{e.schema_version}, this bank uses {SCHEMA_VERSION}")
    _key(e.key)
    s = e.signature
    _text(s.op_type, "signature.op_type", required=True)
    _text(s.domain, "signature.domain")
    if not 0 <= s.opset <= 10_000:
        raise RecordError("signature.opset", f"{s.opset} is not an opset version")
    _object(s.canonical_json, "signature.canonical_json", MAX_SIGNATURE_JSON)
    if not _HEX64.fullmatch(s.digest):
        raise RecordError("signature.digest", "not 64 lowercase hex digits")
    _device(e.device)
    _strategy(e, vocabulary)
    for name, stats, required in (("winner", e.winner, True), ("baseline", e.baseline, False)):
        _time(stats.median_us, f"{name}.median_us", zero=not required)
        _time(stats.min_us, f"{name}.min_us", zero=True)
        _finite(stats.spread, f"{name}.spread", 0.0, 1e6)
        if stats.repeats > 10**9:
            raise RecordError(f"{name}.repeats", f"{stats.repeats}, more than 10^9")
    a = e.accuracy
    _finite(a.max_abs_error, "accuracy.max_abs_error", 0.0, 1e300)
    _finite(a.max_rel_error, "accuracy.max_rel_error", 0.0, 1e300)
    _finite(a.cosine, "accuracy.cosine", -1.001, 1.001)
    p = e.provenance
    for name in ("host", "aoed_version", "onnxruntime_version", "job_id", "model"):
        _text(getattr(p, name), f"provenance.{name}")
    if not (0 <= p.created.seconds < 1 << 40 and 0 <= p.created.nanos < 10**9):
        raise RecordError("provenance.created", "not a time stamp")


def check_record(record: Any, vocabulary: Vocabulary | None = None) -> None:
    """`check_entry` for an aoe.bankrecord.BankRecord, as a bank stores it."""
    from aoe.bankrecord import encode

    check_entry(bank_pb2.BankEntry.FromString(encode(record)), vocabulary)


def _device(d: bank_pb2.DeviceFingerprint) -> None:
    if d.execution_provider not in (_CPU_PROVIDER, _GDAT_PROVIDER, *_PROVIDER_KIND):
        raise RecordError(
            "device.execution_provider",
            f"{_show(d.execution_provider)} is no provider the tuner measures on",
        )
    _text(d.hardware, "device.hardware")
    _text(d.runtime_version, "device.runtime_version", 128)
    if len(d.isa_flags) > MAX_ISA_FLAGS:
        raise RecordError(
            "device.isa_flags", f"{len(d.isa_flags)} flags, more than {MAX_ISA_FLAGS}"
        )
    for flag in d.isa_flags:
        if not _ISA_FLAG.fullmatch(flag):
            raise RecordError("device.isa_flags", f"{_show(flag)} is not an ISA flag")
    doc = _object(d.canonical_json, "device.canonical_json", MAX_DEVICE_JSON)
    for part in ("options", "accelerator"):
        sub = doc.get(part, {})
        if not (
            isinstance(sub, dict)
            and len(sub) <= MAX_PARAMS
            and all(isinstance(k, str) and isinstance(v, str) for k, v in sub.items())
        ):
            raise RecordError(f"device.canonical_json: {part}", "not an object of strings")
    if not _HEX64.fullmatch(d.digest):
        raise RecordError("device.digest", "not 64 lowercase hex digits")


def _strategy(e: bank_pb2.BankEntry, vocabulary: Vocabulary | None) -> None:
    st = e.strategy
    if st.precision not in _PRECISIONS:
        raise RecordError("strategy.precision", f"{st.precision} is no precision policy")
    if not _FAMILY.fullmatch(st.family):
        raise RecordError("strategy.family", f"{_show(st.family)} is not a family name")
    if len(st.params) > MAX_PARAMS:
        raise RecordError("strategy.params", f"{len(st.params)} parameters, more than {MAX_PARAMS}")
    for k in st.params:
        if not _PARAM_KEY.fullmatch(k):
            raise RecordError("strategy.params", f"{_show(k)} is not a parameter name")
    if st.family == SESSION_FAMILY:
        _text(st.name, "strategy.name", MAX_OPTIONS_JSON)
        check_session_options(loads(st.name, "strategy.name", MAX_OPTIONS_JSON), "strategy.name")
        _model_params(st.params)
    elif st.family == GDAT_FAMILY:
        _gdat(st.name, st.params, vocabulary)
    else:
        _text(st.name, "strategy.name", MAX_NAME, required=True)
        if not _STRATEGY.fullmatch(st.name):
            raise RecordError("strategy.name", f"{_show(st.name)} is not a strategy name")
        if vocabulary is not None:
            vocabulary.check_strategy(st.family, st.name)
        for k, v in st.params.items():
            _text(v, f"strategy.params.{k}")


def _model_params(params: Mapping[str, str]) -> None:
    unknown = sorted(set(params) - _SESSION_PARAMS)
    if unknown:
        raise RecordError(
            f"strategy.params.{unknown[0]}", "not a parameter of a model-level record"
        )
    if params.get("reverted"):
        _reverted(params["reverted"].split(","), "strategy.params.reverted")
    if params.get("confirmed"):
        _object(params["confirmed"], "strategy.params.confirmed", MAX_CONFIRMED_JSON)
    if params.get("runtime"):
        _runtime(params["runtime"], "strategy.params.runtime")


def _runtime(raw: Any, what: str) -> None:
    """The runtime that shipped (aoe.ovartifact.RuntimeDecision), checked as on read."""
    from aoe.errors import ModelError
    from aoe.ovartifact import RuntimeDecision

    try:
        RuntimeDecision.checked(_object(raw, what, MAX_CONFIRMED_JSON), what)
    except ModelError as exc:
        raise RecordError(what, str(exc).removeprefix(f"{what}: ")) from None


def _reverted(digests: Iterable[Any], what: str) -> None:
    n = 0
    for d in digests:
        n += 1
        if n > MAX_REVERTED:
            raise RecordError(what, f"more than {MAX_REVERTED} tasks")
        if not (isinstance(d, str) and _HEX64.fullmatch(d)):
            raise RecordError(what, "a reverted task is not a 64-digit signature digest")


def _gdat(name: str, params: Mapping[str, str], vocabulary: Vocabulary | None) -> None:
    from aoe.errors import OptionError
    from aoe.gdat import BUILTIN_HOOKS, DDPConfig

    for k, v in params.items():
        what = f"strategy.params.{k}"
        if k.startswith("world."):
            knob = k.removeprefix("world.")
            known = vocabulary.knobs.get(knob) if vocabulary is not None else None
            if vocabulary is not None and (known is None or v not in known):
                raise RecordError(what, f"{_show(v)}: not a process-group knob the tuner sets")
            if not (_KNOB.fullmatch(knob) and _KNOB_VALUE.fullmatch(v)):
                raise RecordError(what, "not a process-group knob")
        elif k not in _GDAT_PARAMS:
            raise RecordError(what, "not a parameter of a DDP configuration")
        elif k == "confirmed":
            if v:
                _object(v, what, MAX_CONFIRMED_JSON)
        else:
            _text(v, what, 128)
    for k in ("bucket_cap_mb", "first_bucket_mb", "tail_before_ms", "tail_after_ms"):
        v = params.get(k, "")
        if v:
            try:
                x = float(v)
            except ValueError:
                raise RecordError(f"strategy.params.{k}", f"{_show(v)} is not a number") from None
            _finite(x, f"strategy.params.{k}", 0.0, 1e9)
    hook = params.get("hook", "")
    if hook and hook not in BUILTIN_HOOKS and not _PLUGIN_HOOK.fullmatch(hook):
        raise RecordError("strategy.params.hook", f"{_show(hook)} is not a comm hook")
    for k, hi in (("powersgd_rank", 1 << 16), ("powersgd_start", 10**9)):
        v = params.get(k, "")
        if v and not (v.isdigit() and int(v) <= hi):
            raise RecordError(f"strategy.params.{k}", f"{_show(v)} is not a count up to {hi}")
    try:
        label = DDPConfig.from_params(params).label
    except OptionError as exc:
        raise RecordError("strategy.params", str(exc)) from None
    if name != label:
        raise RecordError(
            "strategy.name", f"{_show(name)} is not the label of its parameters ({label})"
        )


def check_default(rec: bank_pb2.DefaultRecord) -> None:
    """Raise RecordError unless `rec`, a "default stays best" record, is one the tuner
    writes: a key, the default's time, reverted task digests and a confirmation."""
    _key(rec.key)
    _time(rec.default_us, "default_us")
    _reverted(rec.reverted, "reverted")
    _text(rec.job_id, "job_id")
    if rec.confirmed:
        _object(rec.confirmed, "confirmed", MAX_CONFIRMED_JSON)


def check_default_doc(doc: Any) -> None:
    """`check_default` for the document a bank stores for a default record
    (aoe.exchange.default_doc): only its fields, each of its type."""
    if not isinstance(doc, dict):
        raise RecordError("default record", "not a JSON object")
    unknown = sorted(set(doc) - _DEFAULT_DOC)
    if unknown:
        raise RecordError(f"default record: {_show(str(unknown[0]))}", "not a field of one")
    if not isinstance(doc.get("default_us"), (int, float)) or isinstance(doc["default_us"], bool):
        raise RecordError("default_us", "not a number")
    _time(doc["default_us"], "default_us", zero=True)  # stored untimed: the slowest to merge
    reverted = doc.get("reverted", [])
    if not isinstance(reverted, list):
        raise RecordError("reverted", "not a list")
    _reverted(reverted, "reverted")
    for k in ("job", "confirmed", "runtime"):
        if not isinstance(doc.get(k, ""), str):
            raise RecordError(k, "not a string")
    _text(doc.get("job", ""), "job_id")
    if doc.get("confirmed"):
        _object(doc["confirmed"], "confirmed", MAX_CONFIRMED_JSON)
    if doc.get("runtime"):
        _runtime(doc["runtime"], "runtime")


def check_trial(rec: bank_pb2.TrialRecord) -> dict[str, Any]:
    """The trial of `rec` (a JSON object) when `rec` is one the tuner writes: a key, a
    time stamp, and a bounded object whose timings (`*_us`, and lists of them) are
    finite and 0 or within [MIN_US, MAX_US]. Raises RecordError otherwise."""
    _key(rec.key)
    if not 0 < rec.time_ns < 1 << 63:
        raise RecordError("time_ns", "no time stamp")
    doc = _object(rec.trial_json, "trial_json", MAX_TRIAL_JSON)
    stack: list[tuple[str, Any]] = [("trial_json", doc)]
    while stack:  # the depth is bounded already; a stack keeps it flat anyway
        where, value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if k.endswith("_us"):
                    times = [v]
                    while times:
                        t = times.pop()
                        if isinstance(t, list):
                            times.extend(t)
                        elif t is not None and not isinstance(t, (bool, dict)):
                            _time(t, f"{where}.{k}", zero=True)
                stack.append((f"{where}.{k}", v))
        elif isinstance(value, list):
            stack.extend((where, v) for v in value)
    return doc
