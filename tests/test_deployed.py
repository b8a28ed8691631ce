"""Measurement as deployed (backends/ort/deployed.py): each candidate in a process of its
own, set up exactly as `aoe.session` sets up the model a user deploys, driven by the one
measurement procedure, through the real runner."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

import aoe
from aoe.device import CPU
from aoe.sessionopts import METADATA_KEY
from aoed.backends.ort import deployed, runner
from aoed.engine.messages import Candidate, MeasurePlan, MeasureRequest
from aoed.samples import mlp

OPTIONS = {"execution_mode": "parallel", "graph_optimization_level": "basic"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The mlp sample, the same graph carrying OPTIONS as a tuned model does, a model
    whose outputs differ, and inputs for them."""
    d = tmp_path_factory.mktemp("deployed")
    plain = mlp()
    onnx.save(plain, d / "plain.onnx")
    tuned = onnx.ModelProto()
    tuned.CopyFrom(plain)
    tuned.metadata_props.add(key=METADATA_KEY, value=json.dumps(OPTIONS))
    onnx.save(tuned, d / "tuned.onnx")
    off = onnx.ModelProto()
    off.CopyFrom(plain)
    init = off.graph.initializer[0]
    arr = onnx.numpy_helper.to_array(init) + 1.0
    init.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), init.name))
    onnx.save(off, d / "off.onnx")
    sess = aoe.session(d / "plain.onnx")
    rng = np.random.default_rng(0)
    feeds = {
        i.name: rng.standard_normal([x if isinstance(x, int) else 1 for x in i.shape]).astype(
            np.float32
        )
        for i in sess.get_inputs()
    }
    np.savez(d / "inputs.npz", **feeds)
    return {
        "plain": d / "plain.onnx",
        "tuned": d / "tuned.onnx",
        "off": d / "off.onnx",
        "inputs": d / "inputs.npz",
    }


def test_each_candidate_runs_in_a_process_of_its_own_set_up_as_aoe_session_sets_it(models):
    """The worker of a tuned model's candidate runs the session `aoe.session` gives a user
    for that file (its stored options, onnxruntime's spinning), not the runner's quiet
    one; every candidate has its own process, and none is the caller's."""
    with deployed.workers_for(models["inputs"]) as w:
        errors = w.load([("plain", models["plain"], {}), ("tuned", models["tuned"], OPTIONS)])
        assert errors == {}
        got = {cid: w.by[cid].ask(op="describe") for cid in ("plain", "tuned")}
    pids = {g["pid"] for g in got.values()}
    assert len(pids) == 2 and os.getpid() not in pids
    for cid in ("plain", "tuned"):
        assert got[cid]["session"] == deployed.describe(aoe.session(models[cid]))
    assert got["tuned"]["session"]["execution_mode"] == "ExecutionMode.ORT_PARALLEL"
    # In one process the runner turns spinning off; deployed, onnxruntime decides.
    quiet = deployed.describe(runner._session(models["tuned"], OPTIONS))
    assert quiet["session.intra_op.allow_spinning"] == "0"
    assert got["tuned"]["session"]["session.intra_op.allow_spinning"] is None


def test_a_deployed_measurement_reports_as_the_runner_does_and_keeps_no_session(models):
    """Through the runner's own request: a missing model fails as a load, a model whose
    outputs differ is told apart by its accuracy, every kept round has every candidate,
    and the workers kept for the next request hold no session."""
    cands = (
        Candidate("plain", models["plain"]),
        Candidate("tuned", models["tuned"], OPTIONS),
        Candidate("off", models["off"]),
        Candidate("missing", models["plain"].with_name("missing.onnx")),
    )
    plan = MeasurePlan.fixed(5, 60.0, deployed=True)  # a budget no busy machine reaches
    reply = runner.measure(MeasureRequest(cands, models["inputs"], "plain", CPU, plan))
    r = reply.results
    assert not r["missing"].ok and r["missing"].error.startswith("load:")
    assert r["plain"].ok and r["tuned"].ok and r["off"].ok
    assert r["tuned"].cosine == pytest.approx(1.0, abs=1e-6)
    assert r["off"].max_abs_error > 0.1
    assert len(r["plain"].rounds_us) == len(r["tuned"].rounds_us) == 5
    assert all(x is not None and x > 0 for x in r["plain"].rounds_us + r["tuned"].rounds_us)
    assert deployed._idle, "the workers are kept for the next measurement"
    for w in deployed._idle:
        assert w.ask(op="describe")["session"] is None


def _cpu_ticks(pid: int) -> tuple[str, int]:
    """(state, user + system clock ticks) of process `pid`, all its threads together."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]) + int(fields[12])


#: Twenty of the kernel's 10 ms ticks: a stopped worker's threads would take some of them
#: if they still spun. Taking no CPU leaves no event to wait for, only the quiet period.
STOPPED_QUIET_S = 0.2


def test_a_worker_takes_no_core_between_its_turns(models):
    """onnxruntime's intra-op threads spin on after a run; the worker whose turn ended is
    stopped, so they cannot take the cores of the next worker's turn, and continued for
    its next one."""
    with deployed.workers_for(models["inputs"]) as w:
        assert w.load([("a", models["plain"], {})]) == {}
        w.first("a")
        samples = w.turn("a", 3, 50)
        assert len(samples) == 3 and all(s > 0 for s in samples)
        pid = w.by["a"].proc.pid
        state, before = _cpu_ticks(pid)
        time.sleep(STOPPED_QUIET_S)
        assert state == "T" and _cpu_ticks(pid) == (state, before)
        assert w.warm("a", 0.01) > 0  # continued for its next request, stopped after it
        assert _cpu_ticks(pid)[0] == "T"
    for x in deployed._idle:  # kept for the next measurement: waiting on its pipe
        assert _cpu_ticks(x.proc.pid)[0] in "SR"


def test_a_worker_that_dies_fails_its_candidate_and_is_never_reused(models):
    """A worker killed between its load and its run fails that candidate with a reason;
    the measurement's other candidates are measured, and the dead process is not kept."""
    with deployed.workers_for(models["inputs"]) as w:
        assert w.load([("a", models["plain"], {}), ("b", models["plain"], {})]) == {}
        dead = w.by["b"].proc
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
        with pytest.raises(deployed.WorkerError, match="process ended"):
            w.first("b")
        w.drop("b")
        assert len(w.first("a")) == 1
    assert all(x.proc is not dead for x in deployed._idle)
    assert all(x.proc.poll() is None for x in deployed._idle)
