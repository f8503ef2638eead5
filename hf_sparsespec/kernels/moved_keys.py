"""Moved keys of the `"diagonal"` selection: the verification's most attended keys, moved along the
diagonal to each draft query's position.

Why: copy and induction heads attend a key that advances with the query (the token after the one
being copied). A selection frozen at the last verification points one cycle behind them; an offset
`j - p` (key minus query position) stays right as the drafts advance.

Verification side (per layer): for verification query `i` of a row (position `p = num_old_keys + i`)
and query head `g` of a KV head's group, the old key `j < num_old_keys` with the largest attention
probability (ties: the lowest position, as `torch.argmax`); entry `e = i * group + g` of the row's
list holds `j - p`, or `NO_OFFSET` where the row has no query `i` or no old key. Triton: the PillarAttn
scoring pass (`pillar_select._pillar_scores_kernel` with `TRACK_BEST`) folds each (query, head)'s
best key into the int64 workspace `best` by an atomic max of `(probability bits << 32) | (2^31 - 1 -
key)` (probabilities are >= 0, so their bits order like the values); `store_moved_offsets` then turns
the workspace into offsets at each row's slot and zeroes it for the next use (the engine keeps one
workspace per layer and stores every layer's offsets in one launch after the forward).

Draft side (`sparse_attention`): a draft query at position `q` also attends `q + offset` for every
entry with `0 <= q + offset < recent_start` (later keys are in the recent window anyway), except an
entry whose key equals an earlier entry's or one of the PillarAttn selection's (deduplicated: a key
attended twice would get twice its weight). `NO_OFFSET` is far enough below 0 that it never passes.
Equal offsets are equal keys whatever the query, so the writers drop repeats once per list
(`unique_offsets`: `store_moved_offsets` within the diagonal's entries, `write_induction_keys`
against them), and the Triton draft kernels only look for the selection's keys (an in-kernel
comparison of every entry with every earlier one cost ~10-17 us of a 20-70 us layer on the H200:
docs/measurements.md 23). The references deduplicate both ways, whatever the store holds.

Store: `offsets [num_layers, num_slots, num_kv_heads, (k + 1) x group]` int32 in the cache, next to
`selected`; written by each layer's verifications, read by the next cycle's drafts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import INDEX, check_tensor
from hf_sparsespec.kernels._paging import gather_context

NO_OFFSET = -(2**30)  # an entry that moves no key: q + NO_OFFSET < 0 for every position q < 2^30


def moved_offsets_ref(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: torch.Tensor,  # [num_rows, max_pages] int32
    query_start: torch.Tensor,  # [num_rows + 1] int32
    num_old_keys: torch.Tensor,  # [num_rows] int32, keys older than the row's query block
    num_entries: int,  # (k + 1) x group: the list's width
    scale: float,
) -> torch.Tensor:
    """Reference: `offsets [num_rows, num_kv_heads, num_entries]` int32 (see the module docstring).
    The argmax of a (query, head)'s probabilities over the old keys is the argmax of its logits."""
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_rows = page_table.shape[0]
    offsets = torch.full((num_rows, num_kv_heads, num_entries), NO_OFFSET, dtype=torch.int32, device=query.device)
    starts = query_start.tolist()
    for row, n_old in enumerate(num_old_keys.tolist()):
        q0, q1 = starts[row], starts[row + 1]
        num_q = min(q1 - q0, num_entries // group)
        if n_old == 0 or num_q <= 0:
            continue
        q = query[q0 : q0 + num_q].float().view(num_q, num_kv_heads, group, head_dim)
        k = gather_context(k_cache, page_table[row], n_old).float()  # [n_old, kvh, d]
        best = torch.einsum("qhgd,khd->hqgk", q, k).mul(scale).argmax(dim=-1)  # [kvh, q, g]
        position = n_old + torch.arange(num_q, device=query.device)[None, :, None]
        offsets[row, :, : num_q * group] = (best - position).reshape(num_kv_heads, -1).to(torch.int32)
    return unique_offsets(offsets)


def unique_offsets(offsets: torch.Tensor, taken: torch.Tensor | None = None) -> torch.Tensor:
    """`offsets [..., num_entries]` with `NO_OFFSET` for every entry that repeats an earlier entry of its list,
    or (given `taken [..., num_taken]`, lists of the same leading shape) an entry of `taken`'s list."""
    num_entries = offsets.shape[-1]
    earlier = torch.ones(num_entries, num_entries, dtype=torch.bool, device=offsets.device).tril(-1)  # [e, l]: l < e
    repeat = ((offsets[..., :, None] == offsets[..., None, :]) & earlier).any(dim=-1)
    if taken is not None and taken.shape[-1]:
        repeat = repeat | (offsets[..., :, None] == taken[..., None, :]).any(dim=-1)
    return torch.where(repeat, NO_OFFSET, offsets)


def moved_positions_ref(
    offsets: torch.Tensor,  # [num_kv_heads, num_entries] int32, one row's list
    query_position: int,
    recent_start: int,
    selected: torch.Tensor,  # [num_kv_heads, num_selected] int, the row's PillarAttn positions
) -> tuple[torch.Tensor, torch.Tensor]:
    """The moved keys of one draft query: `(positions [num_kv_heads, num_entries] int64, attend [same]
    bool)`; `attend` is False for entries outside `[0, recent_start)` and for duplicates (of an earlier
    entry, or of a selected key)."""
    positions = query_position + offsets.long()
    valid = (positions >= 0) & (positions < recent_start)
    first = unique_offsets(offsets) == offsets  # equal offsets, equal keys: False where an earlier entry has it
    in_selection = (positions[:, :, None] == selected.long()[:, None, :]).any(dim=-1)
    return torch.where(valid, positions, 0), valid & first & ~in_selection


@triton.jit
def _store_moved_offsets_kernel(
    best_ptr,  # [num_layers, num_rows, num_kv_heads, num_entries] int64, packed (probability bits, key); 0: none
    num_old_keys_ptr,  # [num_rows] int32
    slots_ptr,  # [num_rows] int32 or int64
    offsets_ptr,  # [num_layers, num_slots, num_kv_heads, num_entries] int32
    num_entries,
    stride_best_layer,
    stride_best_row,
    stride_best_head,
    stride_off_layer,
    stride_off_slot,
    stride_off_head,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    num_old = tl.load(num_old_keys_ptr + row)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    best_row_ptr = best_ptr + layer * stride_best_layer + row.to(tl.int64) * stride_best_row + kv_head * stride_best_head
    off_row_ptr = offsets_ptr + layer * stride_off_layer + slot * stride_off_slot + kv_head * stride_off_head
    entry = tl.arange(0, BLOCK)  # the whole list in one block (BLOCK >= num_entries)
    valid = entry < num_entries
    packed = tl.load(best_row_ptr + entry, mask=valid, other=0)
    key = 0x7FFFFFFF - (packed & 0xFFFFFFFF)
    offset = tl.where(packed > 0, key - (num_old + entry // GROUP), -(2**30))
    # an entry repeating an earlier one's offset moves no key (the draft kernels do not look for repeats)
    repeat = (offset[:, None] == offset[None, :]) & (entry[None, :] < entry[:, None])
    offset = tl.where(tl.sum(repeat.to(tl.int32), axis=1) > 0, -(2**30), offset)
    tl.store(off_row_ptr + entry, offset.to(tl.int32), mask=valid)
    tl.store(best_row_ptr + entry, tl.zeros([BLOCK], tl.int64), mask=valid)  # ready for the next use


def store_moved_offsets(
    best: torch.Tensor,  # [(num_layers,) num_rows, num_kv_heads, num_entries] int64 workspace
    num_old_keys: torch.Tensor,  # [num_rows] int32
    offsets: torch.Tensor,  # [(num_layers,) num_slots, num_kv_heads, num_entries] int32, written in place
    slots: torch.Tensor,  # [num_rows] int32/int64
    group: int,
) -> None:
    """Triton: `offsets[slots[r]]` from the scoring pass's packed best keys of row r (`NO_OFFSET` where
    none, and for an entry repeating an earlier one: `unique_offsets`), then `best` back to zeros. With
    a leading layer dimension on `best` and `offsets`, every layer at once. Grid `(num_rows,
    num_kv_heads, num_layers)`: shapes only."""
    device = best.device
    if best.ndim == 3:
        best, offsets = best[None], offsets[None]
    check_tensor("best", best, ndim=4, dtypes=(torch.int64,), device=device)
    num_layers, num_rows, num_kv_heads, num_entries = best.shape
    check_tensor("num_old_keys", num_old_keys, dtypes=INDEX, device=device, shape=(num_rows,))
    check_tensor("offsets", offsets, ndim=4, dtypes=(torch.int32,), device=device,
                 shape=(num_layers, None, num_kv_heads, num_entries))  # fmt: skip
    check_tensor("slots", slots, dtypes=(torch.int32, torch.int64), device=device, shape=(num_rows,))
    if best.stride(-1) != 1 or offsets.stride(-1) != 1:
        raise ValueError("best and offsets: expected unit-stride last dimensions")
    if num_rows == 0 or num_entries == 0 or num_layers == 0:
        return
    block = triton.next_power_of_2(num_entries)
    _store_moved_offsets_kernel[(num_rows, num_kv_heads, num_layers)](
        best, num_old_keys, slots, offsets, num_entries,
        best.stride(0), best.stride(1), best.stride(2), offsets.stride(0), offsets.stride(1), offsets.stride(2),
        GROUP=group, BLOCK=block, num_warps=1 if block <= 64 else 4,  # the repeat check compares block x block
    )  # fmt: skip
