"""Acceptance study: how many of k greedy drafts each selection policy gets accepted, teacher-forced on
real texts, against the oracles, and how many bytes each policy's draft step reads.

    OMP_NUM_THREADS=1 python benchmarks/acceptance_study.py --texts 4 --episodes 6 --cycles 12 \
        --min-budgets 64 --out out/study_smollm2

Protocol, vocabulary and byte accounting: `study_harness.py`; the policies: `study_policies.py`
(`--policies` takes `kind[:key=value,...]` specs, e.g. `rerank:candidates=1.5`); the texts:
`study_traces.py` (sampled once per recipe and cached in `--texts-file`). The model runs unmodified
(fp32 by default: argmax near-ties make bf16 acceptance noisy). Prints a table last and writes
`results.json` (run info + one summary row per policy), `cycles.json.gz` (every counted cycle, columnar)
and `acceptance.png` to `--out`.

Defaults: SmolLM2-135M-Instruct (embedded), single-turn mmath texts sampled at T=0.6 with a windowed
repetition penalty, k=8, budget_ratio 0.05. `--gguf` loads another model (e.g. Qwen2.5-Coder-1.5B);
`--turns` makes multi-turn texts (the Qwen reference study's recipe).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from prompts import distinct_ngrams
from study_harness import Study
from study_policies import make_policy
from study_traces import anchors, load_or_generate

DEFAULT_POLICIES = (
    "dense,pillar,streaming,oracle_step,oracle_first,oracle_frozen,pillar:budget_scale=1.3,"
    "quest:extra=0.25,rerank:candidates=1.6,shared:mode=mass,shared:mode=entropy,diagonal"
)
ORACLES = ("dense", "oracle_step", "oracle_first", "oracle_frozen")


def load_model(args):
    dtype = getattr(torch, args.dtype)
    if args.random:
        from loading import random_model

        model, _ = random_model(args.random, dtype, args.device)
        return model, None
    if args.gguf:
        from loading import load_gguf

        return load_gguf(args.gguf, dtype, args.device)
    from hf_sparsespec.demo_model import load_smollm2

    return load_smollm2(dtype, args.device)


def get_texts(args, model, tokenizer) -> list[dict]:
    if tokenizer is None:  # random weights: random tokens (a smoke test of the tool, not a measurement)
        generator = torch.Generator().manual_seed(args.seed)
        size = model.config.vocab_size
        return [{"tokens": torch.randint(size, (args.max_new + 64,), generator=generator).tolist(), "prompt_len": 64,
                 "forced": [[0, 64]], "recipe": {}} for _ in range(args.texts)]  # fmt: skip
    return load_or_generate(
        args.texts_file, model, tokenizer, args.texts, max_new=args.max_new, min_new=args.min_new,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, penalty=args.penalty,
        window=args.penalty_window, turns=args.turns, turn_cap=args.turn_cap, first_problem=args.first_problem,
    )  # fmt: skip


def summarize(records: list[dict], k: int, bins: list[int]) -> list[dict]:
    """One row per (policy, min_budget): mean accepted with the cluster SE over episodes, bytes, bins."""
    by_config = defaultdict(list)
    for r in records:
        by_config[r["policy"], r["min_budget"]].append(r)
    pillar_bytes = {mb: statistics.fmean(r["bytes_per_step"] for r in rs) for (p, mb), rs in by_config.items()
                    if p == "pillar"}  # fmt: skip
    rows = []
    for (policy, mb), rs in by_config.items():
        episodes = defaultdict(list)
        for r in rs:
            episodes[r["text"], r["episode"]].append(r["accepted"])
        means = [statistics.fmean(v) for v in episodes.values()]
        se = statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else float("nan")
        mean_bytes = statistics.fmean(r["bytes_per_step"] for r in rs)
        edges = [0, *bins, math.inf]
        by_bin = {}
        for lo, hi in zip(edges[:-1], edges[1:]):
            sel = [r for r in rs if lo <= r["t"] < hi]
            if sel:
                by_bin[f"{lo}-{hi}"] = {"accepted": statistics.fmean(r["accepted"] for r in sel), "cycles": len(sel),
                                        "budget": statistics.fmean(r["budget"] for r in sel)}  # fmt: skip
        fresh = [r["accepted"] for r in rs if r["local_distinct4"] >= 0.5]
        rows.append({
            "policy": policy, "min_budget": mb, "accepted": statistics.fmean(r["accepted"] for r in rs), "se": se,
            "rate": statistics.fmean(r["accepted"] for r in rs) / k, "cycles": len(rs), "episodes": len(means),
            "budget": statistics.fmean(r["budget"] for r in rs),
            "old_keys_per_head": statistics.fmean(r["old_keys_per_head"] for r in rs),
            "bytes_per_step": mean_bytes, "bytes_vs_pillar": mean_bytes / pillar_bytes[mb] if mb in pillar_bytes else None,
            "accepted_non_loop": statistics.fmean(fresh) if fresh else None, "cycles_non_loop": len(fresh),
            "histogram": [sum(r["accepted"] == a for r in rs) / len(rs) for a in range(k + 1)], "by_context": by_bin,
        })  # fmt: skip
    return rows


def table(rows: list[dict], k: int) -> str:
    head = (f"| policy | min_budget | accepted of {k} (± cluster SE) | a/k | mean B | old keys/head | "
            "KiB/step (bf16 KV) | bytes vs pillar | accepted, non-loop |")  # fmt: skip
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        ratio = f"{r['bytes_vs_pillar']:.2f}x" if r["bytes_vs_pillar"] is not None else "-"
        if r["policy"].startswith("oracle"):
            ratio = "(bound)"  # chooses from the exact attention over every old key: its K would be read too
        fresh = f"{r['accepted_non_loop']:.2f}" if r["accepted_non_loop"] is not None else "-"
        lines.append(f"| {r['policy']} | {r['min_budget']} | {r['accepted']:.2f} ± {r['se']:.2f} | {r['rate']:.2f} | "
                     f"{r['budget']:.0f} | {r['old_keys_per_head']:.0f} | {r['bytes_per_step'] / 1024:.0f} | {ratio} | "
                     f"{fresh} |")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, k: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    budgets = sorted({r["min_budget"] for r in rows})
    for color, mb in zip(("tab:blue", "tab:orange", "tab:green", "tab:red"), budgets):
        for r in (r for r in rows if r["min_budget"] == mb):
            if r["policy"] in ORACLES:
                left.axhline(r["accepted"], color=color, lw=0.8, ls=":")
                left.annotate(f"{r['policy']} mb={mb}", (0.02, r["accepted"]), xycoords=("axes fraction", "data"),
                              fontsize=7, color=color)  # fmt: skip
            elif r["bytes_vs_pillar"] is not None:
                left.errorbar(r["bytes_vs_pillar"], r["accepted"], yerr=r["se"], fmt="o", color=color, ms=4)
                left.annotate(r["policy"], (r["bytes_vs_pillar"], r["accepted"]), fontsize=7, xytext=(3, 3),
                              textcoords="offset points")  # fmt: skip
    left.set_xlabel("bytes read per draft step / PillarAttn's (same min_budget)")
    left.set_ylabel(f"mean accepted drafts per cycle (of {k})")
    left.set_title("acceptance vs draft bytes (dotted: oracles)")
    mb = budgets[0]
    shown = [r for r in rows if r["min_budget"] == mb and r["policy"] != "dense"]
    for index, r in enumerate(shown):
        keys = list(r["by_context"])
        style = dict(ls="--", marker="s") if r["policy"] in ORACLES else dict(ls="-", marker="o")
        right.plot(range(len(keys)), [r["by_context"][b]["accepted"] for b in keys], label=r["policy"],
                   color=plt.cm.tab20(index % 20), ms=4, **style)  # fmt: skip
        right.set_xticks(range(len(keys)), keys, fontsize=7)
    right.set_xlabel("context length t at the cycle start")
    right.set_ylabel("mean accepted drafts per cycle")
    right.set_title(f"by context length (min_budget {mb})")
    right.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--random", default=None, help="random weights of a benchmarks/loading.py shape (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated; ';' separates if specs hold ','")
    parser.add_argument("--min-budgets", default="64")
    parser.add_argument("--budget-ratio", type=float, default=0.05)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=6, help="episodes (anchors) per text")
    parser.add_argument("--cycles", type=int, default=12, help="counted cycles per episode (after 1 warm-up)")
    parser.add_argument("--texts-file", type=Path, default=Path("out/study/texts_smollm2.json"))
    parser.add_argument("--max-new", type=int, default=1800)
    parser.add_argument("--min-new", type=int, default=1500)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--penalty", type=float, default=1.25, help="windowed repetition penalty (0: none)")
    parser.add_argument("--penalty-window", type=int, default=96)
    parser.add_argument("--turns", action="store_true", help="multi-turn texts (next problem on each end of turn)")
    parser.add_argument("--turn-cap", type=int, default=1400)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--first-problem", type=int, default=0,
                        help="texts start on this mmath problem (another value: held-out texts)")
    parser.add_argument("--texts-only", action="store_true", help="make (or check) the texts file and stop")
    parser.add_argument("--bins", default="500,1000,1500")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("out/study"))
    parser.add_argument("--replot", type=Path, default=None, help="a results.json: redraw its plot into --out, print its table")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        plot(saved["summary"], args.out / "acceptance.png", saved["info"]["k"])
        print(table(saved["summary"], saved["info"]["k"]))
        return
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    start = time.perf_counter()
    model, tokenizer = load_model(args)
    texts = get_texts(args, model, tokenizer)
    text_seconds = time.perf_counter() - start
    if args.texts_only:
        for t in texts:
            new = t["tokens"][t["prompt_len"] :]
            print(f"{len(t['tokens'])} tokens, {t.get('turns', 1)} turns, distinct-4 {distinct_ngrams(new):.2f}")
        print(f"texts in {args.texts_file} ({text_seconds:.0f} s)")
        return
    separator = ";" if ";" in args.policies else ","
    specs = [s for s in args.policies.split(separator) if s]
    budgets = [int(b) for b in args.min_budgets.split(",")]
    policies = [make_policy(s, mb, args.budget_ratio) for mb in budgets for s in specs]
    study = Study(model, policies, num_draft=args.k)
    span = (args.cycles + 1) * (args.k + 1) + 1
    records = []
    for index, text in enumerate(texts):
        starts = anchors(text, args.episodes, span)
        tokens = text["tokens"]
        text_start = time.perf_counter()
        for r in study.run_text(tokens, starts, args.cycles):
            r["text"] = index
            r["local_distinct4"] = distinct_ngrams(tokens[max(0, r["t"] - 256) : r["t"]])
            records.append(r)
        print(f"text {index}: {len(tokens)} tokens, anchors {starts}, {time.perf_counter() - text_start:.0f} s",
              flush=True)  # fmt: skip
        # written after every text, so that a run cut short (a device call's time limit) keeps what it measured
        rows, info = write_results(args, records, texts[: index + 1], policies, start, text_seconds)
    plot(rows, args.out / "acceptance.png", args.k)
    print(json.dumps({k: v for k, v in info.items() if k != "policies"}))
    print(table(rows, args.k))


def write_results(args, records, texts, policies, start, text_seconds) -> tuple[list, dict]:
    """Summary rows and run info of the texts done so far, written to --out (results.json, cycles.json.gz)."""
    rows = summarize(records, args.k, [int(b) for b in args.bins.split(",")])
    dense = [r for r in records if r["policy"] == "dense"]
    info = {
        "model": str(args.gguf or args.random or "SmolLM2-135M-Instruct"), "device": args.device, "dtype": args.dtype,
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "k": args.k, "budget_ratio": args.budget_ratio, "texts": len(texts), "episodes_per_text": args.episodes,
        "cycles_per_episode": args.cycles, "text_seconds": text_seconds,
        "study_seconds": time.perf_counter() - start - text_seconds,
        "dense_cycles_below_k": sum(r["accepted"] < args.k for r in dense),
        "text_lengths": [len(t["tokens"]) for t in texts], "recipe": texts[0].get("recipe"),
        "distinct4": [distinct_ngrams(t["tokens"][t["prompt_len"] :]) for t in texts],
        "policies": {p.name: p.describe() for p in policies},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"info": info, "summary": rows}, indent=1))
    columns = list(records[0]) if records else []
    rounded = [[round(r[c], 3) if isinstance(r[c], float) else r[c] for c in columns] for r in records]
    with gzip.open(args.out / "cycles.json.gz", "wt") as f:
        json.dump({"columns": columns, "rows": rounded}, f, separators=(",", ":"))
    return rows, info


if __name__ == "__main__":
    main()
