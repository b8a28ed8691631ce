"""The engine's messages: strict at both edges of the line protocol, and every message
type survives the trip as a JSON line (the engine's encoder, the stdlib's line)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Union

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from aoe.device import CPU, Device
from aoe.partition import Task
from aoe.signature import TaskSignature
from aoed.engine import messages as m
from aoed.engine._child import Child, ChildDiedError


def _line(msg: Any) -> Any:
    """`msg` as it crosses a pipe: encoded, one JSON line, read back."""
    line = json.dumps(m.encode(msg))
    assert "\n" not in line
    return json.loads(line)


# --------------------------------------------------------------------------- refused


def test_an_unknown_field_is_refused_naming_the_type_and_the_field() -> None:
    with pytest.raises(m.MessageError) as err:
        m.decode(
            m.MeasureReply, {"results": {"a": {"ok": True, "median_us": 5.0, "medain_us": 4.0}}}
        )
    assert (
        "MeasureReply" in str(err.value)
        and "medain_us" in str(err.value)
        and "$.results[...]" in str(err.value)
    )


def test_an_unknown_field_of_a_clients_value_inside_a_message_is_refused() -> None:
    # The client's values (Task, TaskSignature, ...) forbid unknown fields as messages do.
    sig = TaskSignature("MatMul", "", 17, "{}", "d" * 64)
    task = Task("t0", "matmul", ("n",), sig, ("a", "w"), ("y",))
    data = _line(m.ExtractRequest(Path("/p.onnx"), (task,), Path("/s.npz"), Path("/r")))
    assert m.decode(m.ExtractRequest, data).tasks == (task,)
    data["tasks"][0]["signature"]["opset_version"] = 17
    with pytest.raises(
        m.MessageError, match=r"ExtractRequest: .*`opset_version` - at `\$\.tasks\[0\]\.signature`"
    ):
        m.decode(m.ExtractRequest, data)


def test_a_wrong_type_is_refused() -> None:
    with pytest.raises(
        m.MessageError, match=r"PingReply: Expected `int`, got `str` - at `\$\.cores`"
    ):
        m.decode(m.PingReply, {"cores": "2", "providers": []})
    with pytest.raises(
        m.MessageError, match=r"CompileRequest: Expected `str` \(a path\), got `int` - at `\$\.out`"
    ):
        m.decode(
            m.CompileRequest,
            {
                "op": "compile",
                "task_model": "/t.onnx",
                "family": "matmul",
                "strategy": "x",
                "prefix": "p",
                "out": 3,
            },
        )


def test_a_none_where_a_float_is_required_is_refused() -> None:
    with pytest.raises(
        m.MessageError, match=r"Measurement: Expected `float`, got `null` - at `\$\.median_us`"
    ):
        m.decode(m.Measurement, {"ok": True, "median_us": None})
    # Where None is allowed it stays None, and an infinite error stays infinite.
    got = m.decode(
        m.Measurement, _line(m.Measurement(True, max_abs_error=float("inf"), rounds_us=(1.0, None)))
    )
    assert got.max_abs_error == float("inf") and got.rounds_us == (1.0, None)


def test_a_missing_field_is_refused() -> None:
    with pytest.raises(
        m.MessageError, match=r"ProfileReply: Object missing required field `total_us`"
    ):
        m.decode(m.ProfileReply, {"nodes": {}})


def test_requests_are_told_apart_by_their_op_alone_never_by_guessing() -> None:
    requests = [
        c
        for c in vars(m).values()
        if isinstance(c, type) and issubclass(c, m.Request) and c is not m.Request
    ]
    tags = [c.__struct_config__.tag for c in requests]
    assert len(requests) == 15 and len(set(tags)) == len(tags)
    union = Union[tuple(requests)]  # noqa: UP007
    ping = m.encode(m.PingRequest(CPU))
    assert m.decode(union, ping) == m.PingRequest(CPU)
    with pytest.raises(m.MessageError, match="missing required field `op`"):
        m.decode(union, {k: v for k, v in ping.items() if k != "op"})
    with pytest.raises(m.MessageError, match=r"Invalid value 'nope' - at `\$\.op`"):
        m.decode(union, {**ping, "op": "nope"})
    # Replies carry no tag: a union of two would be ambiguous, and msgspec will not build it.
    with pytest.raises(TypeError, match="all Struct types must be tagged"):
        m.decode(Union[m.PingReply, m.ProfileReply], {"cores": 1, "providers": []})  # noqa: UP007


# --------------------------------------------------------------------------- round trips


def _strategy(tp: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of `tp`, as messages hold them (finite or infinite floats, never NaN: NaN
    equals nothing, so a round trip could not be checked by equality)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return st.one_of(st.integers(-1000, 1000), st.text(max_size=4), st.booleans())
    if origin in (Union, types.UnionType):
        return st.one_of(*(_strategy(a, depth) for a in args))
    if tp is type(None):
        return st.none()
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-(2**53), 2**53)
    if tp is str:
        return st.text(max_size=6)
    if tp is Path:
        return st.lists(st.text("abc._-", min_size=1, max_size=4), min_size=1, max_size=3).map(
            lambda parts: Path("/", *parts)
        )
    if tp is Device:
        return st.builds(
            Device,
            st.sampled_from(["cpu", "cuda", "cann"]),
            st.integers(0, 7),
            st.lists(st.tuples(st.text(max_size=4), st.text(max_size=4)), max_size=2).map(
                lambda kv: tuple(sorted(kv))
            ),
        )
    if tp is Task:
        twins = st.just([]) if depth > 0 else st.lists(_strategy(Task, depth + 1), max_size=2)
        return st.builds(
            Task,
            _strategy(str),
            _strategy(str),
            _strategy(tuple[str, ...]),
            _strategy(TaskSignature),
            _strategy(tuple[str, ...]),
            _strategy(tuple[str, ...]),
            twins,
        )
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_strategy(args[0], depth), max_size=3).map(tuple)
        return st.tuples(*(_strategy(a, depth) for a in args))
    if origin is list:
        return st.lists(_strategy(args[0], depth), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=4), _strategy(args[1], depth), max_size=3)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return st.builds(
            tp, **{f.name: _strategy(f.type, depth) for f in msgspec.structs.fields(tp)}
        )
    raise AssertionError(f"no strategy for {tp!r}")


MESSAGES = sorted(
    (
        c
        for c in vars(m).values()
        if isinstance(c, type)
        and issubclass(c, m.Message)
        and c not in (m.Message, m.Request, m.Call, m.Answer)
    ),
    key=lambda c: c.__name__,
)


def test_every_message_type_is_covered() -> None:
    assert len(MESSAGES) == 36, [c.__name__ for c in MESSAGES]


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_every_message_type_survives_a_json_line(cls: type) -> None:
    @settings(max_examples=25, deadline=None)
    @given(_strategy(cls))
    def round_trip(msg: Any) -> None:
        assert m.decode(cls, _line(msg)) == msg

    round_trip()


# --------------------------------------------------------------------------- the edges


def _worker(*lines: str) -> list[dict[str, Any]]:
    """What a real compile worker answers to `lines`, one JSON answer per line."""
    proc = subprocess.run(
        [sys.executable, "-m", "aoed.backends.ort.worker"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_a_child_refuses_a_malformed_request_naming_its_type_and_field(tmp_path: Path) -> None:
    good = m.encode(
        m.CompileRequest(tmp_path / "t.onnx", "matmul", "default", "p", tmp_path / "o.onnx")
    )
    unknown, wrong = {**good, "strategie": "default"}, {**good, "strategy": 3}
    answers = _worker(
        *(json.dumps({"id": i, "request": r}) for i, r in enumerate([unknown, wrong], 1)),
        "not json",
        json.dumps({"id": 3, "request": m.encode(m.PingRequest(CPU))}),
    )
    assert [(a["id"], a["ok"]) for a in answers] == [
        (1, False),
        (2, False),
        (None, False),
        (3, True),
    ]
    assert "CompileRequest" in answers[0]["error"] and "`strategie`" in answers[0]["error"]
    assert "CompileRequest: Expected `str`, got `int` - at `$.strategy`" in answers[1]["error"]
    assert answers[2]["error"].startswith("malformed request")
    assert m.decode(m.PingReply, answers[3]["reply"]).cores >= 1


BAD_CHILD = textwrap.dedent(
    """
    import json, sys
    # Answers every request with the reply it was given in its arguments: what a child
    # that does not speak the engine's messages would say.
    reply = json.loads(sys.argv[-1])
    for line in sys.stdin:
        call = json.loads(line)
        print(json.dumps({"id": call["id"], "ok": True, "reply": reply}), flush=True)
    """
)


@pytest.mark.parametrize(
    ("reply", "refused"),
    [
        (
            {"cores": 1, "providers": [], "threads": 2},
            "PingReply: Object contains unknown field `threads`",
        ),
        ({"cores": "1", "providers": []}, "PingReply: Expected `int`, got `str` - at `$.cores`"),
        ({"cores": None, "providers": []}, "PingReply: Expected `int`, got `null` - at `$.cores`"),
    ],
)
async def test_the_engine_refuses_a_malformed_reply_as_a_broken_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reply: dict[str, Any], refused: str
) -> None:
    (tmp_path / "aoed_bad_child.py").write_text(BAD_CHILD)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(p for p in sys.path if p))
    child = Child("aoed_bad_child", "bad child", tmp_path / "bad.log", args=[json.dumps(reply)])
    try:
        with trio.fail_after(60), pytest.raises(ChildDiedError) as err:
            await child.call(m.PingRequest(CPU))
    finally:
        await child.aclose()
    assert "broke the protocol" in str(err.value) and refused in str(err.value)
    assert child.pid is None  # killed: the next call starts a fresh one
