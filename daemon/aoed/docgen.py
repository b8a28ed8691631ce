"""The reference parts of the docs, rendered from the code so that they cannot drift.

    python -m aoed.docgen            # rewrite every generated block (make docs)
    python -m aoed.docgen --check    # exit 1 naming each block that differs
    python -m aoed.docgen [--check] PAGE...   # those pages only

A generated block in a page of docs/ (or the README) lies between two marker comments:

    <!-- generated: options aoe tune -->
    ...what the code renders...
    <!-- end -->

and is replaced whole. The blocks: `options aoe COMMAND...` (a command's options table,
from the argparse parser `aoe` itself parses with), `options aoed` (the daemon's), `commands
aoe` (every command the pages do not show on their own, one table each) and `settings
engine` / `settings daemon` (every key of the TOML file with its default, from
aoed.settingsref). Text outside the markers is the authors'; tests/test_docs_reference.py
fails when a block differs from what this module renders.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from aoed import settingsref

__all__ = ["PAGES", "ROOT", "main", "render", "stale_blocks", "update"]

ROOT = Path(__file__).resolve().parents[2]
#: The pages that may hold generated blocks.
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

_BLOCK = re.compile(r"(<!-- generated: (?P<id>[^>]+?) -->\n)(?P<body>.*?)(<!-- end -->)", re.S)

#: Where the docs say more about one of `aoe tune`'s options.
_TUNE_MORE = {
    "--precision": "[precision policies](tuning.md#precision-policies-and-accuracy-gates)",
    "--calibration": "[precision policies](tuning.md#precision-policies-and-accuracy-gates)",
    "--min-cosine": "[accuracy gates](tuning.md#precision-policies-and-accuracy-gates)",
    "--max-rel-error": "[accuracy gates](tuning.md#precision-policies-and-accuracy-gates)",
    "--job-type": "[job types](tuning.md#job-types-opat-sgat-and-both)",
    "--budget": "[the budget](tuning.md#the-budget)",
    "--bank": "[bank.md](bank.md)",
    "--bank-layer": "[bank.md](bank.md)",
    "--repeat-tune": "[AOE's bank rules](bank.md#aoes-rules-hit-miss-repeat_tune)",
    "--reload": "[resuming](#resuming-an-interrupted-run---reload)",
    "--output": "[outputs](#outputs-and-the-result-json)",
    "--keep-workspace": "[outputs](#outputs-and-the-result-json)",
    "--world-size": "[gdat.md](gdat.md)",
    "--backend": "[gdat.md](gdat.md)",
    "--gradient-precision": "[gdat.md](gdat.md)",
    "--entry": "[gdat.md](gdat.md)",
    "--executor": "[Ray](daemon.md#devices-on-other-servers-ray)",
    "--ray-address": "[Ray](daemon.md#devices-on-other-servers-ray)",
    "--socket": "[daemon.md](daemon.md)",
    "--local": "[daemon.md](daemon.md)",
}
#: Commands whose options table sits in a page section of its own (`options aoe ...`),
#: so `commands aoe` leaves them out.
_OWN_SECTION = ("tune", "compile", "devices")


# ---------------------------------------------------------------------- parsers


def _aoe() -> argparse.ArgumentParser:
    from aoe.cli import build_parser

    return build_parser()


def _aoed() -> argparse.ArgumentParser:
    from aoed.__main__ import build_parser

    return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> Mapping[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _command(parser: argparse.ArgumentParser, words: Sequence[str]) -> argparse.ArgumentParser:
    for word in words:
        try:
            parser = _subcommands(parser)[word]
        except KeyError:
            raise ValueError(
                f"no generated block 'options aoe {' '.join(words)}': aoe has no command {word!r} there"
            ) from None
    return parser


# ---------------------------------------------------------------------- tables


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        m = action.metavar
        return " ".join(m) if isinstance(m, tuple) else m or action.dest.upper()
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    if action.metavar is not None:
        metavar = action.metavar
    elif action.choices is not None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        metavar = action.dest.upper()
    return f"{flags} {metavar}"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    return parser._get_formatter()._expand_help(action)


def options_table(parser: argparse.ArgumentParser, more: Mapping[str, str] | None = None) -> str:
    """`parser`'s arguments as markdown tables: its positional arguments and options in
    one, then one per titled argument group under its title; each row the invocation and
    its help, and with `more` a column of links by option."""
    untitled: list[argparse.Action] = []
    groups: list[tuple[str, list[argparse.Action]]] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _shown(a)]
        if group.title in ("positional arguments", "options", "optional arguments"):
            untitled += actions
        elif actions:
            groups.append((group.title or "", actions))
    out: list[str] = []
    for title, actions in [("", untitled), *groups]:
        if not actions:
            continue
        if title:
            out.append(f"{_cell(title)}:\n")
        out += [
            "| argument | what it does |" + (" more |" if more is not None else ""),
            "|---|---|" + ("---|" if more is not None else ""),
        ]
        for a in actions:
            row = f"| `{_cell(_invocation(a))}` | {_cell(_help(parser, a))} |"
            if more is not None:
                row += f" {next((more[o] for o in a.option_strings if o in more), '')} |"
            out.append(row)
        out.append("")
    return "\n".join(out).rstrip("\n")


def _shown(action: argparse.Action) -> bool:
    return action.help is not argparse.SUPPRESS and not isinstance(
        action, argparse._HelpAction | argparse._SubParsersAction
    )


def _commands_aoe() -> str:
    """Every `aoe` command without a section of its own, one heading and table each (a
    command with subcommands: each of them)."""
    out: list[str] = []

    def walk(words: list[str], parser: argparse.ArgumentParser) -> None:
        subs = _subcommands(parser)
        if not subs:
            out.append(f"### `aoe {' '.join(words)}`\n")
            if parser.description:
                out.append(f"{_cell(parser.description)}\n")
            out.append(options_table(parser) + "\n")
            return
        for name, sub in subs.items():
            walk([*words, name], sub)

    for name, parser in _subcommands(_aoe()).items():
        if name not in _OWN_SECTION:
            walk([name], parser)
    return "\n".join(out).rstrip("\n")


def _settings(rows: Sequence[settingsref.Setting], env: bool) -> str:
    cfg = settingsref.defaults()
    if env:
        out = ["| key | default | environment | what it sets |", "|---|---|---|---|"]
    else:
        out = ["| key | default | what it sets |", "|---|---|---|"]
    for s in rows:
        cells = [f"`{s.heading} {s.key}`", _cell(s.default(cfg))]
        if env:
            cells.append(s.env())
        cells.append(_cell(s.what))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def render(block: str) -> str:
    """What the block named `block` holds. ValueError for a name this module does not
    render."""
    words = block.split()
    if words[:2] == ["options", "aoe"]:
        parser = _command(_aoe(), words[2:])
        return options_table(parser, _TUNE_MORE if words[2:] == ["tune"] else None)
    if words == ["options", "aoed"]:
        return options_table(_aoed())
    if words == ["commands", "aoe"]:
        return _commands_aoe()
    if words == ["settings", "engine"]:
        return _settings(settingsref.ENGINE, env=True)
    if words == ["settings", "daemon"]:
        return _settings(settingsref.DAEMON, env=False)
    raise ValueError(f"no generated block {block!r} (see aoed.docgen)")


# ---------------------------------------------------------------------- pages


def _rendered(text: str) -> Iterator[tuple[re.Match[str], str]]:
    for m in _BLOCK.finditer(text):
        yield m, f"\n{render(m['id'])}\n\n"


def stale_blocks(pages: Sequence[Path] = PAGES) -> list[str]:
    """`page: block` for each generated block whose text differs from what the code
    renders."""
    return [
        f"{_shown_path(page)}: {m['id']}"
        for page in pages
        for m, body in _rendered(page.read_text())
        if m["body"] != body
    ]


def _shown_path(page: Path) -> Path:
    return page.relative_to(ROOT) if page.is_relative_to(ROOT) else page


def update(pages: Sequence[Path] = PAGES) -> list[Path]:
    """Rewrite each page's generated blocks; returns the pages that changed."""
    changed = []
    for page in pages:
        text = page.read_text()
        new = _BLOCK.sub(lambda m: f"{m[1]}\n{render(m['id'])}\n\n{m[4]}", text)
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m aoed.docgen",
        description="Render the docs' generated blocks (options tables, settings) from the code.",
    )
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    p.add_argument(
        "pages", nargs="*", type=Path, metavar="PAGE", help="the pages (default: README.md, docs/)"
    )
    args = p.parse_args(argv)
    pages = tuple(args.pages) or PAGES
    if args.check:
        stale = stale_blocks(pages)
        for line in stale:
            print(f"docgen: stale: {line} (run make docs)", file=sys.stderr)
        return 1 if stale else 0
    for page in update(pages):
        print(f"docgen: rewrote {_shown_path(page)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
