"""Where an iteration's device time goes: steady-state decode iterations timed and profiled, several
engine configurations side by side in one process (random weights of a real shape, or a GGUF).

    python benchmarks/profile_step.py --random qwen2.5-1.5b --batch 256 --runs ar,pillar,ar_compiled,pillar_compiled
    python benchmarks/profile_step.py --random qwen2.5-1.5b --batch 64 --prompt-tokens 4000 --runs ar,pillar
    python benchmarks/profile_step.py --random qwen2.5-1.5b --batch 256 --prompt-tokens 8000 --top-k 20 --top-p 0.8 \
        --runs induction_diagonal,induction_diagonal_unfused,induction_diagonal_overlap
    python benchmarks/profile_step.py --random qwen2.5-1.5b --batch 256 --prompt-tokens 1000 --top-k 20 --top-p 0.8 \
        --repetition-penalty 1.05 --runs induction_diagonal_compiled,induction_diagonal_compiled_fromlogits0

Per run (names as in e2e_throughput.py, with its `_k<n>`, `_fullsplit<n>`, `_scoregrid<n>`, `_scorechunk<n>`
and `_unfused` suffixes; graphs on unless the run turns them off): the engine decodes
to a steady state (through the whole chunked prefill, then `--warm-iterations` decode iterations,
which compile kernels and capture graphs), then `--iterations` iterations are timed (wall time of `step()` and CUDA-event device
time of each iteration) and, with `--profile`, traced by torch.profiler: the kernels by device time per
iteration. The cost of an iteration does not depend on the weights (random weights accept few
drafts, but the unified scheduler's mix of verifications and drafts per iteration is the same).
Prints a table last (with the timed iterations' real tokens next to their padded shape: until a
bucket has bought its own graph, `graph_buckets.py`, it replays a larger one: in the first ~100
decode iterations, the batch's first graph); `--out` writes it as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from e2e_throughput import run_fields, run_settings
from loading import add_model_arguments, load_model
from torch.profiler import ProfilerActivity, profile
from transformers import GenerationConfig

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.engine import Engine
from hf_sparsespec.generation import prepare_batch


def kernel_table(prof, iterations: int) -> tuple[float, float, list[tuple[str, float, float]]]:
    """(kernel ms per iteration, launches per iteration, [(kernel, ms / iter, launches / iter)] by time)."""
    totals, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total / 1000
            counts[event.name] += 1
    rows = sorted(((name, total / iterations, counts[name] / iterations) for name, total in totals.items()),
                  key=lambda row: -row[1])  # fmt: skip
    return sum(totals.values()) / iterations, sum(counts.values()) / iterations, rows


def measure(model, prompts, args, run: str) -> dict:
    with run_settings(run):
        return _measure(model, prompts, args, run)


def _measure(model, prompts, args, run: str) -> dict:
    fields = dict(num_draft_tokens=args.k, min_budget=128, cuda_graphs=True) | run_fields(run, args)
    config = SparseSpecConfig(**fields)
    # every request must still be decoding when the timing ends: one admitted early decodes (in AR mode one
    # token an iteration) through the rest of the chunked prefill, so its length covers the prefill too
    # (at 256 x 8,000-token prompts a 400-token run lost 48 requests before the timing: 208 AR rows)
    prefill_bound = sum(len(p) for p in prompts) // config.prefill_chunk_size + len(prompts)
    timed = args.warm_iterations + args.iterations + (args.profile_iterations if args.profile else 0)
    n = max(args.new_tokens, prefill_bound + timed + 1)
    sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=0.65, top_k=args.top_k,
                                                               top_p=args.top_p)  # fmt: skip
    gen = GenerationConfig(**sampling, repetition_penalty=args.repetition_penalty, max_new_tokens=n, min_new_tokens=n,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    job = prepare_batch(model, prompts, gen)
    engine = Engine(model, job.requests, config, job.pipeline, job.do_sample, job.stop_checker)
    runner = engine.runner
    shapes = []  # every launched iteration's shape
    launch = runner.run

    real_tokens = []  # every launched iteration's tokens of real rows (the rest of its shape is padding)

    def run_and_record(batch):
        shapes.append(batch.shape)
        real_tokens.append(batch.num_real_tokens)
        return launch(batch)

    runner.run = run_and_record
    result = dict(run=run, batch=len(prompts), k=config.num_draft_tokens, compile_forward=config.compile_forward)
    with engine.running():  # as `generate`: the projections packed with the compiled forward (unpacked before §42)
        began = time.perf_counter()
        prefill_iterations = 0
        while not shapes or shapes[-1].num_prefill_rows:  # the (chunked) prefill
            engine.step()
            prefill_iterations += 1
        for _ in range(args.warm_iterations):
            engine.step()
        torch.cuda.synchronize()
        result["warm_seconds"] = time.perf_counter() - began
        result["prefill_iterations"] = prefill_iterations
        runner.time_iterations = True
        runner.counters.iteration_events.clear()
        replays, eager = runner.counters.graph_replays, runner.counters.eager_iterations
        rows, wall = [], []
        began = time.perf_counter()
        for _ in range(args.iterations):
            start = time.perf_counter()
            engine.step()
            wall.append(1000 * (time.perf_counter() - start))
            shape = shapes[-1]
            rows.append((shape.num_tokens, real_tokens[-1], shape.num_verify_rows, shape.num_single_rows))
        torch.cuda.synchronize()
        result["wall_ms_per_iteration"] = 1000 * (time.perf_counter() - began) / args.iterations
        gpu = runner.counters.gpu_milliseconds()
        runner.time_iterations = False
        result["gpu_ms_per_iteration"] = float(np.mean(gpu))
        result["step_host_ms_median"] = float(np.median(wall))
        result["replays"] = runner.counters.graph_replays - replays
        result["eager"] = runner.counters.eager_iterations - eager
        tokens, real, verify, single = np.array(rows).mean(axis=0) if rows else (0, 0, 0, 0)
        result |= dict(padded_tokens=float(tokens), real_tokens=float(real), verify_rows=float(verify),
                       single_rows=float(single))  # fmt: skip
        if args.profile:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.profile_iterations):
                    engine.step()
                torch.cuda.synchronize()
            kernel_ms, launches, table = kernel_table(prof, args.profile_iterations)
            result |= dict(
                kernel_ms_per_iteration=kernel_ms, launches_per_iteration=launches, kernels=table[: args.top]
            )
    result["graphs_captured"] = runner.counters.graphs_captured
    del runner.run  # the wrapper closes over the runner: a cycle that would keep the pool alive
    del engine, job, runner
    gc.collect()  # before the next run sizes its pool (a pool left alive made later captures run out of memory)
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--runs", default="ar,pillar")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="prompt length (0: 100-250 tokens, as the mmath prompts); long prompts emulate late decoding",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=400,
        help="output length (raised to outlast the prefill and the timed iterations)",
    )
    parser.add_argument("--top-k", type=int, default=0, help="sampling's top-k (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling's top-p (1.0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="transformers' repetition penalty (1.0: off; Qwen2.5's model cards: 1.05)")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling at T=0.65")
    parser.add_argument("--warm-iterations", type=int, default=60)
    parser.add_argument("--iterations", type=int, default=36)
    parser.add_argument("--profile", action="store_true", help="also trace kernels (torch.profiler)")
    parser.add_argument("--profile-iterations", type=int, default=9)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model, _ = load_model(args, torch.bfloat16, "cuda")
    rng = np.random.default_rng(0)
    lengths = [args.prompt_tokens] * args.batch if args.prompt_tokens else rng.integers(100, 250, args.batch)
    prompts = [rng.integers(1, 1000, int(n)).tolist() for n in lengths]
    results = []
    for run in args.runs.split(","):
        result = measure(model, prompts, args, run)
        results.append(result)
        if args.profile:
            print(f"\n{run}: {result['kernel_ms_per_iteration']:.2f} ms of kernels, "
                  f"{result['launches_per_iteration']:.0f} launches per iteration")  # fmt: skip
            print("| kernel | ms / iter | launches / iter |\n|---|---|---|")
            for name, ms, launches in result["kernels"]:
                print(f"| {name[:100]} | {ms:.3f} | {launches:.0f} |")
        print(json.dumps({key: value for key, value in result.items() if key != "kernels"}), flush=True)
        if args.out is not None:  # after every run: a later run past the time limit loses only itself
            args.out.mkdir(parents=True, exist_ok=True)
            name = f"profile_step_{args.random or Path(args.gguf).stem}_{args.batch}x{args.prompt_tokens or 'short'}.json"
            (args.out / name).write_text(
                json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, results=results), indent=1)
            )
    print(f"\nbatch {args.batch}, prompts {args.prompt_tokens or '100-250'} tokens, {args.iterations} timed iterations")
    print(
        "| run | padded tokens (verify / one-token rows) | real tokens | wall ms / iter | GPU ms / iter "
        "| host ms / step (median) | replays / eager | graphs captured | kernels ms / launches |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        kernels = f"{r['kernel_ms_per_iteration']:.2f} / {r['launches_per_iteration']:.0f}" if args.profile else "-"
        print(f"| {r['run']} | {r['padded_tokens']:.0f} ({r['verify_rows']:.0f} / {r['single_rows']:.0f}) "
              f"| {r['real_tokens']:.0f} | {r['wall_ms_per_iteration']:.2f} | {r['gpu_ms_per_iteration']:.2f} | "
              f"{r['step_host_ms_median']:.2f} | {r['replays']} / {r['eager']} | {r['graphs_captured']} "
              f"| {kernels} |")  # fmt: skip


if __name__ == "__main__":
    main()
