"""The `aoe` command line itself (one parser, one error style) and the config module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aoe.config import load_config
from aoe.device import CPU, Device
from aoe.errors import OptionError

from .conftest import run_aoe


def test_help_lists_every_command_with_a_line_each() -> None:
    r = run_aoe("--help")
    assert r.returncode == 0
    for cmd, words in (("tune", "embedded"), ("compile", "bank alone"), ("bank", "knowledge bank")):
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith(f"    {cmd} ")]
        assert words in line
    assert "--framework 5" in r.stdout  # AOE's spelling is documented
    sub = run_aoe("bank", "--help")
    assert all(c in sub.stdout for c in ("stats", "lookup", "export", "import", "prune", "verify"))


def test_version_works_alone() -> None:
    r = run_aoe("--version")
    assert r.returncode == 0 and r.stdout.startswith("aoe ")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["foo"], "unknown command 'foo'"),
        (["bank", "frobnicate"], "unknown command 'frobnicate'"),
        (["tune"], "tune: the following arguments are required: model"),
        (["tune", "m.onnx", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ([], "required: COMMAND"),
    ],
)
def test_usage_errors_are_one_line_with_exit_code_2(args: list[str], needle: str) -> None:
    r = run_aoe(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aoe: error: ") and needle in lines[0], lines


def test_ascend_device_id_selects_the_npu_and_says_which_provider_is_missing(
    models: Path, tmp_path: Path
) -> None:
    r = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
        "--no-progress",
        env={"ASCEND_DEVICE_ID": "1"},
    )
    assert r.returncode == 5, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "ASCEND_DEVICE_ID=1 selects cann:1" in line and "CANNExecutionProvider" in line
    assert "onnxruntime-cann" in line
    # --device wins over the variable.
    cfg = load_config(env={"ASCEND_DEVICE_ID": "1"}).replace(device=CPU)
    assert cfg.device == CPU and cfg.sources["device"] == "command line"


def test_config_file_then_environment_then_command_line(tmp_path: Path) -> None:
    toml = tmp_path / "aoed.toml"
    toml.write_text(
        '[bank]\npath = "/srv/bank"\nlayers = ["/srv/team"]\n'
        '[tuning]\nparallel = 3\nrepeat_tune = true\ndevice = "cuda:1"\nplugins = ["p1"]\n'
        '[engine]\ndedicated_cores = "auto"\nworker_memory_mb = 4096\n'
    )
    cfg = load_config(toml, env={})
    assert cfg.bank == Path("/srv/bank") and cfg.bank_layers == (Path("/srv/team"),)
    assert (cfg.parallel, cfg.repeat_tune, cfg.device, cfg.plugins) == (
        3,
        True,
        Device("cuda", 1),
        ("p1",),
    )
    assert cfg.dedicated_cores is None and cfg.worker_memory_mb == 4096
    assert cfg.sources["parallel"] == f"{toml} [tuning] parallel"
    env = {
        "TUNE_BANK_PATH": "/env/bank",
        "TE_PARALLEL_COMPILER": "5",
        "REPEAT_TUNE": "False",
        "AOED_BANK_LAYERS": os.pathsep.join(["/a", "", "/b"]),
    }
    cfg = load_config(toml, env=env)
    assert cfg.bank == Path("/env/bank") and cfg.parallel == 5 and cfg.repeat_tune is False
    assert cfg.bank_layers == (Path("/a"), Path("/b")) and cfg.sources["bank"] == "TUNE_BANK_PATH"
    assert cfg.replace(parallel=2, bank=None).parallel == 2  # None leaves a value as it was
    assert load_config(env={"AOED_CONFIG": str(toml)}).parallel == 3
    # What `--runtime auto` may ship on: the file's, then the environment's, checked by name.
    toml.write_text('[tuning]\nruntime = "openvino"\n')
    assert load_config(toml, env={}).runtime == "openvino"
    cfg = load_config(toml, env={"AOED_TUNING_RUNTIME": "onnxruntime"})
    assert cfg.runtime == "onnxruntime" and cfg.sources["runtime"] == "AOED_TUNING_RUNTIME"
    with pytest.raises(OptionError, match="AOED_TUNING_RUNTIME='tvm': expected one of auto, "):
        load_config(env={"AOED_TUNING_RUNTIME": "tvm"})


def test_engine_limits_come_from_the_config_with_the_constants_as_defaults(tmp_path: Path) -> None:
    from aoed.engine.prep import MAX_MODEL_BYTES, MAX_NODES, MAX_TENSOR_BYTES, Limits

    assert Limits.of(load_config(env={})) == Limits()  # the defaults are prep's constants
    assert (Limits().model_bytes, Limits().nodes, Limits().tensor_bytes) == (
        MAX_MODEL_BYTES,
        MAX_NODES,
        MAX_TENSOR_BYTES,
    )
    toml = tmp_path / "aoed.toml"
    toml.write_text(
        "[engine]\nmax_model_mb = 64\nmax_nodes = 500\nmax_tensor_mb = 16\n"
        "compile_timeout_s = 2.5\nstage_timeout_s = 60\n"
    )
    cfg = load_config(toml, env={})
    assert (cfg.max_model_mb, cfg.max_nodes, cfg.max_tensor_mb) == (64, 500, 16)
    assert (cfg.compile_timeout_s, cfg.stage_timeout_s) == (2.5, 60.0)
    assert cfg.sources["max_nodes"] == f"{toml} [engine] max_nodes"
    assert Limits.of(cfg) == Limits(model_bytes=64 << 20, nodes=500, tensor_bytes=16 << 20)


@pytest.mark.parametrize(
    ("text", "env", "needle"),
    [
        (
            "[engine]\nmax_nodes = 0\n",
            {},
            "[engine] max_nodes = 0: must be between 1 and 1000000000",
        ),
        (
            '[engine]\nmax_model_mb = "lots"\n',
            {},
            "[engine] max_model_mb = 'lots': expected a whole number of MiB",
        ),
        (
            "[engine]\nmax_tensor_mb = 1.5\n",
            {},
            "[engine] max_tensor_mb = 1.5: expected a whole number of MiB",
        ),
        (
            "[engine]\nmax_nodes = true\n",
            {},
            "[engine] max_nodes = True: expected a whole number of nodes",
        ),
        (
            "[engine]\ncompile_timeout_s = 0\n",
            {},
            "[engine] compile_timeout_s = 0: must be between 1 and 604800",
        ),
        (
            '[engine]\nstage_timeout_s = "soon"\n',
            {},
            "[engine] stage_timeout_s = 'soon': expected a number of seconds",
        ),
        (
            "[engine]\nstage_timeout_s = nan\n",
            {},
            "[engine] stage_timeout_s = nan: must be between 1 and 604800",
        ),
        (
            "[engine]\ncompile_timeout_s = []\n",
            {},
            "[engine] compile_timeout_s = []: expected a number of seconds",
        ),
        ("[engine]\nworker_memory_mb = 300\n", {}, "worker_memory_mb=300 ("),
        ("[engine]\nworker_memory_mb = -1\n", {}, "must be 0 (no limit) or at least 1024 MiB"),
    ],
)
def test_bad_engine_limits_are_option_errors_naming_the_key(
    tmp_path: Path, text: str, env: dict, needle: str
) -> None:
    toml = tmp_path / "aoed.toml"
    toml.write_text(text)
    with pytest.raises(OptionError) as err:
        load_config(toml, env=env)
    assert needle in str(err.value) and str(toml) in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("text", "env", "needle"),
    [
        ("[tuning]\nparallel = 99\n", {}, "[tuning] parallel = 99: must be between 1 and 32"),
        ("[tuning]\nthreads = 2\n", {}, "[tuning] threads: unknown setting"),
        ("[tuning\n", {}, "not valid TOML"),
        ("", {"REPEAT_TUNE": "maybe"}, "REPEAT_TUNE='maybe'"),
        ("", {"ASCEND_DEVICE_ID": "npu0"}, "ASCEND_DEVICE_ID='npu0'"),
        ('[tuning]\ndevice = "tpu:0"\n', {}, "unknown kind"),
    ],
)
def test_bad_settings_name_where_they_came_from(
    tmp_path: Path, text: str, env: dict, needle: str
) -> None:
    toml = tmp_path / "aoed.toml"
    toml.write_text(text)
    with pytest.raises(OptionError) as err:
        load_config(toml, env=env)
    assert needle in str(err.value)


def test_the_file_is_read_strictly_and_every_problem_named_at_once(tmp_path: Path) -> None:
    # TOML has numbers and booleans: a quoted one is a mistake the file names, not a
    # string read leniently, and one read reports each bad key with what it expects.
    toml = tmp_path / "aoed.toml"
    toml.write_text(
        '[tuning]\nparallel = "4"\nrepeat_tune = "yes"\ndevices = ["cpu:0", "tpu:1"]\n'
        '[engine]\nmax_model_mb = "64"\nmax_nodes = 100\n[log]\nlevel = "WARNING"\n'
        "[tunning]\nparallel = 2\n"
    )
    with pytest.raises(OptionError) as err:
        load_config(toml, env={})
    at = f"{toml} "
    assert sorted(err.value.problems) == sorted(
        [
            at + "[tuning] parallel = '4': expected a number of compile processes from 1 to 32",
            at + "[tuning] repeat_tune = 'yes': expected true or false",
            at + "[tuning] devices = ['cpu:0', 'tpu:1']: device 'tpu': unknown kind "
            "(one of cpu, cuda, tensorrt, cann)",
            at
            + "[engine] max_model_mb = '64': expected a whole number of MiB from 1 to 1073741824",
            at + "[log] level = 'WARNING': expected one of debug, error, info, warning",
            at + "[tunning]: unknown section (known: bank, cluster, daemon, engine, inbox, limits, "
            "listen, log, metrics, tuning)",
        ]
    )
    # The keys given well are still read; the environment's strings stay lenient.
    toml.write_text("[engine]\nmax_nodes = 100\n")
    cfg = load_config(toml, env={"REPEAT_TUNE": "yes", "TE_PARALLEL_COMPILER": "4"})
    assert (cfg.max_nodes, cfg.repeat_tune, cfg.parallel) == (100, True, 4)
