"""A KV-cache decoder (past length dynamic) tuned with no shape flags generates what the
input model generates: the tuned model keeps its dynamic past and runs at every length a
generation loop reaches, from an empty past on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from .conftest import run_aoe

pytest.importorskip("torch", reason="the gdat extra (torch) is not installed")

from aoed import samples  # noqa: E402

from .kv_decoder import greedy  # noqa: E402


@pytest.mark.slow
def test_a_kv_cache_decoder_tuned_exact_decodes_32_steps_as_the_input_does(
    tmp_path: Path,
) -> None:
    import onnxruntime as ort

    import aoe

    src = samples.save(samples.kv_decoder(), tmp_path / "dec.onnx")
    r = run_aoe(
        "tune",
        str(src),
        "--precision",
        "exact",
        "--budget",
        "3",
        "--no-progress",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "out"),
    )
    assert r.returncode == 0, r.stderr
    (path,) = (tmp_path / "out").glob("aoe_result_*.json")
    doc = json.loads(path.read_text())
    # the past stays dynamic in what ships
    shipped = onnx.load(doc["tuned_model"])
    past = next(i for i in shipped.graph.input if i.name == "past_key_0")
    assert past.type.tensor_type.shape.dim[2].dim_param, past
    want, want_logits = greedy(
        ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]), 32
    )
    got, got_logits = greedy(aoe.session(doc["tuned_model"]), 32)
    assert got == want
    worst = min(
        float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        for a, b in zip(want_logits, got_logits, strict=True)
    )
    assert worst >= 0.9999, worst
