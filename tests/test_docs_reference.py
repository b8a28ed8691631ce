"""The reference parts of the docs say what the code does: the generated blocks (options
tables from the argparse parsers, the settings tables from aoed.settingsref) are what
`python -m aoed.docgen` renders now, the settings reference names exactly the keys the
loaders read, and deploy/aoed.toml shows every default it does not deliberately change.
The output layout the docs show is checked against a real run in tests/test_cli_tune.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from aoed import docgen, settingsref
from aoed.config import load_daemon_config
from tests.conftest import run_aoe

ROOT = Path(__file__).resolve().parent.parent
DEPLOY_TOML = ROOT / "deploy" / "aoed.toml"


def test_the_generated_blocks_are_what_the_code_renders() -> None:
    stale = docgen.stale_blocks()
    assert not stale, "stale generated blocks (run make docs): " + "; ".join(stale)
    ids = [m["id"] for page in docgen.PAGES for m in docgen._BLOCK.finditer(page.read_text())]
    for must in ("options aoe tune", "options aoe compile", "settings engine", "settings daemon"):
        assert must in ids, f"no generated block {must!r} in the docs"


def test_a_block_that_differs_from_the_code_is_named(tmp_path: Path) -> None:
    """The check can fail: a page whose tune table lost a row, or names a flag the parser
    does not have, is stale, and `make docs` (docgen.update) puts the block right."""
    page = tmp_path / "cli.md"
    text = (ROOT / "docs" / "cli.md").read_text()
    (row,) = [ln for ln in text.splitlines() if ln.startswith("| `--reload` |")]
    page.write_text(text.replace(row + "\n", "").replace("`--no-progress`", "`--quiet`"))
    assert docgen.stale_blocks([page]) == [f"{page}: options aoe tune"]
    assert docgen.update([page]) == [page]
    assert docgen.stale_blocks([page]) == [] and page.read_text() == text
    with pytest.raises(ValueError, match="no generated block 'options aoe nosuch'"):
        page.write_text("<!-- generated: options aoe nosuch -->\n<!-- end -->\n")
        docgen.stale_blocks([page])


def test_docgen_check_exits_1_naming_a_stale_page(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    text = (ROOT / "docs" / "configuration.md").read_text()
    page.write_text(
        text.replace(
            "| `[daemon] max_running_jobs` | `2` |", "| `[daemon] max_running_jobs` | `4` |"
        )
    )
    check = [sys.executable, "-m", "aoed.docgen", "--check", str(page)]
    r = subprocess.run(check, capture_output=True, text=True)
    assert r.returncode == 1 and f"{page}: settings daemon (run make docs)" in r.stderr, r.stderr
    subprocess.run([sys.executable, "-m", "aoed.docgen", str(page)], check=True)
    assert page.read_text() == text
    r = subprocess.run(check, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr, r.stderr


def test_the_settings_reference_names_every_key_the_loaders_read() -> None:
    rows = [(s.section, s.key) for s in (*settingsref.ENGINE, *settingsref.DAEMON)]
    twice = [k for k, n in Counter(rows).items() if n > 1]
    assert not twice, f"listed twice: {twice}"
    read = set(settingsref.read_keys())
    assert set(rows) - read == set(), "the reference lists keys no loader reads"
    assert read - set(rows) == set(), "keys the loaders read that the reference leaves out"
    for s in (*settingsref.ENGINE, *settingsref.DAEMON):
        assert s.value is not None or s.shown, f"{s.heading} {s.key}: no default"


def test_each_default_read_back_from_a_file_is_the_default(tmp_path: Path) -> None:
    """A file that sets every key to the default the reference shows loads to the same
    configuration: the reference's units (days, hours, MiB, octal modes) are the file's."""
    cfg = settingsref.defaults()
    sections: dict[str, list[str]] = {}
    for s in (*settingsref.ENGINE, *settingsref.DAEMON):
        if s.value is not None:
            sections.setdefault(s.section, []).append(
                f"{s.key} = {settingsref.toml_value(s.value(cfg))}"
            )
    inbox = sections.pop("inbox")
    text = "".join(f"[{name}]\n" + "\n".join(lines) + "\n" for name, lines in sections.items())
    text += '[[inbox]]\npath = "/srv/inbox"\n' + "\n".join(inbox) + "\n"
    (tmp_path / "aoed.toml").write_text(text)
    loaded = load_daemon_config(tmp_path / "aoed.toml", env={})
    for s in (*settingsref.ENGINE, *settingsref.DAEMON):
        if s.value is not None:
            assert s.value(loaded) == s.value(cfg), f"{s.heading} {s.key}"


def _deploy_keys() -> list[tuple[str, str, str]]:
    """(section, key, value) of each `key = value` line of deploy/aoed.toml, the
    `#key = value` examples included."""
    out, section = [], ""
    for line in DEPLOY_TOML.read_text().splitlines():
        if m := re.fullmatch(r"\[\[?(\w+)\]\]?", line.strip()):
            section = m[1]
        elif m := re.fullmatch(r"(#?)(\w+) = (.+)", line.strip()):
            out.append((section, m[2], m[3]))
    return out


def test_deploy_aoed_toml_shows_the_defaults() -> None:
    """Every key deploy/aoed.toml sets or shows commented out is one the daemon reads,
    and its value is the default unless the key is a deployment's own choice (a path, a
    group, the log level) or the default depends on the machine."""
    tomllib.loads(DEPLOY_TOML.read_text())  # it parses
    cfg = settingsref.defaults()
    reference = {(s.section, s.key): s for s in (*settingsref.ENGINE, *settingsref.DAEMON)}
    found = _deploy_keys()
    assert len(found) > 30, found
    wrong = []
    for section, key, raw in found:
        s = reference.get((section, key))
        if s is None:
            wrong.append(f"[{section}] {key}: no such setting")
            continue
        if s.site or s.value is None or s.shown:
            continue
        given = tomllib.loads(f"v = {raw}")["v"]
        if settingsref.toml_value(given) != settingsref.toml_value(s.value(cfg)):
            wrong.append(
                f"{s.heading} {key} = {raw}: the default is {settingsref.toml_value(s.value(cfg))}"
            )
    assert not wrong, "deploy/aoed.toml: " + "; ".join(wrong)


def _shape(example: str, output: str) -> re.Pattern[str]:
    """The paths an example of the docs stands for: its timestamps (14 digits) and the
    process id of a result's name may be any."""
    pat = re.escape(example)
    pat = re.sub(r"\d{14}", r"\\d{14}", pat)
    pat = re.sub(r"_\d+\\\.json$", r"_\\d+\\.json", pat)
    return re.compile(re.escape(output) + "/" + pat.removeprefix("out/"))


