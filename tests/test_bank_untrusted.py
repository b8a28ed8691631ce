"""Bank records from others are untrusted input: each field is checked against what the
tuner itself writes (aoe.recordcheck), at every door (`aoe bank import`, ImportEntries,
a followed peer, SyncBank, `aoe compile`, a tuning run's bank hits, a tuned model's
metadata for `aoe.session`), and no record makes the runtime touch a path.

The hostile records here ask onnxruntime to write its per-node memory statistics to a
file (`session.collect_node_memory_stats_to_file`): onnxruntime writes that CSV at any
path, through links, as soon as a session with it runs. A sentinel file, and a link to
another, stand for a file of the daemon's (its job store)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aoe
from aoe.bank import open_bank
from aoe.bankrecord import BankRecord, Measured, encode
from aoe.exchange import default_record, record_to_json
from aoe.fingerprint import device_fingerprint
from aoe.gdat import BUILTIN_HOOKS, DDPConfig
from aoe.keys import bank_key, canonical_json
from aoe.provider_options import OPTIONS
from aoe.recordcheck import (
    FILE_OPTIONS,
    MAX_DEPTH,
    PROVIDER_VALUES,
    SESSION_CONFIG,
    RecordError,
    check_session_options,
    loads,
)
from aoe.sessionopts import METADATA_KEY, make_session_options, session_providers, trt_files
from aoe.v1 import bank_pb2, tuning_pb2
from aoed.bank.daemonbank import check_import
from aoed.bank.exchange import check_change
from aoed.bank.store import ENTRY, TRIAL, BankStore, Change, Record, encode_doc, history_key
from aoed.vocabulary import tuner_vocabulary

from .bank_util import make_bank, make_entry, rec
from .conftest import run_aoe

FILE_KEY = "session.collect_node_memory_stats_to_file"
SENTINEL = b"the daemon's job store\n"


def _sig(n: int):
    """A task signature of its own for `n` (with a true digest)."""
    return make_entry(n, 1.0, "x").signature


def _session(n: int, options: dict, **kw) -> BankRecord:
    """A model-level record (session options) for model `n`, as the tuner shapes one."""
    return rec(sig=_sig(n), strategy=canonical_json(options), family="session", params={}, **kw)


def _gdat(n: int, params: dict[str, str]) -> BankRecord:
    config = DDPConfig.from_params(params)
    return rec(sig=_sig(n), strategy=config.label, family="gdat", params=params)


def _line(record: BankRecord) -> str:
    return record_to_json(
        bank_pb2.ExportEntriesResponse(entry=bank_pb2.BankEntry.FromString(encode(record)))
    )


def _trial_line(key: bytes, text: str, time_ns: int = 7) -> str:
    t = bank_pb2.TrialRecord(key=key.decode(), time_ns=time_ns, trial_json=text)
    return record_to_json(bank_pb2.ExportEntriesResponse(trial=t))


@pytest.fixture
def targets(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(a sentinel file, another file, a link to that other file): what hostile records
    point onnxruntime at. None of them may change."""
    sentinel, other, link = tmp_path / "jobs.sqlite3", tmp_path / "other.db", tmp_path / "link"
    sentinel.write_bytes(SENTINEL)
    other.write_bytes(SENTINEL)
    link.symlink_to(other)
    return sentinel, other, link


def _untouched(sentinel: Path, other: Path, link: Path) -> None:
    assert sentinel.read_bytes() == SENTINEL and other.read_bytes() == SENTINEL
    assert link.is_symlink() and link.resolve() == other.resolve()


# --------------------------------------------------------------------------- each field


