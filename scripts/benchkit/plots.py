"""Plots with matplotlib, which only the [bench] extra installs: without it a report is written without its plot."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (after a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on the benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", flush=True)
        return None
    return plt


def save(fig, path: Path) -> None:
    """Write `fig` as a PNG and free it (pyplot keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
