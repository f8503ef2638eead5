"""Kernel benchmark of hf_sparsespec's Triton attention on one GPU (bf16), with correctness checks.

For each model shape (Qwen2.5-Coder-1.5B: 12 q / 2 kv heads, head_dim 128; SmolLM2-135M: 9 q / 3 kv
heads, head_dim 64), batch (64, 256) and context (4K, 16K, 32K), on one layer's paged cache (page
size 16, pages shuffled):

- decode   full attention, 1 query per row (the dense decode step a draft step replaces);
- verify   full attention, 9 queries per row (k = 8), with LSE;
- score    PillarAttn after verify: scores kernel, then top-k (`pillar_select`);
- draft    sparse draft attention: budget = ceil(0.05 * context) selected keys + a recent window of 1-9;
- mixed    a unified batch: round(B/9) rows verify 9 tokens, the rest draft; ONE fused launch
           (`mixed_attention`) vs separate launches (`paged_attention` + `sparse_draft_attention`),
           timed eagerly and as CUDA-graph replays.

Bandwidth counts only the bytes that must move: K and V of every attended key once per KV head,
selected indices, Q, outputs and LSE; the page table is left out (< 1%). Times are medians of
`triton.testing.do_bench`, which flushes the L2 (60 MB on an H200) before every run; every KV cache
here is larger than the L2 except the keys a sparse draft reads (and the flush covers those).
Correctness: every op in the same run against the float32 references on a few rows.

`--sweep` first tries a few launch configurations per kernel family at batch 64 / 16K and uses the
fastest for the table. Prints a table last; writes JSON to `$OUT/bench_kernels.json` (or --out).

    python benchmarks/bench_kernels.py --sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hf_sparsespec.kernels import _attention_tile  # noqa: E402
from hf_sparsespec.kernels.attention_plan import plan_attention  # noqa: E402
from hf_sparsespec.kernels.mixed_attention import mixed_attention, mixed_attention_ref  # noqa: E402
from hf_sparsespec.kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from hf_sparsespec.kernels.pillar_select import (  # noqa: E402
    pillar_scores,
    pillar_scores_ref,
    pillar_select,
    select_top_keys,
)
from hf_sparsespec.kernels.sparse_attention import sparse_draft_attention, sparse_draft_attention_ref  # noqa: E402

HBM_BYTES_PER_S = 4.26e12  # measured device-to-device copy on the H200 (read + write)
MODELS = {"qwen2.5-1.5b": (12, 2, 128), "smollm2-135m": (9, 3, 64)}
PAGE_SIZE = 16
K_DRAFTS = 8
BUDGET_RATIO = 0.05
DT = torch.bfloat16
DEV = "cuda"


def i32(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int32, device=DEV)


def eager_bench(fn, warmup=10, rep=60) -> float:
    """Median ms of eager calls: includes the host's launch overhead whenever it exceeds the GPU time."""
    if DEV != "cuda":  # --smoke: the interpreter, one untimed-quality run
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench(fn, warmup=10, rep=60) -> float:
    """Median ms of CUDA-graph replays of `fn` (GPU time; do_bench flushes the L2 before each)."""
    if DEV != "cuda":
        return eager_bench(fn)
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")


