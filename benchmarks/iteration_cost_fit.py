"""Where SparseSpec's iteration starts to beat our autoregressive mode per token: a straight-line fit of
each run's device ms per iteration against the generated context, from e2e_throughput.py's JSON.

    python benchmarks/iteration_cost_fit.py docs/results/e2e_throughput_qwen15_256x8192_compiled_h100_run23.json

Per run, over the iterations while the batch is full (past the first `--skip` ones): device ms per
iteration = intercept + slope x context (thousands of tokens per request). The context is the rows'
mean context, prompt and generated tokens, where the JSON records it (`iteration_mean_context`);
older JSONs give the generated context only, estimated as the iteration index x the run's tokens per
request-iteration while the batch is full (`full_batch_tokens_per_s` x `full_batch_seconds` /
full-batch iterations / batch: ~1 for AR, ~(accepted + 1) / (k + 1) for SparseSpec). Dividing by the tokens per
request-iteration gives the cost per generated token; the crossover is the context past
which the drafting run's token costs less than the baseline's (`--baseline`, default `ar_compiled`).
Prints a table; the fit says what an iteration costs before any context (the fixed cost: weights,
GEMMs over the iteration's tokens, sampling, launches) and what each thousand tokens of context adds.
Also, per drafting run, its tokens/s over the baseline's as the fits put it at each run's mean
context over its fitted iterations (older JSONs: half the run's new tokens), and with `--target R`
the cost at no context its iteration would need for R x the baseline, at the slope it has.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class CostFit:
    run: str
    intercept_ms: float  # device ms of an iteration at no generated context
    slope_ms_per_k: float  # device ms each 1,000 tokens of generated context add
    tokens_per_row_iteration: float
    iterations_fitted: int
    mean_context_k: float  # the fitted iterations' mean context (thousands of tokens)

    def ms_per_token(self, context_k: float) -> float:
        """Device ms per generated token of one full batch's iteration at `context_k` thousand tokens."""
        return (self.intercept_ms + self.slope_ms_per_k * context_k) / self.tokens_per_row_iteration


def fit_run(run: str, result: dict, batch: int, skip: int, new_tokens_k: float) -> CostFit:
    """The straight-line fit of one run's full-batch iterations (see the module docstring)."""
    gpu_ms = np.asarray(result["iteration_gpu_ms"], dtype=np.float64)
    rows = np.asarray(result["iteration_rows"])
    index = np.arange(len(gpu_ms))
    full = rows == batch
    per_row = result["full_batch_tokens_per_s"] * result["full_batch_seconds"] / full.sum() / batch
    keep = full & (index >= skip)
    if keep.sum() < 2:
        raise ValueError(f"{run}: fewer than 2 full-batch iterations past the first {skip}")
    if "iteration_mean_context" in result:
        context_k = np.asarray(result["iteration_mean_context"], dtype=np.float64)[keep] / 1000
        mean_context_k = float(context_k.mean())
    else:  # generated tokens only, from the iteration index
        context_k = index[keep] * per_row / 1000
        mean_context_k = new_tokens_k / 2
    design = np.stack([np.ones_like(context_k), context_k], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(design, gpu_ms[keep], rcond=None)
    return CostFit(run, float(intercept), float(slope), float(per_row), int(keep.sum()), mean_context_k)


def crossover_k(run: CostFit, baseline: CostFit) -> float | None:
    """The generated context (thousands of tokens) at which `run`, dearer per token than `baseline` at
    no context, costs the same as it (cheaper past it); 0.0 if `run` is no dearer at no context;
    None if it starts dearer and never catches up."""
    gain = (
        baseline.slope_ms_per_k / baseline.tokens_per_row_iteration - run.slope_ms_per_k / run.tokens_per_row_iteration
    )
    start = run.intercept_ms / run.tokens_per_row_iteration - baseline.intercept_ms / baseline.tokens_per_row_iteration
    if start <= 0:
        return 0.0
    if gain <= 0:
        return None
    return start / gain


def mean_ms_per_token(fit: CostFit) -> float:
    """Device ms per generated token over the fitted iterations (the line at their mean context)."""
    return fit.ms_per_token(fit.mean_context_k)


def intercept_for_ratio(run: CostFit, baseline: CostFit, ratio: float) -> float:
    """The no-context cost `run`'s iteration would need to decode `ratio` x the baseline's tokens/s over
    the fitted iterations, at its own slope and tokens per request-iteration."""
    per_token = mean_ms_per_token(baseline) / ratio
    return per_token * run.tokens_per_row_iteration - run.slope_ms_per_k * run.mean_context_k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="e2e_throughput.py JSON files")
    parser.add_argument("--baseline", default="ar_compiled")
    parser.add_argument("--skip", type=int, default=50, help="iterations left out at the start (the ramp)")
    parser.add_argument("--target", type=float, default=None, help="a tokens/s ratio over the baseline to price")
    args = parser.parse_args()
    target = f" | ms / iter at no context for {args.target}x" if args.target else ""
    lines = [
        "| results | run | ms / iter at no context | + ms per 1K context | tokens / request-iteration | "
        f"ms / token at 0 / 2K / 8K | crossover (K tokens of context) | tok/s vs baseline (fits){target} |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if args.target else ""),
    ]
    for path in args.results:
        data = json.loads(path.read_text())
        runs = data["runs"]
        batch = int(data["meta"]["args"]["batch"])
        new_tokens_k = int(data["meta"]["args"]["new_tokens"]) / 1000
        fits = {name: fit_run(name, r, batch, args.skip, new_tokens_k)
                for name, r in runs.items() if r.get("iteration_gpu_ms")}  # fmt: skip
        baseline = fits.get(args.baseline)
        for name, fit in fits.items():
            cross = ratio = "-"
            needed = " | -" if args.target else ""
            if baseline is not None and name != args.baseline:
                value = crossover_k(fit, baseline)
                cross = "never" if value is None else f"{value:.2f}"
                ratio = f"{mean_ms_per_token(baseline) / mean_ms_per_token(fit):.3f}x"
                if args.target:
                    needed = f" | {intercept_for_ratio(fit, baseline, args.target):.2f}"
            costs = " / ".join(f"{fit.ms_per_token(c):.2f}" for c in (0, 2, 8))
            lines.append(f"| {path.name} | {name} | {fit.intercept_ms:.2f} | {fit.slope_ms_per_k:.2f} | "
                         f"{fit.tokens_per_row_iteration:.3f} | {costs} | {cross} | {ratio}{needed} |")  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    main()
