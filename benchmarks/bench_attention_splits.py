"""How finely the unified attention launch should split a verification's keys, by batch and context.

`attention_plan` cuts every row's keys into work items of about `total keys / items` keys, but never
fewer than a floor (`MIN_KEYS_PER_FULL_SPLIT` for the verification rows, `MIN_KEYS_PER_SPLIT` for the
drafts). At 256 rows the chunk is above the floors; at 64 rows the floor decides, and the 8 or so
verification rows of an iteration may leave most of the H200's 132 multiprocessors idle.

For each (batch, context) this times the mixed batch of one layer (round(B / 9) rows verify 9 tokens,
the rest draft over 5 % of the keys, as `bench_kernels.Problem.mixed`) under each floor and programs
per SM, as CUDA-graph replays (`do_bench`, L2 flushed), and checks every output against the default
plan's. Prints a table last; JSON to `$OUT/bench_attention_splits.json` (or --out).

    python benchmarks/bench_attention_splits.py --batches 64,256 --contexts 1024,4096,8192
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_kernels  # noqa: E402
from bench_kernels import HBM_BYTES_PER_S, Problem, bench  # noqa: E402

from hf_sparsespec.kernels import attention_plan  # noqa: E402
from hf_sparsespec.kernels.mixed_attention import mixed_attention  # noqa: E402


def time_splits(p: Problem, floors: list[int], per_sm: list[int]) -> list[dict]:
    args, host, n_v = p.mixed()
    device = torch.device(bench_kernels.DEV)
    saved = (attention_plan.PROGRAMS_PER_SM, attention_plan.MIN_KEYS_PER_FULL_SPLIT)
    reference = None
    rows = []
    try:
        for programs in per_sm:
            for floor in floors:
                attention_plan.PROGRAMS_PER_SM, attention_plan.MIN_KEYS_PER_FULL_SPLIT = programs, floor
                plan = attention_plan.plan_attention(*host, group=p.group, num_kv_heads=p.num_kv_heads, device=device)
                out, _ = mixed_attention(*args, plan=plan)
                if reference is None:
                    reference = out.float()
                err = (out.float() - reference).abs().max().item()
                ms = bench(lambda plan=plan: mixed_attention(*args, plan=plan), 5, 40)
                moved = p.full_bytes(n_v, 9) + p.draft_bytes(p.batch - n_v)
                rows.append({
                    "batch": p.batch, "context": p.context, "verify_rows": n_v, "programs_per_sm": programs,
                    "min_keys_per_full_split": floor, "work_items": plan.num_work, "ms": ms,
                    "roofline": moved / HBM_BYTES_PER_S / (ms / 1e3), "max_err_vs_first": err,
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    finally:
        attention_plan.PROGRAMS_PER_SM, attention_plan.MIN_KEYS_PER_FULL_SPLIT = saved
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=list(bench_kernels.MODELS))
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--floors", default="1024,512,256,128", help="least keys per verification split (first: the reference)")
    parser.add_argument("--programs-per-sm", default="4,8")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes under TRITON_INTERPRET=1 on the CPU")
    a = parser.parse_args()
    if a.smoke:
        bench_kernels.DEV, bench_kernels.DT = "cpu", torch.float16
        a.batches, a.contexts, a.floors = "10", "200", "128,64"
    floors = [int(f) for f in a.floors.split(",")]
    per_sm = [int(n) for n in a.programs_per_sm.split(",")]
    rows = []
    for batch in map(int, a.batches.split(",")):
        for context in map(int, a.contexts.split(",")):
            p = Problem(a.model, batch, context)
            rows += time_splits(p, floors, per_sm)
            del p
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    with open(os.path.join(a.out, "bench_attention_splits.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print("\nbatch | context | verify rows | programs/SM | min keys/full split | items | ms | roofline | err")
    for r in rows:
        print(f"{r['batch']:5d} | {r['context']:7d} | {r['verify_rows']:3d} | {r['programs_per_sm']:2d} | "
              f"{r['min_keys_per_full_split']:5d} | {r['work_items']:5d} | {r['ms']:.4f} | {r['roofline']:.1%} | "
              f"{r['max_err_vs_first']:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
