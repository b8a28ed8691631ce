"""The compile pool and the device agent with their real child processes."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import trio

from aoe.errors import DeviceError
from aoed import samples
from aoed.engine.device import DeviceAgent
from aoed.engine.partition import partition
from aoed.engine.pool import CompilePool
from aoed.engine.prep import make_inputs, prepare
from aoed.engine.tasks import constant_values, task_model

PLUGIN = textwrap.dedent(
    """
    import os, time
    from aoed.backends.ort.strategies import Strategy, register

    def _crash(view):
        os.abort()

    def _hang(view):
        time.sleep(600)

    register(Strategy("crash_in_worker", "matmul", "exact", _crash))
    register(Strategy("hang_in_worker", "matmul", "exact", _hang))
    """
)


@pytest.fixture
def plugin_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers (not this process) load a plugin whose strategies crash or hang."""
    (tmp_path / "aoed_crash_plugin.py").write_text(PLUGIN)
    monkeypatch.setenv("AOED_PLUGINS", "aoed_crash_plugin")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(p for p in sys.path if p))


@pytest.fixture
def mlp_task(tmp_path: Path) -> tuple[Path, Path]:
    """(task model path, inputs.npz) for the first task of the MLP sample."""
    src = samples.save(samples.mlp(), tmp_path / "mlp.onnx")
    prep = prepare(src, tmp_path / "prep")
    task = partition(prep.model, prep.ctx)[0]
    tm = task_model(prep.model, task, constant_values(prep.model.graph), prep.ctx.tensors)
    path = tmp_path / "task.onnx"
    onnx.save(tm, str(path))
    feeds = {i.name: np.random.default_rng(0).standard_normal(
        [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32) for i in tm.graph.input}
    np.savez(tmp_path / "inputs.npz", **feeds)
    return path, tmp_path / "inputs.npz"


def _req(task: Path, strategy: str, out: Path) -> dict:
    return {"task_model": str(task), "family": "matmul", "strategy": strategy, "prefix": "t", "out": str(out)}


def _state(pid: int) -> str:
    # Field 3 of /proc/PID/stat; the command name (field 2) is parenthesized.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_worker_crash_and_hang_cost_one_candidate(plugin_env, mlp_task, tmp_path):
    task, _ = mlp_task
    pool = CompilePool(1, tmp_path / "logs", timeout_s=5.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        ok = await pool.compile(_req(task, "default", tmp_path / "a.onnx"))
        assert ok["ok"], ok
        crashed = await pool.compile(_req(task, "crash_in_worker", tmp_path / "b.onnx"))
        assert not crashed["ok"] and "crashed" in crashed["error"]
        again = await pool.compile(_req(task, "fused_gemm", tmp_path / "c.onnx"))
        assert again["ok"], again  # a fresh worker took over
        hung = await pool.compile(_req(task, "hang_in_worker", tmp_path / "d.onnx"))
        assert not hung["ok"] and "timed out" in hung["error"]
        after = await pool.compile(_req(task, "gemm_pretransposed", tmp_path / "e.onnx"))
        assert after["ok"], after
        assert pool.crashes == 2
        nursery.cancel_scope.cancel()
    assert onnx.load(str(tmp_path / "c.onnx")).graph.node[0].op_type == "FusedGemm"


async def test_inapplicable_strategy_is_not_a_failure(mlp_task, tmp_path):
    task, _ = mlp_task
    pool = CompilePool(1, tmp_path / "logs")
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        # fc1 is Gemm(+Relu) after prep; a Conv strategy does not apply to it.
        res = await pool.compile({**_req(task, "conv1x1_as_matmul", tmp_path / "x.onnx"), "family": "conv"})
        nursery.cancel_scope.cancel()
    assert res["ok"] is False and res["applicable"] is False


async def test_device_serializes_and_pauses_compile_workers(mlp_task, tmp_path):
    task, inputs = mlp_task
    pool = CompilePool(1, tmp_path / "logs")
    request = {
        "op": "measure",
        "candidates": [{"id": "default", "model": str(task)}, {"id": "t1", "model": str(task),
                                                              "options": {"intra_op_num_threads": 1}}],
        "inputs": str(inputs),
        "reference": "default",
        "budget_s": 0.5,
        "min_rounds": 6,
    }
    replies: list[dict] = []
    seen_states: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        device = DeviceAgent("cpu", pool, tmp_path / "logs")
        await nursery.start(device.run)
        assert (await pool.compile(_req(task, "default", tmp_path / "a.onnx")))["ok"]
        worker_pid = pool._children[0].pid
        assert worker_pid is not None

        async def submit():
            replies.append(await device.submit(request))

        async with trio.open_nursery() as inner:
            for _ in range(3):
                inner.start_soon(submit)
            while len(replies) < 3:
                seen_states.append(_state(worker_pid))
                await trio.sleep(0.02)
        assert _state(worker_pid) != "T"  # resumed once the device is idle
        nursery.cancel_scope.cancel()
    spans = sorted((r["started"], r["finished"]) for r in replies)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "two measurements overlapped on one device"
    assert "T" in seen_states, "compile worker kept running while the device measured"
    for r in replies:
        res = r["results"]
        assert res["default"]["max_abs_error"] == 0.0 and res["default"]["cosine"] == pytest.approx(1.0)
        assert res["t1"]["max_rel_error"] < 1e-5
        assert res["default"]["median_us"] > 0 and len(res["default"]["rounds_us"]) >= 6
    assert device.requests == 3 and device.busy_s > 0


async def test_runner_reports_wrong_outputs_and_broken_candidates(tmp_path):
    src = samples.save(samples.mlp(), tmp_path / "mlp.onnx")
    other = samples.mlp()
    # Same interface, different weights: outputs differ, which the gate must see.
    for init in other.graph.initializer:
        arr = onnx.numpy_helper.to_array(init) * 1.5
        init.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), init.name))
    wrong = samples.save(other, tmp_path / "wrong.onnx")
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    prep = prepare(src, tmp_path / "prep")
    np.savez(tmp_path / "in.npz", **make_inputs(prep.inputs))
    async with trio.open_nursery() as nursery:
        device = DeviceAgent("cpu", None, tmp_path / "logs")
        await nursery.start(device.run)
        reply = await device.submit(
            {
                "op": "measure",
                "candidates": [
                    {"id": "ref", "model": str(src)},
                    {"id": "wrong", "model": str(wrong)},
                    {"id": "broken", "model": str(tmp_path / "broken.onnx")},
                ],
                "inputs": str(tmp_path / "in.npz"),
                "reference": "ref",
                "budget_s": 0.3,
            }
        )
        with pytest.raises(DeviceError, match="reference"):
            await device.submit(
                {
                    "op": "measure",
                    "candidates": [{"id": "broken", "model": str(tmp_path / "broken.onnx")}],
                    "inputs": str(tmp_path / "in.npz"),
                    "reference": "broken",
                }
            )
        prof = await device.submit(
            {"op": "profile", "model": str(prep.path), "inputs": str(tmp_path / "in.npz"),
             "workdir": str(tmp_path), "runs": 3}
        )
        nursery.cancel_scope.cancel()
    res = reply["results"]
    assert res["ref"]["ok"] and res["wrong"]["ok"]
    assert res["wrong"]["max_rel_error"] > 0.1 and res["ref"]["max_rel_error"] == 0.0
    assert not res["broken"]["ok"] and "load" in res["broken"]["error"]
    node_names = {n.name for n in prep.model.graph.node}
    assert prof["nodes"] and set(prof["nodes"]) <= node_names
