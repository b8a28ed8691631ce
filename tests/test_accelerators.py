"""GPU discovery (aoe.accelerators) and what device fingerprints make of it.

No GPU is needed: nvidia-smi's answers are fixtures written from its documented format
(tests/fixtures/nvidia-smi/README.md), served by a fake nvidia-smi on PATH."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aoe.accelerators import Discovery, discover, parse_build_info, parse_gpus, runtime_versions
from aoe.device import Device
from aoe.errors import DeviceError
from aoe.fingerprint import device_fingerprint
from aoe.keys import canonical_json
from tests.fake_gpu import FIXTURES, install_nvidia_smi, path_with


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install a fake nvidia-smi answering from a fixture; discovery is re-read."""

    def install(fixture: str) -> None:
        install_nvidia_smi(tmp_path / "bin", fixture)
        monkeypatch.setenv("PATH", path_with(tmp_path / "bin"))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        discover.cache_clear()

    yield install
    discover.cache_clear()


def test_parse_gpus_reads_every_documented_field() -> None:
    (h100,) = parse_gpus((FIXTURES / "h100.csv").read_text())
    assert (
        h100.index,
        h100.name,
        h100.compute_capability,
        h100.memory_mib,
        h100.driver_version,
    ) == (0, "NVIDIA H100 80GB HBM3", "9.0", 81559, "580.159.04")
    assert h100.uuid.startswith("GPU-") and h100.pci_bus_id == "00000000:00:05.0"


def test_parse_gpus_reads_several_and_takes_no_value_as_empty() -> None:
    gpus = parse_gpus((FIXTURES / "mixed.csv").read_text())
    assert [(g.index, g.name, g.compute_capability) for g in gpus] == [
        (0, "NVIDIA A100-SXM4-40GB", "8.0"),
        (1, "Tesla T4", "7.5"),
        (2, "NVIDIA GeForce RTX 4090", ""),
    ]


def test_parse_gpus_names_a_malformed_line() -> None:
    with pytest.raises(ValueError, match="nvidia-smi line 2: 3 values for 7 fields"):
        parse_gpus((FIXTURES / "h100.csv").read_text() + "1, Tesla T4, 7.5\n")
    with pytest.raises(ValueError, match="line 1: index 'GPU' .* is not a number"):
        parse_gpus("GPU, x, 9.0, 1, 2, 3, 4\n")


def test_build_info_is_read_as_data_never_run() -> None:
    text = (
        "package_name = 'onnxruntime-gpu'\n__version__ = '1.31.1'\ncuda_version = '13.0'\n"
        "cudart_version = 13000\nimport os\nos.system('false')\nx = f()\n"
    )
    assert parse_build_info(text) == {
        "package_name": "onnxruntime-gpu",
        "__version__": "1.31.1",
        "cuda_version": "13.0",
        "cudart_version": "13000",
    }
    assert parse_build_info("def (:") == {}


def test_runtime_versions_name_this_onnxruntime() -> None:
    import onnxruntime

    v = runtime_versions()
    assert v["onnxruntime"] == onnxruntime.__version__
    assert v["package"] in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-cann")
    assert set(v) == {"onnxruntime", "package", "cuda", "cudnn", "tensorrt"}


def test_discover_runs_nvidia_smi(fake_smi) -> None:
    fake_smi("mixed.csv")
    found = discover()
    assert [g.name for g in found.gpus] == [
        "NVIDIA A100-SXM4-40GB",
        "Tesla T4",
        "NVIDIA GeForce RTX 4090",
    ]
    assert found.note == "" and found.gpu(1).memory_mib == 15360 and found.gpu(7) is None


def test_discover_asks_an_old_driver_again_without_compute_capability(fake_smi) -> None:
    fake_smi("old-driver.txt")
    found = discover()
    assert [(g.name, g.compute_capability, g.memory_mib) for g in found.gpus] == [
        ("Tesla V100-SXM2-16GB", "", 16160)
    ]
    assert "compute capability" in found.note


