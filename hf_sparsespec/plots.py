"""Matplotlib plots of acceptance and speed (optional: `pip install "hf_sparsespec[eval]"`).

Each function draws on the Axes it is given (or a new figure's) and returns the Axes, so notebooks
compose them; `save_eval_plots` writes the eval CLI's figures as PNG files. Inputs are plain lists and
dicts (what `SparseSpecStats.as_dict()` and the eval report hold), never live objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _pyplot():
    try:
        import matplotlib.pyplot as plt  # headless machines fall back to the Agg backend by themselves
    except ImportError as error:
        raise ImportError('plots need matplotlib: pip install "hf_sparsespec[eval]" (or matplotlib)') from error
    return plt


def _axes(ax):
    if ax is not None:
        return ax
    _, ax = _pyplot().subplots(figsize=(6, 3.5))
    return ax


def plot_acceptance_histogram(histograms: Mapping[str, Sequence[int]], ax=None):
    """Fraction of cycles that accepted 0..k drafts, one bar series per label."""
    ax = _axes(ax)
    labels = list(histograms)
    width = 0.8 / max(len(labels), 1)
    for index, label in enumerate(labels):
        counts = list(histograms[label])
        total = sum(counts) or 1
        xs = [a + (index - (len(labels) - 1) / 2) * width for a in range(len(counts))]
        ax.bar(xs, [c / total for c in counts], width=width, label=f"{label} ({sum(counts)} cycles)")
    ax.set_xlabel("accepted drafts per cycle")
    ax.set_ylabel("fraction of cycles")
    ax.set_title("Acceptance histogram")
    ax.legend()
    return ax


def acceptance_by_position(traces: Sequence[Sequence[int]], bucket: int) -> tuple[list[int], list[float]]:
    """Mean accepted drafts per cycle by output position: (bucket starts, means) over all requests.

    A trace is one request's `cycle_accepted`; its cycle i starts at output position
    1 + sum of (accepted + 1) over the cycles before it (position 0 is the token sampled at prefill).
    """
    sums: dict[int, list[float]] = {}
    for trace in traces:
        position = 1
        for accepted in trace:
            entry = sums.setdefault(position // bucket, [0.0, 0])
            entry[0] += accepted
            entry[1] += 1
            position += accepted + 1
    starts = sorted(sums)
    return [s * bucket for s in starts], [sums[s][0] / sums[s][1] for s in starts]


def plot_acceptance_by_position(traces: Mapping[str, Sequence[Sequence[int]]], bucket: int = 64, ax=None):
    """Mean accepted drafts per cycle against the output position where the cycle starts."""
    ax = _axes(ax)
    for label, label_traces in traces.items():
        xs, ys = acceptance_by_position(label_traces, bucket)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(f"output position (buckets of {bucket} tokens)")
    ax.set_ylabel("mean accepted drafts / cycle")
    ax.set_title("Acceptance along the output")
    ax.set_ylim(bottom=0)
    ax.legend()
    return ax


def plot_throughput_by_length(points: Mapping[str, Sequence[tuple[int, float]]], ax=None):
    """Tokens/s of each request (or batch) against its output length, one series per label."""
    ax = _axes(ax)
    for label, pairs in points.items():
        ax.scatter([p[0] for p in pairs], [p[1] for p in pairs], label=label, alpha=0.8)
    ax.set_xlabel("output length (tokens)")
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput by output length")
    ax.set_ylim(bottom=0)
    ax.legend()
    return ax


def plot_speedup(lengths: Sequence[int], speedups: Sequence[float], ax=None):
    """Per-request speedup (plain time / SparseSpec time) against output length; 1.0 marked."""
    ax = _axes(ax)
    ax.scatter(list(lengths), list(speedups), color="#55a868")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("output length (tokens)")
    ax.set_ylabel("speedup (plain / SparseSpec time)")
    ax.set_title("Per-request speedup")
    ax.set_ylim(bottom=0)
    return ax


def save_eval_plots(report: Mapping, out_dir: str | Path) -> list[Path]:
    """The eval report's figures as PNG files in `out_dir`; returns their paths."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {name: run for name, run in report["runs"].items() if run.get("stats")}
    figures = {}
    if runs:
        figures["acceptance_histogram.png"] = lambda ax: plot_acceptance_histogram(
            {name: run["stats"]["total"]["accepted_histogram"] for name, run in runs.items()}, ax=ax
        )
        traces = {name: [r["cycle_accepted"] for r in run["stats"]["per_request"]] for name, run in runs.items()}
        longest = max(s["output_tokens"] for run in runs.values() for s in run["samples"])
        figures["acceptance_by_position.png"] = lambda ax: plot_acceptance_by_position(
            traces, bucket=_bucket(longest), ax=ax
        )
    figures["throughput_by_length.png"] = lambda ax: plot_throughput_by_length(
        {
            name: [(s["output_tokens"], s["tokens_per_second"]) for s in run["samples"] if s["tokens_per_second"]]
            for name, run in report["runs"].items()
        },
        ax=ax,
    )
    speedups = [s for s in report.get("per_request_speedup", []) if s["speedup"] is not None]
    if speedups:
        figures["speedup.png"] = lambda ax: plot_speedup(
            [s["output_tokens"] for s in speedups], [s["speedup"] for s in speedups], ax=ax
        )
    paths = []
    for name, draw in figures.items():
        figure, ax = plt.subplots(figsize=(6, 3.5))
        draw(ax)
        figure.tight_layout()
        path = out_dir / name
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def _bucket(max_position: int) -> int:
    """A bucket width giving about 10 points along the longest output, rounded to 8."""
    return max(8, (max_position // 10 + 7) // 8 * 8)