def _hostile_lines(sentinel: Path, link: Path) -> dict[str, tuple[str, str]]:
    """name -> (an exchange line that must be refused, the field its reason names)."""
    key = make_entry(40, 1.0, "x").key
    return {
        "memory stats file": (
            _line(_session(20, {"config": {FILE_KEY: str(sentinel)}})),
            f"strategy.name: config '{FILE_KEY}'",
        ),
        "memory stats file through a link": (
            _line(_session(21, {"config": {FILE_KEY: str(link)}})),
            f"strategy.name: config '{FILE_KEY}'",
        ),
        "unknown session option": (
            _line(_session(22, {"optimized_model_filepath": str(sentinel)})),
            "strategy.name: 'optimized_model_filepath'",
        ),
        "wrong-typed value": (
            _line(_session(23, {"intra_op_num_threads": "4"})),
            "strategy.name: intra_op_num_threads",
        ),
        "provider option naming a file": (
            _line(
                _session(
                    24,
                    {"providers": [["TensorrtExecutionProvider", {"trt_engine_cache_path": "/"}]]},
                )
            ),
            "strategy.name: providers: TensorrtExecutionProvider: 'trt_engine_cache_path'",
        ),
        "infinite timing": (_line(make_entry(25, math.inf, "x")), "winner.median_us"),
        "NaN timing": (_line(make_entry(26, math.nan, "x")), "winner.median_us"),
        "subnormal timing": (_line(make_entry(27, 1e-320, "x")), "winner.median_us"),
        "negative timing": (_line(make_entry(28, -5.0, "x")), "winner.median_us"),
        "7 MB strategy": (
            _line(dataclasses.replace(make_entry(29, 1.0, "x"), strategy="a" * (7 << 20))),
            "strategy.name: 7340032 characters",
        ),
        "unknown strategy": (
            _line(dataclasses.replace(make_entry(30, 1.0, "x"), strategy="no_such_strategy")),
            "strategy.name: 'no_such_strategy' is no strategy of family matmul",
        ),
        "unknown process-group knob": (
            _line(_gdat(31, {"hook": "", "world.NCCL_DEBUG_FILE": "nccl.log"})),
            "strategy.params.world.NCCL_DEBUG_FILE",
        ),
        "trial nested 100k deep": (
            _trial_line(key, '{"a":' * 100_000 + "1" + "}" * 100_000),
            f"nested more than {MAX_DEPTH} deep",
        ),
        "infinite trial timing": (_trial_line(key, '{"median_us": Infinity}'), "median_us"),
        "line nested 100k deep": ("[" * 100_000 + "]" * 100_000, "not a bank record"),
    }


def test_each_field_the_tuner_never_writes_refuses_its_record_and_the_rest_imports(
    tmp_path: Path, targets: tuple[Path, Path, Path]
) -> None:
    sentinel, other, link = targets
    hostile = _hostile_lines(sentinel, link)
    good = [make_entry(n, 5.0 + n, "alpha") for n in range(3)]
    dump = tmp_path / "bank.jsonl"
    lines = [_line(good[0]), *(line for line, _ in hostile.values()), *map(_line, good[1:])]
    dump.write_text("\n".join(lines) + "\n")
    bank = make_bank(tmp_path / "bank")

    r = run_aoe("bank", "import", str(dump), "--bank", str(bank))
    assert r.returncode == 0, r.stderr
    assert f"3 added, 0 updated, 0 kept, {len(hostile)} refused" in r.stdout, r.stdout
    refused = [line for line in r.stdout.splitlines() if line.startswith("  refused ")]
    assert len(refused) == len(hostile)
    for (name, (_, field)), said in zip(hostile.items(), refused, strict=True):
        assert field in said, f"{name}: {said[:300]}"
    assert max(map(len, refused)) < 2000, "a 7 MB value is cut in the reason"
    with open_bank(bank, use_env=False) as reader:
        stored = {e.key for _, e in reader.entries()}
        [stats] = reader.stats()
    assert stored == {g.key.decode() for g in good} and stats.history == 0
    _untouched(sentinel, other, link)
    # Over a socket, the client reads the whole file first: a line that is no record at
    # all (nested past any bound) stops it, naming the line, before anything is sent.
    deep = tmp_path / "deep.jsonl"
    deep.write_text(_line(good[0]) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    r = run_aoe("bank", "import", str(deep), "--socket", str(tmp_path / "no.sock"))
    assert r.returncode == 2 and f"{deep}:2: not a bank record" in r.stderr, r.stderr
    assert "nested more than" in r.stderr and "Traceback" not in r.stderr


def test_a_peer_s_record_is_checked_as_an_import(tmp_path: Path) -> None:
    vocabulary = tuner_vocabulary()
    bad = _session(1, {"config": {FILE_KEY: str(tmp_path / "x")}})
    got, why = check_change(Change(1, ENTRY, bad.key, encode(bad), 0), vocabulary)
    assert got is None and f"config '{FILE_KEY}'" in why
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    got, why = check_change(Change(2, TRIAL, history_key(bad.key, 5), deep, 0), vocabulary)
    assert got is None and "nested more than" in why
    got, why = check_change(Change(3, "default", bad.key, deep, 0))
    assert got is None and "nested more than" in why
    ok = _session(2, {"intra_op_num_threads": 2})
    got, why = check_change(Change(4, ENTRY, ok.key, encode(ok), 0), vocabulary)
    assert got is not None and not why


def test_json_is_refused_past_its_depth_and_size_before_it_is_parsed() -> None:
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(deepest, "x", 1000) == json.loads(deepest)
    with pytest.raises(RecordError, match="nested more than"):
        loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "x", 1000)
    # Brackets inside strings, escaped quotes included, are not nesting.
    text = json.dumps({"s": '"[[[[' * 40 + "\\" * 3})
    assert loads(text, "x", 10_000)["s"].startswith('"[[[[')
    with pytest.raises(RecordError, match="more than 10"):
        loads("[1, 2, 3, 4, 5]", "x", 10)


