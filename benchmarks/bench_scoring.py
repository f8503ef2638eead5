"""The PillarAttn scoring pass at the engine's verification shape, with and without the diagonal
selections' best-key tracking, over a few launch configurations (one GPU, bf16).

One layer of Qwen2.5-1.5B's shape (12 query / 2 KV heads, head_dim 128, pages of 16 shuffled): `--rows`
padded verification rows, the first `--active` of them with k + 1 = 9 queries and `--context` keys
(the rest padding, as a 256-row unified batch pads ~29 verifications to 32). Per configuration
(`BLOCK_N`, `num_warps`, `num_stages` of the "score" launch config, `--candidates`), least keys per
chunk (`--min-keys-per-chunk`), the keys chunks grow to (`--preferred-keys-per-chunk`) and programs
per SM (`--programs-per-sm`, the grid): the scoring kernel alone and the whole refresh
(`update_selection`: scores, top-B into the selected-index store, and the moved-key offsets), as medians of CUDA-graph replays (GPU time). The bandwidth column counts the K
bytes the scoring pass must read (each old key of each active row once per KV head). Prints a table
last; writes JSON to `--out`.

    python benchmarks/bench_scoring.py --rows 32 --active 29 --context 8000 --out $OUT/scoring
"""

from __future__ import annotations

import argparse
import json
import math
import os

import bench_kernels
import torch
from bench_kernels import MODELS, Problem, bench, i32

from hf_sparsespec.kernels import _attention_tile, pillar_select
from hf_sparsespec.kernels.moved_keys import NO_OFFSET
from hf_sparsespec.kernels.paged_attention import paged_attention
from hf_sparsespec.kernels.pillar_select import pillar_scores_into, update_selection

CANDIDATES = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (64, 8, 2), (128, 8, 2), (32, 4, 3)]
MODEL = "qwen2.5-1.5b"
K_DRAFTS = 8


def inputs(rows: int, active: int, context: int, budget_ratio: float) -> dict:
    p = Problem(MODEL, rows, context)
    q_len = K_DRAFTS + 1
    starts = [min(r, active) * q_len for r in range(rows + 1)]
    query = p.q9[: active * q_len]
    query_start = i32(starts)
    _, lse = paged_attention(*p.full_args(q_len, rows=active), plan=p.plan(q_len, rows=active))
    num_old = i32([context - q_len] * active + [0] * (rows - active))
    budget = max(128, math.ceil(budget_ratio * context))
    entries = q_len * p.group
    device = p.k_cache.device
    return dict(
        problem=p, query=query, query_start=query_start, lse=lse, num_old=num_old, budgets=i32([budget] * rows),
        scores=torch.zeros(rows, p.num_kv_heads, context, dtype=torch.float32, device=device),
        best=torch.zeros(rows, p.num_kv_heads, entries, dtype=torch.int64, device=device),
        selected=torch.full((rows, p.num_kv_heads, budget), -1, dtype=torch.int32, device=device),
        offsets=torch.full((rows, p.num_kv_heads, entries), NO_OFFSET, dtype=torch.int32, device=device),
        slots=torch.arange(rows, dtype=torch.int32, device=device), budget=budget,
    )  # fmt: skip


