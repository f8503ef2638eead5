"""Top keys: each (row, KV head)'s B best-scored key positions, sorted ascending.

`select_top_keys` (reference, shared by every backend: `torch.topk` then a sort) returns them padded
with -1. Triton (`select_top_keys_into`): one program per (row, KV head) finds the B-th largest score
by a 16-way search on the scores' bit patterns (non-negative floats order like their int32 bits; 8
passes narrow 2^31 candidates to one), then writes the positions of the top B, ascending, straight
into the selected-index store at the row's slot: no per-layer topk + sort + index_copy_ chain, and a
grid that depends only on the shapes. Ties at the threshold go to the lowest positions.

Only (rows x KV heads) programs run (a few dozen: one per verification), so each one's latency is
the kernel's: a pass accumulates its threshold counts elementwise in a [thresholds, BLOCK] register
tile and reduces across threads once per pass, not once per key block (on the H200 the per-block
reductions made this kernel the largest of a SparseSpec iteration at long contexts: 4.0 ms of 10.5
at 64 rows x 8K, docs/measurements.md 7), and the count of keys above the threshold comes from the
passes' own counts: 9 sweeps over the keys (8 passes, then the write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import INDEX, check_tensor


def select_top_keys(
    scores: torch.Tensor,  # [num_rows, num_kv_heads, width] float32, -inf = not selectable
    budgets: torch.Tensor,  # [num_rows] int32, keys to keep per row (<= selectable keys)
    max_budget: int,
) -> torch.Tensor:
    """Top-`budgets[r]` positions per (row, KV head), sorted ascending, padded with -1 to `max_budget`.

    Runs on device without host syncs (shared by every backend).
    """
    num_rows, num_kv_heads, width = scores.shape
    if width < max_budget:
        scores = torch.nn.functional.pad(scores, (0, max_budget - width), value=float("-inf"))
    top = scores.topk(max_budget, dim=-1, sorted=True).indices  # [rows, kvh, max_budget], best first
    rank = torch.arange(max_budget, device=scores.device)
    keep = rank[None, None, :] < budgets.to(scores.device)[:, None, None]
    sentinel = torch.iinfo(torch.int32).max
    top = torch.where(keep, top, sentinel).sort(dim=-1).values
    return torch.where(top == sentinel, -1, top).to(torch.int32)


# Keys per block of the sweeps and warps per program, by device type. CUDA: the fastest of
# `benchmarks/top_keys_configs.py` on the H200 (49 us per launch at 8 x 2 x 8K keys, against 58 at
# 512 / 8 warps and 106 at 256 / 4; docs/measurements.md 7). The CPU interpreter's cost grows with the
# block and its contexts are short (the engine tests run this kernel in every verification): 256.
LAUNCH = {"cuda": dict(BLOCK=1024, num_warps=8), "cpu": dict(BLOCK=256, num_warps=4)}


@triton.jit
def _select_top_keys_kernel(
    scores_ptr,  # [num_rows, num_kv_heads, width] fp32, >= 0 at j < num_old_keys[row]
    num_old_keys_ptr,  # [num_rows] int32
    budgets_ptr,  # [num_rows] int32
    slots_ptr,  # [num_rows] int32 or int64, slot of `selected` each row writes
    selected_ptr,  # [num_slots, num_kv_heads, max_budget] int32
    stride_scores_row,
    stride_scores_head,
    stride_sel_slot,
    stride_sel_head,
    BLOCK: tl.constexpr,
    NUM_THRESHOLDS: tl.constexpr,
    NUM_PASSES: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_old = tl.load(num_old_keys_ptr + row)
    budget = tl.minimum(tl.load(budgets_ptr + row), num_old)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    score_row_ptr = scores_ptr + row.to(tl.int64) * stride_scores_row + kv_head * stride_scores_head
    sel_row_ptr = selected_ptr + slot * stride_sel_slot + kv_head * stride_sel_head
    offs = tl.arange(0, BLOCK)
    if budget > 0:
        # Invariant: count(bits >= lo) >= budget > count(bits >= hi) = num_above. +inf has bits
        # 0x7F800000. Every threshold lies in [0, 0x7F800001 + NUM_THRESHOLDS): int32 compares are exact.
        # NUM_PASSES 16-way steps narrow [lo, hi) to one bit pattern (hi = lo + 1), so num_above, kept
        # from the pass counts, is then the number of keys strictly above the threshold.
        lo = tl.zeros([1], tl.int64)
        hi = tl.full([1], 0x7F800001, tl.int64)
        num_above = tl.zeros([1], tl.int32)
        steps = tl.arange(0, NUM_THRESHOLDS).to(tl.int64)
        if budget < num_old:
            for _ in tl.static_range(NUM_PASSES):
                step = (hi - lo + NUM_THRESHOLDS - 1) // NUM_THRESHOLDS  # (1,)
                thresholds = lo + steps * step  # (NUM_THRESHOLDS,)
                below = thresholds.to(tl.int32)[:, None]
                tally = tl.zeros([NUM_THRESHOLDS, BLOCK], tl.int32)  # reduced once, after the sweep
                for start in range(0, num_old, BLOCK):
                    key = start + offs
                    bits = tl.load(score_row_ptr + key, mask=key < num_old, other=-1.0).to(tl.int32, bitcast=True)
                    tally += (bits[None, :] >= below).to(tl.int32)
                counts = tl.sum(tally, axis=1)
                ok = (counts >= budget) & (thresholds < hi)
                best = tl.max(tl.where(ok, steps, -1), axis=0)
                # the new hi is the next threshold when it lies below the old hi: its count is known
                next_is_hi = (steps == best + 1) & (thresholds < hi)
                num_above = tl.where(tl.sum(next_is_hi.to(tl.int32), axis=0) > 0,
                                     tl.sum(tl.where(next_is_hi, counts, 0), axis=0), num_above)  # fmt: skip
                lo = lo + best * step
                hi = tl.minimum(lo + step, hi)
        else:
            lo = lo - 1  # every key: the threshold is below all scores
            num_above = num_above + num_old
        threshold = tl.max(lo, axis=0)  # the bit pattern of the budget-th largest score
        ties_needed = budget - tl.max(num_above, axis=0)
        written = 0
        ties_seen = 0
        for start in range(0, num_old, BLOCK):
            key = start + offs
            valid = key < num_old
            bits = tl.load(score_row_ptr + key, mask=valid, other=-1.0).to(tl.int32, bitcast=True).to(tl.int64)
            above = valid & (bits > threshold)
            tie = valid & (bits == threshold)
            tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            keep = above | (tie & (tie_rank < ties_needed))
            index = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(sel_row_ptr + index, key, mask=keep)
            written += tl.sum(keep.to(tl.int32), axis=0)
            ties_seen += tl.sum(tie.to(tl.int32), axis=0)


def select_top_keys_into(
    scores: torch.Tensor,  # [num_rows, num_kv_heads, width] fp32, >= 0 at j < num_old_keys
    num_old_keys: torch.Tensor,  # [num_rows] int32
    budgets: torch.Tensor,  # [num_rows] int32
    selected: torch.Tensor,  # [num_slots, num_kv_heads, max_budget] int32, written in place
    slots: torch.Tensor,  # [num_rows] int32/int64, the slot each row writes
) -> None:
    """Triton: the `min(budgets[r], num_old_keys[r])` best keys of row r, per KV head, as ascending
    positions into `selected[slots[r], h, :budget]` (entries past the budget are left as they were).
    Same sets as `select_top_keys` when scores have no ties at the threshold."""
    device = scores.device
    check_tensor("scores", scores, ndim=3, dtypes=(torch.float32,), device=device)
    num_rows, num_kv_heads, _ = scores.shape
    check_tensor("num_old_keys", num_old_keys, dtypes=INDEX, device=device, shape=(num_rows,))
    check_tensor("budgets", budgets, dtypes=INDEX, device=device, shape=(num_rows,))
    check_tensor("selected", selected, ndim=3, dtypes=INDEX, device=device, shape=(None, num_kv_heads, None))
    check_tensor("slots", slots, dtypes=(torch.int32, torch.int64), device=device, shape=(num_rows,))
    if scores.stride(-1) != 1 or selected.stride(-1) != 1:
        raise ValueError("scores and selected: expected unit-stride last dimensions")
    if num_rows == 0:
        return
    _select_top_keys_kernel[(num_rows, num_kv_heads)](
        scores, num_old_keys, budgets, slots, selected,
        scores.stride(0), scores.stride(1), selected.stride(0), selected.stride(1),
        NUM_THRESHOLDS=16, NUM_PASSES=8, **LAUNCH.get(device.type, LAUNCH["cuda"]),
    )  # fmt: skip
