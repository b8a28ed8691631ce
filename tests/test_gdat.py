"""GDAT: gradient-communication tuning with real worlds of rank processes over gloo.

Every job here starts real rank processes (python -m aoed.backends.torch.rank) that
form a world on a loopback FileStore and run DDP steps on a small MLP; the bank is a
real LMDB bank in tmp_path. Jobs use few rounds and steps: the figures they produce
are noise on a shared machine, and no test reads a speed into them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
import trio

from aoe.bank import open_bank
from aoe.config import Config, load_config
from aoe.errors import OptionError
from aoe.gdat import DDPConfig, hook_class, read_config
from aoe.gradlayout import GradientLayout, bucket_sizes, gdat_key, host_fingerprint
from aoe.outcome import JobOutcome
from aoe.spec import JobType

from .conftest import run_aoe
from .helpers import wait_until
from .procs import children_running, run_ranks

torch = pytest.importorskip(
    "torch", reason="GDAT needs torch: pip install '.[gdat]' (make test installs it)"
)

from aoed.engine.world import RANK_MODULE  # noqa: E402
from aoed.gdat import GdatOptions, run_gdat, space, to_outcome  # noqa: E402

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- fixtures


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 8),
        )

    def forward(self, x):
        return self.layers(x)


@pytest.fixture(scope="module")
def pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gdat") / "mlp.pt2"
    torch.export.save(torch.export.export(MLP(), (torch.randn(16, 64),)), str(path))
    return path


def _config(tmp_path: Path) -> Config:
    return dataclasses.replace(
        load_config(env={}).replace(bank=tmp_path / "bank"), runtime_dir=tmp_path / "rt"
    )


def _quick(model: Path, output: Path, **kw) -> GdatOptions:
    return GdatOptions(
        model, output, rounds=3, confirm_rounds=5, warmup=1, steps=3, budget_s=60.0, **kw
    )


def _rank_pids() -> set[int]:
    """Rank processes this process started that still exist (alive, or not yet reaped)."""
    return children_running(os.getpid(), RANK_MODULE)


def _exist(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists()}


# --------------------------------------------------------------------------- pure parts


def test_a_layout_signature_is_shapes_and_dtypes_in_order_with_world_and_backend() -> None:
    a = GradientLayout.of([("torch.float32", (256, 64)), ("float32", [256])], 2, "gloo")
    assert (
        a.signature().digest
        == GradientLayout.of([("float32", (256, 64)), ("float32", (256,))], 2, "gloo")
        .signature()
        .digest
    )
    others = [
        # registration order
        GradientLayout.of([("float32", (256,)), ("float32", (256, 64))], 2, "gloo"),
        GradientLayout.of([("float16", (256, 64)), ("float32", (256,))], 2, "gloo"),
        GradientLayout.of(a.params, 4, "gloo"),
        GradientLayout.of(a.params, 2, "nccl"),
    ]
    assert len({a.signature().digest, *(o.signature().digest for o in others)}) == 5
    assert a.grad_bytes == (256 * 64 + 256) * 4
    host = host_fingerprint("gloo", version="2.13.0")
    assert host.execution_provider == "torch.distributed" and host.runtime_version == "2.13.0"
    assert host_fingerprint("gloo", version="2.14.0").digest != host.digest
    assert gdat_key(a, host, "fp16").endswith(b"/fp16")


def test_ddp_configs_convert_both_ways_and_refuse_nonsense() -> None:
    configs = [
        DDPConfig(),
        DDPConfig(
            bucket_cap_mb=4.0, first_bucket_mb=0.25, gradient_as_bucket_view=True, static_graph=True
        ),
        DDPConfig(
            hook="powersgd", powersgd_rank=4, powersgd_start=2, world=(("NCCL_ALGO", "Tree"),)
        ),
        DDPConfig(hook="fp16-mine"),
    ]
    for c in configs:
        assert DDPConfig.from_params(c.to_params()) == c
        assert DDPConfig.from_params(json.loads(json.dumps(c.to_params()))).label == c.label
    assert configs[0].label == "default" and configs[0].ddp_kwargs() == {}
    assert configs[1].ddp_kwargs() == {
        "bucket_cap_mb_list": [0.25, 4.0],
        "gradient_as_bucket_view": True,
        "static_graph": True,
    }
    assert hook_class("bf16") == "bf16" and hook_class("lowrank-x") == "lowrank"
    with pytest.raises(OptionError, match="<class>-<name>"):
        DDPConfig(hook="mystery")
    with pytest.raises(OptionError, match="bucket_cap_mb"):
        DDPConfig(bucket_cap_mb=0)
    with pytest.raises(OptionError, match="not a DDP configuration"):
        DDPConfig.from_params({"static_graph": "perhaps"})


def test_a_rank_process_loads_no_part_of_the_onnx_engine() -> None:
    """A rank process starts with every world and again after every broken turn: before
    torch, it imports what its own messages need, not the ONNX jobs' (onnx, their graph
    preparation) nor the engine's event loop. The imports `python -m` makes of it, then
    those of its main()."""
    code = (
        f"import sys, {RANK_MODULE}, aoed.backends._wire, aoed.engine.rankmessages\n"
        "print(sorted({'onnx', 'onnxruntime', 'trio', 'aoed.engine.messages'} & set(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["[]"], (r.stdout, r.stderr)


def test_aoe_mode_selects_the_job_type_as_aoe_does() -> None:
    from aoe.config import job_type_from_env

    assert [job_type_from_env({"AOE_MODE": m}) for m in ("1", "2", "4", "")] == [
        "sgat",
        "opat",
        "gdat",
        None,
    ]
    with pytest.raises(OptionError, match="AOE_MODE=3"):
        job_type_from_env({"AOE_MODE": "3"})
    r = run_aoe("tune", "model.onnx", "--job-type", "opat", env={"AOE_MODE": "4"})
    assert r.returncode == 2 and "AOE_MODE selects gdat, --job-type opat" in r.stderr, r.stderr


def test_the_ladder_measures_one_configuration_per_distinct_set_of_buckets() -> None:
    # 65 KiB: one bucket at any cap
    small = GradientLayout.of([("float32", (256, 64)), ("float32", (256,))], 2, "gloo")
    assert [c.label for c in space.ladder(small)] == ["default"]
    # 96 MiB in 4 MiB gradients
    big = GradientLayout.of([("float32", (1024, 1024))] * 24, 2, "gloo")
    caps = [c.bucket_cap_mb for c in space.ladder(big)]
    assert caps[0] is None and caps[-1] == 100.0  # up to the first cap that holds everything
    assert len({bucket_sizes(big.sizes_bytes(), int(c * 2**20)) for c in caps[1:]}) == len(caps) - 1
    assert space.hooks(DDPConfig(), "exact", "gloo") == []
    assert [c.hook for c in space.hooks(DDPConfig(), "bf16", "gloo")] == [
        "fp16",
        "fp16_scaled",
    ]  # bf16's hook needs NCCL
    assert any("NCCL" in why for why in space.skipped_hooks("bf16", "gloo"))


def _scripted_search(layout: GradientLayout, picks: dict[str, DDPConfig], monkeypatch):
    """A Search whose stages race nothing: each stage's candidates are recorded and the
    stage keeps `picks[stage]` (the incumbent when absent); every hook passes its gate."""
    from aoed.engine.world import WorldSpec
    from aoed.gdat import search as search_mod

    raced: dict[str, list[DDPConfig]] = {}

    async def stage(self, name, incumbent, configs, category="search", worlds=None):
        raced[name] = list(configs)
        self.stages.append(name)
        return picks.get(name, incumbent)

    async def gate(self, incumbent):
        return space.hooks(incumbent, self.precision, self.spec.backend)

    monkeypatch.setattr(search_mod.Search, "_stage", stage)
    monkeypatch.setattr(search_mod.Search, "_gate", gate)
    spec = WorldSpec({"kind": "pt2", "path": "m.pt2"}, 2, "gloo")
    return search_mod.Search(layout, "fp16", spec, meter=None, open_world=None), raced


async def test_a_hook_the_search_adopts_gets_the_bucket_ladder_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    big = GradientLayout.of([("float32", (1024, 1024))] * 6, 2, "gloo")  # 24 MiB
    flags = DDPConfig(bucket_cap_mb=10.0, gradient_as_bucket_view=True)
    hooked = flags.replace(hook="fp16_scaled")
    search, raced = _scripted_search(
        big, {"ladder": DDPConfig(bucket_cap_mb=10.0), "flags": flags, "hooks": hooked}, monkeypatch
    )
    assert await search.run() == hooked  # the rebucket stage kept it here
    assert search.stages == ["ladder", "refine", "flags", "hooks", "rebucket"]
    again = raced["rebucket"]
    # The ladder's caps with the hook and the flags, the adopted cap not measured twice
    # (nor 1 and 2 MiB: in 4 MiB gradients they make the buckets 0.5 MiB makes).
    assert {c.bucket_cap_mb for c in again} == {None, 0.5, 5.0, 25.0}
    assert all(c.replace(bucket_cap_mb=10.0) == hooked for c in again)
    # A smaller cap the rebucket stage finds faster is what the search proposes.
    small = hooked.replace(bucket_cap_mb=0.5)
    search, _ = _scripted_search(
        big, {"flags": flags, "hooks": hooked, "rebucket": small}, monkeypatch
    )
    assert await search.run() == small
    # No hook adopted (the exact configuration stayed): no second ladder.
    search, raced = _scripted_search(big, {"flags": flags}, monkeypatch)
    assert await search.run() == flags
    assert "rebucket" not in raced and search.stages[-1] == "hooks"


class _ScriptedWorld:
    """Step times by configuration and turn, as a world's ranks would report them: to
    make the racing rules' branches happen on purpose (a real world's noise decides them
    by chance; the jobs below measure for real)."""

    def __init__(self, script: dict[str, list[float]]) -> None:
        self.script, self.turns = script, {k: 0 for k in script}

    async def call(self, request, limit_s):
        (name,) = request.order
        times = self.script[name]
        ms = times[min(self.turns[name], len(times) - 1)]
        self.turns[name] += 1
        result = {"step_us": [ms * 1e3], "tail_us": [ms * 500]}
        return [{"results": {name: result}} for _rank in range(2)]


async def test_a_stage_gives_its_close_calls_more_rounds_and_no_one_else() -> None:
    from aoed.engine.decisions import best
    from aoed.gdat.race import Entrant, Meter, race
    from aoed.gdat.search import close_calls

    script = {
        "incumbent": [100.0],
        "close": [95.0, 103.0, 95.0, 95.0, 95.0],  # 5% faster, one noisy round
        "level": [101.0],  # neither faster nor clearly slower
        "slow": [130.0],  # clearly slower: dropped after MIN_ROUNDS
    }
    entrants = [Entrant(k, DDPConfig(bucket_cap_mb=i + 1.0)) for i, k in enumerate(script)]

    async def run(**kw):
        world = _ScriptedWorld(script)
        meter = Meter({"": world}, lambda s, c: None, lambda: 1e9, warmup=0, steps=1)
        figs = await race(meter, "flags", entrants, 4, protect=frozenset({"incumbent"}), **kw)
        measured = {k: f.measurement() for k, f in figs.items()}
        return world.turns, best(measured, "incumbent", lambda m: True)

    # Four rounds leave the close call open: a 90% interval of four ratios is their
    # whole range, and one round was slower.
    turns, pick = await run()
    assert turns == {"incumbent": 4, "close": 4, "level": 4, "slow": 3} and pick == "incumbent"
    # With close calls settled: the two alone run on until eight rounds tell them apart
    # (the interval then leaves out the extreme ratios), and stop there, short of the cap.
    turns, pick = await run(settle=lambda f: close_calls(f, "incumbent"), max_rounds=12)
    assert turns == {"incumbent": 8, "close": 8, "level": 4, "slow": 3} and pick == "close"
    # Nothing close: no extra round.
    script["close"] = [101.0]
    turns, _ = await run(settle=lambda f: close_calls(f, "incumbent"), max_rounds=12)
    assert turns == {"incumbent": 4, "close": 4, "level": 4, "slow": 3}


# --------------------------------------------------------------------------- jobs


async def test_a_job_ends_with_outputs_and_a_bank_record_and_the_next_is_answered_from_it(
    pt2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which configuration wins depends on the machine; this job forces the branch where
    one does: after the search, the confirming A/B measures `view` against DDP's defaults
    for real and ships it. So the record, the next job's answer and the training-side
    helper all carry a configuration that DDP's defaults would not give."""
    from aoed.gdat import search as search_mod

    chosen = DDPConfig(gradient_as_bucket_view=True)
    real_confirm = search_mod.Search.confirm

    async def confirm(self: search_mod.Search, proposal: DDPConfig, banked: object):
        c = await real_confirm(self, chosen, banked)
        mine = c.figures[chosen.label].measurement()
        return dataclasses.replace(
            c, shipped=chosen, verdict="faster", result_ms=mine.median_us / 1e3
        )

    monkeypatch.setattr(search_mod.Search, "confirm", confirm)
    config = _config(tmp_path)
    r = await run_gdat(_quick(pt2, tmp_path / "out"), config)
    assert r.shipped == chosen and read_config(r.ddp_config) == chosen
    # The confirming rows say which is which: the shipped one, the baseline, the copy.
    confirm_rows = {c["name"]: c["status"] for c in r.configurations if c["stage"] == "confirm"}
    assert confirm_rows == {
        chosen.label: "chosen",
        "default": "baseline",
        "default (second instance)": "reference",
    }

    doc = json.loads(Path(r.result_json).read_text())
    assert Path(r.result_json).parent == tmp_path / "out" and Path(r.result_json).name.startswith(
        "aoe_result_gdat_"
    )
    g = doc["GDAT"]
    assert (
        g["gdat_tuning_result"] == "tuning successful" and g["model_baseline_performance(ms)"] > 0
    )
    assert g["baseline_tail(ms)"] >= 0 and g["result_tail(ms)"] >= 0
    assert g["repo_summary"]["repo_add_num"] + g["repo_summary"]["repo_unsatisfied_num"] == 1
    details = doc["details"]
    assert details["confirmation"]["rounds"] == 5 and details["broken_turns"] == []
    # The fields every job has, as every job's result reads them (aoe.outcome).
    outcome = to_outcome(r)
    assert outcome.job_type == JobType.GDAT and doc["figures"] == json.loads(
        json.dumps(outcome.figures.to_dict())
    )
    assert outcome.figures.baseline_ms == r.baseline_ms and outcome.figures.rounds == 5
    assert (
        outcome.figures.changed == (not r.shipped.is_default)
        and outcome.tuned_model == r.ddp_config
    )
    assert JobOutcome.from_dict(outcome.to_dict()).details.ddp_config == r.shipped.to_json()
    measured = [c for c in details["configurations"] if c.get("step_ms") is not None]
    assert {c["stage"] for c in measured} >= {"flags", "confirm"}
    assert all(
        len(c["per_rank"]) == 2 and all(p["step_ms"] > 0 for p in c["per_rank"]) for c in measured
    )
    # The buckets DDP formed are the buckets the search space predicted (how it tells configurations apart).
    layout = GradientLayout.of(
        [(str(p.dtype), tuple(p.shape)) for p in MLP().parameters()], 2, "gloo"
    )
    for c in measured:
        cfg = DDPConfig.from_params(c["params"])
        assert sorted(c["buckets"]) == sorted(space._buckets(layout, cfg)), c["name"]
    assert read_config(r.ddp_config) == r.shipped
    assert json.loads(Path(r.ddp_config).read_text())["bank_key"] == r.key

    with open_bank(config.bank, use_env=False) as bank:
        entry, _ = bank.lookup(r.key)
        default, _ = bank.lookup_default(r.key)
        trials = sum(rec.WhichOneof("record") == "trial" for _, rec in bank.records())
    assert (entry is not None) != (default is not None)
    assert (entry or default) is not None and (
        entry.provenance.job_id if entry else default["job"]
    ) == r.job_id
    assert trials >= len(measured)
    assert entry is not None and entry.strategy.name == chosen.label
    assert DDPConfig.from_params(dict(entry.strategy.params)) == chosen
    # The record's figures are the confirming A/B's: the shipped configuration's and the
    # defaults' medians, as the result reports them.
    assert entry.winner.median_us == pytest.approx(r.result_ms * 1e3, rel=1e-6)
    assert entry.baseline.median_us == pytest.approx(r.baseline_ms * 1e3, rel=1e-6)

    # Exported and imported like any record: this machine's, so nothing is refused.
    dump = tmp_path / "bank.jsonl"
    assert (
        run_aoe("bank", "export", "--bank", str(config.bank), "--output", str(dump)).returncode == 0
    )
    moved = run_aoe("bank", "import", str(dump), "--bank", str(tmp_path / "team"))
    assert moved.returncode == 0 and " 0 refused" in moved.stdout, moved.stdout
    with open_bank(tmp_path / "team", use_env=False) as team:
        assert (team.lookup(r.key)[0] or team.lookup_default(r.key)[0]) is not None

    # The same layout again, through the command line: the bank answers and no world starts.
    again = run_aoe(
        "tune",
        str(pt2),
        "--job-type",
        "gdat",
        "--bank",
        str(config.bank),
        "--output",
        str(tmp_path / "again"),
        "--no-progress",
        env={"AOED_RUNTIME_DIR": str(config.runtime_dir)},
    )
    assert again.returncode == 0, again.stderr
    assert f"from the bank: confirmed by {r.job_id}" in again.stdout and "hit 1" in again.stdout
    (second,) = (tmp_path / "again").glob("aoe_result_gdat_*.json")
    assert json.loads(second.read_text())["GDAT"]["gdat_tuning_result"] == "from the bank"
    assert not list((tmp_path / "again").glob("aoe_workspace/*/worlds/world*-rank*.log"))

    # The training-side helper finds the same record in a real world of two, importing
    # no trio, onnxruntime or daemon. Its model is MLP's module as training code builds
    # it, not the exported program: the gradient layout, the record's key, is the same.
    store = tmp_path / "helper.store"
    code = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist
        import aoe.gdat
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", store=dist.FileStore({str(store)!r}, 2), rank=rank, world_size=2)
        nn = torch.nn
        model = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
        )
        ddp = aoe.gdat.ddp(model, bank={str(config.bank)!r})
        print(ddp.gradient_as_bucket_view, ddp.static_graph, sorted({{m.split(".")[0] for m in sys.modules}}
              & {{"trio", "onnxruntime", "aoed"}}))
        dist.destroy_process_group()
    """)
    outs = run_ranks(code)
    note = [line for line in outs[0][1].splitlines() if line.startswith("aoe.gdat: ")]
    assert len(note) == 1 and f"job {r.job_id}" in note[0], outs[0][1]
    # rank 0 only
    assert not [line for line in outs[1][1].splitlines() if line.startswith("aoe.gdat: ")]
    assert outs[0][0].split() == [
        str(r.shipped.gradient_as_bucket_view),
        str(r.shipped.static_graph),
        "[]",
    ]


def _stages_kept(bank: Path) -> dict[str, dict]:
    """The GDAT stages a run keeps in `bank` for a resume (engine/resume.py: the bank's
    decisions), read as another process reads them while the run writes."""
    if not (bank / "data.mdb").exists():
        return {}
    env = lmdb.open(str(bank), readonly=True, max_dbs=16)
    try:
        with env.begin(db=env.open_db(b"decisions", create=False)) as txn:
            return {k.split(b"/", 1)[1].decode(): json.loads(v)["stage"] for k, v in txn.cursor()}
    except lmdb.NotFoundError:  # no decisions yet
        return {}
    finally:
        env.close()


_PLUGIN = """
import torch


