"""How finely the unified attention launch should split its rows' keys, by batch and context.

`attention_plan` cuts every row's keys into work items of about `total keys / items` keys, but never
fewer than a floor (`MIN_KEYS_PER_FULL_SPLIT` for one-query full rows, `MIN_KEYS_PER_VERIFY_SPLIT` for
full rows of several queries, `MIN_KEYS_PER_SPLIT` for the drafts; `--floors full:draft` sets the first
two to `full`). At
256 rows and long contexts the chunk is above the floors; at 64 rows or short contexts the floors
decide.

For each (batch, context) this times one layer's launch under each pair of floors, as CUDA-graph
replays (`do_bench`, L2 flushed), and checks every output against the first pair's plan:
- `mixed`: round(B / (k + 1)) rows verify k + 1 tokens (`--verify-tokens`, 9 by default), the rest
  draft over max(`--min-budget`, 5 % of the keys) selected keys plus a recent window of 1-9
  (`bench_kernels.Problem.mixed`; the engine's default min_budget is 128), and `--moved` moved-key
  entries per (row, KV head) as the default selection's (`induction_diagonal`: (k + 1) x group
  diagonal entries + 16 induction entries = 70 on this shape), half of them keys the selection holds already (the kernel searches the selection to
  skip those);
- `verify` and `draft`: the `mixed` launch's verification rows alone and its draft rows alone (what
  each half of the launch costs by itself);
- `ar`: every row one query with full attention (the AR mode's plain steps).
`--mixed-configs` also sweeps the mixed launch's configuration (`BLOCK_N_FULL:BLOCK_N_DRAFT:num_warps:
num_stages`, the engine's `LAUNCH_CONFIG[("mixed", head_dim)]`; `engine` = the one it uses).
Prints a table last; JSON to `$OUT/bench_attention_splits.json` (or --out).

    python benchmarks/bench_attention_splits.py --batches 64,256 --contexts 1024,4096,8192 --kinds mixed,ar
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_kernels  # noqa: E402
from bench_kernels import HBM_BYTES_PER_S, Problem, bench  # noqa: E402

from hf_sparsespec.kernels import _attention_tile, attention_plan  # noqa: E402
from hf_sparsespec.kernels.mixed_attention import mixed_attention  # noqa: E402
from hf_sparsespec.kernels.moved_keys import unique_offsets  # noqa: E402


def with_min_budget(p: Problem, min_budget: int) -> None:
    """Drafts select max(min_budget, 5 % of the context) keys, as the engine's `min_budget` makes them."""
    if min_budget <= p.budget:
        return
    p.budget = min(min_budget, p.context - 10)
    p.num_selected = torch.full_like(p.num_selected, p.budget)
    noise = torch.rand(p.batch, p.num_kv_heads, p.context - 10, device=p.k_cache.device)
    p.selected = noise.topk(p.budget, dim=-1).indices.sort(dim=-1).values.to(torch.int32)


def moved_offsets(p: Problem, num_moved: int) -> torch.Tensor:
    """`[rows, KV heads, num_moved]` offsets from each draft query (position context - 1): every other
    entry a key of the row's selection, the rest random keys below the recent window; repeats dropped."""
    device = p.k_cache.device
    keys = torch.randint(0, p.context - 10, (p.batch, p.num_kv_heads, num_moved), device=device)
    pick = torch.randint(0, p.budget, (p.batch, p.num_kv_heads, num_moved), device=device)
    keys[..., ::2] = p.selected.long().gather(2, pick)[..., ::2]
    return unique_offsets((keys - (p.context - 1)).to(torch.int32))  # as the engine's store holds them


