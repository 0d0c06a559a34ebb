"""A simulation's coverage over time as a picture (matplotlib, the `dev` extra): the least-held block by
live servers and as placement counts it (records renewed lately), with each crash marked, and the
sessions open (right axis) and their per-token latency against the oracle's when there are any."""

from __future__ import annotations

from pathlib import Path

from corolla.errors import InvalidRequest

FORMATS = (".png", ".svg", ".pdf")


def check_plot_path(path: str | Path) -> None:
    """InvalidRequest naming what is wrong with where a plot is to go."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise InvalidRequest(f"--plot {path}: the file must end in one of {', '.join(FORMATS)}")
    if not path.parent.is_dir():
        raise InvalidRequest(f"--plot {path}: no folder {path.parent}")


def plot(result: dict, path: str | Path) -> None:
    """Write `result` (report.py `summarize`) to `path` (PNG, SVG or PDF, by its suffix)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display
        from matplotlib import pyplot
    except ImportError:
        raise InvalidRequest("--plot needs matplotlib: pip install 'matplotlib>=3.8'") from None
    times = [sample[0] for sample in result["coverage"]]
    figure, axes = pyplot.subplots(figsize=(9, 4.5))
    axes.step(times, [sample[1] for sample in result["coverage"]], where="post", label="live servers")
    axes.step(times, [sample[2] for sample in result["coverage"]], where="post", label="as placement counts")
    for crash in result["crashes"]:
        axes.axvline(crash["at_s"], color="red", linestyle=":", label=f"{crash['servers']} servers crash")
    ratio = result["sessions"]["latency_vs_oracle"]
    title = f"{result['scenario']}: servers on the least-held block"
    if ratio["median"] is not None:
        title += f" (sessions' latency vs oracle: median {ratio['median']}x, p95 {ratio['p95']}x)"
    axes.set(xlabel="simulated seconds", ylabel="servers", title=title)
    axes.set_ylim(bottom=0)
    axes.legend(loc="upper left")
    if result["sessions"]["started"]:
        sessions = axes.twinx()
        sessions.plot(times, [sample[3] for sample in result["coverage"]], color="gray", alpha=0.6)
        sessions.set(ylabel="sessions open (gray)")
        sessions.set_ylim(bottom=0)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
