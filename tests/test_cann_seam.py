"""CANN by the same door, checked at the hardware seam only: aoed's device agent and its
real measurement runner over a fake CANN provider (tests/fake_cann.py: onnxruntime that
claims the provider, checks its documented options, and runs on the CPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import trio

from aoe.device import Device
from aoed import samples
from aoed.backends.ort import accel
from aoed.backends.ort.runtime import ORT
from aoed.engine.device import DeviceAgent
from aoed.engine.messages import Candidate, MeasurePlan, MeasureRequest
from aoed.engine.session import base_options, merge_options

#: ONNX Runtime with the fake CANN provider's runner: the same runtime, another device
FAKE_CANN = dataclasses.replace(ORT, runner_module="tests.fake_cann")


async def test_cann_options_reach_the_provider_and_candidates_are_measured(
    tmp_path: Path, monkeypatch
) -> None:
    log = tmp_path / "cann.log"
    monkeypatch.setenv("AOED_FAKE_CANN_LOG", str(log))
    model = tmp_path / "mlp.onnx"
    samples.save(samples.build("mlp"), model)
    import onnx

    inp = onnx.load(model).graph.input[0]
    shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    np.savez(
        tmp_path / "inputs.npz",
        **{inp.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)},
    )
    npu = Device.parse("cann:0")
    base = base_options(npu)
    cands = [Candidate("current", model, base)]
    for name, values in accel.dimensions(npu, "fp16"):
        cands += [
            Candidate(f"{name}{i}", model, merge_options(base, v)) for i, v in enumerate(values)
        ]
    agent = DeviceAgent(npu, None, tmp_path / "logs", tmp_path / "run", runtime=FAKE_CANN)
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.run)
        assert "CANNExecutionProvider" in agent.providers
        reply = await agent.call(
            MeasureRequest(
                tuple(cands), tmp_path / "inputs.npz", "current", npu, MeasurePlan.fixed(3, 5.0)
            )
        )
        nursery.cancel_scope.cancel()
    results = reply.results
    assert set(results) == {c.id for c in cands} and all(r.ok for r in results.values()), results
    assert all(r.median_us > 0 and r.cosine > 0.9999 for r in results.values())
    seen = [json.loads(line)["options"] for line in log.read_text().splitlines()]
    assert {s.get("precision_mode") for s in seen} >= {"force_fp16", "allow_mix_precision"}
    assert {"enable_cann_graph": "0", "device_id": "0"}.items() <= next(
        s for s in seen if "enable_cann_graph" in s
    ).items()
