"""`hybridpd bench plot RESULT.json... --out FILE.png`: TTFT and ITL CDFs side by side, one line per result.

matplotlib is an optional extra (`pip install 'hybridpd[plot]'`), imported only here and only when
plotting, with the Agg backend (no display needed).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class NotABenchResultError(ValueError):
    """The file is not JSON, or lacks the per-request `ttfts` / `itls` lists of a bench result."""


@dataclass(frozen=True, kw_only=True)
class Series:
    label: str
    ttfts_ms: tuple[float, ...]
    itls_ms: tuple[float, ...]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", metavar="RESULT.json", help="files written by --save-result")
    parser.add_argument("--out", required=True, metavar="FILE.png")


def load_series(path: Path) -> Series:
    """Successful requests only (empty error text), times in ms; the label is the result's, else the file name."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotABenchResultError(f"{path}: cannot read a bench result ({exc})") from None
    if not isinstance(result, dict) or not isinstance(result.get("ttfts"), list) or not isinstance(
        result.get("itls"), list
    ):
        raise NotABenchResultError(f"{path}: not a `hybridpd bench` result (no ttfts/itls lists)")
    errors = result.get("errors") or [""] * len(result["ttfts"])
    ok = [not e for e in errors]
    return Series(
        label=str(result.get("label") or path.stem),
        ttfts_ms=tuple(float(t) * 1000 for t, good in zip(result["ttfts"], ok) if good),
        itls_ms=tuple(float(g) * 1000 for gaps, good in zip(result["itls"], ok) if good for g in gaps),
    )


def _cdf(values: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    data = np.sort(np.asarray(values, dtype=float))
    return data, np.arange(1, len(data) + 1) / max(len(data), 1)


def draw(series: list[Series], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft_axes, itl_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for axes, title, pick in (
        (ttft_axes, "Time to first token", lambda s: s.ttfts_ms),
        (itl_axes, "Inter-token latency", lambda s: s.itls_ms),
    ):
        for one in series:
            x, y = _cdf(pick(one))
            axes.step(x, y, where="post", label=f"{one.label} (n={len(x)})")
        axes.set_title(f"{title} (CDF)")
        axes.set_xlabel("ms")
        axes.set_ylabel("fraction of samples")
        axes.grid(alpha=0.3)
        axes.legend(loc="lower right")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def run(args: argparse.Namespace) -> int:
    try:
        series = [load_series(Path(p)) for p in args.results]
    except NotABenchResultError as exc:
        print(f"hybridpd bench plot: error: {exc}")
        return 2
    try:
        path = draw(series, Path(args.out))
    except ImportError:
        print("hybridpd bench plot: error: matplotlib is not installed (pip install 'hybridpd[plot]')")
        return 2
    print(f"Plot saved to {path}")
    return 0
