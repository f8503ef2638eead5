"""The evaluation report: one dict (written as `results.json`), a markdown table and PNG plots.

Per mode: accuracy, output tokens, wall time (the slowest process's decoding time), tokens/s, and
for SparseSpec the acceptance statistics merged over every request. Across modes: the speedup,
per-request speedups, and whether greedy outputs are identical token for token.
"""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

from hf_sparsespec.eval.config import WARMUP_TOKENS
from hf_sparsespec.eval.scoring import gsm_reference, math_reference
from hf_sparsespec.stats import RequestStats, SparseSpecStats

logger = logging.getLogger(__name__)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers

    try:
        ours = version("hf_sparsespec")
    except PackageNotFoundError:
        ours = "source"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "hf_sparsespec": ours}


def _merged_stats(requests: list[dict], k: int) -> dict:
    per_request = []
    for data in requests:
        stats = RequestStats(
            cycles=data["cycles"], drafted_tokens=data["drafted_tokens"], accepted_drafts=data["accepted_drafts"],
            generated_tokens=data["generated_tokens"], accepted_histogram=list(data["accepted_histogram"]),
            cycle_accepted=list(data["cycle_accepted"]), cycle_drafted=list(data.get("cycle_drafted", [])),
        )
        per_request.append(stats)
    return SparseSpecStats.from_requests(k, per_request).as_dict()


def build_report(config, records: list[dict], times: list[dict], meta: dict) -> dict:
    """The report of gathered `records` (one per example) and per-process decoding `times`."""
    records = sorted(records, key=lambda r: r["index"])
    k = config.num_draft_tokens
    runs = {}
    for mode in config.modes:
        mine = [r["runs"][mode] for r in records]
        scored = [run["correct"] for run in mine if run["correct"] is not None]
        wall = max(t[mode] for t in times)
        tokens = sum(run["output_tokens"] for run in mine)
        run = {
            "correct": sum(scored) if scored else None,
            "accuracy": sum(scored) / len(scored) if scored else None,
            "output_tokens": tokens,
            "time_s": wall,
            "tokens_per_second": tokens / wall if wall > 0 else None,
            "samples": [{"index": r["index"], "output_tokens": run["output_tokens"],
                         "tokens_per_second": run["tokens_per_second"]} for r, run in zip(records, mine)],
        }
        warmups = [t["warmup"][mode] for t in times if mode in t.get("warmup", {})]
        if warmups:  # untimed, the slowest process
            run["warmup_s"] = max(warmups)
        engines = [t["engine"][mode] for t in times if mode in t.get("engine", {})]
        if engines:  # summed over processes
            run["engine"] = _summed(engines)
        if mode == "sparsespec":
            stats = _merged_stats([m["stats"] for m in mine], k)
            run.update(mean_accepted_per_cycle=stats["total"]["mean_accepted_per_cycle"],
                       acceptance_rate=stats["total"]["acceptance_rate"], stats=stats)
        runs[mode] = run
    report = {
        "config": config.as_dict(), "versions": _versions(), **meta,
        "num_examples": len(records), "num_draft_tokens": k, "runs": runs,
    }
    if set(runs) == {"plain", "sparsespec"}:
        plain, sparse = runs["plain"], runs["sparsespec"]
        report["speedup"] = plain["time_s"] / sparse["time_s"] if sparse["time_s"] > 0 else None
        if config.batch_size == 1:  # a batch's requests share its time: per request only one at a time
            report["per_request_speedup"] = [
                {"index": r["index"], "output_tokens": r["runs"]["sparsespec"]["output_tokens"],
                 "speedup": r["runs"]["plain"]["time_s"] / r["runs"]["sparsespec"]["time_s"]
                 if r["runs"]["sparsespec"]["time_s"] > 0 else None}
                for r in records
            ]
        if not config.do_sample:
            report["identical_outputs"] = sum(bool(r["identical"]) for r in records)
            report["different_outputs"] = [r["index"] for r in records if not r["identical"]]
            report["same_answers"] = sum(
                r["runs"]["plain"]["answer"] == r["runs"]["sparsespec"]["answer"]
                and r["runs"]["plain"]["correct"] == r["runs"]["sparsespec"]["correct"] for r in records
            )
    report["examples"] = records
    return report


def merge_reports(reports: list[dict]) -> dict:
    """One report of several runs of the same configuration over consecutive slices of a dataset
    (e.g. `--offset 0 --limit 16`, then `--offset 16 --limit 16`, each under a time limit): the
    examples are concatenated and renumbered, the decoding times added."""
    from hf_sparsespec.eval.config import EvalConfig

    first = reports[0]
    options = {**first["config"], "modes": tuple(first["config"]["modes"]), "filters": tuple(first["config"]["filters"])}
    options["selection"] = _selection(first)
    config = EvalConfig(**options)
    for report in reports[1:]:
        if list(report["runs"]) != list(first["runs"]) or report["task"] != first["task"]:
            raise ValueError(f"expected reports of the same modes and task, got {list(report['runs'])} {report['task']}")
        if _selection(report) != config.selection:
            raise ValueError(f"expected reports of the same selection, got {_selection(report)!r} and {config.selection!r}")
    records, offset = [], 0
    for report in reports:
        records += [{**record, "index": record["index"] + offset} for record in report["examples"]]
        offset += report["num_examples"]
    times = [{mode: sum(report["runs"][mode]["time_s"] for report in reports) for mode in config.modes}]
    meta = {key: first[key] for key in ("task", "num_processes", "device", "dtype")}
    merged = build_report(config, records, times, meta)
    for mode in config.modes:
        engines = [report["runs"][mode]["engine"] for report in reports if "engine" in report["runs"][mode]]
        if engines:
            merged["runs"][mode]["engine"] = _summed(engines)
    merged["versions"] = first["versions"]
    merged["merged_from"] = [{"offset": r["config"]["offset"], "limit": r["config"]["limit"]} for r in reports]
    return merged


