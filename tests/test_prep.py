"""Tests for graph preparation (aoed.engine.prep, over aoe.graph's normalization)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from aoe.errors import ModelError, OptionError
from aoe.signature import TensorInfo
from aoe.specargs import parse_shapes as parse_input_shapes
from aoed import samples
from aoed.engine.modelio import tensors
from aoed.engine.prep import make_inputs, prepare


def _save(tmp_path: Path, name: str, model: onnx.ModelProto | None = None) -> Path:
    path = tmp_path / f"{name}.onnx"
    samples.save(model if model is not None else samples.build(name), path)
    return path


def _run(model: onnx.ModelProto | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


def _dims(vi: onnx.ValueInfoProto) -> list[int | str]:
    dims = vi.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]


# --------------------------------------------------------------------------- shapes


def test_dynamic_batch_without_override_is_prepared_at_its_profiles_middle(
    tmp_path: Path,
) -> None:
    src = _save(tmp_path, "mlp_dynamic", samples.mlp(dynamic_batch=True))
    prep = prepare(src, tmp_path / "work")
    assert prep.profile is not None
    assert prep.profile.points == ({"input": (1, 256)}, {"input": (4, 256)})
    assert _dims(prep.model.graph.input[0]) == [4, 256]
    assert prep.profile.inputs == {"input": ("batch", 256)}
    assert any(n.startswith("shape profile: 2 points") for n in prep.notes)
    assert not any("fixed by --input-shape" in n for n in prep.notes)  # no flag fixed it


def test_input_shape_override_makes_the_model_static(tmp_path: Path) -> None:
    src = _save(tmp_path, "mlp_dynamic", samples.mlp(dynamic_batch=True))
    prep = prepare(src, tmp_path / "work", {"input": (4, 256)})
    assert _dims(prep.model.graph.input[0]) == [4, 256]
    assert prep.inputs == {"input": TensorInfo("float32", (4, 256))}
    assert prep.ctx.tensors["logits"] == TensorInfo("float32", (4, 16))
    assert prep.path == tmp_path / "work" / "prepared.onnx"
    saved = onnx.load(str(prep.path))
    assert _dims(saved.graph.input[0]) == [4, 256]
    feeds = make_inputs(prep.inputs)
    (out,) = _run(prep.path, feeds)
    assert out.shape == (4, 16)


def test_an_output_whose_length_only_run_time_shapes_give_gets_its_static_shape(
    tmp_path: Path,
) -> None:
    """A KV cache's present, a graph output declared `past + seq`, concatenates a tensor
    reshaped to a target computed at run time (a Max that inference does not propagate):
    the prepared model knows its length, as it knows an intermediate tensor's, so an
    attention block that reads it is recognized (a decoder's second layer was not)."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    def const(name: str, v: list[int]) -> onnx.TensorProto:
        return nh.from_array(np.array(v, np.int64), name)

    graph = h.make_graph(
        [
            h.make_node("Shape", ["x"], ["shape"]),
            h.make_node("Max", ["shape", "one"], ["at_least_one"]),
            h.make_node("Slice", ["at_least_one", "one", "two"], ["seq"]),
            h.make_node("Concat", ["head", "seq", "tail"], ["target"], axis=0),
            h.make_node("Reshape", ["x", "target"], ["new"]),
            h.make_node("Concat", ["past", "new"], ["present"], axis=2),
        ],
        "step",
        [
            h.make_tensor_value_info("x", T.FLOAT, [1, "seq", 8]),
            h.make_tensor_value_info("past", T.FLOAT, [1, 2, "past", 4]),
        ],
        [h.make_tensor_value_info("present", T.FLOAT, [1, 2, "past + seq", 4])],
        [const("one", [1]), const("two", [2]), const("head", [1, 2]), const("tail", [4])],
        # as exporters write it: the run-time reshape's result with its symbols
        value_info=[h.make_tensor_value_info("new", T.FLOAT, [1, 2, "seq", 4])],
    )
    src = _save(tmp_path, "step", h.make_model(graph, opset_imports=[h.make_opsetid("", 18)]))
    prep = prepare(src, tmp_path / "work", {"x": (1, 3, 8), "past": (1, 2, 5, 4)})
    assert _dims(prep.model.graph.output[0]) == [1, 2, 8, 4]
    assert prep.ctx.tensors["present"] == TensorInfo("float32", (1, 2, 8, 4))


def test_override_of_unknown_input_is_an_option_error(tmp_path: Path) -> None:
    src = _save(tmp_path, "mlp")
    with pytest.raises(OptionError, match="'pixels'") as err:
        prepare(src, tmp_path / "work", {"pixels": (1, 256)})
    assert "input" in str(err.value)


def test_override_contradicting_a_fixed_dim_is_an_option_error(tmp_path: Path) -> None:
    src = _save(tmp_path, "mlp_dynamic", samples.mlp(dynamic_batch=True))
    with pytest.raises(OptionError, match="dimension 1 is fixed at 256") as err:
        prepare(src, tmp_path / "work", {"input": (4, 128)})
    assert "input" in str(err.value)
    with pytest.raises(OptionError, match="rank"):
        prepare(src, tmp_path / "work", {"input": (4, 256, 1)})


# --------------------------------------------------------------------------- legacy models


def test_legacy_mlp_initializers_become_constants(tmp_path: Path) -> None:
    original = samples.legacy_mlp()
    inits = {t.name for t in original.graph.initializer}
    assert inits & {i.name for i in original.graph.input}  # the sample does list them
    prep = prepare(_save(tmp_path, "legacy_mlp", original), tmp_path / "work")
    assert [i.name for i in prep.model.graph.input] == ["input"]
    assert list(prep.inputs) == ["input"]
    opset = next(o.version for o in prep.model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset >= 13
    assert prep.model.ir_version >= 4
    notes = " ".join(prep.notes)
    assert "initializers listed as graph inputs" in notes
    assert "opset 9" in notes
    assert "IR version 3" in notes


def test_legacy_mlp_keep_initializer_inputs(tmp_path: Path) -> None:
    original = samples.legacy_mlp()
    inits = {t.name for t in original.graph.initializer}
    src = _save(tmp_path, "legacy_mlp", original)
    prep = prepare(src, tmp_path / "work", keep_initializer_inputs=True)
    listed = {i.name for i in prep.model.graph.input}
    assert inits <= listed
    assert "input" in listed
    assert list(prep.inputs) == ["input"]
    assert not any("initializers listed" in n for n in prep.notes)
    # Weights the user may feed are not constants: nothing may bake them into a rewrite.
    assert not inits & prep.ctx.constants
    from aoe.partition import partition

    assert partition(prep.model, prep.ctx) == []


def test_legacy_cnn_computed_weights_are_constants_and_stay_computed(tmp_path: Path) -> None:
    original = samples.legacy_cnn()
    orig_inits = {t.name for t in original.graph.initializer}
    orig_convs = [n for n in original.graph.node if n.op_type == "Conv"]
    computed = [n.input[1] for n in orig_convs if n.input[1] not in orig_inits]
    assert computed  # the sample computes a conv weight with nodes
    prep = prepare(_save(tmp_path, "legacy_cnn", original), tmp_path / "work")
    convs = [n for n in prep.model.graph.node if n.op_type == "Conv"]
    assert len(convs) == len(orig_convs)
    inits = {t.name for t in prep.model.graph.initializer}
    for conv in convs:
        # Known constant for partition and signatures, yet not materialised: the prepared
        # model keeps the nodes that compute it, as the input had them.
        assert conv.input[1] in prep.ctx.constants, conv.name
    assert set(computed) <= {n.input[1] for n in convs} and not set(computed) & inits
    assert {n.op_type for n in prep.model.graph.node} >= {"Reshape", "Mul", "ConstantOfShape"}
    assert any("opset 11" in n for n in prep.notes)


def test_input_shape_that_fixes_a_dynamic_dimension_says_so(tmp_path: Path) -> None:
    src = _save(tmp_path, "mlp_dynamic", samples.mlp(dynamic_batch=True))
    prep = prepare(src, tmp_path / "work", {"input": (4, 256)})
    (note,) = [n for n in prep.notes if "--input-shape" in n]
    assert "'input'" in note and "'batch'" in note and "= 4" in note
    static = prepare(_save(tmp_path, "mlp"), tmp_path / "work2", {"input": (1, 256)})
    assert not [n for n in static.notes if "--input-shape" in n]  # nothing was dynamic


# --------------------------------------------------------------------------- unreadable files


def test_garbage_file_is_a_model_error(tmp_path: Path) -> None:
    src = tmp_path / "garbage.onnx"
    src.write_bytes(b"\xff\x00not an onnx model at all\x13\x37" * 10)
    with pytest.raises(ModelError, match="garbage.onnx"):
        prepare(src, tmp_path / "work")


def test_missing_file_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="absent.onnx"):
        prepare(tmp_path / "absent.onnx", tmp_path / "work")


def test_external_data_outside_the_model_directory_is_refused(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    model = samples.mlp()
    onnx.save(
        model,
        str(model_dir / "mlp.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="w.bin",
        size_threshold=0,
    )
    # Move the data one level up and point the model at it there.
    (model_dir / "w.bin").rename(tmp_path / "outside.bin")
    model = onnx.load(str(model_dir / "mlp.onnx"), load_external_data=False)
    moved = 0
    for tensor in tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../outside.bin"
                moved += 1
    assert moved > 0
    (model_dir / "mlp.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ModelError, match="external data must sit beside the model") as err:
        prepare(model_dir / "mlp.onnx", tmp_path / "work")
    assert "../outside.bin" in str(err.value)
    assert not (tmp_path / "work" / "prepared.onnx").exists()


def test_external_data_beside_the_model_loads(tmp_path: Path) -> None:
    model = samples.mlp()
    onnx.save(
        model,
        str(tmp_path / "mlp.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="w.bin",
        size_threshold=0,
    )
    assert (tmp_path / "w.bin").stat().st_size > 0
    assert (tmp_path / "mlp.onnx").stat().st_size < (tmp_path / "w.bin").stat().st_size
    prep = prepare(tmp_path / "mlp.onnx", tmp_path / "work")
    feeds = make_inputs(prep.inputs)
    (got,) = _run(prep.model, feeds)
    (want,) = _run(samples.mlp(), feeds)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_tensors_walks_subgraphs_and_local_functions() -> None:
    # Every place onnx keeps tensor data (external data may point from any of them):
    # initializers of the graph and of an If's branches, Constant values in either,
    # and a Constant in a model-local function.
    h, T = onnx.helper, onnx.TensorProto

    def const(name: str) -> onnx.NodeProto:
        return h.make_node("Constant", [], [name], value=h.make_tensor(name, T.FLOAT, [1], [1.0]))

    def branch(name: str, init: str | None) -> onnx.GraphProto:
        inits = [h.make_tensor(init, T.FLOAT, [1], [2.0])] if init else []
        return h.make_graph(
            [const(name)], name, [], [h.make_tensor_value_info(name, T.FLOAT, [1])], inits
        )

    fn = h.make_function("local", "f", [], ["fc"], [const("fc")], [h.make_opsetid("", 17)])
    graph = h.make_graph(
        [
            const("gc"),
            h.make_node("f", [], ["y"], domain="local"),
            h.make_node(
                "If",
                ["cond"],
                ["z"],
                then_branch=branch("tc", "ti"),
                else_branch=branch("ec", None),
            ),
        ],
        "g",
        [h.make_tensor_value_info("cond", T.BOOL, [])],
        [h.make_tensor_value_info("z", T.FLOAT, [1])],
        [h.make_tensor("w", T.FLOAT, [1], [3.0])],
    )
    model = h.make_model(graph, functions=[fn], opset_imports=[h.make_opsetid("", 17)])
    assert sorted(t.name for t in tensors(model)) == ["ec", "fc", "gc", "tc", "ti", "w"]
    assert sorted(t.name for t in tensors(model, attributes=False)) == ["ti", "w"]


# --------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("name", sorted(samples.SAMPLES))
def test_prepared_model_computes_what_the_original_does(tmp_path: Path, name: str) -> None:
    src = _save(tmp_path, name)
    prep = prepare(src, tmp_path / "work")
    onnx.checker.check_model(prep.model)
    feeds = make_inputs(prep.inputs, seed=3)
    want = _run(src, feeds)
    got = _run(prep.model, feeds)
    assert prep.outputs == [o.name for o in onnx.load(str(src)).graph.output]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert float(np.abs(w).max()) > 0
        assert np.allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("naming", ["empty", "duplicate"])
def test_nodes_get_unique_names(tmp_path: Path, naming: str) -> None:
    model = samples.cnn()
    for node in model.graph.node:
        node.name = "" if naming == "empty" else "layer"
    src = _save(tmp_path, "cnn", model)
    prep = prepare(src, tmp_path / "work")
    names = [n.name for n in prep.model.graph.node]
    assert all(names)
    assert len(names) == len(set(names))
    assert any("nodes without a unique name were named" in n for n in prep.notes)
    feeds = make_inputs(prep.inputs)
    want = _run(samples.cnn(), feeds)[0]  # onnxruntime refuses the duplicate names
    assert np.allclose(_run(prep.model, feeds)[0], want, rtol=1e-5, atol=1e-6)


def test_named_nodes_keep_their_names(tmp_path: Path) -> None:
    prep = prepare(_save(tmp_path, "cnn"), tmp_path / "work")
    assert {"stem/conv", "block2/conv1", "head/fc"} <= {n.name for n in prep.model.graph.node}
    assert not any("name" in n for n in prep.notes)


# --------------------------------------------------------------------------- helpers


def test_parse_input_shapes() -> None:
    assert parse_input_shapes("a:1,2;b:3") == {"a": (1, 2), "b": (3,)}
    assert parse_input_shapes(["a:1,2", "b:3"]) == {"a": (1, 2), "b": (3,)}
    assert parse_input_shapes("input:0:1,3") == {"input:0": (1, 3)}
    assert parse_input_shapes(None) == {}
    assert parse_input_shapes("") == {}


@pytest.mark.parametrize("spec", ["a", "a:x", "a:0", "a:", ":1,2", "a:1,-2"])
def test_parse_input_shapes_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(OptionError, match="--input-shape"):
        parse_input_shapes(spec)


def test_make_inputs_is_deterministic() -> None:
    infos = {
        "x": TensorInfo("float32", (2, 3)),
        "ids": TensorInfo("int64", (5,)),
        "mask": TensorInfo("bool", (4,)),
    }
    one, two = make_inputs(infos, seed=7), make_inputs(infos, seed=7)
    other = make_inputs(infos, seed=8)
    assert list(one) == ["x", "ids", "mask"]
    for name in infos:
        assert np.array_equal(one[name], two[name])
        assert one[name].dtype == np.dtype(infos[name].dtype)
        assert one[name].shape == infos[name].shape
    assert not np.array_equal(one["x"], other["x"])
    assert one["ids"].min() >= 0 and one["ids"].max() < 8


def test_make_inputs_refuses_unknown_dtypes() -> None:
    with pytest.raises(ModelError, match="'s'"):
        make_inputs({"s": TensorInfo("<U4", (2,))})