def _layout(output: Path, model: str) -> list[re.Pattern[str]]:
    """The lines of cli.md's output layout block, as patterns of paths under `output`."""
    text = (ROOT / "docs" / "cli.md").read_text()
    block = text.split("Outputs, as AOE lays them out", 1)[1].split("```", 2)[1]
    out = []
    for line in block.splitlines():
        if line.startswith("{output}/"):
            template = line.split(" #", 1)[0].strip()
            pat = re.escape(template)
            for name, value in (
                (r"\{output\}", re.escape(str(output))),
                (r"\{model\}", re.escape(model)),
                (r"\{ts\}", r"\d{14}"),
                (r"\{pid\}", r"\d+"),
            ):
                pat = pat.replace(name, value)
            out.append(re.compile(pat))
    return out


@pytest.mark.slow
def test_the_output_layout_the_docs_show_is_what_a_tune_writes(
    models: Path, tmp_path: Path
) -> None:
    """One real `aoe tune` of the sample the README runs, with the default job type:
    every file it leaves is one cli.md's layout names, each line of the layout is one
    file, and the README's `tuned model` and `report` lines have the shape of what it
    printed."""
    (tmp_path / "cnn.onnx").write_bytes((models / "cnn.onnx").read_bytes())
    r = run_aoe(
        "tune", "cnn.onnx", "--budget", "1", "--parallel", "1", "--no-progress",
        "--output", "out", "--bank", "bank", "--local", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    written = sorted(str(p) for p in (tmp_path / "out").rglob("*") if p.is_file())
    layout = _layout(tmp_path / "out", "cnn")
    assert len(layout) == 3, layout
    for pat in layout:
        assert [w for w in written if pat.fullmatch(w)], f"cli.md: no file like {pat.pattern}"
    unnamed = [w for w in written if not any(p.fullmatch(w) for p in layout)]
    assert not unnamed, f"cli.md's layout does not name {unnamed}"

    printed = {
        m[1]: m[2]
        for ln in r.stdout.splitlines()
        if (m := re.fullmatch(r"\s+(tuned model|report)\s+(\S+)", ln))
    }
    readme = (ROOT / "README.md").read_text()
    for label in ("tuned model", "report"):
        (example,) = re.findall(rf"^  {label}\s+(out/\S+)$", readme, re.M)
        got = str(tmp_path / printed[label])
        assert _shape(example, str(tmp_path / "out")).fullmatch(got), (label, example, got)


def _toml_examples() -> list[tuple[str, dict]]:
    """(page, parsed) of each ```toml block in docs/."""
    return [
        (page.name, tomllib.loads(m[1]))
        for page in sorted((ROOT / "docs").glob("*.md"))
        for m in re.finditer(r"```toml\n(.*?)```", page.read_text(), re.S)
    ]


def test_every_toml_example_names_settings_that_exist() -> None:
    """A settings file in the docs names only keys the loaders read; a drop folder's
    options file (no sections) is one JobSpec.from_toml takes."""
    from aoe.spec import JobSpec

    read = set(settingsref.read_keys())
    examples = _toml_examples()
    assert len(examples) >= 4, examples
    unknown = []
    for page, doc in examples:
        if not any(isinstance(v, dict | list) and k != "input_shapes" for k, v in doc.items()):
            JobSpec.from_toml(doc)  # a drop folder's options
            continue
        for section, table in doc.items():
            for t in table if isinstance(table, list) else [table]:
                unknown += [f"{page}: [{section}] {k}" for k in t if (section, k) not in read]
    assert not unknown, "examples name settings no loader reads: " + "; ".join(unknown)


def test_the_environment_table_lists_every_variable_read() -> None:
    from aoe.config import ENV_KEYS
    from aoed.sandbox import UNCONFINED_ENV

    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("## Environment variables", 1)[1]
    listed = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    read = {*ENV_KEYS, "ASCEND_DEVICE_ID", "AOED_CONFIG", "AOED_SOCKET", "AOE_MODE", UNCONFINED_ENV}
    assert read - listed == set(), f"configuration.md does not list {sorted(read - listed)}"
    assert listed - read == set(), f"configuration.md lists {sorted(listed - read)}, read nowhere"
