"""Jobs on a shared engine: identity, accounting, workspaces, cancellation, isolation.

These run the real engine (compile workers, a measurement runner, LMDB) in this process,
with small models and budgets."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import trio

from aoe.config import load_config
from aoe.errors import JobCancelledError, ModelError
from aoe.spec import JobSpec
from aoed import samples
from aoed.backends.ort.runtime import ORT
from aoed.engine.engine import open_engine
from aoed.engine.job import JobHandle, JobRun
from aoed.engine.modelio import load_model, save_model
from aoed.engine.prep import make_inputs, prepare
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


def _config(tmp_path: Path):
    return load_config(env={}).replace(
        bank=tmp_path / "bank", parallel=1, runtime_dir=tmp_path / "run"
    )


async def test_two_jobs_of_one_model_share_an_engine_without_colliding(
    models: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    opts = [
        JobRun(models / "mlp.onnx", out, JobSpec(job_type="opat", budget_s=1.0)),
        JobRun(
            models / "mlp.onnx", out, JobSpec(job_type="opat", budget_s=1.0), keep_workspace=True
        ),
    ]
    results = {}
    async with open_engine(_config(tmp_path), ORT, tmp_path / "logs") as engine:
        async with trio.open_nursery() as nursery:
            for i, o in enumerate(opts):

                async def one(i=i, o=o) -> None:
                    results[i] = await engine.run_job(o)

                nursery.start_soon(one)
        busy = engine.device.busy_s
    a, b = results[0], results[1]
    assert a.job_id != b.job_id
    assert (
        a.workspace != b.workspace
        and a.result_json != b.result_json
        and a.tuned_model != b.tuned_model
    )
    assert {Path(r.result_json).name.startswith("aoe_result_opat_") for r in (a, b)} == {True}
    for r in (a, b):
        doc = json.loads(Path(r.result_json).read_text())
        assert doc["basic"]["job_id"] == r.job_id
        assert Path(r.tuned_model).is_file()
        log = (Path(r.workspace) / "job.log").read_text()
        assert r.job_id in log and (a if r is b else b).job_id not in log  # each job its own log
        assert r.resources["trials"] > 0 and r.resources["device_s"] > 0
        assert 0 < r.resources["duty_cycle"] <= 1.0
        assert r.resources["peak_worker_rss_mb"] > 10
    # Each job was charged its own device time, and together they account for the device.
    assert a.resources["device_s"] + b.resources["device_s"] == pytest.approx(busy, rel=0.01)
    # Scratch goes after success unless kept.
    assert not (Path(a.workspace) / "tunespace" / "work").exists()
    assert list((Path(b.workspace) / "tunespace" / "work" / "tasks").iterdir())
    # Candidate files are removed once measured, even where the workspace is kept.
    assert not list((Path(b.workspace) / "tunespace" / "work" / "tasks").rglob("fused_gemm.onnx"))


async def test_a_job_that_fails_before_tuning_leaves_no_workspace_and_the_engine_goes_on(
    models: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    async with open_engine(_config(tmp_path), ORT, tmp_path / "logs") as engine:
        with pytest.raises(ModelError, match="bad.onnx"):
            await engine.run_job(JobRun(bad, tmp_path / "out"))
        assert not (tmp_path / "out" / "aoe_workspace").exists()
        good = await engine.run_job(
            JobRun(models / "mlp.onnx", tmp_path / "out", JobSpec(budget_s=0.5))
        )
    assert [p.name for p in (tmp_path / "out" / "aoe_workspace").iterdir()] == [
        Path(good.workspace).name
    ]
    assert Path(good.tuned_model).is_file()
    assert not (tmp_path / "logs").exists(), "the workers logged nothing: no empty logs are left"


async def test_cancel_stops_a_job_mid_measurement_and_the_next_job_runs(
    models: Path, tmp_path: Path
) -> None:
    handle = JobHandle()
    stages: list[str] = []
    async with open_engine(_config(tmp_path), ORT, tmp_path / "logs") as engine:

        async def cancel_when_measuring() -> None:
            await wait_until(
                lambda: any(s.startswith("tuning") for s in stages), 120, "the job tuning"
            )
            served = engine.device.requests
            await wait_until(  # the job's own measurements are under way
                lambda: engine.device.requests != served, 120, "a measurement of the job's"
            )
            assert engine.device.runner_pid is not None
            handle.cancel("test")

        # Left alone the job measures for its 300 s budget: the deadline (far above what
        # cancelling needs) fails a cancel that waits for the job instead of stopping it.
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_when_measuring)
                with pytest.raises(JobCancelledError, match="test"):
                    await engine.run_job(
                        JobRun(models / "cnn.onnx", tmp_path / "out", JobSpec(budget_s=300.0)),
                        lambda e: stages.append(e.message) if e.kind == "stage" else None,
                        handle,
                    )
        requests = engine.device.requests
        nxt = await engine.run_job(
            JobRun(models / "mlp.onnx", tmp_path / "out2", JobSpec(budget_s=0.5))
        )
    assert engine.device.requests > requests and Path(nxt.tuned_model).is_file()
    (ws,) = (tmp_path / "out" / "aoe_workspace").glob("cnn_*")
    assert not (ws / "tunespace" / "work").exists()  # a cancelled job leaves no scratch
    assert not list((tmp_path / "out").glob("aoe_result_*.json"))


def test_the_engine_process_never_loads_onnxruntime(models: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, trio
        from pathlib import Path
        from aoe.config import load_config
        from aoed.backends.ort.runtime import ORT
        from aoed.engine.engine import open_engine
        from aoe.spec import JobSpec
        from aoed.engine.job import JobRun

        async def main():
            tmp = Path({str(tmp_path)!r})
            config = load_config(env={{}}).replace(bank=tmp / "bank", parallel=1, runtime_dir=tmp / "run")
            async with open_engine(config, ORT, tmp / "logs") as engine:
                opts = JobRun(Path({str(models / "legacy_cnn.onnx")!r}), tmp / "out",
                              JobSpec(precision="int8", job_type="opat", budget_s=0.5))
                return await engine.run_job(opts)

        result = trio.run(main)
        print(result.verified, "|", "onnxruntime" in sys.modules, "|", Path(result.tuned_model).is_file())
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    verified, loaded, shipped = (part.strip() for part in out.stdout.split("|"))
    assert verified in ("tuned", "options only", "reverted to input") and shipped == "True", (
        out.stdout
    )
    assert loaded == "False", out.stdout


def test_large_models_round_trip_with_external_data(models: Path, tmp_path: Path) -> None:
    model = onnx.load(str(models / "cnn.onnx"))
    path = tmp_path / "big" / "model.onnx"
    written = save_model(model, path, external_above=0)  # as if it were over the limit
    assert (tmp_path / "big" / "model.onnx.data").is_file()
    assert written == path.stat().st_size + (tmp_path / "big" / "model.onnx.data").stat().st_size
    assert path.stat().st_size < 20_000 < written
    assert not list((tmp_path / "big").glob(".*tmp"))
    again = load_model(path)
    feeds = make_inputs(prepare(models / "cnn.onnx", tmp_path / "prep").inputs)
    want = ort.InferenceSession(str(models / "cnn.onnx"), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(got[0], want[0])
    assert (
        onnx.load(str(path), load_external_data=False).graph.initializer[0].data_location
        == onnx.TensorProto.EXTERNAL
    )
    assert again.graph.initializer[0].raw_data  # loaded back with its data
    _ = samples  # the models fixture builds them
