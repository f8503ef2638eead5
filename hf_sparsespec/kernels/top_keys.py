"""Top keys: each (row, KV head)'s B best-scored key positions, sorted ascending.

Scores are ranked at bfloat16 precision: each float32 score's bit pattern truncated to its top 16
bits (sign, exponent, 7 mantissa bits; a relative resolution of 2^-7), and keys whose truncated
scores tie go to the lowest positions. The set is the exact top B of the truncated scores, the same
on every backend; against the full-precision top B it can only differ among keys whose scores lie
within 0.8 % of the B-th largest (any selection is lossless: only acceptance could change). The
coarser key halves the Triton search (4 passes over the keys instead of 8).

`select_top_keys` (reference, shared by every backend: a stable sort of the truncated scores) returns
them padded with -1. Triton (`select_top_keys_into`): one program per (row, KV head) finds the B-th
largest truncated score (non-negative floats order like their bits), then writes the positions of
the top B, ascending, straight into the selected-index store at the row's slot: no per-layer topk +
sort + index_copy_ chain, and a grid that depends only on the shapes. Two searches (`SEARCH`):
- `"histogram"` (the default): two radix digits of the 15-bit keys, each one sweep with
  `tl.histogram` (the high 8 bits, i.e. the exponent; then the low 7 among the keys with that high
  digit): 3 sweeps over the keys with the write.
- `"thresholds"`: a 16-way search, 4 passes narrowing 2^15 candidates to one, each accumulating its
  threshold counts elementwise in a [thresholds, BLOCK] register tile: 5 sweeps.

Only (rows x KV heads) programs run (a few dozen: one per verification), so each one's latency is
the kernel's: its sweeps over the keys (per-block cross-thread reductions made this kernel the
largest of a SparseSpec iteration at long contexts once: 4.0 ms of 10.5 at 64 rows x 8K,
docs/measurements.md 7). The count of keys above the threshold comes from the searches' own counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import INDEX, check_tensor

RANK_BITS_DROPPED = 16  # low bits of a float32 score's pattern ignored when ranking (bfloat16 precision)


def rank_key(scores: torch.Tensor) -> torch.Tensor:
    """The scores as ranked: float32 bit patterns truncated to bfloat16 precision (toward zero, so the
    order is kept, ties aside; -inf stays -inf)."""
    bits = scores.float().contiguous().view(torch.int32)
    return (bits & -(1 << RANK_BITS_DROPPED)).view(torch.float32)


def select_top_keys(
    scores: torch.Tensor,  # [num_rows, num_kv_heads, width] float32, -inf = not selectable
    budgets: torch.Tensor,  # [num_rows] int32, keys to keep per row (<= selectable keys)
    max_budget: int,
) -> torch.Tensor:
    """Top-`budgets[r]` positions per (row, KV head) by `rank_key` (ties to the lowest positions),
    sorted ascending, padded with -1 to `max_budget`.

    Runs on device without host syncs (shared by every backend).
    """
    num_rows, num_kv_heads, width = scores.shape
    ranked = rank_key(scores)
    if width < max_budget:
        ranked = torch.nn.functional.pad(ranked, (0, max_budget - width), value=float("-inf"))
    # a stable descending sort keeps equal keys in position order: ties go to the lowest positions
    top = ranked.sort(dim=-1, descending=True, stable=True).indices[..., :max_budget]  # best first
    rank = torch.arange(max_budget, device=scores.device)
    keep = rank[None, None, :] < budgets.to(scores.device)[:, None, None]
    sentinel = torch.iinfo(torch.int32).max
    top = torch.where(keep, top, sentinel).sort(dim=-1).values
    return torch.where(top == sentinel, -1, top).to(torch.int32)


# Keys per block of the sweeps and warps per program, by device type. CUDA: the fastest of
# `benchmarks/top_keys_configs.py` on the H200 with the histogram search (26.5 us per launch at
# 8 x 2 x 8K keys, against 28.0 at 1024 / 8 warps and 57.0 at 256 / 4; the 16-way search took 33.8
# at 1024 / 8; docs/measurements.md 15). The CPU interpreter's cost grows with the block and its
# contexts are short (the engine tests run this kernel in every verification): 256.
LAUNCH = {"cuda": dict(BLOCK=2048, num_warps=16), "cpu": dict(BLOCK=256, num_warps=4)}
# How the threshold is searched: "histogram" (2 radix passes; 3 sweeps over the keys with the write)
# or "thresholds" (4 passes of 16-way counts; 5 sweeps).
SEARCH = {"cuda": "histogram", "cpu": "histogram"}


@triton.jit
def _select_top_keys_kernel(
    scores_ptr,  # [num_layers, num_rows, num_kv_heads, width] fp32, >= 0 at j < num_old_keys[row]
    num_old_keys_ptr,  # [num_rows] int32
    budgets_ptr,  # [num_rows] int32
    slots_ptr,  # [num_rows] int32 or int64, slot of `selected` each row writes
    selected_ptr,  # [num_layers, num_slots, num_kv_heads, max_budget] int32
    stride_scores_layer,
    stride_scores_row,
    stride_scores_head,
    stride_sel_layer,
    stride_sel_slot,
    stride_sel_head,
    BLOCK: tl.constexpr,
    NUM_THRESHOLDS: tl.constexpr,
    NUM_PASSES: tl.constexpr,
    SHIFT: tl.constexpr,
    HISTOGRAM: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    num_old = tl.load(num_old_keys_ptr + row)
    budget = tl.minimum(tl.load(budgets_ptr + row), num_old)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    score_row_ptr = scores_ptr + layer * stride_scores_layer + row.to(tl.int64) * stride_scores_row
    score_row_ptr += kv_head * stride_scores_head
    sel_row_ptr = selected_ptr + layer * stride_sel_layer + slot * stride_sel_slot + kv_head * stride_sel_head
    offs = tl.arange(0, BLOCK)
    if budget > 0:
        # Keys are the patterns' top 16 bits (`rank_key`; masked keys load -1.0: negative keys).
        # Both searches end with lo = the budget-th largest key and num_above = the keys above it.
        # The thresholds' invariant: count(keys >= lo) >= budget > count(keys >= hi) = num_above. +inf's key is
        # 0x7F80. Every threshold lies in [0, 0x7F81 + NUM_THRESHOLDS): int32 compares are exact.
        # NUM_PASSES 16-way steps narrow [lo, hi) to one key (hi = lo + 1: 32641 -> 2041 -> 128 -> 8
        # -> 1), so num_above, kept from the pass counts, is then the number of keys strictly above.
        lo = tl.zeros([1], tl.int64)
        hi = tl.full([1], 0x7F81, tl.int64)
        num_above = tl.zeros([1], tl.int32)
        steps = tl.arange(0, NUM_THRESHOLDS).to(tl.int64)
        if budget < num_old and HISTOGRAM:
            # two radix digits: a histogram of the keys' high 8 bits (the exponent) finds the digit of
            # the budget-th largest key, then one of the low 7 bits among the keys with that digit
            high_bins = tl.arange(0, 256)
            counts = tl.zeros([256], tl.int32)
            for start in range(0, num_old, BLOCK):
                key = start + offs
                valid = key < num_old
                bits = tl.load(score_row_ptr + key, mask=valid, other=0.0).to(tl.int32, bitcast=True) >> SHIFT
                counts += tl.histogram(bits >> 7, 256, mask=valid)
            # keys at or above each digit: the total less those strictly below
            at_or_above = num_old - tl.cumsum(counts, axis=0) + counts
            high = tl.max(tl.where(at_or_above >= budget, high_bins, -1), axis=0)
            above_high = tl.sum(tl.where(high_bins == high, at_or_above - counts, 0), axis=0)
            low_bins = tl.arange(0, 128)
            counts_low = tl.zeros([128], tl.int32)
            for start in range(0, num_old, BLOCK):
                key = start + offs
                valid = key < num_old
                bits = tl.load(score_row_ptr + key, mask=valid, other=0.0).to(tl.int32, bitcast=True) >> SHIFT
                counts_low += tl.histogram(bits & 0x7F, 128, mask=valid & ((bits >> 7) == high))
            # keys at or above (high, each low digit): those above `high`, then that digit's own suffix
            at_or_above_low = above_high + tl.sum(counts_low, axis=0) - tl.cumsum(counts_low, axis=0) + counts_low
            low = tl.max(tl.where(at_or_above_low >= budget, low_bins, -1), axis=0)
            lo = lo + (high * 128 + low).to(tl.int64)
            num_above = num_above + tl.sum(tl.where(low_bins == low, at_or_above_low - counts_low, 0), axis=0)
        elif budget < num_old:
            for _ in tl.static_range(NUM_PASSES):
                step = (hi - lo + NUM_THRESHOLDS - 1) // NUM_THRESHOLDS  # (1,)
                thresholds = lo + steps * step  # (NUM_THRESHOLDS,)
                below = thresholds.to(tl.int32)[:, None]
                tally = tl.zeros([NUM_THRESHOLDS, BLOCK], tl.int32)  # reduced once, after the sweep
                for start in range(0, num_old, BLOCK):
                    key = start + offs
                    bits = tl.load(score_row_ptr + key, mask=key < num_old, other=-1.0).to(tl.int32, bitcast=True)
                    bits = bits >> SHIFT
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
        threshold = tl.max(lo, axis=0)  # the key of the budget-th largest score
        ties_needed = budget - tl.max(num_above, axis=0)
        written = 0
        ties_seen = 0
        for start in range(0, num_old, BLOCK):
            key = start + offs
            valid = key < num_old
            bits = tl.load(score_row_ptr + key, mask=valid, other=-1.0).to(tl.int32, bitcast=True)
            bits = (bits >> SHIFT).to(tl.int64)
            above = valid & (bits > threshold)
            tie = valid & (bits == threshold)
            tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            keep = above | (tie & (tie_rank < ties_needed))
            index = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(sel_row_ptr + index, key, mask=keep)
            written += tl.sum(keep.to(tl.int32), axis=0)
            ties_seen += tl.sum(tie.to(tl.int32), axis=0)


def select_top_keys_into(
    scores: torch.Tensor,  # [(num_layers,) num_rows, num_kv_heads, width] fp32, >= 0 at j < num_old_keys
    num_old_keys: torch.Tensor,  # [num_rows] int32
    budgets: torch.Tensor,  # [num_rows] int32
    selected: torch.Tensor,  # [(num_layers,) num_slots, num_kv_heads, max_budget] int32, written in place
    slots: torch.Tensor,  # [num_rows] int32/int64, the slot each row writes
) -> None:
    """Triton: the `min(budgets[r], num_old_keys[r])` best keys of row r, per KV head (by `rank_key`,
    ties to the lowest positions), as ascending positions into `selected[slots[r], h, :budget]`
    (entries past the budget are left as they were). The same sets as `select_top_keys`.

    With a leading layer dimension on both `scores` and `selected`, every layer's selection in one
    launch (grid `(rows, KV heads, layers)`): the engine scores each layer inside the forward and
    selects them all after it, instead of 28 launches of a few dozen programs each."""
    device = scores.device
    if scores.ndim == 3:
        scores, selected = scores[None], selected[None]
    check_tensor("scores", scores, ndim=4, dtypes=(torch.float32,), device=device)
    num_layers, num_rows, num_kv_heads, _ = scores.shape
    check_tensor("num_old_keys", num_old_keys, dtypes=INDEX, device=device, shape=(num_rows,))
    check_tensor("budgets", budgets, dtypes=INDEX, device=device, shape=(num_rows,))
    check_tensor("selected", selected, ndim=4, dtypes=INDEX, device=device, shape=(num_layers, None, num_kv_heads, None))
    check_tensor("slots", slots, dtypes=(torch.int32, torch.int64), device=device, shape=(num_rows,))
    if scores.stride(-1) != 1 or selected.stride(-1) != 1:
        raise ValueError("scores and selected: expected unit-stride last dimensions")
    if num_rows == 0 or num_layers == 0:
        return
    _select_top_keys_kernel[(num_rows, num_kv_heads, num_layers)](
        scores, num_old_keys, budgets, slots, selected,
        scores.stride(0), scores.stride(1), scores.stride(2), selected.stride(0), selected.stride(1), selected.stride(2),
        NUM_THRESHOLDS=16, NUM_PASSES=4, SHIFT=RANK_BITS_DROPPED,
        HISTOGRAM=SEARCH.get(device.type, SEARCH["cuda"]) == "histogram", **LAUNCH.get(device.type, LAUNCH["cuda"]),
    )  # fmt: skip