def launch(p: Problem, kind: str, num_moved: int = 0, verify_tokens: int = 9):
    """(mixed_attention args, kwargs, host plan inputs, full rows, bytes that must move) of one layer."""
    i32 = bench_kernels.i32
    if kind in ("mixed", "verify", "draft"):
        args, host, n_v = p.mixed(verify_tokens)
        kwargs = {"offsets": moved_offsets(p, num_moved)} if num_moved and kind != "verify" else {}
        moved_bytes = (p.batch - n_v) * p.num_kv_heads * num_moved * (p.head_dim * 2 * 2 + 4)
        verify_bytes = p.full_bytes(n_v, verify_tokens)
        draft_bytes = p.draft_bytes(p.batch - n_v) + moved_bytes
        if kind == "verify":  # the mixed launch's verifications alone
            starts = host[0][: n_v + 1]
            zeros = [0] * n_v
            args = (args[0][: n_v * verify_tokens], p.k_cache, p.v_cache, p.page_table[:n_v], i32(starts),
                    p.context_lens[:n_v], n_v, i32(zeros), p.selected, p.selection_slot[:n_v], i32(zeros), p.scale)  # fmt: skip
            return args, kwargs, (starts, [p.context] * n_v, n_v, zeros, zeros), n_v, verify_bytes
        if kind == "draft":  # the mixed launch's drafts alone
            rows = slice(n_v, p.batch)
            starts = list(range(p.batch - n_v + 1))
            num_selected, recent_start = host[3][rows], host[4][rows]
            args = (p.q1[rows], p.k_cache, p.v_cache, p.page_table[rows], i32(starts), p.context_lens[rows], 0,
                    i32(recent_start), p.selected, p.selection_slot[rows], i32(num_selected), p.scale)  # fmt: skip
            return args, kwargs, (starts, [p.context] * len(starts[1:]), 0, num_selected, recent_start), 0, draft_bytes
        return args, kwargs, host, n_v, verify_bytes + draft_bytes
    starts = list(range(p.batch + 1))
    zeros = [0] * p.batch
    args = (p.q1, p.k_cache, p.v_cache, p.page_table, i32(starts), p.context_lens, p.batch, i32(zeros),
            p.selected, p.selection_slot, i32(zeros), p.scale)  # fmt: skip
    return args, {}, (starts, [p.context] * p.batch, p.batch, zeros, zeros), p.batch, p.full_bytes(p.batch, 1)


def mixed_config(spec: str) -> dict[str, int] | None:
    """`BLOCK_N_FULL:BLOCK_N_DRAFT:num_warps:num_stages` as a launch config; `engine`: None (the engine's)."""
    if spec == "engine":
        return None
    block_n_full, block_n_draft, warps, stages = (int(v) for v in spec.split(":"))
    return {"BLOCK_N_FULL": block_n_full, "BLOCK_N_DRAFT": block_n_draft, "num_warps": warps, "num_stages": stages}


