"""Where an iteration's device time goes: a torch.profiler trace of steady-state decode iterations.

    python benchmarks/profile_step.py --random qwen2.5-1.5b --batch 256 --k 8 [--graphs]

Runs the engine to a steady state (after prefill), then profiles `--iterations` iterations and prints
the kernels by total device time (per iteration), the sum of kernel times per iteration, and the
host time per iteration. Eager iterations (default) show every kernel; with `--graphs` the replays
are profiled as the profiler sees them.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch
from loading import add_model_arguments, load_gguf, random_model
from torch.profiler import ProfilerActivity, profile
from transformers import GenerationConfig

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.attention import use_attention
from hf_sparsespec.engine import Engine
from hf_sparsespec.generation import prepare_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--warm-iterations", type=int, default=40)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()

    if args.gguf is not None:
        model, _ = load_gguf(args.gguf, torch.bfloat16, "cuda")
    else:
        model, _ = random_model(args.random, torch.bfloat16, "cuda")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 1000, int(n)).tolist() for n in rng.integers(100, 250, args.batch)]
    n = args.new_tokens
    gen = GenerationConfig(do_sample=True, temperature=0.65, top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    config = SparseSpecConfig(num_draft_tokens=args.k, min_budget=128, cuda_graphs=args.graphs)
    for _ in range(2):  # the first pass compiles kernels and captures graphs
        job = prepare_batch(model, prompts, gen)
        engine = Engine(model, job.requests, config, job.pipeline, job.do_sample, job.stop_checker)
        host_ms = []
        with use_attention(model), torch.no_grad():
            for _ in range(args.warm_iterations):
                engine.step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iterations):
                    start = time.perf_counter()
                    engine.step()
                    host_ms.append(1000 * (time.perf_counter() - start))
                torch.cuda.synchronize()
            while engine.scheduler.has_work or engine.pending:
                engine.step()
    totals, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total / 1000
            counts[event.name] += 1
    per_iter = sum(totals.values()) / args.iterations
    print(f"\nbatch {args.batch}, k={args.k}, graphs={args.graphs}: {per_iter:.2f} ms of kernels per iteration, "
          f"host {np.median(host_ms):.2f} ms per step() (median); {len(counts)} kernel names, "
          f"{sum(counts.values()) / args.iterations:.0f} launches per iteration")  # fmt: skip
    print("| kernel | ms / iter | launches / iter |\n|---|---|---|")
    for name, total in sorted(totals.items(), key=lambda item: -item[1])[: args.top]:
        print(f"| {name[:90]} | {total / args.iterations:.3f} | {counts[name] / args.iterations:.0f} |")


if __name__ == "__main__":
    main()
