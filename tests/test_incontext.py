"""A lossy candidate that fails the task gate on its own outputs is judged in the model.

The candidate here is a plugin strategy: a rank-8 product in place of a 1024x1024 weight
that is rank 8 plus a little noise. It is many times faster than the full product, and
its error (the noise it drops) fails the task gate on the product's own outputs. Where
the product's output is added to a residual stream five times its size, the model's
outputs meet the same limits, and the job keeps it; where the product's output is the
model's output, the model does not absorb the error, and the job keeps the float product.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from .conftest import held_alone, run_aoe
from .plugins import lowrank_env

#: The weight's side: large enough that the rank-8 product is several times faster than
#: int8's (on AMX, int8 of a 512-wide weight ran within 2x of it, and a busy machine's
#: noise could hide that).
SIDE = 1024


def _model(path: Path, residual: bool) -> Path:
    rng = np.random.default_rng(7)
    low = rng.standard_normal((SIDE, 8)) @ rng.standard_normal((8, SIDE))
    noise = rng.standard_normal((SIDE, SIDE))
    # ~0.5% of the energy is noise
    w = low / np.linalg.norm(low) + 0.07 * noise / np.linalg.norm(noise)
    w *= 0.2 * np.sqrt(SIDE) / np.sqrt((w**2).sum(axis=0).mean())  # outputs ~0.2x the input's
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y" if residual else "out"], name="proj")]
    if residual:
        nodes.append(helper.make_node("Add", ["x", "y"], ["out"], name="residual"))
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [128, SIDE])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [128, SIDE])],
        [numpy_helper.from_array((w / np.sqrt(SIDE)).astype(np.float32), "w")],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _tune(tmp_path: Path, residual: bool, searched: bool = True) -> dict:
    env = lowrank_env(tmp_path)
    src = _model(tmp_path / "m.onnx", residual)
    r = run_aoe(
        "tune",
        str(src),
        "--precision",
        "int8",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
        "--budget",
        # enough rounds that the rank-8 product is clearly faster than int8 on a busy machine
        "4",
        "--parallel",
        "1",
        "--no-progress",
        "--job-type",
        "opat",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    (path,) = (tmp_path / "o").glob("aoe_result_opat_*.json")
    doc = json.loads(path.read_text())
    (task,) = [t for t in doc["tasks"] if t["op_name"] == "proj"]
    if searched:
        low = next(c for c in task["candidates"] if c["strategy"] == "lowrank8")
        # outside the task gate on its own outputs
        assert low["ok"] and 0.99 < low["cosine"] < 0.9995, low
    return doc | {"task": task}


@pytest.fixture(scope="module")
def residual_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One job on the residual model: its folder (bank included) and its result. The
    bank-hit test starts from a copy of its bank."""
    folder = tmp_path_factory.mktemp("residual")
    with held_alone():
        return folder, _tune(folder, residual=True)


@pytest.mark.slow
def test_a_residual_stream_absorbs_the_error_and_the_candidate_is_kept(
    residual_job: tuple[Path, dict],
) -> None:
    _, doc = residual_job
    task = doc["task"]
    assert task["strategy"] == "lowrank8", task["rejected"]
    assert task["accuracy"]["model_cosine"] >= 0.9995, task["accuracy"]
    assert task["accuracy"]["cosine"] < 0.9995  # what the task alone reached, reported as such
    assert any(
        "the model with it alone reached cosine" in n and n.endswith("kept") for n in doc["notes"]
    ), doc["notes"]
    assert doc["accuracy"]["cosine"] >= 0.999  # and the end-to-end gate, on the tuned model


@pytest.mark.slow
def test_an_error_the_model_does_not_absorb_stays_rejected(tmp_path: Path) -> None:
    doc = _tune(tmp_path, residual=False)
    task = doc["task"]
    assert task["strategy"] != "lowrank8"
    (why,) = [r for r in task["rejected"] if r.startswith("lowrank8: ")]
    if "the model with it alone reached cosine" in why:  # judged in the model's context
        assert "outside the task budget of" in why, why
    else:
        # Only a candidate clearly faster than what passed is judged in context; on a busy
        # machine lowrank8 may not be, and the task's own gate is what rejected it.
        assert why.startswith("lowrank8: outside the accuracy budget (cosine "), why


@pytest.mark.slow
@pytest.mark.usefixtures("machine_alone")
def test_a_bank_entry_kept_in_context_is_checked_in_context_on_the_next_model(
    residual_job: tuple[Path, dict], tmp_path: Path
) -> None:
    first, doc = residual_job
    assert doc["task"]["strategy"] == "lowrank8"
    shutil.copytree(first / "bank", tmp_path / "bank")
    # the bank answers; the hit is checked on this model's weights
    doc = _tune(tmp_path, residual=True, searched=False)
    task = doc["task"]
    assert (task["update_mode"], task["strategy"]) == ("hit", "lowrank8"), (task, doc["notes"])
    assert not any("tuned again" in n for n in doc["notes"]), doc["notes"]
