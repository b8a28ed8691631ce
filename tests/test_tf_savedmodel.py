"""A TensorFlow SavedModel (a directory with saved_model.pb, or a .tar of one: AOE's
--framework 3) is tuned for inference as the ONNX model tf2onnx converts it to in a
confined process (engine/tfconvert.py, backends/tensorflow/convert.py): embedded, in
AOE's spelling and through a daemon's drop folder; what is not one, or cannot be
converted, is refused in one line.

One tiny SavedModel (a dense layer, a ReLU and another, with a dynamic batch) is saved
once per module, in a child process: importing TensorFlow here would cost the test
process seconds and its log noise."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest

from aoe.v1 import tuning_pb2

from .conftest import run_aoe
from .daemon_util import DaemonProcess

pytest.importorskip("tf2onnx", reason="the tensorflow extra (tf2onnx) is not installed")

#: Saves the SavedModel at argv[1] and TensorFlow's outputs for two batch sizes beside
#: it (argv[2], an .npz): the reference the tuned ONNX model is compared with; and at
#: argv[3] a hostile one, whose loading writes the file argv[4].
_SAVE = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import tensorflow as tf

class Tiny(tf.Module):
    def __init__(self):
        super().__init__()
        self.w1 = tf.Variable(tf.random.stateless_normal((16, 32), seed=(1, 2)))
        self.b1 = tf.Variable(tf.random.stateless_normal((32,), seed=(3, 4)))
        self.w2 = tf.Variable(tf.random.stateless_normal((32, 8), seed=(5, 6)))

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
    def __call__(self, x):
        return {"y": tf.matmul(tf.nn.relu(tf.matmul(x, self.w1) + self.b1), self.w2)}

m = Tiny()
tf.saved_model.save(m, sys.argv[1], signatures={"serving_default": m.__call__})
rng = np.random.default_rng(0)
x3 = rng.standard_normal((3, 16)).astype(np.float32)
x5 = rng.standard_normal((5, 16)).astype(np.float32)
np.savez(sys.argv[2], x3=x3, y3=m(x3)["y"].numpy(), x5=x5, y5=m(x5)["y"].numpy())


# A resource whose initializer, which tf.saved_model.load runs, writes argv[4].
class Planted(tf.saved_model.experimental.TrackableResource):
    def _create_resource(self):
        return tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="planted")

    def _initialize(self):
        tf.io.write_file(sys.argv[4], "ran")
        return tf.raw_ops.AssignVariableOp(resource=self.resource_handle, value=1.0)


class Hostile(tf.Module):
    def __init__(self):
        super().__init__()
        self.planted = Planted()

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    def __call__(self, x):
        return {"y": x * 2.0}


h = Hostile()
tf.saved_model.save(h, sys.argv[3], signatures={"serving_default": h.__call__})
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """The SavedModel's directory and TensorFlow's own inputs and outputs: saved once for
    the whole run, by the first xdist worker that asks (the others wait for it and read
    the same files), since each save imports TensorFlow in a process of its own."""
    import fcntl
    import os

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "tf-saved"
    model, ref = folder / "tiny", folder / "ref.npz"
    hostile, marker = folder / "hostile", folder / "planted-ran"
    with open(shared / "tf-saved.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "saved").exists():
            folder.mkdir(exist_ok=True)
            r = subprocess.run(
                [sys.executable, "-c", _SAVE, str(model), str(ref), str(hostile), str(marker)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert r.returncode == 0, r.stderr[-3000:]
            (folder / "saved").touch()
    with np.load(ref) as data:
        return model, dict(data)


def _tune(model: Path, folder: Path, *extra: str):
    return run_aoe(
        "tune",
        str(model),
        "--job-type",
        "opat",
        "--local",
        "--no-progress",
        "--budget",
        "1",
        "--bank",
        str(folder / "bank"),
        "--output",
        str(folder / "out"),
        *extra,
    )


@pytest.fixture(scope="module")
def tuned(
    saved: tuple[Path, dict[str, np.ndarray]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict]:
    """One embedded `aoe tune DIR` of the SavedModel: its folder and its result."""
    folder = tmp_path_factory.mktemp("tuned")
    r = _tune(saved[0], folder)
    assert r.returncode == 0, r.stderr
    (path,) = (folder / "out").glob("aoe_result_opat_*.json")
    return folder, json.loads(path.read_text())


def _said(stderr: str) -> list[str]:
    """What a failed run said, less the lines that say it waits for the device lock (which
    another process on this machine may hold)."""
    return [ln for ln in stderr.strip().splitlines() if not ln.startswith("aoe: waiting for ")]


def _dynamic_batch(model: Path) -> str:
    (inp,) = onnx.load(str(model)).graph.input
    first = inp.type.tensor_type.shape.dim[0]
    assert first.dim_param and not first.dim_value, inp
    return first.dim_param


@pytest.mark.slow
def test_a_saved_model_ships_an_onnx_model_that_computes_what_tensorflow_does_at_any_batch(
    saved: tuple[Path, dict[str, np.ndarray]], tuned: tuple[Path, dict]
) -> None:
    import aoe

    ref = saved[1]
    folder, doc = tuned
    (converted,) = (folder / "out" / "aoe_workspace").glob("*/converted/tiny.onnx")
    onnx.checker.check_model(onnx.load(str(converted)))
    batch = _dynamic_batch(converted)  # the signature's None, kept
    said = next(n for n in doc["notes"] if n.startswith("tiny: tuned as the ONNX model tf2onnx"))
    assert "converted its signature 'serving_default' to (opset " in said, said
    assert said.endswith(f"dynamic dimensions kept: {batch} (x axis 0)"), said
    shipped = doc["tuned_model"] or str(converted)
    assert _dynamic_batch(Path(shipped))
    sess = aoe.session(shipped)
    (name,) = [i.name for i in sess.get_inputs()]
    for n in (3, 5):  # two batch sizes: the dimension is dynamic in what ships
        np.testing.assert_allclose(
            sess.run(None, {name: ref[f"x{n}"]})[0], ref[f"y{n}"], rtol=1e-4, atol=1e-5
        )


def test_a_folder_that_is_not_a_saved_model_is_refused_naming_what_is_missing(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "model"
    (folder / "variables").mkdir(parents=True)
    for argv in (
        ("tune", str(folder), "--local", "--output", str(tmp_path / "out")),
        ("--framework", "3", "--model", str(folder), "--output", str(tmp_path / "out")),
    ):
        r = run_aoe(*argv)
        assert r.returncode == 3, (argv, r.stderr)  # a ModelError
        assert f"error: {folder}: not a TensorFlow SavedModel (no saved_model.pb in it)" in r.stderr
        assert len(_said(r.stderr)) == 1, r.stderr
    assert not (tmp_path / "out" / "aoe_workspace").exists()


def test_framework_3_takes_saved_models_and_framework_5_onnx_models(
    saved: tuple[Path, dict[str, np.ndarray]], models: Path, tmp_path: Path
) -> None:
    r = run_aoe("--framework", "3", "--model", str(models / "mlp.onnx"))
    assert r.returncode == 2 and "TensorFlow models are taken as a SavedModel" in r.stderr
    r = run_aoe("--framework", "5", "--model", str(saved[0]))
    assert r.returncode == 2 and "pass --framework 3" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_broken_saved_model_fails_in_aoes_spelling_with_one_line_saying_why(
    saved: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """--framework 3 reaches the conversion: a saved_model.pb that is not one fails there,
    in one line naming the model and what is wrong, and nothing is tuned."""
    broken = tmp_path / "broken"
    shutil.copytree(saved[0], broken)
    (broken / "saved_model.pb").write_bytes(b"\x08\x01not a saved model at all")
    r = run_aoe(
        "--framework", "3", "--model", str(broken), "--job_type", "2",
        "--output", str(tmp_path / "out"), "--bank", str(tmp_path / "bank"),
        "--progress_bar", "off",
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    (line,) = _said(r.stderr)
    assert line.startswith("aoe: error: broken: saved_model.pb is not a readable SavedModel ("), (
        line
    )
    assert not list((tmp_path / "out").glob("aoe_result_*"))


@pytest.mark.slow
def test_what_a_hostile_saved_model_runs_while_it_converts_stays_in_its_sandbox(
    saved: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """Loading a SavedModel runs its resources' initializers: this one's writes a file
    beside the model, outside the job's workspace, which the converter may not write.
    The job fails in one line saying so, and the file is never written."""
    hostile = saved[0].parent / "hostile"
    marker = saved[0].parent / "planted-ran"
    r = _tune(hostile, tmp_path)
    assert r.returncode == 3, r.stderr
    (line,) = _said(r.stderr)
    assert line.startswith("aoe: error: hostile: tf2onnx could not convert signature"), line
    assert "PermissionDenied" in line, line
    assert not marker.exists()


def test_without_the_tensorflow_extra_a_saved_model_job_says_what_to_install(
    saved: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """tf2onnx made unimportable (as Python spells it: None in sys.modules) in the process
    that runs the job: it fails in one line naming the extra, and starts no converter."""
    code = (
        "import sys; sys.modules['tf2onnx'] = None\n"
        "from aoe.cli import main\n"
        f"sys.exit(main(['tune', {str(saved[0])!r}, '--local', '--no-progress', "
        f"'--output', {str(tmp_path / 'out')!r}, '--bank', {str(tmp_path / 'bank')!r}]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr  # an OptionError
    (line,) = _said(r.stderr)
    assert "tf2onnx is not installed: pip install 'aoed[tensorflow]'" in line, line
    assert not list((tmp_path / "out").glob("aoe_workspace/*/converted/convert.log"))


def _tar(folder: Path, archive: Path, *, arcname: str) -> bytes:
    with tarfile.open(archive, "w") as tar:
        tar.add(folder, arcname=arcname)
    return archive.read_bytes()


@pytest.mark.slow
@pytest.mark.long  # the conversion as the embedded case has it, on the daemon's surfaces
def test_a_daemon_tunes_a_saved_model_dropped_as_a_tar_named_by_path_or_uploaded(
    saved: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    import aoe

    ref = saved[1]
    good = _tar(saved[0], tmp_path / "good.tar", arcname="tiny")
    # A link in the archive: refused before anything is unpacked.
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        tar.add(saved[0], arcname="tiny")
        link = tarfile.TarInfo("tiny/variables/escape")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    d = DaemonProcess(tmp_path / "d")
    d.inbox.mkdir(parents=True)
    (d.inbox / "aoed.toml").write_text('job_type = "opat"\nbudget_s = 1.0\n')
    d.start()
    try:
        report = d.deliver("tiny.tar", good)
        outbox = report.parent
        assert report.read_text().startswith("aoed tuned tiny.tar\n"), report.read_text()
        notes = json.loads((outbox / "tiny_result.json").read_text())["notes"]
        assert any(n.startswith("tiny.tar: tuned as the ONNX model tf2onnx") for n in notes)
        tuned_model = outbox / "tiny_tuned.onnx"
        assert _dynamic_batch(tuned_model)
        sess = aoe.session(tuned_model)
        (name,) = [i.name for i in sess.get_inputs()]
        np.testing.assert_allclose(
            sess.run(None, {name: ref["x5"]})[0], ref["y5"], rtol=1e-4, atol=1e-5
        )
        (d.inbox / "evil.tar").write_bytes(evil.read_bytes())
        failed = d.inbox.parent / "failed"
        from .helpers import wait_for

        why = wait_for(
            lambda: next(failed.glob("evil.tar.error.txt"), None), 240, "evil.tar in failed/"
        )
        text = why.read_text()
        assert "member 'tiny/variables/escape' is a link" in text, text
        # By path over gRPC: a SavedModel's directory inside the allowed ones is a model;
        # a folder without saved_model.pb is refused naming it.
        empty = d.models / "empty"
        empty.mkdir()
        with pytest.raises(grpc.RpcError) as refused:
            d.tuning().SubmitJob(tuning_pb2.SubmitJobRequest(model_path=str(empty)), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no saved_model.pb in it" in (refused.value.details() or "")
        shutil.copytree(saved[0], d.models / "tiny")
        by_path = d.tuning().SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_path=str(d.models / "tiny"),
                options=tuning_pb2.JobOptions(budget_s=1.0, job_type=tuning_pb2.JOB_TYPE_OPAT),
            ),
            timeout=30,
        )
        assert d.wait_job(by_path.job_id).state == tuning_pb2.JOB_STATE_SUCCEEDED
        # `aoe tune DIR` on the daemon: the directory travels as a .tar of it.
        r = run_aoe(
            "tune", str(saved[0]), "--socket", str(d.socket), "--job-type", "opat",
            "--budget", "1", "--no-progress", "--output", str(tmp_path / "fetched"),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "tuning on the daemon" in r.stderr, r.stderr
        assert d.serving()
    finally:
        d.close()


def _archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes]], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


_PB = (_member("m/saved_model.pb"), b"\x08\x01")


@pytest.mark.parametrize(
    ("members", "mode", "said"),
    [
        ([_PB, (_member("m/../../escape"), b"x")], "w", "names a path outside"),
        ([_PB, (_member("/etc/cron.d/x"), b"x")], "w", "names a path outside"),
        ([_PB, (_member("m/v", tarfile.LNKTYPE, "m/saved_model.pb"), b"")], "w", "is a link"),
        ([_PB, (_member("m/f", tarfile.FIFOTYPE), b"")], "w", "not a file or folder"),
        ([_PB], "w:gz", "not a readable tar archive"),
        ([(_member("m/variables/v"), b"x")], "w", "no saved_model.pb in it"),
    ],
    ids=["dotdot", "absolute", "hardlink", "fifo", "gzip", "no-pb"],
)
def test_an_archive_is_refused_member_by_member_before_anything_is_unpacked(
    tmp_path: Path, members: list, mode: str, said: str
) -> None:
    """The converter's check of a dropped or uploaded .tar (read here without TensorFlow:
    the module imports it only to convert)."""
    from aoe.errors import ModelError
    from aoed.backends.tensorflow.convert import _unpack

    archive = _archive(tmp_path / "m.tar", members, mode)
    dest = tmp_path / "scratch"
    with pytest.raises(ModelError, match=said) as refused:
        _unpack(archive, dest, "m.tar")
    assert str(refused.value).startswith("m.tar: ")
    assert "\n" not in str(refused.value)
    if said != "no saved_model.pb in it":  # refused before anything was unpacked
        assert not dest.exists() or not any(dest.iterdir())
    assert not (tmp_path / "escape").exists()


def test_an_archive_holding_the_folder_or_its_files_unpacks_to_the_saved_model(
    tmp_path: Path,
) -> None:
    from aoed.backends.tensorflow.convert import _unpack

    nested = _archive(tmp_path / "a.tar", [_PB, (_member("m/variables/v"), b"x")])
    assert _unpack(nested, tmp_path / "a", "a.tar") == tmp_path / "a" / "m"
    flat = _archive(tmp_path / "b.tar", [(_member("saved_model.pb"), b"\x08\x01")])
    assert _unpack(flat, tmp_path / "b", "b.tar") == tmp_path / "b"


def test_a_sparse_member_is_refused_before_it_unpacks_to_more_than_the_archive(
    tmp_path: Path,
) -> None:
    """GNU tar's --sparse: a 50 MiB file of holes takes a few blocks in the archive."""
    if shutil.which("tar") is None:
        pytest.skip("no tar command to write a sparse member with")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "saved_model.pb").write_bytes(b"\x08\x01")
    with open(tmp_path / "m" / "big", "wb") as f:
        f.truncate(50 << 20)
    archive = tmp_path / "m.tar"
    subprocess.run(["tar", "-S", "-cf", str(archive), "-C", str(tmp_path), "m"], check=True)
    assert archive.stat().st_size < 1 << 20
    from aoe.errors import ModelError
    from aoed.backends.tensorflow.convert import _unpack

    with pytest.raises(ModelError, match="member 'm/big' is a sparse file"):
        _unpack(archive, tmp_path / "scratch", "m.tar")
    assert not (tmp_path / "scratch").exists()
