"""The metrics endpoint of a real daemon: scraped during a job and after it, parsed with
Prometheus' own text parser; and the [metrics] settings."""

from __future__ import annotations

import http.client
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from aoe.errors import OptionError
from aoe.v1 import tuning_pb2
from aoed import samples
from aoed.config import load_daemon_config
from tests.daemon_util import DaemonProcess, upload
from tests.helpers import wait_for
from tests.metrics_util import (
    HALF_A_REQUEST,
    Samples,
    metrics_address,
    open_fds,
    sample_value,
    scrape,
    server_side,
    url_port,
)

pytestmark = pytest.mark.slow


def _wait_for(
    url: str, cond: Callable[[Samples], bool], what: str, timeout: float = 120
) -> Samples:
    last: list[Samples] = []

    def scraped() -> Samples | None:
        last[:] = [scrape(url)]
        return last[0] if cond(last[0]) else None

    return wait_for(scraped, timeout, what, poll=0.1, detail=lambda: f"last scrape: {last}")


ACTIVE = ("preparing", "tuning", "verifying")


def test_a_scrape_during_a_job_shows_the_job_and_the_device_moving(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", extra_toml='[metrics]\nlisten = "127.0.0.1:0"\n')
    try:
        d.start()
        url = metrics_address(d)
        before = scrape(url)
        assert sample_value(before, "aoed_queue_length") == 0
        assert sum(sample_value(before, "aoed_jobs", state=s) for s in ACTIVE) == 0
        device = next(
            dict(k[1])["device"] for k in before if k[0] == "aoed_device_measurements_total"
        )
        path = d.models / "mlp.onnx"
        samples.save(samples.build("mlp"), path)
        model_id = upload(d.tuning(), path)
        job = (
            d.tuning()
            .SubmitJob(
                tuning_pb2.SubmitJobRequest(
                    model_id=model_id, options=tuning_pb2.JobOptions(budget_s=2.0)
                ),
                timeout=30,
            )
            .job_id
        )
        during = _wait_for(
            url,
            lambda s: (
                sample_value(s, "aoed_jobs", state="tuning") == 1
                and sample_value(s, "aoed_device_measurements_total", device=device) > 0
            ),
            "the job tuning and the device measuring",
        )
        final = d.wait_job(job)
        assert final.state == tuning_pb2.JOB_STATE_SUCCEEDED, final.error
        after = _wait_for(
            url, lambda s: sample_value(s, "aoed_jobs", state="succeeded") == 1, "the job succeeded"
        )
        # The job and device series moved between the scrape during the job and after it.
        assert sample_value(after, "aoed_jobs", state="tuning") == 0
        assert sample_value(after, "aoed_device_measurements_total", device=device) > sample_value(
            during, "aoed_device_measurements_total", device=device
        )
        assert (
            sample_value(after, "aoed_device_busy_seconds_total", device=device)
            > sample_value(during, "aoed_device_busy_seconds_total", device=device)
            > 0
        )
        assert sample_value(after, "aoed_bank_records", kind="trial") > 0
        assert sample_value(after, "aoed_bank_head_seq") > sample_value(
            before, "aoed_bank_head_seq"
        )
        assert sample_value(after, "aoed_bank_lookups_total", source="engine", result="miss") > 0
        assert sample_value(after, "aoed_compile_workers") == 1
        # RPCs by method and status, an error among them.
        with pytest.raises(grpc.RpcError):
            d.tuning().GetJob(tuning_pb2.GetJobRequest(job_id="no-such-job"), timeout=10)
        rpcs = scrape(url)
        assert (
            sample_value(rpcs, "aoed_rpcs_total", method="TuningService/SubmitJob", code="OK") == 1
        )
        assert (
            sample_value(rpcs, "aoed_rpcs_total", method="TuningService/GetJob", code="NOT_FOUND")
            == 1
        )
    finally:
        d.close()


ESTABLISHED, CLOSE_WAIT = "01", "08"


def _open_files_limits(pid: int) -> tuple[str, str]:
    """(soft, hard) of the process's open files, as /proc/PID/limits shows them."""
    with open(f"/proc/{pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return soft, hard


def _stall(port: int) -> socket.socket | None:
    """A connection that sends half a request and stalls (None: reset before it was up)."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
    except ConnectionResetError:
        return None
    try:
        s.sendall(HALF_A_REQUEST)
    except OSError:  # refused already
        pass
    return s


def _refused(url: str) -> bool:
    """True when a scrape is refused (the connection reset or closed unanswered), False
    when it is answered; a scrape left waiting fails the test."""
    try:
        urllib.request.urlopen(url, timeout=120).close()
    except (ConnectionResetError, http.client.RemoteDisconnected):
        return True
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionResetError):
            return True
        raise
    return False


def test_a_flood_of_stalled_connections_to_the_metrics_port_wedges_nothing(
    tmp_path: Path,
) -> None:
    """1,100 connections that send half a request and stall, against a daemon started
    with 256 of its 1024 descriptors: it raises its limit, keeps 16 of them (its
    max_connections) and closes the rest at once; gRPC and the drop folder go on; once
    they are gone its descriptors are back and nothing is left in CLOSE-WAIT."""
    d = DaemonProcess(
        tmp_path / "d",
        # Long enough that the 16 it takes stay taken for the whole test.
        extra_toml='[metrics]\nlisten = "127.0.0.1:0"\ntimeout_s = 300\n',
        nofile=(256, 1024),
    )
    d.inbox.mkdir()
    (d.inbox / "aoed.toml").write_text("budget_s = 1.0\n")
    flood: list[socket.socket | None] = []
    try:
        d.start()
        pid = d.proc.pid  # type: ignore[union-attr]
        assert _open_files_limits(pid) == ("1024", "1024"), "the soft limit is raised to the hard"
        url = metrics_address(d)
        port = url_port(url)
        assert scrape(url), "served before the flood"
        before = open_fds(pid)
        flood = [_stall(port) for _ in range(1100)]
        # The daemon keeps 16 and closes the others as they come: none waits in its
        # backlog, none holds a descriptor.
        wait_for(
            lambda: server_side(port).count(ESTABLISHED) <= 16,
            120,
            "the daemon keeping at most max_connections of the flood",
        )
        assert open_fds(pid) <= before + 16 + 8, "the flood holds at most 16 descriptors"
        # gRPC answers, the drop folder tunes, and a scrape is refused at once (every
        # slot is taken), not left waiting.
        assert d.serving()
        d.tuning().ListJobs(tuning_pb2.ListJobsRequest(), timeout=60)
        assert _refused(url)
        samples.save(samples.build("mlp"), d.inbox / ".flood.onnx.part")
        (d.inbox / ".flood.onnx.part").rename(d.inbox / "flood.onnx")
        outbox = d.inbox.parent / "outbox"
        wait_for(
            lambda: (outbox / "flood_tuned.onnx").exists(),
            300,
            f"the dropped model tuned during the flood:\n{d.log()[-3000:]}",
        )
        for s in flood:
            if s is not None:
                s.close()
        wait_for(
            lambda: (
                not server_side(port).count(ESTABLISHED) and not server_side(port).count(CLOSE_WAIT)
            ),
            60,
            "no connection of the flood left open or in CLOSE-WAIT",
        )
        wait_for(lambda: open_fds(pid) <= before + 8, 60, "the daemon's descriptors back")
        assert scrape(url), "served after the flood"
    finally:
        for s in flood:
            if s is not None:
                s.close()
        d.close()


def _config(tmp_path: Path, text: str):
    path = tmp_path / "aoed.toml"
    path.write_text(f'[listen]\nsocket = "{tmp_path}/s.sock"\n' + text)
    return load_daemon_config(path, env={})


def test_metrics_are_off_by_default_and_loopback_unless_allowed(tmp_path: Path) -> None:
    assert _config(tmp_path, "").metrics_listen == ""
    assert (
        _config(tmp_path, '[metrics]\nlisten = "127.0.0.1:9464"\n').metrics_listen
        == "127.0.0.1:9464"
    )
    with pytest.raises(
        OptionError, match=r"\[metrics\] listen = '0.0.0.0:9464': not a loopback address"
    ):
        _config(tmp_path, '[metrics]\nlisten = "0.0.0.0:9464"\n')
    cfg = _config(tmp_path, '[metrics]\nlisten = "0.0.0.0:9464"\nallow_remote = true\n')
    assert cfg.metrics_listen == "0.0.0.0:9464"
    with pytest.raises(OptionError, match="expected HOST:PORT"):
        _config(tmp_path, '[metrics]\nlisten = "9464"\n')


def test_the_endpoints_limits_have_defaults_and_bounds(tmp_path: Path) -> None:
    cfg = _config(tmp_path, '[metrics]\nlisten = "127.0.0.1:9464"\n')
    assert (cfg.metrics_max_connections, cfg.metrics_timeout_s) == (16, 10.0)
    cfg = _config(tmp_path, "[metrics]\nmax_connections = 4\ntimeout_s = 2.5\n")
    assert (cfg.metrics_max_connections, cfg.metrics_timeout_s) == (4, 2.5)
    with pytest.raises(OptionError, match=r"\[metrics\] max_connections = 0: must be between 1"):
        _config(tmp_path, "[metrics]\nmax_connections = 0\n")
    with pytest.raises(OptionError, match=r"\[metrics\] timeout_s = 0: must be between 0.1"):
        _config(tmp_path, "[metrics]\ntimeout_s = 0\n")


def test_follow_targets_over_tcp_need_tls_as_the_listener_does(tmp_path: Path) -> None:
    cfg = _config(tmp_path, '[bank]\nfollow = ["unix:///run/b/aoed.sock"]\n')
    assert cfg.follow == ("unix:///run/b/aoed.sock",)
    with pytest.raises(OptionError, match="a peer over TCP needs TLS"):
        _config(tmp_path, '[bank]\nfollow = ["dns:///gpu-02:7461"]\n')
    with pytest.raises(OptionError, match="follow_insecure_loopback"):
        _config(tmp_path, '[bank]\nfollow = ["127.0.0.1:7461"]\n')
    ok = _config(tmp_path, '[bank]\nfollow = ["127.0.0.1:7461"]\nfollow_insecure_loopback = true\n')
    assert ok.follow == ("127.0.0.1:7461",)
    with pytest.raises(OptionError, match="follow_ca = .*: no such file"):
        _config(
            tmp_path,
            f'[bank]\nfollow = ["dns:///gpu-02:7461"]\nfollow_ca = "{tmp_path}/none.pem"\n',
        )
    with pytest.raises(OptionError, match="expected a list of gRPC targets"):
        _config(tmp_path, '[bank]\nfollow = "unix:///x"\n')


def test_the_example_dashboard_uses_only_series_the_daemon_serves_and_each_panel_is_described() -> (
    None
):
    import json

    from aoed import metrics

    root = Path(__file__).resolve().parent.parent
    dash = json.loads((root / "deploy" / "grafana-dashboard.json").read_text())
    readme = (root / "deploy" / "README.md").read_text()
    served = set(re.findall(r"aoed_\w+", metrics.__doc__ or "")) | set(
        re.findall(r'"(aoed_\w+)"', Path(metrics.__file__).read_text())
    )
    for panel in dash["panels"]:
        assert f"| {panel['title']} |" in readme, (
            f"deploy/README.md does not describe the panel {panel['title']!r}"
        )
        for target in panel["targets"]:
            for name in re.findall(r"aoed_\w+", target["expr"]):
                assert name.removesuffix("_total") in served, (
                    f"{panel['title']}: {name} is not a series aoed serves"
                )
