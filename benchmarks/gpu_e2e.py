"""End-to-end checks and measurements on a GPU, one model per process (load once, run everything).

    python benchmarks/gpu_e2e.py --gguf PATH [--phases exact,accept,throughput] [--out DIR]

- exact: greedy `generate(..., generation_strategy="sparsespec")` with the Triton backend vs the torch
  backend vs plain `generate`, on a left-padded batch of mmath prompts, in float32 and bfloat16;
  reports tokens equal up to the first divergence and the top-2 logit gap of plain decoding there
  (a numeric tie when small), and the acceptance statistics of both backends.
- accept: sampled acceptance (T=0.6) of PillarAttn vs streaming vs dense on mmath prompts.
Throughput is measured by `e2e_throughput.py`. Prints tables last and writes JSON into --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import transformers
import triton
from loading import load_gguf
from prompts import distinct_ngrams, left_pad, reasoning_prompts
from transformers import GenerationConfig

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_divergence(model, reference, other, mask):
    """Per row: (index of the first differing generated token or None, top-2 gap there, and which side a
    one-pass forward of the unpadded common prefix picks: "reference", "other" or "neither"; it judges
    an incremental decode that drifted, e.g. plain decoding's own left-padded batch)."""
    out = []
    width = mask.shape[1]
    for row in range(reference.shape[0]):
        a, b = reference[row, width:].tolist(), other[row, width:].tolist()
        index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        gap = side = None
        if index is not None:
            num_pad = int((mask[row] == 0).sum())
            prefix = reference[row : row + 1, num_pad : width + index]
            with torch.no_grad():
                top2 = model(input_ids=prefix).logits[0, -1].float().topk(2)
            gap = float(top2.values[0] - top2.values[1])
            best = int(top2.indices[0])
            side = "reference" if best == a[index] else "other" if best == b[index] else "neither"
        out.append((index, gap, side))
    return out


def phase_exact(model, tokenizer, args, report):
    prompts = reasoning_prompts(tokenizer, args.exact_prompts)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, args.device)
    rows = []
    for dtype in [getattr(torch, name) for name in args.exact_dtypes.split(",")]:
        m = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=args.exact_tokens, do_sample=False)
        plain = m.generate(**settings)
        outs = {}
        backends = args.backends.split(",")
        for backend in backends:
            config = SparseSpecConfig(min_budget=args.min_budget, backend=backend, cuda_graphs=args.graphs == "on")
            sync()
            start = time.perf_counter()
            outs[backend] = m.generate(
                **settings, generation_strategy="sparsespec", sparsespec_config=config, return_dict_in_generate=True
            )
            sync()
            outs[backend + "_seconds"] = time.perf_counter() - start
            print(f"exact {dtype} {backend}: {outs[backend + '_seconds']:.1f} s", flush=True)
        pairs = [(f"{b} vs plain", plain, outs[b].sequences) for b in backends]
        if len(backends) == 2:
            pairs.insert(0, ("triton vs torch", outs["torch"].sequences, outs["triton"].sequences))
        for name, reference, other in pairs:
            diverged = first_divergence(m, reference, other, mask)
            rows.append({
                "dtype": str(dtype).removeprefix("torch."), "pair": name, "rows": len(diverged),
                "identical_rows": sum(d[0] is None for d in diverged),
                "divergences": [d for d in diverged if d[0] is not None],
            })
        for backend in backends:
            stats = outs[backend].sparsespec_stats.total
            rows.append({
                "dtype": str(dtype).removeprefix("torch."), "pair": f"{backend} stats",
                "mean_accepted": stats.mean_accepted_per_cycle, "acceptance_rate": stats.acceptance_rate,
                "cycles": stats.cycles, "histogram": stats.accepted_histogram, "seconds": outs[backend + "_seconds"],
            })
        if m is not model:
            del m
            sync()
    report["exact"] = rows
    print(f"\ngraphs {args.graphs}")
    print("| dtype | comparison | rows identical | divergences (generated index, top-2 gap of a one-pass forward) |")
    print("|---|---|---|---|")
    for row in rows:
        if "identical_rows" in row:
            div = ", ".join(f"({i}, {g:.3g}, one-pass forward picks {side})" for i, g, side in row["divergences"]) or "-"
            print(f"| {row['dtype']} | {row['pair']} | {row['identical_rows']}/{row['rows']} | {div} |")
    print("\n| dtype | backend | mean accepted/cycle | acceptance rate | cycles | seconds |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "mean_accepted" in row:
            print(f"| {row['dtype']} | {row['pair']} | {row['mean_accepted']:.3f} | {row['acceptance_rate']:.3f} | "
                  f"{row['cycles']} | {row['seconds']:.1f} |")


def phase_accept(model, tokenizer, args, report):
    m = copy.deepcopy(model).to(torch.bfloat16)
    prompts = reasoning_prompts(tokenizer, args.accept_prompts)
    config = GenerationConfig(
        do_sample=True, temperature=0.6, top_k=0, top_p=1.0, max_new_tokens=args.accept_tokens,
        min_new_tokens=args.accept_tokens, eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    rows = []
    budgets = [int(b) for b in args.accept_budgets.split(",")]
    for selection in ("pillar", "streaming", "dense"):
        for min_budget in budgets if selection != "dense" else (0,):
            sconfig = SparseSpecConfig(selection=selection, min_budget=max(min_budget, 8))
            torch.manual_seed(args.seed)
            start = time.perf_counter()
            results = hf_sparsespec.generate_batch(m, prompts, config, sconfig)
            seconds = time.perf_counter() - start
            stats = hf_sparsespec.SparseSpecStats.from_requests(8, [r.stats for r in results])
            rows.append({
                "selection": selection, "min_budget": min_budget, "mean_accepted": stats.total.mean_accepted_per_cycle,
                "acceptance_rate": stats.total.acceptance_rate, "histogram": stats.total.accepted_histogram,
                "distinct4": sum(distinct_ngrams(r.generated_ids) for r in results) / len(results),
                "seconds": seconds,
            })
            print(f"accept {selection} {min_budget}: {rows[-1]['mean_accepted']:.2f} in {seconds:.0f} s", flush=True)
    del m
    sync()
    report["accept"] = rows
    print(f"\n{len(prompts)} mmath prompts x {args.accept_tokens} sampled tokens (T=0.6), k=8, budget_ratio=0.05, bf16")
    print("| selection | min_budget | mean accepted/cycle | acceptance rate | histogram 0..8 | mean distinct-4 | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['selection']} | {r['min_budget']} | {r['mean_accepted']:.2f} | {r['acceptance_rate']:.3f} | "
              f"{r['histogram']} | {r['distinct4']:.2f} | {r['seconds']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--phases", default="exact,accept")
    parser.add_argument("--exact-prompts", type=int, default=4)
    parser.add_argument("--exact-tokens", type=int, default=192)
    parser.add_argument("--min-budget", type=int, default=64)
    parser.add_argument("--accept-prompts", type=int, default=8)
    parser.add_argument("--accept-tokens", type=int, default=1024)
    parser.add_argument("--accept-budgets", default="64,128")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backends", default="torch,triton")
    parser.add_argument("--graphs", choices=["on", "off"], default="on", help="CUDA graphs of our engine")
    parser.add_argument("--exact-dtypes", default="float32,bfloat16")
    args = parser.parse_args()

    start = time.perf_counter()
    model, tokenizer = load_gguf(args.gguf, torch.float32, args.device)
    print(f"loaded {args.gguf.name} in {time.perf_counter() - start:.0f} s", flush=True)
    report = {"meta": {
        "model": args.gguf.name, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
        "triton": triton.__version__, "transformers": transformers.__version__, "args": {k: str(v) for k, v in vars(args).items()},
    }}
    args.out.mkdir(parents=True, exist_ok=True)
    for phase in args.phases.split(","):
        {"exact": phase_exact, "accept": phase_accept}[phase](model, tokenizer, args, report)
        (args.out / f"e2e_{args.gguf.stem}.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report["meta"]))


if __name__ == "__main__":
    main()