def time_config(x: dict, track_best: bool) -> tuple[float, float]:
    p = x["problem"]
    best = x["best"] if track_best else None
    offsets = x["offsets"] if track_best else None

    def scores_only():
        pillar_scores_into(x["query"], p.k_cache, p.page_table, x["query_start"], x["lse"], x["num_old"],
                           x["scores"], p.scale, K_DRAFTS + 1, best)  # fmt: skip
        if best is not None:
            best.zero_()

    def refresh():
        update_selection(x["query"], p.k_cache, p.page_table, x["query_start"], x["lse"], x["num_old"], x["budgets"],
                         x["selected"], x["slots"], x["scores"], p.scale, K_DRAFTS + 1, offsets, best)  # fmt: skip

    return bench(scores_only, 5, 40), bench(refresh, 5, 40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--active", type=int, default=29)
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--budget-ratio", type=float, default=0.05)
    parser.add_argument("--min-keys-per-chunk", default=str(pillar_select.SCORE_MIN_KEYS_PER_CHUNK),
                        help="comma-separated SCORE_MIN_KEYS_PER_CHUNK values to sweep")  # fmt: skip
    parser.add_argument("--preferred-keys-per-chunk", default=str(pillar_select.SCORE_PREFERRED_KEYS_PER_CHUNK),
                        help="comma-separated SCORE_PREFERRED_KEYS_PER_CHUNK values to sweep")  # fmt: skip
    parser.add_argument("--programs-per-sm", default=str(pillar_select.SCORE_PROGRAMS_PER_SM),
                        help="comma-separated SCORE_PROGRAMS_PER_SM values (the grid) to sweep")  # fmt: skip
    parser.add_argument("--candidates", default=",".join(":".join(map(str, c)) for c in CANDIDATES),
                        help="comma-separated BLOCK_N:num_warps:num_stages launch configurations")  # fmt: skip
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--smoke", action="store_true", help="fp16 under TRITON_INTERPRET=1 on the CPU (set it)")
    args = parser.parse_args()
    if args.smoke:
        bench_kernels.DEV, bench_kernels.DT = "cpu", torch.float16  # the interpreter cannot do bf16
    elif not torch.cuda.is_available():
        raise SystemExit("bench_scoring.py times CUDA kernels: it needs a GPU (or --smoke)")
    x = inputs(args.rows, args.active, args.context, args.budget_ratio)
    head_dim = MODELS[MODEL][2]
    k_bytes = args.active * (args.context - K_DRAFTS - 1) * MODELS[MODEL][1] * head_dim * x["problem"].k_cache.element_size()
    settings = ("SCORE_PROGRAMS_PER_SM", "SCORE_MIN_KEYS_PER_CHUNK", "SCORE_PREFERRED_KEYS_PER_CHUNK")
    saved = dict(_attention_tile.LAUNCH_CONFIG), [getattr(pillar_select, name) for name in settings]
    results = []
    candidates = [tuple(int(v) for v in c.split(":")) for c in args.candidates.split(",")]
    sweep = [
        (c, int(per_sm), int(keys), int(preferred))
        for per_sm in args.programs_per_sm.split(",")
        for keys in args.min_keys_per_chunk.split(",")
        for preferred in args.preferred_keys_per_chunk.split(",")
        for c in candidates
    ]
    for track_best in (False, True):
        for (block_n, warps, stages), per_sm, keys, preferred in sweep:
            if keys % block_n:
                continue
            config = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            _attention_tile.LAUNCH_CONFIG[("score", head_dim)] = config
            for name, value in zip(settings, (per_sm, keys, preferred)):
                setattr(pillar_select, name, value)
            scores_ms, refresh_ms = time_config(x, track_best)
            results.append(dict(track_best=track_best, block_n=block_n, num_warps=warps, num_stages=stages,
                                min_keys_per_chunk=keys, preferred_keys_per_chunk=preferred, programs_per_sm=per_sm,
                                scores_ms=scores_ms, refresh_ms=refresh_ms, k_gb_per_s=k_bytes / scores_ms / 1e6))  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
        _attention_tile.LAUNCH_CONFIG.clear()
        _attention_tile.LAUNCH_CONFIG.update(saved[0])
        for name, value in zip(settings, saved[1]):
            setattr(pillar_select, name, value)
    os.makedirs(args.out, exist_ok=True)
    gpu = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name()
    meta = dict(gpu=gpu, torch=torch.__version__, **vars(args))
    with open(os.path.join(args.out, "bench_scoring.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    print(f"\n{MODEL} shape, {args.active} of {args.rows} rows verify {K_DRAFTS + 1} queries over {args.context} keys; "
          f"{meta['gpu']}, torch {meta['torch']}")  # fmt: skip
    print("| pass | BLOCK_N | warps | stages | least / preferred keys per chunk | programs / SM | scoring ms "
          "| scoring K GB/s | refresh ms (scores + top-B + offsets) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        name = "with best-key tracking" if r["track_best"] else "PillarAttn"
        print(f"| {name} | {r['block_n']} | {r['num_warps']} | {r['num_stages']} | {r['min_keys_per_chunk']} / "
              f"{r['preferred_keys_per_chunk']} | {r['programs_per_sm']} | {r['scores_ms']:.4f} | "
              f"{r['k_gb_per_s']:.0f} | {r['refresh_ms']:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
