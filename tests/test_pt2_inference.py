"""A torch.export program (.pt2) given to an ONNX job type is tuned for inference, as the
ONNX model torch.onnx's exporter makes of it in a confined process (engine/onnxjob.py),
embedded and through a daemon's drop folder; a hostile one is refused before anything
loads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from .conftest import run_aoe
from .daemon_util import DaemonProcess

torch = pytest.importorskip("torch", reason="the gdat extra (torch) is not installed")

from .hostile_pt2 import KINDS, root_of, tiny_program  # noqa: E402


def _tune(model: Path, folder: Path, *extra: str):
    """`aoe tune` of `model` as an OPAT job, embedded, its bank and outputs in `folder`."""
    return run_aoe(
        "tune",
        str(model),
        "--job-type",
        "opat",
        "--no-progress",
        "--bank",
        str(folder / "bank"),
        "--output",
        str(folder / "out"),
        *extra,
    )


def _static_program(path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A small program with static shapes, its example input and its output there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16)
    ).eval()
    x = torch.randn(4, 64)
    ep = torch.export.export(model, (x,))
    torch.export.save(ep, str(path))
    with torch.no_grad():
        y = model(x)
    return path, x.numpy(), y.numpy()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, np.ndarray, np.ndarray]:
    """One embedded `aoe tune` of a .pt2: its folder, its result, the example input and
    the program's own output there."""
    folder = tmp_path_factory.mktemp("pt2")
    pt2, x, y = _static_program(folder / "mlp.pt2")
    r = _tune(pt2, folder, "--budget", "2")
    assert r.returncode == 0, r.stderr
    (path,) = (folder / "out").glob("aoe_result_opat_*.json")
    return folder, json.loads(path.read_text()), x, y


@pytest.mark.slow
def test_a_pt2_is_tuned_as_its_onnx_export_and_the_tuned_model_computes_the_program(
    tuned: tuple[Path, dict, np.ndarray, np.ndarray],
) -> None:
    import onnxruntime as ort

    import aoe

    folder, doc, x, y = tuned
    assert any(
        n.startswith("mlp.pt2: tuned as the ONNX model torch.onnx exported from it")
        for n in doc["notes"]
    ), doc["notes"]
    (converted,) = (folder / "out" / "aoe_workspace").glob("*/converted/mlp.onnx")
    onnx.checker.check_model(onnx.load(str(converted)))
    # What ships is an ONNX model that computes what the program computes.
    shipped = doc["tuned_model"] or str(converted)
    assert shipped.endswith(".onnx")
    sess = aoe.session(shipped)
    (name,) = [i.name for i in sess.get_inputs()]
    got = sess.run(None, {name: x})[0]
    np.testing.assert_allclose(got, y, rtol=1e-4, atol=1e-5)
    # and the stock runtime opens it as it is
    plain = ort.InferenceSession(shipped, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(plain.run(None, {name: x})[0], y, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_pt2_with_a_dynamic_batch_is_tuned_over_its_declared_range_and_keeps_it(
    tmp_path: Path,
) -> None:
    """No shape flags: the export keeps the batch dimension symbolic, the job measures
    over the range the program declares for it (Dim min=2, max=1024), and the tuned model
    keeps the dimension."""
    pt2 = tiny_program(tmp_path / "tiny.pt2")
    r = _tune(pt2, tmp_path, "--budget", "1")
    assert r.returncode == 0, r.stderr
    (converted,) = (tmp_path / "out" / "aoe_workspace").glob("*/converted/tiny.onnx")
    (inp,) = onnx.load(str(converted)).graph.input
    first = inp.type.tensor_type.shape.dim[0]
    assert first.dim_param and not first.dim_value, inp  # symbolic, as the program left it
    (path,) = (tmp_path / "out").glob("aoe_result_opat_*.json")
    doc = json.loads(path.read_text())
    said = next(n for n in doc["notes"] if n.startswith("tiny.pt2: tuned as the ONNX model"))
    assert f"dynamic dimensions kept: {first.dim_param}" in said, said
    assert said.endswith(f"the ranges the program declares: {inp.name}:2~1024,32"), said
    (shipped,) = onnx.load(doc["tuned_model"]).graph.input
    assert shipped.type.tensor_type.shape.dim[0].dim_param, shipped


@pytest.mark.slow
def test_a_hostile_pt2_for_inference_is_refused_before_loading_naming_the_member(
    tmp_path: Path,
) -> None:
    base = tiny_program(tmp_path / "tiny.pt2")
    marker = tmp_path / "ran"
    kind = KINDS["opaque_object"]
    evil = kind.build(base, tmp_path / "evil.pt2", marker)
    r = _tune(evil, tmp_path, "--input-shape", "x:8,32")
    assert r.returncode != 0
    assert f"{evil}: refused before loading: {root_of(base)}/{kind.member}" in r.stderr, r.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_a_pt2_dropped_in_an_inbox_comes_out_tuned_for_inference(tmp_path: Path) -> None:
    pt2, x, y = _static_program(tmp_path / "mlp.pt2")
    d = DaemonProcess(tmp_path / "d")
    d.inbox.mkdir(parents=True)
    (d.inbox / "aoed.toml").write_text('job_type = "opat"\nbudget_s = 2.0\n')
    d.start()
    try:
        report = d.deliver("mlp.pt2", pt2.read_bytes())
        outbox = report.parent
        assert report.read_text().startswith("aoed tuned mlp.pt2\n"), report.read_text()
        notes = json.loads((outbox / "mlp_result.json").read_text())["notes"]
        assert any(n.startswith("mlp.pt2: tuned as the ONNX model torch.onnx") for n in notes)
        tuned_model = outbox / "mlp_tuned.onnx"
        import aoe

        sess = aoe.session(tuned_model)
        (name,) = [i.name for i in sess.get_inputs()]
        np.testing.assert_allclose(sess.run(None, {name: x})[0], y, rtol=1e-4, atol=1e-5)
        assert d.serving()
    finally:
        d.close()


@pytest.mark.slow
def test_a_module_from_the_python_api_is_tuned_with_its_dynamic_batch_kept(
    tmp_path: Path,
) -> None:
    from aoe.config import load_config
    from aoe.spec import JobSpec, JobType
    from aoed import embedded

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    batch = torch.export.Dim("batch", min=2, max=64)
    config = load_config(env={}).replace(bank=tmp_path / "bank")
    outcome = embedded.tune_module(
        module,
        (torch.randn(4, 32),),
        JobSpec(job_type=JobType.OPAT, budget_s=1.0, input_shapes={"input": (4, 32)}),
        tmp_path / "out",
        dynamic_shapes=({0: batch},),
        name="mlp",
        config=config,
    )
    assert (tmp_path / "out" / "mlp.pt2").is_file()
    (converted,) = (tmp_path / "out" / "aoe_workspace").glob("*/converted/mlp.onnx")
    (inp,) = onnx.load(str(converted)).graph.input
    assert inp.type.tensor_type.shape.dim[0].dim_param, inp
    assert any(n.startswith("mlp.pt2: tuned as the ONNX model") for n in outcome.notes)
    with pytest.raises(Exception, match="torch.export could not export it"):
        embedded.tune_module(
            _Branchy(), (torch.randn(4, 32),), JobSpec(job_type=JobType.OPAT), tmp_path / "bad"
        )


class _Branchy(torch.nn.Module):
    """Control flow on a tensor's value: torch.export refuses it."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x
