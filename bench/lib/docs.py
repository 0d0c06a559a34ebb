"""docs/benchmarks.md, written from the benchmarks themselves (`make bench-docs`).

Per group (a folder of bench/), per script: the command that runs it, what it measures (the first
paragraph of its docstring) and, where bench/results/NAME.json exists, its stamp (commit, date, cores,
load) and its result's headline numbers; then docs/benchmarks-earlier.md, kept by hand (measurements
taken before results were stamped), as it is. Reads files only: it runs no benchmark.

    python -m bench.lib.docs [--output docs/benchmarks.md]
"""

from __future__ import annotations

import ast
import json
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.lib.env import ROOT, parser
from bench.lib.stamp import RESULTS

BENCH = ROOT / "bench"
OUTPUT = ROOT / "docs" / "benchmarks.md"
EARLIER = ROOT / "docs" / "benchmarks-earlier.md"
ENTRY_CHARS = 400  # a result's headline, at most
SHORT_LIST = 8  # a list of plain values up to this long is shown whole, on one line
STRING_CHARS = 60
WIDTH = 110  # the docs' lines (markdown joins them)

INTRO = """\
<!-- Written by `make bench-docs` (python -m bench.lib.docs) from bench/'s docstrings and bench/results/:
edit those (or docs/benchmarks-earlier.md), not this file. -->
# Benchmarks

Every benchmark runs from the repository root as a module, `python -m bench.GROUP.NAME` (`--help` says
what it takes); `make bench-GROUP` runs a group, `make bench` every group but wan (whose emulated
internet needs root and iptables: `make bench-wan`). Each prints its result as JSON and keeps the latest
in `bench/results/NAME.json`, stamped (bench/lib/stamp.py) with the command, the commit (and whether the tree
had changes), the date, the machine's cores and CPU and its load average at the start and the end: quote a
number with its stamp. What several scripts share (prompts, timers, a local swarm, random checkpoints of
real shapes, the emulated internet) is in bench/lib/.
"""


@dataclass(frozen=True)
class Script:
    """A benchmark: its group (folder), its name (file stem) and what it measures."""

    group: str
    name: str
    summary: str

    @property
    def command(self) -> str:
        return f"python -m bench.{self.group}.{self.name}"


def first_paragraph(docstring: str | None) -> str:
    """A docstring's first paragraph, on one line."""
    return " ".join((docstring or "").strip().split("\n\n")[0].split())


def groups(bench: Path) -> list[Path]:
    """The folders of benchmarks (packages), lib/ aside, by name."""
    return sorted(p for p in bench.iterdir() if (p / "__init__.py").is_file() and p.name != "lib")


def scripts(group: Path) -> list[Script]:
    """The group's scripts (modules that run as __main__; helpers of a script are not listed), by name."""
    found = []
    for path in sorted(group.glob("*.py")):
        text = path.read_text()
        if path.name != "__init__.py" and '__name__ == "__main__"' in text:
            summary = first_paragraph(ast.get_docstring(ast.parse(text)))
            found.append(Script(group.name, path.stem, summary))
    return found


def plain(value: object) -> str:
    """A value as a result shows it: numbers and booleans as JSON writes them, strings cut short."""
    if isinstance(value, str):
        return value if len(value) <= STRING_CHARS else value[: STRING_CHARS - 1] + "…"
    return json.dumps(value)


def flatten(value: object, path: str = "") -> Iterator[tuple[str, str]]:
    """(dotted path, shown value) of every plain value, short lists of plain values whole."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from flatten(inner, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        if len(value) <= SHORT_LIST and not any(isinstance(v, (dict, list)) for v in value):
            yield path, "[" + ", ".join(plain(v) for v in value) + "]"
        else:
            for index, inner in enumerate(value):
                yield from flatten(inner, f"{path}[{index}]")
    else:
        yield path, plain(value)


def headline(result: object, limit: int = ENTRY_CHARS) -> str:
    """The result's values in order, `path: value; ...`, cut after `limit` characters at a value's end."""
    shown = ""
    for path, value in flatten(result):
        item = f"{path}: {value}" if path else value
        if len(shown) + len(item) + 2 > limit:
            return shown + "; …"
        shown = f"{shown}; {item}" if shown else item
    return shown


def stamp_line(measured_on: dict) -> str:
    """What a result was measured on, in a line."""
    commit = measured_on.get("commit") or "unknown commit"
    changes = " with uncommitted changes" if measured_on.get("uncommitted_changes") else ""
    load = measured_on.get("load_average_1m", {})
    command = f"`{measured_on['command']}`, " if measured_on.get("command") else ""
    return (
        f"{command}commit {commit}{changes}, {measured_on.get('date')}, {measured_on.get('cores')} cores "
        f"({measured_on.get('cpu')}), load {load.get('start')} at the start, {load.get('end')} at the end"
    )


def entry(script: Script, results: Path) -> str:
    """A script's section: its command, what it measures, its latest stamped result or that it has none."""
    lines = [f"### {script.name}", "", *wrap(f"`{script.command}`: {script.summary}"), ""]
    kept = results / f"{script.name}.json"
    if kept.is_file():
        found = json.loads(kept.read_text())
        lines += wrap(f"- Measured on: {stamp_line(found.get('measured_on', {}))}.")
        lines += wrap(f"- Result (bench/results/{kept.name}): {headline(found.get('result'))}")
    else:
        lines.append(f"- No stamped result yet (bench/results/{kept.name} does not exist).")
    return "\n".join(lines) + "\n"


def wrap(text: str) -> list[str]:
    """A paragraph (or a list item, its later lines indented) as lines of at most WIDTH characters."""
    indent = "  " if text.startswith("- ") else ""
    return textwrap.wrap(
        text, WIDTH, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False
    )


def render(bench: Path = BENCH, results: Path = RESULTS, earlier: Path = EARLIER) -> str:
    """The whole of docs/benchmarks.md."""
    parts = [INTRO]
    for group in groups(bench):
        about = first_paragraph(ast.get_docstring(ast.parse((group / "__init__.py").read_text())))
        parts.append(f"## {group.name} (`make bench-{group.name}`)\n\n" + "\n".join(wrap(about)) + "\n")
        parts += [entry(script, results) for script in scripts(group)]
    parts.append("## Earlier measurements (before stamped results)\n")
    parts.append(earlier.read_text() if earlier.is_file() else f"({earlier.name} is missing.)\n")
    return "\n".join(parts)


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--output", type=Path, default=OUTPUT, help="where to write (default: %(default)s)")
    args = flags.parse_args()
    args.output.write_text(render())
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