class Problem:
    """One layer's cache for `batch` rows of `context` tokens, and the inputs of every op."""

    def __init__(self, model: str, batch: int, context: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model, self.batch, self.context = model, batch, context
        self.num_q_heads, self.num_kv_heads, self.head_dim = MODELS[model]
        self.group = self.num_q_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5
        pages_per_row = math.ceil(context / PAGE_SIZE)
        num_pages = batch * pages_per_row
        shape = (num_pages, PAGE_SIZE, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.randn(shape, dtype=DT, device=DEV)
        self.v_cache = torch.randn(shape, dtype=DT, device=DEV)
        self.page_table = torch.randperm(num_pages, device=DEV).to(torch.int32).view(batch, pages_per_row)
        self.context_lens = i32([context] * batch)
        self.budget = math.ceil(BUDGET_RATIO * context)
        self.recent = [1 + r % 9 for r in range(batch)]  # recent window lengths of the drafts
        self.recent_start = i32([context - r for r in self.recent])
        self.num_selected = i32([self.budget] * batch)
        # Sorted random positions below each row's recent window (what select_top_keys stores).
        noise = torch.rand(batch, self.num_kv_heads, context - 10, device=DEV)
        self.selected = noise.topk(self.budget, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
        del noise
        self.selection_slot = torch.arange(batch, dtype=torch.int32, device=DEV)
        self.q1 = torch.randn(batch, self.num_q_heads, self.head_dim, dtype=DT, device=DEV)
        self.q9 = torch.randn(batch * (K_DRAFTS + 1), self.num_q_heads, self.head_dim, dtype=DT, device=DEV)

    # --- bytes that must move ---
    def kv_bytes(self, keys_per_row: float, rows: int) -> float:
        return rows * keys_per_row * self.num_kv_heads * self.head_dim * 2 * 2

    def qo_bytes(self, tokens: int) -> float:
        return tokens * self.num_q_heads * (self.head_dim * 2 * 2 + 4)

    def full_bytes(self, rows: int, q_len: int) -> float:
        return self.kv_bytes(self.context, rows) + self.qo_bytes(rows * q_len)

    def draft_bytes(self, rows: int) -> float:
        mean_recent = sum(self.recent[:rows]) / rows
        index_bytes = rows * self.num_kv_heads * self.budget * 4
        return self.kv_bytes(self.budget + mean_recent, rows) + index_bytes + self.qo_bytes(rows)

    # --- ops ---
    def plan(self, q_len: int, rows: int | None = None):
        rows = rows or self.batch
        starts = [i * q_len for i in range(rows + 1)]
        return plan_attention(
            starts, [self.context] * rows, rows, [0] * rows, [0] * rows,
            group=self.group, num_kv_heads=self.num_kv_heads, device=torch.device(DEV),
        )  # fmt: skip

    def full_args(self, q_len: int, rows: int | None = None, first: int = 0):
        rows = rows or self.batch
        query = (self.q1 if q_len == 1 else self.q9)[first * q_len : (first + rows) * q_len]
        page_table = self.page_table[first : first + rows]
        return (query, self.k_cache, self.v_cache, page_table, i32([i * q_len for i in range(rows + 1)]),
                self.context_lens[first : first + rows], self.scale)  # fmt: skip

    def draft_args(self, rows: int | None = None, first: int = 0):
        rows = rows or self.batch
        sl = slice(first, first + rows)
        return (self.q1[sl], self.k_cache, self.v_cache, self.page_table[sl], self.context_lens[sl],
                self.recent_start[sl], self.selected, self.selection_slot[sl], self.num_selected[sl],
                self.scale)  # fmt: skip

    def draft_plan(self, rows: int | None = None, first: int = 0):
        rows = rows or self.batch
        return plan_attention(
            list(range(rows + 1)), [self.context] * rows, 0, [self.budget] * rows,
            self.recent_start[first : first + rows].tolist(),
            group=self.group, num_kv_heads=self.num_kv_heads, device=torch.device(DEV),
        )  # fmt: skip

    def mixed(self, verify_tokens: int = K_DRAFTS + 1):
        """Rows [0, n_v) verify `verify_tokens` (k + 1) tokens, n_v = round(B / (k + 1)) as the unified
        scheduler balances them; rows [n_v, B) draft: args, host plan inputs, n_v."""
        n_v = max(1, round(self.batch / verify_tokens))
        q_lens = [verify_tokens] * n_v + [1] * (self.batch - n_v)
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        if n_v * verify_tokens > self.q9.shape[0]:
            raise ValueError(f"{n_v} verifications of {verify_tokens} tokens: more queries than the problem holds")
        query = torch.cat([self.q9[: n_v * verify_tokens], self.q1[n_v:]])
        recent_start = [0] * n_v + self.recent_start[n_v:].tolist()
        num_selected = [0] * n_v + [self.budget] * (self.batch - n_v)
        args = (query, self.k_cache, self.v_cache, self.page_table, i32(starts), self.context_lens, n_v,
                i32(recent_start), self.selected, self.selection_slot, i32(num_selected), self.scale)  # fmt: skip
        host = (starts, [self.context] * self.batch, n_v, num_selected, recent_start)
        return args, host, n_v


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item()


def check_problem(p: Problem) -> dict:
    """bf16 kernels vs the float32 references on rows {0, 1, last}; returns max abs errors and verdicts."""
    rows = [0, 1, p.batch - 1]
    res = {}
    # verify
    out, lse = paged_attention(*p.full_args(9))
    errs, lse_errs = [], []
    for r in rows:
        ro, rl = paged_attention_ref(*p.full_args(9, 1, r))
        errs.append(max_err(out[r * 9 : (r + 1) * 9], ro))
        lse_errs.append(max_err(lse[r * 9 : (r + 1) * 9], rl))
    res["verify_out_err"], res["verify_lse_err"] = max(errs), max(lse_errs)
    # scores of row 0 and row 1 (2-row sub-batch), selection overlap with the fp32 reference's top-B
    sub_q = p.q9[: 2 * 9]
    sub = (
        sub_q,
        p.k_cache,
        p.page_table[:2],
        i32([0, 9, 18]),
        lse[:18],
        i32([p.context - 9] * 2),
        p.context - 9,
        p.scale,
    )
    s_k, s_r = pillar_scores(*sub), pillar_scores_ref(*sub)
    res["score_rel_err"] = max_err(s_k, s_r) / s_r.max().item()
    top_k = select_top_keys(s_k, i32([p.budget] * 2), p.budget).long()
    top_r = select_top_keys(s_r, i32([p.budget] * 2), p.budget).long()
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_k.flatten(0, 1), top_r.flatten(0, 1)))
    res["select_overlap"] = same / top_r.numel()
    # draft
    out = sparse_draft_attention(*p.draft_args())
    res["draft_out_err"] = max(max_err(out[r : r + 1], sparse_draft_attention_ref(*p.draft_args(1, r))) for r in rows)
    # mixed: fused == separate launches, and the reference on two verify + two draft rows
    args, _, n_v = p.mixed()
    out, lse = mixed_attention(*args)
    sep_v, _ = paged_attention(*p.full_args(9, n_v))
    sep_d = sparse_draft_attention(*p.draft_args(p.batch - n_v, n_v))
    res["mixed_vs_separate_err"] = max_err(out, torch.cat([sep_v, sep_d]))
    ref_rows = [0, n_v - 1, n_v, p.batch - 1]
    sub_rows = torch.tensor(ref_rows, device=DEV)
    qs = args[4].tolist()
    sub_q = torch.cat([args[0][qs[r] : qs[r + 1]] for r in ref_rows])
    sub_lens = [qs[r + 1] - qs[r] for r in ref_rows]
    n_full = sum(r < n_v for r in ref_rows)
    sub_args = (sub_q, p.k_cache, p.v_cache, p.page_table[sub_rows], i32([0] + list(itertools.accumulate(sub_lens))),
                p.context_lens[sub_rows], n_full, args[7][sub_rows], p.selected, p.selection_slot[sub_rows],
                args[10][sub_rows], p.scale)  # fmt: skip
    ro, _ = mixed_attention_ref(*sub_args)
    res["mixed_out_err"] = max_err(torch.cat([out[qs[r] : qs[r + 1]] for r in ref_rows]), ro)
    atol = 2e-2  # bf16 outputs of unit-variance values: a few bf16 ulps
    res["ok"] = bool(
        max(res["verify_out_err"], res["draft_out_err"], res["mixed_out_err"]) < atol
        and res["verify_lse_err"] < 1e-2 and res["score_rel_err"] < 2e-2 and res["select_overlap"] > 0.97
        and res["mixed_vs_separate_err"] < atol
    )  # fmt: skip
    return res


def time_problem(p: Problem) -> dict:
    t = {}
    # Every argument is built before timing (no host-to-device copies inside a timed region).
    plan1, plan9, dplan = p.plan(1), p.plan(9), p.draft_plan()
    a1, a9, ad = p.full_args(1), p.full_args(9), p.draft_args()
    t["decode_ms"] = bench(lambda: paged_attention(*a1, plan=plan1))
    t["verify_ms"] = bench(lambda: paged_attention(*a9, plan=plan9))
    t["draft_ms"] = bench(lambda: sparse_draft_attention(*ad, plan=dplan))
    _, lse = paged_attention(*a9, plan=plan9)
    sel_args = (p.q9, p.k_cache, p.page_table, i32([i * 9 for i in range(p.batch + 1)]), lse,
                i32([p.context - 9] * p.batch), i32([p.budget] * p.batch), p.context - 9, p.budget, p.scale)  # fmt: skip
    t["scores_ms"] = bench(lambda: pillar_scores(*sel_args[:6], p.context - 9, p.scale))
    scores = pillar_scores(*sel_args[:6], p.context - 9, p.scale)
    t["topk_ms"] = bench(lambda: select_top_keys(scores, sel_args[6], p.budget))
    scores16 = scores.to(torch.bfloat16)
    t["topk_bf16_ms"] = bench(lambda: select_top_keys(scores16, sel_args[6], p.budget))  # information only
    t["select_ms"] = bench(lambda: pillar_select(*sel_args))
    t["verify_and_select_ms"] = bench(lambda: (paged_attention(*a9, plan=plan9), pillar_select(*sel_args)))
    # mixed
    args, host, n_v = p.mixed()
    t0 = time.perf_counter()
    mplan = plan_attention(*host, group=p.group, num_kv_heads=p.num_kv_heads, device=torch.device(DEV))
    t["plan_host_us"] = (time.perf_counter() - t0) * 1e6
    vplan, dplan_m = p.plan(9, n_v), p.draft_plan(p.batch - n_v, n_v)
    av, adm = p.full_args(9, n_v), p.draft_args(p.batch - n_v, n_v)

    def fused():
        return mixed_attention(*args, plan=mplan)

    def separate():
        paged_attention(*av, plan=vplan)
        sparse_draft_attention(*adm, plan=dplan_m)

    t["mixed_fused_ms"], t["mixed_separate_ms"] = bench(fused), bench(separate)
    t["mixed_fused_eager_ms"], t["mixed_separate_eager_ms"] = eager_bench(fused), eager_bench(separate)
    t["num_verify_rows"] = n_v
    # PillarAttn on the mixed batch's verification rows (what a real step scores)
    _, mixed_lse = fused()
    nvt = n_v * (K_DRAFTS + 1)
    mixed_sel = (args[0][:nvt], p.k_cache, p.page_table[:n_v], i32([i * 9 for i in range(n_v + 1)]), mixed_lse[:nvt],
                 i32([p.context - 9] * n_v), i32([p.budget] * n_v), p.context - 9, p.budget, p.scale)  # fmt: skip
    t["mixed_work_items"] = mplan.num_work
    # bytes and derived numbers
    b = {
        "decode": p.full_bytes(p.batch, 1),
        "verify": p.full_bytes(p.batch, 9),
        "draft": p.draft_bytes(p.batch),
        "mixed": p.full_bytes(n_v, 9) + p.draft_bytes(p.batch - n_v),
        # scores read K once more (not V) plus Q and LSE, and write the scores
        "scores": p.kv_bytes(p.context, p.batch) / 2 + p.qo_bytes(p.batch * 9) / 2 + p.batch * p.num_kv_heads * p.context * 4,
    }  # fmt: skip
    for name in ("decode", "verify", "draft", "scores"):
        t[f"{name}_gbps"] = b[name] / t[f"{name}_ms"] / 1e6
        t[f"{name}_roofline"] = b[name] / HBM_BYTES_PER_S / (t[f"{name}_ms"] / 1e3)
    t["mixed_fused_roofline"] = b["mixed"] / HBM_BYTES_PER_S / (t["mixed_fused_ms"] / 1e3)
    t["draft_speedup_vs_decode"] = t["decode_ms"] / t["draft_ms"]
    t["fused_speedup"] = t["mixed_separate_ms"] / t["mixed_fused_ms"]
    t["fused_speedup_eager"] = t["mixed_separate_eager_ms"] / t["mixed_fused_eager_ms"]
    t["score_overhead"] = t["verify_and_select_ms"] / t["verify_ms"] - 1
    t["scores_only_overhead"] = t["scores_ms"] / t["verify_ms"]
    t["mixed_scores_ms"] = bench(lambda: pillar_select(*mixed_sel))
    t["mixed_score_overhead"] = t["mixed_scores_ms"] / t["mixed_fused_ms"]
    return t


FULL_CANDIDATES = [(64, 4, 2), (32, 4, 3), (64, 4, 3), (128, 4, 2), (64, 8, 2), (64, 2, 2)]
DRAFT_CANDIDATES = [(64, 4, 2), (32, 4, 3), (64, 4, 3), (32, 4, 4), (128, 4, 3), (64, 8, 3), (64, 2, 3)]
SCORE_CANDIDATES = [(64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 4, 2)]
MIXED_DRAFT_BLOCK_N = [32, 64, 128]
SPLITS = [(4, 256, 1024), (8, 256, 1024), (16, 256, 1024), (8, 128, 512), (8, 512, 2048), (16, 256, 2048)]


def sweep(model: str, batch: int = 256, context: int = 16384, small: tuple[int, int] = (64, 4096)) -> dict:
    """Fastest launch config per kernel family for one model (at `batch` x `context`), then the split
    heuristics (programs per SM, least keys per draft / full split) at that size and a small one."""
    from hf_sparsespec.kernels import attention_plan

    p = Problem(model, batch, context)
    d = p.head_dim
    best, log = {}, []
    cfg = _attention_tile.LAUNCH_CONFIG
    plan9, dplan = p.plan(9), p.draft_plan()
    a9, ad = p.full_args(9), p.draft_args()
    for kind, cands, fn in [
        ("full", FULL_CANDIDATES, lambda: paged_attention(*a9, plan=plan9)),
        ("draft", DRAFT_CANDIDATES, lambda: sparse_draft_attention(*ad, plan=dplan)),
    ]:
        times = {}
        for bn, nw, ns in cands:
            cfg[(kind, d)] = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
            times[(bn, nw, ns)] = bench(fn, 5, 40)
            log.append((kind, d, bn, nw, ns, times[(bn, nw, ns)]))
        best[kind] = min(times, key=times.get)
        bn, nw, ns = best[kind]
        cfg[(kind, d)] = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
    _, lse = paged_attention(*a9, plan=plan9)
    sel = (p.q9, p.k_cache, p.page_table, i32([i * 9 for i in range(batch + 1)]), lse, i32([p.context - 9] * batch),
           p.context - 9, p.scale)  # fmt: skip
    times = {}
    for bn, nw, ns in SCORE_CANDIDATES:
        cfg[("score", d)] = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
        times[(bn, nw, ns)] = bench(lambda: pillar_scores(*sel), 5, 40)
        log.append(("score", d, bn, nw, ns, times[(bn, nw, ns)]))
    best["score"] = min(times, key=times.get)
    bn, nw, ns = best["score"]
    cfg[("score", d)] = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
    # the fused kernel: warps/stages of the full or the draft winner, and the draft path's BLOCK_N
    args, host, _ = p.mixed()
    mplan = plan_attention(*host, group=p.group, num_kv_heads=p.num_kv_heads, device=torch.device(DEV))
    times = {}
    for source in ("full", "draft"):
        for bn_draft in MIXED_DRAFT_BLOCK_N:
            key = (cfg[("full", d)]["BLOCK_N"], bn_draft, cfg[(source, d)]["num_warps"], cfg[(source, d)]["num_stages"])
            if key in times:
                continue
            cfg[("mixed", d)] = dict(zip(("BLOCK_N_FULL", "BLOCK_N_DRAFT", "num_warps", "num_stages"), key))
            times[key] = bench(lambda: mixed_attention(*args, plan=mplan), 5, 40)
            log.append(("mixed", d, *key, times[key]))
    best["mixed"] = min(times, key=times.get)
    cfg[("mixed", d)] = dict(zip(("BLOCK_N_FULL", "BLOCK_N_DRAFT", "num_warps", "num_stages"), best["mixed"]))
    # split heuristics
    split_log = []
    problems = [(p, a9, ad), None]
    sp = Problem(model, small[0], small[1], seed=1)
    problems[1] = (sp, sp.full_args(9), sp.draft_args())
    saved = (attention_plan.PROGRAMS_PER_SM, attention_plan.MIN_KEYS_PER_SPLIT, attention_plan.MIN_KEYS_PER_FULL_SPLIT,
             attention_plan.MIN_KEYS_PER_VERIFY_SPLIT)  # fmt: skip
    split_times = {}
    for per_sm, min_draft, min_full in SPLITS:  # min_full: full rows of one query and of several alike
        attention_plan.PROGRAMS_PER_SM = per_sm
        attention_plan.MIN_KEYS_PER_SPLIT = min_draft
        attention_plan.MIN_KEYS_PER_FULL_SPLIT = attention_plan.MIN_KEYS_PER_VERIFY_SPLIT = min_full
        total = 0.0
        for q, qa9, qad in problems:
            pl, dp = q.plan(9), q.draft_plan()
            mq_args, mq_host, _ = q.mixed()
            mp = plan_attention(*mq_host, group=q.group, num_kv_heads=q.num_kv_heads, device=torch.device(DEV))
            tv = bench(lambda pl=pl, qa9=qa9: paged_attention(*qa9, plan=pl), 5, 40)
            td = bench(lambda dp=dp, qad=qad: sparse_draft_attention(*qad, plan=dp), 5, 40)
            tm = bench(lambda mp=mp, mq_args=mq_args: mixed_attention(*mq_args, plan=mp), 5, 40)
            split_log.append((per_sm, min_draft, min_full, q.batch, q.context, tv, td, tm))
            total += tv + td + tm
        split_times[(per_sm, min_draft, min_full)] = total
    best["splits"] = min(split_times, key=split_times.get)
    best["split_totals"] = [[*k, v] for k, v in split_times.items()]
    (attention_plan.PROGRAMS_PER_SM, attention_plan.MIN_KEYS_PER_SPLIT, attention_plan.MIN_KEYS_PER_FULL_SPLIT,
     attention_plan.MIN_KEYS_PER_VERIFY_SPLIT) = saved  # fmt: skip
    del p, sp, problems
    torch.cuda.empty_cache()
    return {"best": {k: list(v) for k, v in best.items()}, "log": log, "split_log": split_log}


def apply_best_splits(sweeps: dict) -> tuple:
    """The split heuristics with the least summed time over every swept model, set as the defaults."""
    from hf_sparsespec.kernels import attention_plan

    totals: dict[tuple, float] = {}
    for result in sweeps.values():
        for per_sm, min_draft, min_full, t in result["best"]["split_totals"]:
            totals[(per_sm, min_draft, min_full)] = totals.get((per_sm, min_draft, min_full), 0.0) + t
    choice = min(totals, key=totals.get)
    per_sm, min_draft, min_full = choice
    attention_plan.PROGRAMS_PER_SM, attention_plan.MIN_KEYS_PER_SPLIT = per_sm, min_draft
    attention_plan.MIN_KEYS_PER_FULL_SPLIT = attention_plan.MIN_KEYS_PER_VERIFY_SPLIT = min_full
    return choice


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes under TRITON_INTERPRET=1 on the CPU")
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sweep_sizes = (256, 16384, (64, 4096))
    if a.smoke:
        global DEV, DT
        DEV, DT = "cpu", torch.float16  # the interpreter cannot do bf16
        a.batches, a.contexts, sweep_sizes = "10", "80", (4, 160, (2, 64))
        env = {"gpu": "cpu (interpreter)"}
    else:
        props = torch.cuda.get_device_properties(0)
        env = {"gpu": props.name, "sms": props.multi_processor_count}
    env.update(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    print(env, flush=True)
    report = {"env": env, "sweep": {}, "rows": []}
    models = a.models.split(",")
    if a.sweep:
        for m in models:
            report["sweep"][m] = sweep(m, *sweep_sizes)
            print("sweep", m, report["sweep"][m]["best"], flush=True)
            for line in report["sweep"][m]["log"]:
                print("  ", line, flush=True)
            for line in report["sweep"][m]["split_log"]:
                print("   split (per_sm, min_draft, min_full, batch, context, verify_ms, draft_ms, mixed_ms)", line)
    if a.sweep:
        report["splits"] = apply_best_splits(report["sweep"])
        print("splits (programs per SM, least keys per draft split, per full split):", report["splits"], flush=True)
    report["launch_config"] = {f"{k[0]}/{k[1]}": v for k, v in _attention_tile.LAUNCH_CONFIG.items()}
    print("launch config", report["launch_config"], flush=True)
    for m in models:
        for batch in map(int, a.batches.split(",")):
            for context in map(int, a.contexts.split(",")):
                p = Problem(m, batch, context)
                row = {"model": m, "batch": batch, "context": context}
                row.update(check_problem(p))
                row.update(time_problem(p))
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
                del p
                torch.cuda.empty_cache()
    with open(os.path.join(a.out, "bench_kernels.json"), "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)


def print_table(report: dict) -> None:
    cols = [("model", "{:>13}"), ("batch", "{:>4}"), ("context", "{:>6}"), ("ok", "{!s:>5}"),
            ("verify_ms", "{:7.3f}"), ("verify_roofline", "{:6.1%}"), ("decode_ms", "{:7.3f}"),
            ("decode_roofline", "{:6.1%}"), ("draft_ms", "{:7.3f}"), ("draft_roofline", "{:6.1%}"),
            ("draft_speedup_vs_decode", "{:6.1f}x"), ("mixed_fused_ms", "{:7.3f}"), ("mixed_separate_ms", "{:7.3f}"),
            ("fused_speedup", "{:5.2f}x"), ("fused_speedup_eager", "{:5.2f}x"), ("scores_ms", "{:7.3f}"),
            ("topk_ms", "{:7.3f}"), ("topk_bf16_ms", "{:7.3f}"), ("score_overhead", "{:6.1%}"),
            ("mixed_score_overhead", "{:6.1%}")]  # fmt: skip
    print("\n" + " | ".join(c for c, _ in cols))
    for row in report["rows"]:
        print(" | ".join(fmt.format(row[c]) for c, fmt in cols))


if __name__ == "__main__":
    main()
