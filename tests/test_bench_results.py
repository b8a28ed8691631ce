"""bench/RESULTS.md opens with every target at a glance, and that table cannot drift
from the sections below it: each section has a row, and each row names the commit its
section was measured at."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "RESULTS.md"
MARKER = re.compile(r"<!-- ([\w-]+):begin -->\n(.*?)<!-- \1:end -->", re.S)
COMMIT = re.compile(r"the code measured: aoe at (?:commit )?([0-9a-f]{7,40})")


def _sections(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in MARKER.finditer(text)}


def _glance_rows(glance: str) -> list[dict[str, str]]:
    """The table's rows; AssertionError where anything else splits it (markdown would end
    the table there and show the rows after it as text)."""
    all_lines = glance.splitlines()
    at = [i for i, ln in enumerate(all_lines) if ln.startswith("|")]
    gaps = [all_lines[i] for i in range(at[0], at[-1]) if not all_lines[i].startswith("|")]
    assert not gaps, f"the table at a glance is split by {gaps[:2]}: rows after it show as text"
    lines = [all_lines[i] for i in at]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows.append(dict(zip(head, cells, strict=True)))
    return rows


def test_the_results_open_with_every_target_at_a_glance():
    text = RESULTS.read_text()
    sections = _sections(text)
    assert next(iter(sections)) == "glance", "the first section is the table of every target"
    rows = _glance_rows(sections["glance"])
    assert rows and all(r["result"] for r in rows)
    named = {r["section"] for r in rows}
    others = set(sections) - {"glance"}
    assert others - named == set(), f"sections without a row at a glance: {others - named}"
    assert named - others == set(), f"rows naming no section: {named - others}"


def test_each_row_names_the_commit_its_section_was_measured_at():
    sections = _sections(RESULTS.read_text())
    for row in _glance_rows(sections["glance"]):
        measured = set(COMMIT.findall(sections[row["section"]]))
        assert measured, f"section {row['section']} says no commit it measured"
        said = set(re.findall(r"\b[0-9a-f]{7,40}\b", row["commit, machine"]))
        assert said, f"the row for {row['target']!r} names no commit"
        assert said <= measured, (
            f"the row for {row['target']!r} says {sorted(said)}, its section {row['section']} "
            f"was measured at {sorted(measured)}"
        )
