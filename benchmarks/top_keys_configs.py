"""`select_top_keys_into` under launch configs (keys per block, warps) and both threshold searches, timed with CUDA-graph-free
`triton.testing.do_bench` medians on PillarAttn-shaped scores, each checked against the reference.

    python benchmarks/top_keys_configs.py

Shapes: (verification rows, KV heads, old keys, budget) as at 64 and 256 rows of Qwen2.5-1.5B
(2 KV heads, budget 5%). Prints one row per (shape, config) with the microseconds per launch.
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
import triton

import hf_sparsespec.kernels.top_keys as top_keys

CONFIGS = [dict(BLOCK=256, num_warps=4), dict(BLOCK=512, num_warps=8), dict(BLOCK=1024, num_warps=8),
           dict(BLOCK=1024, num_warps=16), dict(BLOCK=2048, num_warps=16)]  # fmt: skip
SHAPES = [(8, 2, 8192, 410), (29, 2, 4096, 205), (29, 2, 16384, 820), (8, 2, 32768, 1640)]


def main() -> None:
    device = torch.device("cuda")
    print("| rows x heads x keys (budget) | search | BLOCK | warps | us / launch | equal to the reference |")
    print("|---|---|---|---|---|---|")
    for rows, heads, keys, budget in SHAPES:
        scores = torch.exp(torch.randn(rows, heads, keys, device=device) * 2 - 9)  # spread like probabilities
        num_old = torch.full((rows,), keys, dtype=torch.int32, device=device)
        budgets = torch.full((rows,), budget, dtype=torch.int32, device=device)
        slots = torch.arange(rows, dtype=torch.int32, device=device)
        expected = top_keys.select_top_keys(scores, budgets, budget)
        for search, config in itertools.product(["histogram", "thresholds"], CONFIGS):
            top_keys.LAUNCH["cuda"], top_keys.SEARCH["cuda"] = config, search
            store = torch.full((rows, heads, budget), -7, dtype=torch.int32, device=device)
            top_keys.select_top_keys_into(scores, num_old, budgets, store, slots)
            equal = torch.equal(store, expected)
            launch = partial(top_keys.select_top_keys_into, scores, num_old, budgets, store, slots)
            us = 1000 * triton.testing.do_bench(launch, return_mode="median")
            print(
                f"| {rows} x {heads} x {keys} ({budget}) | {search} | {config['BLOCK']} | {config['num_warps']} | {us:.1f} | {equal} |"
            )


if __name__ == "__main__":
    main()