# --------------------------------------------------------------------------- the runtime edge


def test_session_options_from_data_never_name_a_file(tmp_path: Path, targets) -> None:
    sentinel, other, link = targets
    for options in (
        {"config": {FILE_KEY: str(sentinel)}},
        {"config": {"session.save_model_format": "ORT"}},
        {"config": {"session.intra_op.allow_spinning": "2"}},
        {"providers": [["TensorrtExecutionProvider", {"trt_timing_cache_path": str(link)}]]},
        {"providers": [["TensorrtExecutionProvider", {"trt_extra_plugin_lib_paths": "/x.so"}]]},
        {"providers": [["CANNExecutionProvider", {"dump_om_model": "1"}]]},
    ):
        with pytest.raises(ValueError):
            make_session_options(options)
        if "providers" in options:
            with pytest.raises(ValueError, match="names or writes files"):
                session_providers(options)
    # The tuner's own spinning switch and thread counts pass.
    so = make_session_options(
        {"intra_op_num_threads": 2, "config": {"session.intra_op.allow_spinning": "0"}}
    )
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    # File options come only from the caller's own `files`, and only options naming files.
    trt = {"providers": [["TensorrtExecutionProvider", {"trt_fp16_enable": "1"}]]}
    (name, opts), _cpu = session_providers(trt, 0, trt_files(tmp_path / "cache"))
    assert (
        opts["trt_engine_cache_path"] == str(tmp_path / "cache") and opts["trt_fp16_enable"] == "1"
    )
    with pytest.raises(ValueError, match="name no file"):
        session_providers(trt, 0, {"TensorrtExecutionProvider": {"trt_fp16_enable": "0"}})
    _untouched(sentinel, other, link)


def test_every_provider_option_is_settable_from_data_or_named_as_a_file() -> None:
    """The allowlist covers what onnxruntime documents: each option is typed for data,
    or is a file option, or (device_id, strings of shapes and ops) is no record's."""
    strings = {
        ("tensorrt", "trt_tactic_sources"),
        ("tensorrt", "trt_profile_min_shapes"),
        ("tensorrt", "trt_profile_max_shapes"),
        ("tensorrt", "trt_profile_opt_shapes"),
        ("cann", "optypelist_for_implmode"),
    }
    for kind, names in OPTIONS.items():
        for name in names - {"device_id"}:
            key = (kind, name)
            assert (key in PROVIDER_VALUES) != (key in FILE_OPTIONS or key in strings), key
    assert not set(SESSION_CONFIG) & {FILE_KEY, "session.save_model_format"}