def time_splits(
    p: Problem, kind: str, floors: list[tuple[int, int]], per_sm: list[int], num_moved: int, verify_tokens: int = 9,
    configs: tuple[str, ...] = ("engine",), max_blocks: tuple[int, ...] = (attention_plan.MAX_BLOCK_M,),
) -> list[dict]:  # fmt: skip
    args, kwargs, host, n_full, bytes_to_move = launch(p, kind, num_moved, verify_tokens)
    device = torch.device(bench_kernels.DEV)
    saved = (attention_plan.PROGRAMS_PER_SM, attention_plan.MIN_KEYS_PER_FULL_SPLIT,
             attention_plan.MIN_KEYS_PER_VERIFY_SPLIT, attention_plan.MIN_KEYS_PER_SPLIT, attention_plan.MAX_BLOCK_M)  # fmt: skip
    saved_configs = dict(_attention_tile.LAUNCH_CONFIG)
    key = ("mixed", p.head_dim)
    reference = None
    rows = []
    try:
        for programs, max_block, (full_floor, draft_floor) in itertools.product(per_sm, max_blocks, floors):
            attention_plan.PROGRAMS_PER_SM, attention_plan.MAX_BLOCK_M = programs, max_block
            attention_plan.MIN_KEYS_PER_FULL_SPLIT = attention_plan.MIN_KEYS_PER_VERIFY_SPLIT = full_floor
            attention_plan.MIN_KEYS_PER_SPLIT = draft_floor
            plan = attention_plan.plan_attention(*host, group=p.group, num_kv_heads=p.num_kv_heads, device=device,
                                                 num_moved=num_moved)  # fmt: skip
            for spec in configs:
                config = mixed_config(spec)
                _attention_tile.LAUNCH_CONFIG.pop(key, None)
                _attention_tile.LAUNCH_CONFIG.update({key: config} if config else saved_configs)
                out, _ = mixed_attention(*args, plan=plan, **kwargs)
                if reference is None:
                    reference = out.float()
                err = (out.float() - reference).abs().max().item()
                ms = bench(lambda plan=plan: mixed_attention(*args, plan=plan, **kwargs), 5, 40)
                rows.append({
                    "kind": kind, "batch": p.batch, "context": p.context, "full_rows": n_full,
                    "draft_keys": p.budget, "moved": num_moved, "verify_tokens": verify_tokens if kind != "ar" else 1,
                    "programs_per_sm": programs, "min_keys_per_full_split": full_floor,
                    "min_keys_per_split": draft_floor, "mixed_config": spec, "max_block_m": max_block,
                    "block_m_full": plan.block_m_full, "work_items": plan.num_work, "ms": ms,
                    "roofline": bytes_to_move / HBM_BYTES_PER_S / (ms / 1e3), "max_err_vs_first": err,
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    finally:
        (attention_plan.PROGRAMS_PER_SM, attention_plan.MIN_KEYS_PER_FULL_SPLIT,
         attention_plan.MIN_KEYS_PER_VERIFY_SPLIT, attention_plan.MIN_KEYS_PER_SPLIT, attention_plan.MAX_BLOCK_M) = saved  # fmt: skip
        _attention_tile.LAUNCH_CONFIG.clear()
        _attention_tile.LAUNCH_CONFIG.update(saved_configs)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=list(bench_kernels.MODELS))
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--kinds", default="mixed,ar", help="mixed (verify + draft rows), verify or draft (either half alone), ar (one-query full rows)")
    parser.add_argument("--min-budget", type=int, default=128, help="the least keys a draft selects")
    parser.add_argument("--moved", default="0,70", help="moved-key entries per draft row and KV head, one run each")
    parser.add_argument("--verify-tokens", default="9",
                        help="k + 1 tokens per verification of the mixed kind, one run each (17: k = 16)")  # fmt: skip
    parser.add_argument("--floors", default="1024:256,512:256,256:256,1024:128,1024:64",
                        help="full:draft least keys per split (first: the reference)")  # fmt: skip
    parser.add_argument("--programs-per-sm", default="4")
    parser.add_argument("--mixed-configs", default="engine",
                        help="BLOCK_N_FULL:BLOCK_N_DRAFT:num_warps:num_stages launch configs (engine = the engine's)")  # fmt: skip
    parser.add_argument("--max-block-m", default=str(attention_plan.MAX_BLOCK_M),
                        help="largest query tiles of full rows, one run each (64: k = 16's verifications in two tiles)")  # fmt: skip
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes under TRITON_INTERPRET=1 on the CPU")
    a = parser.parse_args()
    if a.smoke:
        bench_kernels.DEV, bench_kernels.DT = "cpu", torch.float16
        a.batches, a.contexts, a.floors, a.min_budget, a.moved = "10", "200", "128:64,64:64,128:32", 20, "0,6"
        a.verify_tokens, a.mixed_configs, a.max_block_m = "9,17", "engine,64:64:4:2", "128,64"
    floors = [tuple(int(n) for n in f.split(":")) for f in a.floors.split(",")]
    per_sm = [int(n) for n in a.programs_per_sm.split(",")]
    configs = tuple(a.mixed_configs.split(","))
    max_blocks = tuple(int(n) for n in a.max_block_m.split(","))
    for spec in configs:
        mixed_config(spec)  # bad specs fail before any timing
    rows = []
    for batch in map(int, a.batches.split(",")):
        for context in map(int, a.contexts.split(",")):
            p = Problem(a.model, batch, context)
            with_min_budget(p, a.min_budget)
            for kind in a.kinds.split(","):
                for verify_tokens in map(int, a.verify_tokens.split(",") if kind != "ar" else [1]):
                    for num_moved in map(int, a.moved.split(",") if kind in ("mixed", "draft") else [0]):
                        rows += time_splits(p, kind, floors, per_sm, num_moved, verify_tokens, configs, max_blocks)
            del p
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    with open(os.path.join(a.out, "bench_attention_splits.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print("\nkind | batch | context | full rows (tokens each) | draft keys | moved | programs/SM | least keys per full / draft "
          "split | mixed config | full tile | items | ms | roofline | err")  # fmt: skip
    for r in rows:
        print(f"{r['kind']} | {r['batch']} | {r['context']} | {r['full_rows']} ({r['verify_tokens']}) | {r['draft_keys']} | "
              f"{r['moved']} | {r['programs_per_sm']} | "
              f"{r['min_keys_per_full_split']} / {r['min_keys_per_split']} | {r['mixed_config']} | {r['block_m_full']} | {r['work_items']} | "
              f"{r['ms']:.4f} | "
              f"{r['roofline']:.1%} | {r['max_err_vs_first']:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
