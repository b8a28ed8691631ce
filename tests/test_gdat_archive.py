"""A .pt2 is read as data before any torch loader sees it (aoed.backends.torch.archive).

First, that the hostile archives are real: torch 2.13's own loader, unpatched and with
TORCH_FORCE_WEIGHTS_ONLY_LOAD=1, runs their payload (a file appears). Then that
`check_pt2` refuses every hostile kind naming the archive, the member and why, and passes
what torch.export.save writes for plain programs (which torch then loads); and that a
real rank process refuses one before torch opens it, so the payload never runs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aoe.errors import ModelError

torch = pytest.importorskip(
    "torch", reason="GDAT needs torch: pip install '.[gdat]' (make test installs it)"
)

from aoed.backends.torch.archive import check_pt2  # noqa: E402
from aoed.engine.world import inspect_model  # noqa: E402

from .hostile_pt2 import KINDS, Kind, root_of, tiny_program  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_program(tmp_path_factory.mktemp("pt2") / "tiny.pt2")


def _member(kind: Kind, base: Path) -> str:
    if kind.member.startswith("!"):
        return kind.member[1:]
    return f"{root_of(base)}/{kind.member}" if kind.member else ""


_TORCH_LOADS = textwrap.dedent("""
    import os, sys
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    import torch

    for path, how in zip(sys.argv[1::2], sys.argv[2::2]):
        try:
            ep = torch.export.load(path)
            if how == "call":
                ep.module()(torch.randn(8, 32))
        except Exception as exc:  # the next archive is loaded all the same
            print(f"{path}: {type(exc).__name__}: {exc}", file=sys.stderr)
""")


@pytest.fixture(scope="module")
def torch_alone(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], str]:
    """Each hostile archive that runs code, loaded (and called, where its payload runs
    then) by torch's own loader, unpatched and with TORCH_FORCE_WEIGHTS_ONLY_LOAD=1, one
    after another in one fresh process: what each one's payload wrote ("" for nothing),
    by kind, and the process's stderr."""
    folder = tmp_path_factory.mktemp("torch_alone")
    markers, argv = {}, []
    for kind in KINDS.values():
        if kind.runs_code:
            markers[kind.name] = folder / f"{kind.name}.ran"
            evil = kind.build(base, folder / f"{kind.name}.pt2", markers[kind.name])
            argv += [str(evil), kind.runs_code]
    r = subprocess.run(
        [sys.executable, "-c", _TORCH_LOADS, *argv], capture_output=True, text=True, timeout=300
    )
    return {k: m.read_text() if m.exists() else "" for k, m in markers.items()}, r.stderr


@pytest.mark.parametrize("kind", [k for k in KINDS.values() if k.runs_code], ids=lambda k: k.name)
def test_torch_alone_runs_the_payload_of_a_hostile_archive(
    kind: Kind, torch_alone: tuple[dict[str, str], str]
) -> None:
    """Without aoed's check, torch's own loader runs the code: the refusals below matter.
    (Should a torch release stop running it, this fails: the kinds then need a look.)"""
    ran, stderr = torch_alone
    assert ran[kind.name] == "ran", stderr


@pytest.mark.parametrize("kind", KINDS.values(), ids=lambda k: k.name)
def test_a_hostile_archive_is_refused_naming_the_member_and_why(
    kind: Kind, base: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    evil = kind.build(base, tmp_path / "evil.pt2", marker)
    with pytest.raises(ModelError) as err:
        check_pt2(evil)
    text = str(err.value)
    assert text.startswith(f"{evil}: refused before loading: {_member(kind, base)}"), text
    assert kind.why in text and "\n" not in text, text
    # The same through an open file (how a rank checks what it then hands to torch).
    with open(evil, "rb") as f, pytest.raises(ModelError):
        check_pt2(f, name="evil.pt2")
    assert not marker.exists()


def test_a_json_member_over_the_limit_is_refused(base: Path) -> None:
    with pytest.raises(ModelError, match=r"model_weights_config\.json: \d+ bytes, more than 1000 "):
        check_pt2(base, max_json_bytes=1000)


class _Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.offset = torch.randn(4)  # a constant tensor, not a buffer

    def forward(self, x, y=None):
        out = self.bn(self.conv(x)).sum((2, 3)) + self.offset
        return {"o": out, "t": (out, out * 2)}


class _Kwargs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, x, idx, flag: bool = True, n: int = 3, scale: float = 0.5, d=None):
        with torch.no_grad():
            y = self.lin(x) * scale
        return {"a": self.lin(x) + self.emb(idx).sum(1) + y, "b": [x * n]}


class _Guarded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x[: x.shape[0] // 2]).sum()


def _exports():
    half = torch.export.Dim("half", min=3, max=500)
    return {
        "conv_bn_constant": lambda: torch.export.export(
            _Conv(), (torch.randn(2, 3, 8, 8),), {"y": torch.ones(1)}
        ),
        "kwargs_and_scalars": lambda: torch.export.export(
            _Kwargs(),
            (torch.randn(2, 4), torch.randint(0, 10, (2, 3))),
            {"flag": True, "n": 3, "scale": 0.5, "d": {"k": torch.ones(1, dtype=torch.bfloat16)}},
        ),
        "guarded_dynamic": lambda: torch.export.export(
            _Guarded(), (torch.randn(16, 8),), dynamic_shapes=({0: 2 * half},)
        ),
        "encoder": lambda: torch.export.export(
            torch.nn.TransformerEncoder(
                torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2
            ),
            (torch.randn(2, 5, 32),),
        ),
    }


@pytest.mark.parametrize("name", list(_exports()))
def test_programs_torch_export_saves_pass_and_load(name: str, tmp_path: Path) -> None:
    ep = _exports()[name]()
    path = tmp_path / f"{name}.pt2"
    torch.export.save(ep, str(path))
    check_pt2(path)
    loaded = torch.export.load(str(path))
    assert loaded.example_inputs is not None and loaded.module() is not None
    if name == "guarded_dynamic":  # a guard that passes the check, as torch wrote it
        assert loaded._guards_code


async def test_a_rank_process_refuses_the_archive_before_torch_opens_it(
    base: Path, tmp_path: Path
) -> None:
    """Through the real rank process (confined, as the job starts it): the same
    refusal, and the payload never runs."""
    marker = tmp_path / "ran"
    evil = KINDS["opaque_object"].build(base, tmp_path / "evil.pt2", marker)
    with pytest.raises(ModelError, match="opaque_obj_0: is a pickled custom or opaque object"):
        await inspect_model({"kind": "pt2", "path": str(evil)}, "gloo", 2, tmp_path / "w")
    assert not marker.exists()