def test_aoe_session_refuses_a_model_whose_metadata_names_a_file(
    models: Path, tmp_path: Path, targets
) -> None:
    sentinel, other, link = targets
    for target in (sentinel, link):
        model = onnx.load(str(models / "mlp.onnx"))
        meta = model.metadata_props.add()
        meta.key, meta.value = METADATA_KEY, json.dumps({"config": {FILE_KEY: str(target)}})
        path = tmp_path / "tuned.onnx"
        onnx.save(model, path)
        with pytest.raises(ValueError, match=FILE_KEY):
            aoe.session(path)
        with pytest.raises(ValueError, match=FILE_KEY):
            aoe.session_options_of(path)
    _untouched(sentinel, other, link)


# --------------------------------------------------------------------------- our own records


def _measurement(draw, ok: bool = True):
    from aoed.engine.messages import Measurement

    if not ok:
        return Measurement(False, error="failed", max_abs_error=math.inf, max_rel_error=math.inf)
    median = draw(st.floats(0.05, 1e9))
    return Measurement(
        True,
        median_us=median,
        spread=draw(st.floats(0.0, 5.0)),
        repeats=draw(st.integers(1, 100_000)),
        min_us=median * draw(st.floats(0.5, 1.0)),
        q25_us=median * 0.9,
        q75_us=median * 1.1,
        max_abs_error=draw(st.floats(0.0, 10.0)),
        max_rel_error=draw(st.floats(0.0, 1.0)),
        cosine=draw(st.floats(-1.0, 1.0)),
        rounds_us=(median, None),
    )


@functools.cache
def _registry():
    from aoed.backends.ort.catalog import build_registry

    return build_registry()


@functools.cache
def _vocabulary():
    return tuner_vocabulary(_registry())


@st.composite
def _our_records(draw) -> list[str]:
    """Exchange lines of records built as the tuner builds them: a task's entry, a
    model-level record, a GDAT record, default records and trials."""
    from aoe.device import Device
    from aoed.backends.ort import accel
    from aoed.engine import bankrules
    from aoed.engine.session import base_options, dimensions, merge_options
    from aoed.gdat import space

    registry = _registry()
    # A record's precision is the job's policy; its strategy, one the policy allows.
    strategies = [
        (s.name, s.family, p)
        for f in registry.families()
        for p in ("exact", "int8", "int4", "fp16", "bf16")
        for kind in ("cpu", "cuda", "tensorrt")
        for s in registry.strategies_for(f, p, kind)
    ]
    name, family, precision = draw(st.sampled_from(strategies))
    if name == "int8_region":
        name += draw(st.sampled_from(["", ":f1", ":f0.3.7"]))
    sig, device = _sig(draw(st.integers(0, 10**6))), device_fingerprint()
    key = bank_key(sig.digest, device.digest, precision)
    win, base = _measurement(draw), _measurement(draw)
    out = [
        bankrules.make_record(
            key, sig, device, name, family, precision, win, base, "job-1", "m.onnx"
        )
    ]
    # Session options: the CPU's dimensions, each accelerator's, as the search merges them.
    dev = Device.parse(draw(st.sampled_from(["cpu", "cuda:0", "tensorrt:1", "cann:0"])))
    dims = (
        dimensions(4) if dev.is_cpu else accel.dimensions(dev, precision, frozenset({"Conv"}), True)
    )
    options = base_options(dev)
    for _, values in dims:
        if values and draw(st.booleans()):
            options = merge_options(options, draw(st.sampled_from(values)))
    if draw(st.booleans()):
        options = {**options, "intra_op_num_threads": draw(st.integers(0, 256))}
    confirmed = json.dumps(
        {"choices": "c" * 64, "job": "job-1", "options_kept": True, "rounds": [1.5, 2.0]}
    )
    reverted = ",".join(_sig(n).digest for n in range(draw(st.integers(0, 3))))
    params = {"confirmed": confirmed, **({"reverted": reverted} if reverted else {})}
    out.append(
        bankrules.make_record(
            key,
            sig,
            device,
            canonical_json(options),
            "session",
            precision,
            win,
            base,
            "job-1",
            "m",
            params,
        )
    )
    # GDAT: a configuration of its search space, stored as the GDAT job stores it.
    world = draw(st.sampled_from([(), *(w for ws in space.BACKEND_KNOBS.values() for w in ws)]))
    hook = draw(st.sampled_from(["", *BUILTIN_HOOKS, "lowrank-mine"]))
    config = DDPConfig(
        bucket_cap_mb=draw(st.sampled_from([None, *space.LADDER_MB, 3.5355])),
        first_bucket_mb=draw(st.sampled_from([None, *space.FIRST_MB])),
        gradient_as_bucket_view=draw(st.booleans()),
        static_graph=draw(st.booleans()),
        hook=hook,
        powersgd_rank=draw(st.sampled_from(space.POWERSGD_RANKS)),
        world=tuple(world),
    )
    gdat_params = {
        **config.to_params(),
        "confirmed": confirmed,
        "tail_before_ms": f"{draw(st.floats(0, 1e4)):.4f}",
        "tail_after_ms": f"{draw(st.floats(0, 1e4)):.4f}",
    }
    out.append(
        bankrules.make_record(
            bank_key(sig.digest, device.digest, "lowrank"),
            sig,
            device,
            config.label,
            "gdat",
            "lowrank",
            win,
            base,
            "j",
            "m",
            gdat_params,
        )
    )
    lines = [_line(r) for r in out]
    doc = {
        "default_us": win.median_us,
        "job": "job-1",
        "reverted": reverted.split(",") if reverted else [],
        "confirmed": confirmed,
    }
    lines.append(
        record_to_json(bank_pb2.ExportEntriesResponse(default_record=default_record(key, doc)))
    )
    failed = _measurement(draw, ok=draw(st.booleans()))
    for trial in (
        {"task": "t0", "strategy": name, "job": "job-1", **failed.summary()},
        {
            "task": "session",
            "dimension": "execution_mode",
            "options": options,
            "job": "j",
            **win.summary(),
        },
        {
            "stage": "ladder",
            "strategy": config.label,
            "params": config.to_params(),
            "rounds_us": [1.0, None],
            "tails_us": [2.0],
            **base.summary(),
        },
    ):
        lines.append(
            _trial_line(key, encode_doc(trial).decode(), time_ns=draw(st.integers(1, 2**62)))
        )
    return lines


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_our_records())
def test_every_record_the_tuner_writes_passes(lines: list[str]) -> None:
    checked = check_import(lines, "keep-faster", _vocabulary())
    assert not checked.refused and len(checked.records) == len(lines), checked.refused
    options = json.loads(json.loads(lines[1])["entry"]["strategy"]["name"])
    check_session_options(options)
    make_session_options(options)  # the runtime edge takes them too


