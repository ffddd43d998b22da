"""matplotlib for the benchmarks' plots, headless; None (and a hint) where pagekube[bench] is not installed."""

from __future__ import annotations

import sys


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return None
    return plt


def save(fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
