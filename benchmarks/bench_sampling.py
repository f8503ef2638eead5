"""`keyed_sample` over the vocabulary splits it may use, at the row counts of a decode iteration
(Qwen2.5's 151,936-token vocabulary, float32 probabilities), timed with `triton.testing.do_bench`
medians; each result checked against the unsplit kernel's.

    python benchmarks/bench_sampling.py

`SAMPLE_PROGRAMS_PER_SM = 0` is one program per row (the kernel before the split). Prints one row per
(rows, programs per SM) with the microseconds per call (the fold's launch included) and the GB/s of
the probabilities read.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton

import hf_sparsespec.kernels.keyed_sample as keyed

ROWS = [29, 232, 256, 512]  # residual draws of a verification; draft rows; AR rows; a prefill's first tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--programs-per-sm", default="0,2,4,8,16")
    args = parser.parse_args()
    device = torch.device("cuda")
    settings = [int(x) for x in args.programs_per_sm.split(",")]
    print("| rows | programs per SM | us / call | GB/s | equal to one program per row |")
    print("|---|---|---|---|---|")
    for rows in ROWS:
        probs = torch.randn(rows, args.vocab, device=device).mul(3).softmax(-1)
        keys = torch.randint(0, 2**31, (rows, 2), device=device)
        keyed.SAMPLE_PROGRAMS_PER_SM = 0
        expected = keyed.keyed_sample(probs, keys)
        for setting in settings:
            keyed.SAMPLE_PROGRAMS_PER_SM = setting
            equal = torch.equal(keyed.keyed_sample(probs, keys), expected)
            us = 1000 * triton.testing.do_bench(partial(keyed.keyed_sample, probs, keys), return_mode="median")
            print(f"| {rows} | {setting} | {us:.1f} | {probs.numel() * 4 / us / 1e3:.0f} | {equal} |")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