def _scaled_without_reducing(state, bucket):
    # Faster than any all-reduce: no communication at all; and wrong: each rank keeps its
    # own gradients, tripled.
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer() * 3)
    return fut


def uncommunicated(process_group):
    return None, _scaled_without_reducing
"""


def _install_hook_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Install a package whose comm hook `fp16-uncommunicated` the fp16 precision allows:
    this process's jobs list it (its entry point on sys.path) and every process the test
    starts, ranks included, loads it (PYTHONPATH)."""
    plugins = tmp_path / "plugins"
    dist_info = plugins / "gdat_test_hooks-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (plugins / "gdat_test_hooks.py").write_text(_PLUGIN)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gdat-test-hooks\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[aoed.gdat_hooks]\nfp16-uncommunicated = gdat_test_hooks:uncommunicated\n"
    )
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")]))
    )


_RESUMABLE = """
import dataclasses, sys, trio
from pathlib import Path
from aoe.config import load_config
from aoed.gdat import GdatOptions, run_gdat
model, out, bank, rt = map(Path, sys.argv[1:5])
config = dataclasses.replace(load_config(env={}).replace(bank=bank), runtime_dir=rt)
opts = GdatOptions(
    model, out, rounds=3, confirm_rounds=5, warmup=1, steps=3, budget_s=60.0,
    precision="fp16", job_id="job-resume-test",
)
trio.run(run_gdat, opts, config)
"""


