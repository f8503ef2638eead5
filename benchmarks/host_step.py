"""The engine's host work per decode step, alone: the device step is skipped (every verification accepts
all its drafts), so what is timed is what the host does around it at a given row count, on any machine.

    python benchmarks/host_step.py --batch 256                    # our AR mode and SparseSpec, 256 rows
    python benchmarks/host_step.py --batch 64 --runs induction_diagonal --steps 600

Each run (`ar`: `num_draft_tokens=0`; otherwise a selection, k = `--k`) decodes `--batch` requests of a
tiny random model on the CPU: the prefill for real, then `--warm-steps` steps, then `--steps` timed
ones, `--repeats` times. The decode steps are padded to buckets and each bucket keeps its views of the
step buffers, as on a GPU with CUDA graphs (a captured graph keeps them; an eager step builds them).
Per step: `schedule`, `build` (the host batch), `launch` (the runner's upload and result copy, its
device step skipped), `commit` (reading the results) and the whole step, in ms
(`e2e_throughput.HostTimes`); the table shows the fastest repeat and the median, then the garbage
collections' ms per step (median) and the longest collection (of all repeats). On a GPU the same host
work runs beside the device's: a decode step's host time above its device time is wall time lost.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from e2e_throughput import HostTimes, recording_gc_pauses
from loading import random_model
from transformers import GenerationConfig

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.engine import Engine
from hf_sparsespec.generation import prepare_batch


def time_host_steps(model, run: str, args) -> list[dict[str, float]]:
    """Each repeat's mean ms per timed step, by part; the garbage collections' ms per step and the longest
    one's (they pause the host: inside the parts); the buckets its decode steps were padded to."""
    k = 0 if run == "ar" else args.k
    selection = {} if run == "ar" else dict(selection=run)
    config = SparseSpecConfig(num_draft_tokens=k, min_budget=16, **selection)
    tokens = args.warm_steps + args.steps + 4 * (k + 1)  # every request still decoding at the end
    gen = GenerationConfig(do_sample=True, temperature=0.65, max_new_tokens=tokens, min_new_tokens=tokens,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    prompts = [list(range(1, 40 + i % 7)) for i in range(args.batch)]
    repeats = []
    for _ in range(args.repeats):
        job = prepare_batch(model, prompts, gen)
        # decode steps padded to buckets, as with CUDA graphs; a bucket's views kept, as its captured graph keeps them
        engine = Engine(model, job.requests, config, job.pipeline, job.do_sample, job.stop_checker, pad_to_buckets=True)
        runner = engine.runner
        device_step, launch, views_of = runner._step, runner.run, {}

        def replayed_views(shape, views=runner._views, views_of=views_of):
            if not shape.padded:
                return views(shape)  # an eager step's (the prefill's)
            if shape not in views_of:
                views_of[shape] = views(shape)
            return views_of[shape]

        runner._views = replayed_views

        def host_only_step(views, batch, device_step=device_step, runner=runner):
            if batch is not None and batch.shape.num_prefill_rows:
                return device_step(views, batch)  # the prefill for real: tokens and pages set up
            runner.results.fill_(k)  # every verification accepts its k drafts; every token is k

        host = HostTimes(engine)

        def timed_launch(batch, launch=launch, host=host):
            began = time.perf_counter()
            pending = launch(batch)
            return host.timed_pending(pending, time.perf_counter() - began)

        runner._step, runner.run = host_only_step, timed_launch
        with engine.running():
            while engine.scheduler.iteration < args.warm_steps:
                engine.step()
            first = len(host.steps)
            with recording_gc_pauses() as pauses:
                for _ in range(args.steps):
                    engine.step()
        gc_times = {"gc": pauses["ms"] / args.steps, "gc_longest": pauses["max_ms"]}
        repeats.append(host.means(first) | gc_times | {"buckets": len(views_of)})
    return repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", default="ar,induction_diagonal", help="ar and/or selections (comma list)")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warm-steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model, _ = random_model("tiny", torch.float32, "cpu")
    parts = (*HostTimes.PARTS, "step")
    print(f"host ms per step, {args.batch} rows, {args.steps} steps x {args.repeats} repeats: fastest (median)")
    print("| run | " + " | ".join(part for part in parts if part != "wait") + " | GC a step (longest) | buckets |")
    print("|---|" + "---|" * (len(parts) + 1))
    for run in args.runs.split(","):
        repeats = time_host_steps(model, run, args)
        shown = [part for part in parts if part != "wait"]  # ~0: nothing waits for a skipped device step
        cells = [f"{min(r[p] for r in repeats):.3f} ({np.median([r[p] for r in repeats]):.3f})" for p in shown]
        collections = f"{np.median([r['gc'] for r in repeats]):.3f} ({max(r['gc_longest'] for r in repeats):.1f})"
        print(f"| {run} | " + " | ".join(cells) + f" | {collections} | {max(r['buckets'] for r in repeats)} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
