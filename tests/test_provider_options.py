"""Providers and their options as data: validated, carried in a tuned model's metadata,
and rebuilt by aoe.session(), on this machine's CPU-only onnxruntime."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

import aoe
from aoe.device import Device
from aoe.errors import DeviceError
from aoe.sessionopts import METADATA_KEY, normalize_options, session_providers
from aoed import samples
from aoed.engine.assemble import set_metadata, tuned_metadata

TRT_CUDA = [
    ["TensorrtExecutionProvider", {"trt_fp16_enable": "1", "trt_builder_optimization_level": "5"}],
    ["CUDAExecutionProvider", {"use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC"}],
]


def test_providers_are_kept_in_order_with_their_options() -> None:
    opts = normalize_options({"graph_optimization_level": "all", "providers": TRT_CUDA})
    assert [p[0] for p in opts["providers"]] == [
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
    ]
    got = session_providers(opts, device_id=2)
    assert got[0] == (
        "TensorrtExecutionProvider",
        {"device_id": "2", "trt_builder_optimization_level": "5", "trt_fp16_enable": "1"},
    )
    assert got[-1] == ("CPUExecutionProvider", {}), (
        "the CPU always serves what the others do not take"
    )
    assert normalize_options(json.dumps(opts)) == opts


@pytest.mark.parametrize(
    "providers,needle",
    [
        (
            [["CUDAExecutionProvider", {"use_tf33": "0"}]],
            "CUDAExecutionProvider: unknown provider option 'use_tf33'",
        ),
        (
            [["CUDAExecutionProvider", {"cudnn_conv_algo_search": "FAST"}]],
            "cudnn_conv_algo_search='FAST' is not one of",
        ),
        (
            [["TensorrtExecutionProvider", {"trt_builder_optimization_level": "7"}]],
            "is not one of 0, 1, 2, 3, 4, 5",
        ),
        ([["CANNExecutionProvider", {"precision_mode": "fp8"}]], "precision_mode='fp8'"),
        ([["MagicExecutionProvider", {}]], "unknown execution provider 'MagicExecutionProvider'"),
        (
            [["CUDAExecutionProvider", {"device_id": "1"}]],
            "device_id is chosen when the session is made",
        ),
        ([["CUDAExecutionProvider", {}], ["CUDAExecutionProvider", {}]], "listed twice"),
        ([["CPUExecutionProvider", {}]], "always last"),
        ("CUDAExecutionProvider", "must be a list"),
    ],
)
def test_bad_providers_are_refused_naming_provider_and_option(providers, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        normalize_options({"providers": providers})


def _tuned(tmp_path: Path, options: dict, device: Device) -> Path:
    path = tmp_path / "mlp_tune.onnx"
    model = samples.build("mlp")
    set_metadata(model, tuned_metadata(options, "exact", "d" * 64, device))
    onnx.save(model, path)
    return path


def test_a_model_tuned_on_a_gpu_names_its_providers_even_with_default_options(
    tmp_path: Path,
) -> None:
    path = _tuned(tmp_path, {}, Device.parse("tensorrt:0"))
    assert aoe.session_options_of(path)["providers"] == [
        ["TensorrtExecutionProvider", {}],
        ["CUDAExecutionProvider", {}],
    ]
    tuned = _tuned(tmp_path, {"providers": TRT_CUDA[1:]}, Device.parse("cuda:1"))
    assert aoe.session_options_of(tuned)["providers"] == [TRT_CUDA[1]]
    assert "providers" not in aoe.session_options_of(_tuned(tmp_path, {}, Device.parse("cpu")))


def test_aoe_session_refuses_a_provider_this_onnxruntime_lacks(tmp_path: Path) -> None:
    path = _tuned(tmp_path, {"providers": TRT_CUDA}, Device.parse("tensorrt:0"))
    meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    assert json.loads(meta[METADATA_KEY])["providers"][0][1]["trt_fp16_enable"] == "1"
    with pytest.raises(DeviceError) as err:
        aoe.session(path)
    msg = str(err.value)
    assert (
        "tuned on TensorrtExecutionProvider, CUDAExecutionProvider" in msg
        and "install onnxruntime-gpu" in msg
    )
    assert "providers=[...]" in msg
    # The documented way out: name the providers, and run it unmeasured.
    sess = aoe.session(path, providers=["CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"]


def test_a_cpu_tuned_model_still_opens_as_before(tmp_path: Path) -> None:
    path = _tuned(tmp_path, {"intra_op_num_threads": 1}, Device.parse("cpu"))
    assert aoe.session(path).get_providers() == ["CPUExecutionProvider"]


def test_the_runner_never_lets_onnxruntime_drop_a_missing_provider(tmp_path: Path) -> None:
    from aoed.backends.ort.sessions import providers_for, session

    assert providers_for(None) == ["CPUExecutionProvider"]
    with pytest.raises(
        DeviceError,
        match="cuda:0: a candidate runs on CUDAExecutionProvider, which this onnxruntime",
    ):
        session(
            samples.build("mlp").SerializeToString(),
            {"providers": TRT_CUDA[1:]},
            Device.parse("cuda:0"),
        )


def test_bound_runs_time_device_memory_and_give_the_same_outputs() -> None:
    """The accelerator's measuring path (I/O binding), run with the CPU's memory: the
    same code a GPU runs, but for where the OrtValues live."""
    import numpy as np
    import onnxruntime as ort

    from aoed.backends.ort.sessions import BoundRun

    model = samples.build("mlp")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    feeds = {
        inp.name: np.random.default_rng(0)
        .standard_normal([d if isinstance(d, int) else 1 for d in inp.shape])
        .astype(np.float32)
    }
    run = BoundRun(sess, feeds, Device.parse("cpu"))
    first = run.outputs()
    run()
    run()
    again = run.outputs()
    expected = sess.run(None, feeds)
    assert len(first) == len(expected) and all(
        np.array_equal(a, b) for a, b in zip(again, expected, strict=True)
    )
    assert all(np.array_equal(a, b) for a, b in zip(first, expected, strict=True))
