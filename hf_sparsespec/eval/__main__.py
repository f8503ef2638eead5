"""`python -m hf_sparsespec.eval` / `hf-sparsespec-eval`: the command line of the evaluation.

Every option maps to one `EvalConfig` field (see its docstring). `--replot results.json` rewrites the
markdown and the plots of an earlier run (e.g. on a machine that has matplotlib).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields
from pathlib import Path

from hf_sparsespec.config import SELECTION_POLICIES
from hf_sparsespec.eval.config import MODES, TASKS, EvalConfig


def parser() -> argparse.ArgumentParser:
    defaults = {f.name: f.default for f in fields(EvalConfig)}
    p = argparse.ArgumentParser(prog="python -m hf_sparsespec.eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="hub name, local folder, .gguf file, or 'smollm2' (the embedded demo model)")
    p.add_argument("--dataset", help="local .json/.jsonl(.gz)/.parquet file or folder, 'humaneval', or a hub name")
    p.add_argument("--out", dest="out_dir", default=defaults["out_dir"], help="output folder (default: %(default)s)")
    p.add_argument("--split")
    p.add_argument("--task", choices=TASKS, default="auto")
    p.add_argument("--question-field")
    p.add_argument("--answer-field")
    p.add_argument("--filter", dest="filters", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--limit", type=int)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    p.add_argument("--system-prompt")
    p.add_argument("--prompt-suffix")
    p.add_argument("--max-new-tokens", type=int, default=defaults["max_new_tokens"])
    p.add_argument("--batch-size", type=int, default=defaults["batch_size"])
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=defaults["temperature"])
    p.add_argument("--top-p", type=float, default=defaults["top_p"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--device", help="default: accelerate's device for this process")
    p.add_argument("--num-draft-tokens", type=int, default=defaults["num_draft_tokens"])
    p.add_argument("--budget-ratio", type=float, default=defaults["budget_ratio"])
    p.add_argument("--min-budget", type=int, default=defaults["min_budget"])
    p.add_argument("--selection", default=defaults["selection"], choices=SELECTION_POLICIES,
                   help="the old keys a draft step reads (default: %(default)s; 'pillar' is the paper's PillarAttn)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--compile-forward", action="store_true",
                   help="torch.compile the decode forward (minutes of compilation; pays off on long runs)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--humaneval-timeout", type=float, default=defaults["humaneval_timeout"])
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--replot", nargs="+", metavar="RESULTS_JSON",
                   help="only rewrite results.md and the plots of a results.json (several: merged into --out)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from hf_sparsespec.eval.report import write_report

    if args.replot:
        from hf_sparsespec.eval.report import merge_reports

        reports = [json.loads(Path(path).read_text()) for path in args.replot]
        report = reports[0] if len(reports) == 1 else merge_reports(reports)
        out_dir = args.out_dir if args.out_dir != parser().get_default("out_dir") else Path(args.replot[0]).parent
        for path in write_report(report, out_dir, plots=args.plots):
            print(path)
        return 0
    if not args.model or not args.dataset:
        parser().error("--model and --dataset are required (or --replot)")
    options = {name: value for name, value in vars(args).items() if name != "replot"}
    options["modes"] = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    options["filters"] = tuple(args.filters)
    config = EvalConfig(**options)

    from hf_sparsespec.eval.runner import Processes, run_eval

    report = run_eval(config)
    if Processes(cpu=config.device == "cpu").is_main:
        paths = write_report(report, config.out_dir, plots=config.plots)
        print((Path(config.out_dir) / "results.md").read_text())
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