# --------------------------------------------------------------------------- real daemons


def _hostile_records(model: Path, tmp: Path, target: Path) -> list[BankRecord]:
    """A model-level record for the mlp sample on this machine whose session options
    write the memory statistics to `target`: what the tuner would find for that model."""
    from aoed.engine.assemble import model_signature
    from aoed.engine.prep import prepare

    sig = model_signature(prepare(model, tmp / "prep").model)
    device = device_fingerprint()
    return [
        rec(
            sig=sig,
            dev=device,
            strategy=canonical_json({"config": {FILE_KEY: str(target)}}),
            family="session",
            params={},
            winner=Measured(1.0, 0.01, 30, 0.9),
        )
    ]


def _seed(bank: Path, records: list[BankRecord], trials: list[tuple[bytes, bytes]] = ()) -> None:
    """Write `records` into the bank at `bank` as they are (a bank that holds them
    already, whoever wrote them), and `trials` as raw stored bytes."""
    store = BankStore(bank)
    try:
        store.merge([Record(ENTRY, r.key, encode(r)) for r in records], lambda old, new: True)
        store.merge(
            [Record(TRIAL, history_key(k, i + 1), v) for i, (k, v) in enumerate(trials)],
            lambda old, new: True,
        )
    finally:
        store.close()


@pytest.mark.slow
def test_hostile_records_from_an_import_a_peer_or_the_bank_itself_never_reach_onnxruntime(
    models: Path, tmp_path: Path, targets: tuple[Path, Path, Path]
) -> None:
    """A peer daemon whose bank holds hostile records (and good ones); a daemon that
    follows it and whose own bank holds one already, for the model it then tunes; an
    export of the peer imported into it; a SyncBank from the peer into a third; `aoe
    compile` from a bank that holds them. The hostile records are refused, counted and
    logged naming the field; the good ones arrive; nothing writes the sentinel or
    through the link."""
    from aoed import samples

    from .daemon_util import DaemonProcess, follow, log_state, submit_sample
    from .helpers import wait_for

    sentinel, other, link = targets
    good = [make_entry(n, 5.0 + n, "alpha") for n in range(3)]
    peer, follower, syncer = (DaemonProcess(tmp_path / n) for n in ("peer", "a", "c"))
    mlp = samples.save(samples.build("mlp"), follower.models / "mlp.onnx")
    [own] = _hostile_records(mlp, tmp_path, sentinel)
    hostile = [
        _session(50, {"config": {FILE_KEY: str(link)}}),
        dataclasses.replace(make_entry(51, 1.0, "x"), strategy="no_such_strategy"),
        make_entry(52, math.inf, "x"),
        own,
    ]
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    _seed(peer.bank, [*good, *hostile], [(good[0].key, deep)])
    _seed(follower.bank, [own])
    follow(follower, [peer])
    try:
        peer.start()
        follower.start()
        # The follower applies the peer's good records, and refuses and logs the rest.
        wait_for(
            lambda: log_state(follower)[1].get(f"unix://{peer.socket}") == log_state(peer)[0],
            120,
            "the follower has taken every write of the peer",
        )
        with open_bank(follower.bank, use_env=False) as reader:
            held = {e.key: e.strategy.name for _, e in reader.entries()}
            [stats] = reader.stats()
        assert held == {
            **{g.key.decode(): g.strategy for g in good},
            own.key.decode(): own.strategy,  # its own copy, as it held it
        }
        assert stats.history == 0
        log = follower.log()
        for bad, field in zip(
            hostile,
            ("strategy.name: config", "strategy.name", "winner.median_us", "strategy.name: config"),
            strict=True,
        ):
            line = next(
                (x for x in log.splitlines() if "refused" in x and bad.key.decode() in x), ""
            )
            assert field in line, (bad.key, field, log[-3000:])
        assert "nested more than" in log

        # An export of the peer, imported over the socket: refused, named, counted.
        dump = tmp_path / "peer.jsonl"
        r = run_aoe("bank", "export", "--socket", str(peer.socket), "--output", str(dump))
        assert r.returncode == 0, r.stderr
        r = run_aoe("bank", "import", str(dump), "--socket", str(follower.socket))
        assert r.returncode == 0, r.stderr
        assert f"0 added, 0 updated, 3 kept, {len(hostile) + 1} refused" in r.stdout, r.stdout
        assert f"refused {own.key.decode()}: strategy.name: config '{FILE_KEY}'" in r.stdout

        # SyncBank from the peer into a third daemon: the same checks.
        syncer.start()
        r = run_aoe("bank", "sync", f"unix://{peer.socket}", "--socket", str(syncer.socket))
        assert r.returncode == 0, r.stderr
        assert f"refused {len(hostile) + 1} " in r.stdout, r.stdout
        with open_bank(syncer.bank, use_env=False) as reader:
            assert {e.key for _, e in reader.entries()} == {g.key.decode() for g in good}
        syncer.stop()

        # A job on the model whose record the follower's bank holds: the record is
        # ignored, the job tunes as if it were not there.
        job = follower.wait_job(submit_sample(follower, "mlp", 2.0), timeout=600)
        assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
        _untouched(sentinel, other, link)
    finally:
        for d in (syncer, follower, peer):
            d.close()

    # `aoe compile` from a bank that holds them: the session record is ignored, saying why.
    for target in (sentinel, link):
        bank = tmp_path / f"compile-{target.name}"
        _seed(bank, _hostile_records(mlp, tmp_path, target))
        out = tmp_path / f"compiled-{target.name}.onnx"
        r = run_aoe("compile", str(mlp), "-o", str(out), "--bank", str(bank), "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["session_options"] == {}
        session = next(t for t in report["tasks"] if t["task_id"] == "session")
        assert session["status"] == "ignored" and FILE_KEY in session["reason"], session
        aoe.session(out).run(None, {"input": np.zeros((1, 256), np.float32)})
    _untouched(sentinel, other, link)
