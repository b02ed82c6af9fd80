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


def save_json(path: Path, machine_info: dict, args, results: list) -> None:
    """`{"machine", "args", "results"}` as JSON at `path` (its folder created; args as strings), then a line
    saying where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_info, "args": {k: str(v) for k, v in vars(args).items()},
                                "results": results}, indent=1))
    print(f"wrote {path}")


def exit_status(differing: list[str], what: str = "greedy outputs differ from none") -> int:
    """1, after saying which (`what`), when some run's output differed from plain decoding's; else 0."""
    if differing:
        print(f"{what}: {differing}", file=sys.stderr)
        return 1
    return 0
