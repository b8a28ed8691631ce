"""Shape profiles: AOE's spelling (ranges lo~hi, -1 with --dynamic-dims gears) read and
written back by every edge, and errors that name the input."""

from __future__ import annotations

import argparse
import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aoe.errors import OptionError
from aoe.shapes import DimRange, ShapeProfile, parse_dims
from aoe.spec import JobSpec
from aoe.specargs import add_arguments, from_args, split_shapes, to_argv
from aoe.wire import spec_from_pb, spec_to_pb


def _args(*argv: str) -> JobSpec:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(list(argv)))


# --------------------------------------------------------------------------- spelling


def test_ranges_and_gears_in_aoe_spelling() -> None:
    spec = _args("--input-shape", "input_ids:1~4,16~256;mask:1,8")
    assert spec.input_shapes == {"mask": (1, 8)}  # all sizes: one point, as before
    assert spec.shape_profile.dims_of() == {"input_ids": (DimRange(1, 4), DimRange(16, 256))}
    geared = _args("--input-shape", "input_ids:-1,-1", "--dynamic-dims", "1,16;4,64")
    assert geared.shape_profile.gear_list() == ((1, 16), (4, 64))
    assert geared.shape_profile.gear_slots() == [("input_ids", 0), ("input_ids", 1)]
    assert _args(*to_argv(geared)) == geared
    # today's static shape stays a fixed shape, and a range of one size is that size
    assert _args("--input-shape", "x:1,128").input_shapes == {"x": (1, 128)}
    assert parse_dims("8~8,3") == (8, 3)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--input-shape", "input_ids:4~1,16"], "--input-shape input_ids:4~1"),
        (["--input-shape", "input_ids:1~x,16"], "input_ids:1~x: 'x' is not a size"),
        (["--input-shape", "input_ids:-1,16"], "input_ids:-1,16: a dimension of -1"),
        (["--input-shape", "ids:-1,-1", "--dynamic-dims", "1,16,3"], "--dynamic-dims 1,16,3"),
        (["--input-shape", "ids:-1,-1", "--dynamic-dims", "1,a"], "--dynamic-dims '1,a'"),
        (["--dynamic-dims", "1;2"], "no input has a dimension of -1"),
        (["--input-shape", "ids:-3,4"], "ids:-3: sizes are positive"),
        (["--input-shape", "ids:1~4", "--input-shape", "ids:1"], "--input-shape ids: given twice"),
    ],
)
def test_a_wrong_profile_names_the_input_and_the_flag(argv: list[str], needle: str) -> None:
    with pytest.raises(OptionError) as err:
        _args(*argv)
    assert needle in str(err.value), str(err.value)


def test_an_input_given_twice_as_fixed_and_ranged_is_refused() -> None:
    with pytest.raises(OptionError, match="input_shapes x: given twice"):
        JobSpec(input_shapes={"x": [1, 2]}, shape_profile=ShapeProfile({"x": "1~4,2"}))


def test_an_aoed_toml_spells_ranges_and_gears() -> None:
    toml = 'dynamic_dims = "1,16;4,64"\n[input_shapes]\ninput_ids = [-1, -1]\nmask = [1, 8]\n'
    spec = JobSpec.from_toml(tomllib.loads(toml))
    assert spec.input_shapes == {"mask": (1, 8)}
    assert spec.shape_profile == ShapeProfile({"input_ids": "-1,-1"}, "1,16;4,64")
    ranged = JobSpec.from_toml(tomllib.loads('[input_shapes]\nx = "1~4,16~256"\n'))
    assert ranged.shape_profile.dims == {"x": "1~4,16~256"}
    assert JobSpec.from_toml(tomllib.loads(ranged.to_toml())) == ranged
    with pytest.raises(OptionError, match="dynamic_dims"):
        JobSpec.from_toml(tomllib.loads("dynamic_dims = 3\n"))
    with pytest.raises(OptionError, match=r"input_shapes x:1~: '' is not a size"):
        JobSpec.from_toml(tomllib.loads('[input_shapes]\nx = "1~"\n'))


@given(
    st.lists(st.integers(1, 4096), min_size=1, max_size=4),
    st.lists(st.integers(1, 4096), min_size=1, max_size=4),
)
def test_a_range_reads_back_from_every_edge(lo: list[int], span: list[int]) -> None:
    text = ",".join(f"{a}~{a + b}" for a, b in zip(lo, span, strict=False))
    spec = JobSpec(shape_profile=ShapeProfile({"x": text}))
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert spec_from_pb(spec_to_pb(spec)) == spec
    assert _args(*to_argv(spec)) == spec
    assert split_shapes([f"x:{text}"])[1] == spec.shape_profile
