"""GDAT jobs through a real daemon: gRPC (upload, submit, events, download, cancel) and a
drop folder, with real rank processes over gloo; and a daemon without torch.

World size 2, a tiny model, a small budget: what is checked is the plumbing (the
measurement itself is tests/test_gdat.py's).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import grpc
import pytest

from aoe.client import Client
from aoe.spec import JobSpec
from aoe.v1 import tuning_pb2
from aoe.wire import spec_to_pb

from .conftest import run_aoe
from .daemon_util import DaemonProcess, upload
from .helpers import wait_for
from .procs import children_running

torch = pytest.importorskip(
    "torch", reason="GDAT needs torch: pip install '.[gdat]' (make test installs it)"
)

from aoed.engine.world import RANK_MODULE  # noqa: E402

pytestmark = pytest.mark.slow


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        )

    def forward(self, x):
        return self.layers(x)


@pytest.fixture(scope="module")
def pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gdatd") / "tiny.pt2"
    torch.export.save(torch.export.export(Tiny(), (torch.randn(8, 32),)), str(path))
    return path


def _submit(stub, model_id: str, spec: JobSpec) -> str:
    reply = stub.SubmitJob(
        tuning_pb2.SubmitJobRequest(model_id=model_id, options=spec_to_pb(spec)), timeout=30
    )
    return reply.job_id or reply.job.job_id


GDAT = JobSpec(job_type="gdat", world_size=2, budget_s=3.0)


def test_a_gdat_job_through_grpc_reports_progress_downloads_and_cancels(
    pt2: Path, tmp_path: Path
) -> None:
    d = DaemonProcess(tmp_path / "d")
    d.start()
    try:
        stub = d.tuning()
        job_id = _submit(stub, upload(stub, pt2), GDAT)
        events = [
            r.event
            for r in stub.WatchJob(
                tuning_pb2.WatchJobRequest(job_id=job_id, include_logs=True), timeout=240
            )
        ]
        job = d.wait_job(job_id, 60)
        assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, (job.error, d.log())
        kinds = {e.WhichOneof("event") for e in events}
        assert {"state_change", "progress", "result"} <= kinds, kinds
        assert any(
            "starting a world of 2 on gloo" in e.log.message for e in events if e.HasField("log")
        )
        result = job.result
        assert result.job_type == tuning_pb2.JOB_TYPE_GDAT and result.baseline_ms > 0
        assert result.gdat.world_size == 2 and result.gdat.backend == "gloo"
        assert result.gdat.configurations and result.gdat.ddp_config["label"]

        # The result JSON and the DDP configuration, downloaded.
        with Client(d.socket) as client:
            ddp = client.download(job_id, "model", tmp_path)
            report = client.download(job_id, "json", tmp_path)
        assert ddp.name == "ddp_config.json" and "ddp_kwargs" in json.loads(ddp.read_text())
        doc = json.loads(report.read_text())
        assert (
            doc["details"]["ddp_config"]["ddp_kwargs"] == json.loads(ddp.read_text())["ddp_kwargs"]
        )

        # `aoe tune` on the daemon: the same layout, answered from the daemon's bank.
        out = tmp_path / "cli"
        r = run_aoe(
            "tune",
            str(pt2),
            "--job-type",
            "gdat",
            "--world-size",
            "2",
            "--socket",
            str(d.socket),
            "--output",
            str(out),
            "--no-progress",
        )
        assert r.returncode == 0, r.stderr
        assert f"from the bank: confirmed by {job_id}" in r.stdout and "  ddp  " in r.stdout, (
            r.stdout
        )
        assert (out / "ddp_config.json").is_file() and list(out.glob("aoe_result_gdat_*.json"))

        # User code is refused at the door, naming the option; the daemon goes on.
        with pytest.raises(grpc.RpcError) as err:
            _submit(stub, upload(stub, pt2), JobSpec(job_type="gdat", entry="build"))
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "runs no user code" in err.value.details()
        )

        # Cancelled once a rank process of it runs (most often the first, which reads the
        # program's gradient layout; the embedded case in test_gdat.py cancels a world's
        # ranks mid-request): every rank is gone, by pid.
        job_id = _submit(stub, upload(stub, pt2), GDAT.replace(repeat_tune=True))
        ranks = wait_for(
            lambda: children_running(d.proc.pid, RANK_MODULE), 120, "a rank process of the job"
        )
        stub.CancelJob(tuning_pb2.CancelJobRequest(job_id=job_id), timeout=30)
        assert d.wait_job(job_id, 60).state == tuning_pb2.JOB_STATE_CANCELLED
        wait_for(
            lambda: not any(Path(f"/proc/{p}").exists() for p in ranks),
            10,
            f"ranks {ranks} to exit",
        )
        assert children_running(d.proc.pid, RANK_MODULE) == set() and d.serving()
    finally:
        d.close()


def test_a_pt2_dropped_in_a_gdat_inbox_is_delivered_to_its_outbox(
    pt2: Path, tmp_path: Path
) -> None:
    d = DaemonProcess(tmp_path / "d")
    d.inbox.mkdir(parents=True)
    (d.inbox / "aoed.toml").write_text('job_type = "gdat"\nworld_size = 2\nbudget_s = 3.0\n')
    d.start()
    try:
        report = d.deliver("tiny.pt2", pt2.read_bytes())
        outbox = report.parent
        assert json.loads((outbox / "tiny_ddp_config.json").read_text())["bank_key"]
        doc = json.loads((outbox / "tiny_result.json").read_text())
        assert (
            doc["GDAT"]["gdat_tuning_result"] == "tuning successful"
            and doc["details"]["world_size"] == 2
        )
        text = report.read_text()
        assert "tiny_ddp_config.json" in text
        # In a training job's words: steps of the world and DDP's configuration, not models.
        assert "ms per step, tail " in text and "(DDP's defaults; " in text, text
        ddp = doc["details"]["ddp_config"]
        assert f"ddp:          {ddp['label']}: " in text, text
        assert "model" not in text.replace("tiny.pt2", ""), text
        failed = d.inbox.parent / "failed"
        assert not (d.inbox / "tiny.pt2").exists() and not (
            failed.exists() and any(failed.iterdir())
        )
    finally:
        d.close()


_NO_TORCH = textwrap.dedent("""
    import sys


    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}")


    sys.meta_path.insert(0, NoTorch())
""")


def test_a_daemon_without_torch_fails_a_gdat_job_in_one_line_and_goes_on(
    pt2: Path, tmp_path: Path
) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(_NO_TORCH)
    d = DaemonProcess(tmp_path / "d")
    env = d.env
    d.env = lambda: {
        **env(),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")])),
    }
    d.start()
    try:
        stub = d.tuning()
        job = d.wait_job(_submit(stub, upload(stub, pt2), GDAT), 60)
        assert job.state == tuning_pb2.JOB_STATE_FAILED
        assert "aoed[gdat]" in job.error and "\n" not in job.error, job.error
        assert d.serving() and stub.ListJobs(tuning_pb2.ListJobsRequest(), timeout=10).jobs
    finally:
        d.close()