def _summed(engines: list[dict]) -> dict:
    """Engine counts (`EngineStats.as_dict()`) of several processes or slices, added up."""
    return {key: sum(engine[key] for engine in engines) for key in engines[0]}


def _percent(value) -> str:
    return "–" if value is None else f"{value:.1%}"


def _selection(report: dict) -> str:
    """The SparseSpec selection a report ran: reports from before 2026-12-02 ran PillarAttn (the
    default then) and do not name it."""
    return report["config"].get("selection", "pillar")


def markdown(report: dict) -> str:
    """A results table, the greedy check, the histogram and a per-example table."""
    config, runs, n = report["config"], report["runs"], report["num_examples"]
    selection = _selection(report)
    lines = [
        f"## {Path(config['model']).name} on {Path(config['dataset']).name} ({report['task']}, {n} examples)",
        "",
        f"{report['device']}, {report['dtype']}, {report['num_processes']} process(es), batch size "
        f"{config['batch_size']}, max_new_tokens {config['max_new_tokens']}, "
        + ("greedy" if not config["do_sample"] else f"sampling T={config['temperature']} top-p={config['top_p']}")
        + f"; SparseSpec k={config['num_draft_tokens']}, budget_ratio={config['budget_ratio']}, "
        f"min_budget={config['min_budget']}, selection {selection}"
        + (", compiled forward" if config.get("compile_forward") else "")
        + f"; torch {report['versions']['torch']}, "
        f"transformers {report['versions']['transformers']}",
        "",
        "| decoding | accuracy | output tokens | time (s) | tokens/s | accepted drafts / cycle | acceptance rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, run in runs.items():
        accuracy = "–" if run["accuracy"] is None else f"{run['correct']}/{n} ({run['accuracy']:.1%})"
        accepted = f"{run['mean_accepted_per_cycle']:.2f} of {report['num_draft_tokens']}" if "stats" in run else "–"
        speed = "–" if run["tokens_per_second"] is None else f"{run['tokens_per_second']:.1f}"
        lines.append(f"| {mode} | {accuracy} | {run['output_tokens']} | {run['time_s']:.2f} | {speed} | {accepted} | "
                     f"{_percent(run.get('acceptance_rate'))} |")
    lines.append("")
    if report.get("speedup") is not None:
        lines.append(f"Speedup (plain time / SparseSpec time): **{report['speedup']:.2f}x**.")
    if all("warmup_s" in run for run in runs.values()):
        lines.append(f"Untimed warm-up (the first batch, up to {WARMUP_TOKENS} tokens): "
                     + ", ".join(f"{mode} {run['warmup_s']:.1f} s" for mode, run in runs.items()) + ".")
    if "identical_outputs" in report:
        lines.append(f"Greedy: {report['identical_outputs']}/{n} outputs identical token for token, "
                     f"{report['same_answers']}/{n} identical answers"
                     + (f" (different: {report['different_outputs']})." if report["different_outputs"] else "."))
    if "sparsespec" in runs:
        histogram = runs["sparsespec"]["stats"]["total"]["accepted_histogram"]
        lines.append("Accepted drafts per cycle (cycles): " + ", ".join(f"{a}: {c}" for a, c in enumerate(histogram)))
        engine = runs["sparsespec"].get("engine")
        if engine:
            lines.append(f"SparseSpec iterations: {engine['iterations']} ({engine['graph_replays']} graph replays, "
                         f"{engine['eager_iterations']} eager; {engine['graphs_captured']} graphs captured in "
                         f"{engine['capture_seconds']:.1f} s).")
    per_request = "per_request_speedup" in report
    lines += ["", "| # | id | reference | " + " | ".join(f"{m} answer | {m} tokens" for m in runs)
              + (" | speedup |" if per_request else " |"),
              "|---|---|---|" + "---|---|" * len(runs) + ("---|" if per_request else "")]
    speedups = {s["index"]: s["speedup"] for s in report.get("per_request_speedup", [])}
    for record in report["examples"]:
        cells = []
        for mode in runs:
            run = record["runs"][mode]
            mark = "" if run["correct"] is None else (" ✓" if run["correct"] else " ✗")
            cells.append(f"{_cell(run['answer'])}{mark} | {run['output_tokens']}")
        speedup = speedups.get(record["index"])
        last = (f" | {'–' if speedup is None else f'{speedup:.2f}x'} |") if per_request else " |"
        lines.append(f"| {record['index']} | {_cell(record['id'])} | {_cell(_reference(record, report['task']))} | "
                     + " | ".join(cells) + last)
    return "\n".join(lines) + "\n"


def _reference(record: dict, task: str) -> str | None:
    """The answer the outputs are scored against (a GSM or MATH reference solution holds more)."""
    reference = record["reference"]
    if reference is None or task not in ("math", "gsm"):
        return reference
    return gsm_reference(reference) if task == "gsm" else math_reference(reference)


def _cell(value, width: int = 40) -> str:
    text = "–" if value is None else str(value).replace("|", "\\|").replace("\n", " ") or '""'
    return text if len(text) <= width else text[: width - 1] + "…"


def write_report(report: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """`results.json`, `results.md` and (with matplotlib) the plots in `out_dir`; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md"]
    paths[0].write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    paths[1].write_text(markdown(report))
    if plots:
        try:
            from hf_sparsespec.plots import save_eval_plots

            paths += save_eval_plots(report, out_dir)
        except ImportError as error:
            logger.warning("no plots: %s; rerun later with --replot %s", error, paths[0])
    return paths