def test_discover_without_nvidia_smi_has_no_gpus_and_says_why(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    discover.cache_clear()
    try:
        assert discover() == Discovery((), "no nvidia-smi on PATH (no NVIDIA driver installed)")
    finally:
        discover.cache_clear()


def _facts(**changes: str) -> dict[str, str]:
    base = {
        "model": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0",
        "driver": "580.159.04",
        "cuda": "13.0",
        "cudnn": "9.14.0",
        "tensorrt": "10.13.3",
    }
    return {**base, **changes}


@pytest.mark.parametrize(
    "field,other",
    [
        ("model", "NVIDIA A100-SXM4-40GB"),
        ("compute_capability", "8.0"),
        ("driver", "575.57.08"),
        ("cuda", "12.8"),
        ("cudnn", "9.1.0"),
        ("tensorrt", "10.9.0"),
    ],
)
def test_a_gpu_fingerprint_differs_when_any_fact_differs(field: str, other: str) -> None:
    a = device_fingerprint("CUDAExecutionProvider", {}, _facts())
    b = device_fingerprint("CUDAExecutionProvider", {}, _facts(**{field: other}))
    assert a.digest != b.digest
    assert a.accelerator[field] != b.accelerator[field] and a.hardware == "NVIDIA H100 80GB HBM3"


def test_a_gpu_fingerprint_differs_by_provider_and_implementation_options() -> None:
    base = device_fingerprint("CUDAExecutionProvider", {}, _facts())
    assert device_fingerprint("TensorrtExecutionProvider", {}, _facts()).digest != base.digest
    assert (
        device_fingerprint("CUDAExecutionProvider", {"use_tf32": "0"}, _facts()).digest
        != base.digest
    )
    assert device_fingerprint("CUDAExecutionProvider", {}, _facts()).digest == base.digest


def test_the_cpu_fingerprint_keeps_its_layout_so_existing_banks_stay_valid() -> None:
    """The CPU's description is exactly the one bank keys were made with before GPUs
    were described: these five fields, nothing added."""
    fp = Device.parse("cpu").fingerprint()
    desc = {
        "ep": "CPUExecutionProvider",
        "hardware": fp.hardware,
        "isa": list(fp.isa_flags),
        "runtime": fp.runtime_version,
        "options": {},
    }
    assert fp.canonical_json == canonical_json(desc)
    assert fp.digest == hashlib.sha256(canonical_json(desc).encode("ascii")).hexdigest()
    assert fp.digest == device_fingerprint().digest and fp.accelerator == {}


def test_a_cuda_device_is_fingerprinted_by_the_gpu_nvidia_smi_names(fake_smi) -> None:
    fake_smi("mixed.csv")
    a100, t4 = Device.parse("cuda:0").fingerprint(), Device.parse("cuda:1").fingerprint()
    assert (a100.hardware, a100.accelerator["compute_capability"]) == (
        "NVIDIA A100-SXM4-40GB",
        "8.0",
    )
    assert (t4.hardware, t4.accelerator["driver"]) == ("Tesla T4", "535.104.05")
    assert a100.digest != t4.digest, "a decision from one GPU model is never served on another"
    assert Device.parse("tensorrt:0").fingerprint().digest != a100.digest


def test_identical_gpus_share_a_fingerprint(fake_smi) -> None:
    fake_smi("two-h100.csv")
    assert [g.index for g in discover().gpus] == [0, 1]
    assert (
        Device.parse("cuda:0").fingerprint().digest == Device.parse("cuda:1").fingerprint().digest
    )


def test_a_missing_gpu_is_a_device_error_naming_what_there_is(fake_smi) -> None:
    fake_smi("h100.csv")
    with pytest.raises(
        DeviceError, match=r"cuda:3 .*no such NVIDIA GPU \(GPUs: 0: NVIDIA H100 80GB HBM3\)"
    ):
        Device.parse("cuda:3").fingerprint()


def test_cuda_visible_devices_maps_cuda_indices_to_gpus(fake_smi, monkeypatch) -> None:
    fake_smi("mixed.csv")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-1b2c3d4e")
    assert Device.parse("cuda:0").physical_index() == 2
    assert Device.parse("cuda:1").accelerator()["model"] == "Tesla T4"
    with pytest.raises(DeviceError, match="shows 2 GPU"):
        Device.parse("cuda:2").physical_index()


def test_cuda_and_tensorrt_on_one_gpu_share_one_device_lock(tmp_path: Path) -> None:
    from aoed.backends.ort.runtime import ORT
    from aoed.engine.device import DeviceAgent

    agents = [
        DeviceAgent(Device.parse(d), None, tmp_path / "logs", tmp_path / "run", runtime=ORT)
        for d in ("cuda:0", "tensorrt:0")
    ]
    assert agents[0].lock.path == agents[1].lock.path, (
        "two providers of one GPU must not measure at once"
    )
    assert (
        DeviceAgent(
            Device.parse("cuda:1"), None, tmp_path / "logs", tmp_path / "run", runtime=ORT
        ).lock.path
        != agents[0].lock.path
    )
    assert (
        DeviceAgent(
            Device.parse("cpu"), None, tmp_path / "logs", tmp_path / "run", runtime=ORT
        ).lock.path.name
        == "device-cpu.lock"
    )


# ---------------------------------------------------------------- aoe devices / ListDevices


def test_aoe_devices_local_lists_each_gpu_under_both_providers(tmp_path: Path) -> None:
    from tests.conftest import run_aoe

    install_nvidia_smi(tmp_path / "bin", "mixed.csv")
    r = run_aoe("devices", "--local", env={"PATH": path_with(tmp_path / "bin")})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("cpu ") and "cores)" in lines[1]
    ids = [line.split()[0] for line in lines[1:]]
    assert ids[:7] == [
        "cpu",
        "cuda:0",
        "tensorrt:0",
        "cuda:1",
        "tensorrt:1",
        "cuda:2",
        "tensorrt:2",
    ]
    assert ids[7:] and all(i.startswith("openvino") for i in ids[7:]), ids  # then OpenVINO's
    t4 = next(line for line in lines if line.startswith("cuda:1 "))
    assert "Tesla T4 (compute 7.5, 15360 MiB), driver 535.104.05" in t4
    # This machine's onnxruntime is the CPU build: the GPUs are listed, and why they are unusable.
    assert "unusable" in t4 and "install onnxruntime-gpu" in t4


def test_list_devices_names_the_daemons_device_first_and_the_gpus_it_could_use(
    tmp_path: Path, monkeypatch
) -> None:
    from aoe.v1 import devices_pb2
    from tests.daemon_util import DaemonProcess

    install_nvidia_smi(tmp_path / "bin", "mixed.csv")
    monkeypatch.setenv("PATH", path_with(tmp_path / "bin"))
    d = DaemonProcess(tmp_path / "d")
    d.start()
    try:
        devices = d.devices().ListDevices(devices_pb2.ListDevicesRequest()).devices
        # A child looked for OpenVINO: importing it forks, and the daemon has started gRPC.
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    finally:
        d.close()
    assert "libopenvino" not in maps
    assert [(x.id, x.configured) for x in devices][:3] == [
        ("cpu", True),
        ("cuda:0", False),
        ("tensorrt:0", False),
    ]
    cpu, a100, t4 = devices[0], devices[1], devices[3]
    assert cpu.fingerprint.digest and not cpu.HasField("accelerator") and not cpu.unusable
    assert (
        a100.accelerator.name,
        a100.accelerator.compute_capability,
        a100.accelerator.memory_mib,
    ) == ("NVIDIA A100-SXM4-40GB", "8.0", 40960)
    assert (
        t4.accelerator.driver_version == "535.104.05"
        and t4.execution_provider == "CUDAExecutionProvider"
    )
    assert a100.fingerprint.digest and a100.fingerprint.digest != t4.fingerprint.digest
    assert (
        "CUDAExecutionProvider" in a100.unusable
        and a100.versions["onnxruntime"] == cpu.versions["onnxruntime"]
    )
    # The CPU names the OpenVINO its jobs may ship on, where it is installed; a GPU never.
    assert "openvino" not in a100.versions and "OpenVINO" not in a100.description
    if importlib.util.find_spec("openvino") is None:
        assert "openvino" not in cpu.versions and "OpenVINO" not in cpu.description
    else:
        import openvino

        version = openvino.get_version().split("-")[0]
        assert cpu.versions["openvino"] == version, dict(cpu.versions)
        assert cpu.description.endswith(f", OpenVINO {version}"), cpu.description


def test_fingerprinting_the_cpu_starts_no_process() -> None:
    """A daemon fingerprints its CPU after gRPC starts; a child started then (such as
    `platform.processor()`'s `uname -p`) would carry the daemon's environment, the service
    manager's variables included."""
    code = textwrap.dedent(
        """
        import sys
        started = []
        sys.addaudithook(lambda ev, args: started.append(args[0]) if ev in (
            "subprocess.Popen", "os.posix_spawn", "os.fork", "os.exec") else None)
        from aoe.fingerprint import cpu_model_and_flags, device_fingerprint
        model, _ = cpu_model_and_flags()
        device_fingerprint()
        assert model, "no model"
        print(repr(started))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