async def test_a_killed_job_run_again_measures_no_stage_it_finished_nor_a_hook_its_gate_refused(
    pt2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL once the job has kept a stage (and its gates) in the bank; the same job
    run again takes them as they were, measures none of them again, and reports them.
    Its precision (fp16) lets it try an installed hook that is fast and wrong: the gate
    refuses it, and neither run measures or chooses it."""
    _install_hook_plugin(tmp_path, monkeypatch)
    out, bank, rt = tmp_path / "out", tmp_path / "bank", tmp_path / "rt"
    first = subprocess.Popen(  # noqa: ASYNC220 (polled and killed by hand below)
        [sys.executable, "-c", _RESUMABLE, str(pt2), str(out), str(bank), str(rt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def checkpointed() -> dict[str, dict] | None:
        assert first.poll() is None, first.communicate()[1]  # ended before its checkpoint
        done = _stages_kept(bank)
        if "gates" in done and len(done) >= 2:  # a raced stage and the hooks' gates
            return done
        return None

    try:
        checkpoint = await wait_until(
            checkpointed, 240, "a checkpoint with a raced stage and the gates"
        )
    finally:
        first.kill()
    _, err = first.communicate(timeout=60)
    assert checkpoint is not None and first.returncode == -signal.SIGKILL, err
    (ws,) = (out / "aoe_workspace").iterdir()
    assert (ws / ".running").exists()  # killed: the workspace waits for its resume

    config = dataclasses.replace(load_config(env={}).replace(bank=bank), runtime_dir=rt)
    r = await run_gdat(
        dataclasses.replace(_quick(pt2, out, precision="fp16"), job_id="job-resume-test"),
        config,
    )
    # One workspace, continued; nothing of the run left in it but its outputs and log.
    assert [p.name for p in (out / "aoe_workspace").iterdir()] == [ws.name]
    assert not (ws / ".running").exists()
    assert _stages_kept(bank) == {}, "forgotten once the outputs are written"
    raced = [s for s in checkpoint if s != "gates"]
    assert set(r.resources["resumed_stages"]) >= {*raced, "gates"}, r.resources
    assert any(n.startswith("resumed: ") for n in r.notes), r.notes
    # Each finished stage's figures are the killed run's, as measured then.
    for stage in raced:
        kept = {f["name"]: f["rounds_us"] for f in checkpoint[stage]["figures"]}
        reported = {c["name"]: c["rounds_ms"] for c in r.configurations if c["stage"] == stage}
        assert set(reported) == set(kept), (stage, reported, kept)
        for name, rounds in kept.items():
            assert reported[name] == [round(v / 1e3, 4) if v else None for v in rounds], name
    assert r.gates == checkpoint["gates"]["gates"]
    # ... and measured once: the log has each of them raced by the killed run only.
    log_text = (ws / "job.log").read_text()
    for stage in raced:
        assert log_text.count(f"aoed.gdat.search: {stage}: ") == 2, stage  # raced, then taken
        assert (
            f"{stage}: " in log_text and "from the interrupted run: not measured again" in log_text
        )

    # The gates, as the killed run judged them; hooks are tried on the best configuration
    # so far (e.g. "static,hook=fp16"): by hook.
    gates = {g["config"].rsplit("hook=", 1)[-1]: g for g in r.gates}
    bad = gates["fp16-uncommunicated"]
    assert not bad["passed"] and bad["max_rel_error"] > 0.5, bad
    assert gates["fp16"]["passed"], gates["fp16"]  # the real fp16 hooks stay within the bound
    assert gates["fp16_scaled"]["passed"], gates["fp16_scaled"]
    named = [c for c in r.configurations if c["name"] == bad["config"]]
    assert [c["status"] for c in named] == ["rejected"]  # never measured, never chosen
    assert r.shipped.hook != "fp16-uncommunicated"


_ENTRY = """
import torch


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    x, y = torch.randn(16, 64), torch.randint(0, 8, (16,))
    return model, (x,), lambda out: torch.nn.functional.cross_entropy(out, y)
"""


async def test_an_entry_job_measures_a_backend_knob_in_a_world_of_its_own_and_survives_a_killed_rank(
    tmp_path: Path,
) -> None:
    """The user's own code (--entry: model, batch, loss) in every rank; a knob set before
    the process group exists (here gloo's TORCH_GLOO_LAZY_INIT) gets its own world, whose
    ranks carry it, raced against the main world round by round; and a rank killed in
    the middle of a round costs that turn (its world restarts), not the job."""
    entry = tmp_path / "train.py"
    entry.write_text(_ENTRY)
    knob = (("TORCH_GLOO_LAZY_INIT", "1"),)
    environs: dict[int, bytes] = {}
    killed: list[int] = []

    def emit(event) -> None:
        for pid in _rank_pids():
            with contextlib.suppress(OSError):
                environs.setdefault(pid, Path(f"/proc/{pid}/environ").read_bytes())
        if event.kind == "progress" and "round 2 " in event.message and not killed:
            victim = max(_rank_pids())
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    r = await run_gdat(
        _quick(entry, tmp_path / "out", entry="build", world_knobs=(knob,)), _config(tmp_path), emit
    )
    assert r.layout.params == (
        ("float32", (256, 64)),
        ("float32", (256,)),
        ("float32", (8, 256)),
        ("float32", (8,)),
    )
    stage = [c for c in r.configurations if c["stage"] == "world TORCH_GLOO_LAZY_INIT=1"]
    assert {c["world"] for c in stage} == {"main", "TORCH_GLOO_LAZY_INIT=1"}
    assert all(c["step_ms"] is not None for c in stage)
    assert r.resources["worlds"] == 2
    # that world's two ranks
    assert sum(b"TORCH_GLOO_LAZY_INIT=1\0" in env for env in environs.values()) == 2

    assert killed
    (failure,) = r.broken_turns
    assert "died" in failure["error"] and failure["round"] == 1, failure
    assert r.resources["world_restarts"] == 1
    assert Path(r.result_json).is_file() and Path(r.ddp_config).is_file()
    # one turn failed, not a configuration
    assert all(c["status"] != "failed" for c in r.configurations)
    assert _exist(set(environs)) == set() and _rank_pids() == set()


@pytest.mark.parametrize("when", ["measuring", pytest.param("recording", marks=pytest.mark.long)])
async def test_cancelling_the_job_leaves_no_rank_process(
    pt2: Path, tmp_path: Path, when: str
) -> None:
    """Cancelled while the ranks measure (a request in flight), or while they wait idle
    for the bank write between requests."""
    seen: set[int] = set()
    with trio.CancelScope() as scope:

        def emit(event) -> None:
            seen.update(_rank_pids())
            if (when == "measuring" and event.kind == "progress") or event.message.startswith(when):
                scope.cancel()

        await run_gdat(_quick(pt2, tmp_path / "out"), _config(tmp_path), emit)
    assert scope.cancelled_caught
    assert len(seen) == 2  # the world's two ranks were running when it was cancelled
    assert _exist(seen) == set() and _rank_pids() == set()
    assert not list((tmp_path / "out").glob("aoe_result_gdat_*.json"))


@pytest.mark.parametrize(
    ("kind", "args", "code", "needles"),
    [
        ("garbage", ["--job-type", "gdat"], 3, ["garbage.pt2", "torch.export program"]),
        ("AOE_MODE=4", ["--backend", "nccl"], 2, ["backend nccl", "CUDA build of torch"]),
        ("no torch", ["--job-type", "gdat"], 2, ["aoed[gdat]"]),
    ],
)
def test_a_job_that_cannot_run_fails_in_one_line(
    pt2: Path, tmp_path: Path, kind: str, args, code: int, needles
) -> None:
    model = pt2
    if kind == "garbage":
        model = tmp_path / "garbage.pt2"
        model.write_bytes(b"not a zip archive")
    argv = [
        "tune",
        str(model),
        *args,
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
        "--no-progress",
    ]
    if kind == "no torch":
        hide = textwrap.dedent("""
            import sys
            class NoTorch:
                def find_spec(self, name, path=None, target=None):
                    if name == "torch" or name.startswith("torch."):
                        raise ModuleNotFoundError(f"No module named {name!r}")
            sys.meta_path.insert(0, NoTorch())
            from aoe.cli import main
            sys.exit(main(sys.argv[1:]))
        """)
        r = subprocess.run(
            [sys.executable, "-c", hide, *argv], capture_output=True, text=True, timeout=120
        )
    else:
        env = {"AOE_MODE": "4"} if kind == "AOE_MODE=4" else {}
        r = run_aoe(*argv, env={"AOED_RUNTIME_DIR": str(tmp_path / "rt"), **env})
    assert r.returncode == code, (r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("aoe: error: ") and all(n in line for n in needles), line
    assert not (tmp_path / "bank").exists()
