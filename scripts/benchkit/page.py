"""docs/benchmarks.md is generated: each benchmark writes its own block of it, and rerunning replaces the block.

A block sits between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`: one header line with the machine
(`machine.line`: CPU model, cores, jax and flax versions, device, date) and the exact command line that produced
it, then the report's markdown (its headings turned into bold lines, so a block never adds to the page's outline;
the machine, which reports print in their own titles for the terminal, said only once). Text outside the
markers is written by hand and left alone; a block whose markers are missing is added at the end of the page.

The report's JSON goes to bench_out/NAME.json (git-ignored), not beside the page: it is large, specific to one
machine and run, and every rerun would rewrite it whole; the page keeps what a reader needs to compare and to
reproduce (the table, the machine, the command).

Every benchmark script takes `--write-page [NAME]` (`add_option`); `make bench` passes it.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from . import machine

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "benchmarks.md"
JSON_DIR = REPO / "bench_out"


def add_option(parser, name: str) -> None:
    """`--write-page [NAME]`: write the report into docs/benchmarks.md's block NAME (default `name`)."""
    parser.add_argument("--write-page", nargs="?", const=name, default=None, metavar="NAME",
                        help=f"write the report into docs/benchmarks.md's block NAME (default: {name}) and its JSON "
                             "to bench_out/NAME.json")


def command_line(argv: list[str] | None = None, script: str | None = None) -> str:
    """The command as a user types it from the repository root: `python scripts/x.py ARGS` (quoted for a shell)."""
    argv = sys.argv if argv is None else argv
    script = script or argv[0]
    path = Path(script)
    if path.is_absolute():
        try:
            path = path.relative_to(REPO)
        except ValueError:
            pass
    return shlex.join(["python", str(path), *argv[1:]])


def _machine_mention(machine_info: dict) -> re.Pattern:
    """The machine as reports print it inside their own titles and notes (`machine.line`, whatever device and
    minute they recorded), with the separator before it: the block's header already says it once."""
    head = re.escape(f"{machine_info['machine']} ({machine_info['cpu']}), jax {machine_info['jax']}, "
                     f"flax {machine_info['flax']}")
    return re.compile(rf"(?:,|;| \||:)? ?{head}(?:, [\w-]+ \([^)]*\))?(?:, matmul precision \w+)?"
                      rf"(?:, \d{{4}}-\d\d-\d\d(?: \d\d:\d\d)?)?")


def _demote(text: str, machine_info: dict) -> str:
    """Headings as bold lines, a blank line before each table, and the machine the header already gives dropped
    (a line that is only the machine, or its mention inside a title)."""
    mention = _machine_mention(machine_info)
    lines: list[str] = []
    for line in text.strip("\n").split("\n"):
        if mention.search(line):
            bold = line.startswith("**")
            line = mention.sub("", line).lstrip(" ,;:|").rstrip(" ,;:|*")
            if not line.strip(" *"):
                continue
            if bold:
                line += "**"
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        line = f"**{heading.group(1).strip()}**" if heading else line
        if line.startswith("|") and lines and lines[-1].strip() and not lines[-1].startswith("|"):
            lines.append("")  # markdown needs a blank line before a table
        lines.append(line)
    return "\n".join(lines).strip("\n")


def block(name: str, text: str, machine_info: dict, command: str) -> str:
    """The whole block, markers included: one header line (machine, date, command), then the report."""
    return (f"<!-- bench:{name} -->\n"
            f"Measured on {machine.line(machine_info)} by `{command}`:\n\n"
            f"{_demote(text, machine_info)}\n"
            f"<!-- /bench:{name} -->")


def replace(page: str, name: str, new_block: str) -> str:
    """`page` with block `name` replaced by `new_block` (appended after the text when the page has none)."""
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    if pattern.search(page):
        return pattern.sub(lambda _: new_block, page, count=1)
    return page.rstrip("\n") + "\n\n" + new_block + "\n"


def write(name: str, text: str, machine_info: dict, report=None, *, argv: list[str] | None = None,
          script: str | None = None, page: Path = PAGE, json_dir: Path = JSON_DIR) -> Path:
    """Write block `name` of `page` (the report's markdown `text`, the machine, this process's command line) and
    `json_dir/name.json` ({"name", "command", "machine", "markdown", "report"}). Returns the JSON's path."""
    command = command_line(argv, script)
    page = Path(page)
    current = page.read_text() if page.exists() else "# Benchmarks\n"
    page.write_text(replace(current, name, block(name, text, machine_info, command)))
    json_dir = Path(json_dir)
    json_dir.mkdir(parents=True, exist_ok=True)
    out = json_dir / f"{name}.json"
    out.write_text(json.dumps({"name": name, "command": command, "machine": machine_info, "markdown": text,
                               "report": report}, indent=1, default=str))
    print(f"wrote block {name} of {page} and {out}")
    return out


class Tee:
    """Inside `with Tee() as printed:` what the process prints is still printed, and kept in `printed.text`: the
    report of a benchmark that prints its tables row by row, as they are measured."""

    def __init__(self):
        self.parts: list[str] = []
        self._stdout = None

    def __enter__(self) -> Tee:
        self._stdout, sys.stdout = sys.stdout, self
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout = self._stdout

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self._stdout.write(text)

    def flush(self) -> None:
        self._stdout.flush()

    @property
    def text(self) -> str:
        return "".join(self.parts)
