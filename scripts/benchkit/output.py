"""Writing a benchmark's report (JSON and markdown) and its exit status."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write(out_dir: str | Path, stem: str, report: dict, text: str) -> None:
    """`<stem>.json` and `<stem>.md` under `out_dir` (created), and the markdown printed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(text)
    print(text)


def exit_status(differing: list[str]) -> int:
    """1, after saying which, when some run's greedy output differed from plain decoding's; else 0."""
    if differing:
        print(f"greedy outputs differ from none: {differing}", file=sys.stderr)
        return 1
    return 0
