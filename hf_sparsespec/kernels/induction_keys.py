"""Induction keys of the `"induction"` selection: where the draft's own token occurred before, the key
right after it.

Why: an induction head at query position `q` reading token `x` attends the position after an earlier
occurrence of `x` ("the last time `x` came, the text went on with ..."): the copy it predicts. A
selection frozen at the last verification cannot know the token a later draft step reads; the token
ids can, without reading a single key. So at every draft step each draft row gets the successors
`j + 1` of the `num_entries` latest old occurrences `j` of its input token (`j + 1 < recent_start`;
later keys are in the recent window anyway), in every layer and KV head, on top of its PillarAttn
selection.

They travel as moved-key offsets `j + 1 - q` in the same store as the `"diagonal"` selection's
(`moved_keys.py`), written for every draft row before each iteration's forward, so the draft attention
(torch reference and Triton alike) attends them, deduplicated against the selection, with no kernel
of their own. Written after the diagonal selection's entries, they drop the offsets those hold
(`unique_offsets`: the Triton draft kernels do not look for repeats within a list). On the device,
with shapes fixed per bucket (CUDA-graph safe), after the speculative rows' positions were shifted
on the device:
- reference (`write_induction_keys_ref`): a handful of vectorised torch ops over the rows' whole
  token histories (every column of the token buffer), then every layer's store entries;
- Triton (`write_induction_keys`): one program per draft row scans its history backwards from its
  recent window, block by block, and stops once it has `num_entries` matches (a frequent token: a
  block or two; a token not seen before: the row's context, never the buffer's whole width); a second
  launch, one program per (row, layer), writes the entries of every KV head without the diagonal's
  offsets. Two launches in place of ~25 small ones over `[rows, width]` tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import check_tensor
from hf_sparsespec.kernels.moved_keys import NO_OFFSET, unique_offsets


def induction_offsets(
    token_buffer: torch.Tensor,  # [num_slots, width] long, every slot's token history
    input_index: torch.Tensor,  # [num_rows] long, flat index (slot * width + column) of the token each row reads
    row_base: torch.Tensor,  # [num_rows] long, flat index of each row's position 0
    recent_start: torch.Tensor,  # [num_rows], each row's recent window start
    num_entries: int,
) -> torch.Tensor:
    """`offsets [num_rows, num_entries]` int32: `j + 1 - q` for the latest old occurrences `j` of the
    token at `input_index` (its position `q = input_index - row_base`), most recent first, `NO_OFFSET`
    past the matches. Positions below 0 (left padding) and successors at or past `recent_start` never
    match."""
    num_rows = input_index.shape[0]
    width = token_buffer.shape[1]
    if num_rows == 0 or num_entries == 0 or width < 2:
        return torch.full((num_rows, num_entries), NO_OFFSET, dtype=torch.int32, device=token_buffer.device)
    slot = torch.div(row_base, width, rounding_mode="floor")
    padding = row_base - slot * width  # columns before position 0
    query = input_index - row_base
    token = token_buffer.view(-1)[input_index]
    history = token_buffer[slot, :-1]  # [rows, width - 1]: a successor needs a column after it
    successor = torch.arange(1, width, device=token_buffer.device)[None, :] - padding[:, None]  # j + 1
    match = (history == token[:, None]) & (successor >= 1) & (successor < recent_start.long()[:, None])
    take = min(num_entries, width - 1)
    latest = torch.where(match, successor, -1).topk(take, dim=-1).values  # [rows, take], latest first
    offsets = torch.where(latest >= 1, latest - query[:, None], NO_OFFSET).to(torch.int32)
    if take < num_entries:
        offsets = torch.nn.functional.pad(offsets, (0, num_entries - take), value=NO_OFFSET)
    return offsets


def write_induction_offsets(
    store: torch.Tensor,  # [num_layers, num_slots, num_kv_heads, num_entries] int32, written in place
    slots: torch.Tensor,  # [num_rows] long, the slot each row's offsets go to
    offsets: torch.Tensor,  # [num_rows, num_entries] int32
    taken: torch.Tensor | None = None,  # [num_layers, num_slots, num_kv_heads, num_taken] int32: the diagonal's
) -> None:
    """Every layer's and KV head's entries of `slots[r]` := `offsets[r]` (the lookup is the same for
    all of them), `NO_OFFSET` where `taken`'s list of that layer, slot and head holds the offset
    already. Rows sharing a slot (padding rows, the dummy slot) write it in an undefined order."""
    num_layers, _, num_kv_heads, num_entries = store.shape
    values = offsets[None, :, None, :].expand(num_layers, -1, num_kv_heads, num_entries)
    if taken is not None and taken.shape[-1]:
        values = unique_offsets(values, taken.index_select(1, slots))
    store.index_copy_(1, slots, values.contiguous())


def write_induction_keys_ref(
    moved_offsets: torch.Tensor,  # [num_layers, num_slots, num_kv_heads, num_taken + num_entries] int32
    num_taken: int,  # the diagonal selection's entries first (0: none)
    token_buffer: torch.Tensor,  # [num_slots, width] long
    input_index: torch.Tensor,  # [num_rows] long, flat index of the token each draft row reads
    row_base: torch.Tensor,  # [num_rows] long, flat index of each row's position 0
    recent_start: torch.Tensor,  # [num_rows] int, each row's recent window start
) -> None:
    """Every draft row's induction offsets (`induction_offsets`) into the store's last entries of its
    slot, every layer and KV head, without the offsets the diagonal's first `num_taken` hold
    (`write_induction_offsets`)."""
    store = moved_offsets[..., num_taken:]
    offsets = induction_offsets(token_buffer, input_index, row_base, recent_start, store.shape[-1])
    slots = torch.div(row_base, token_buffer.shape[1], rounding_mode="floor")
    write_induction_offsets(store, slots, offsets, moved_offsets[..., :num_taken])


@triton.jit
def _induction_lookup_kernel(
    tokens_ptr,  # [num_slots, width] int64
    input_index_ptr,  # [num_rows] int64
    row_base_ptr,  # [num_rows] int64
    recent_start_ptr,  # [num_rows] int32/int64
    offsets_ptr,  # [num_rows, NUM_ENTRIES] int32 (out)
    width,
    NUM_ENTRIES: tl.constexpr,
    ENTRIES_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    NO_OFFSET_VALUE: tl.constexpr,
):
    row = tl.program_id(0)
    read = tl.load(input_index_ptr + row).to(tl.int64)
    base = tl.load(row_base_ptr + row).to(tl.int64)
    recent = tl.load(recent_start_ptr + row).to(tl.int64)
    slot = base // width
    padding = base - slot * width  # columns before position 0
    query = read - base
    token = tl.load(tokens_ptr + read)
    # old occurrences j: 0 <= j, successor j + 1 < recent_start, and a column after j (j + padding <= width - 2)
    top = tl.minimum(recent - 2, width - 2 - padding)
    lanes = tl.arange(0, BLOCK)
    found = tl.sum(tl.zeros([1], tl.int32), axis=0)
    history = tokens_ptr + slot * width + padding
    out = offsets_ptr + row * NUM_ENTRIES
    for start in range(0, top + 1, BLOCK):  # latest positions first, block by block
        if found < NUM_ENTRIES:
            j = top - start - lanes
            valid = j >= 0
            match = (tl.load(history + j, mask=valid, other=0) == token) & valid
            rank = found + tl.cumsum(match.to(tl.int32), axis=0) - 1  # among all matches, latest first
            # each match goes straight to its entry: no [entries, BLOCK] comparison, so a block can be wide
            tl.store(out + rank, (j + 1 - query).to(tl.int32), mask=match & (rank < NUM_ENTRIES))
            found += tl.sum(match.to(tl.int32), axis=0)
    entries = tl.arange(0, ENTRIES_PAD)  # the entries past the matches (addresses no match was stored to)
    past = (entries >= found) & (entries < NUM_ENTRIES)
    tl.store(out + entries, tl.full([ENTRIES_PAD], NO_OFFSET_VALUE, tl.int32), mask=past)


@triton.jit
def _write_induction_kernel(
    store_ptr,  # [num_layers, num_slots, num_kv_heads, num_taken + NUM_ENTRIES] int32
    offsets_ptr,  # [num_rows, NUM_ENTRIES] int32
    row_base_ptr,  # [num_rows] int64
    width,
    num_kv_heads,
    num_taken,
    stride_layer,
    stride_slot,
    stride_head,
    NUM_ENTRIES: tl.constexpr,
    ENTRIES_PAD: tl.constexpr,
    TAKEN_PAD: tl.constexpr,
    NO_OFFSET_VALUE: tl.constexpr,
):
    row = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(row_base_ptr + row).to(tl.int64) // width
    entries = tl.arange(0, ENTRIES_PAD)
    in_list = entries < NUM_ENTRIES
    offsets = tl.load(offsets_ptr + row * NUM_ENTRIES + entries, mask=in_list, other=NO_OFFSET_VALUE)
    taken_index = tl.arange(0, TAKEN_PAD)
    is_taken = taken_index < num_taken
    for head in range(num_kv_heads):
        lists = store_ptr + layer * stride_layer + slot * stride_slot + head * stride_head
        taken = tl.load(lists + taken_index, mask=is_taken, other=NO_OFFSET_VALUE)
        repeat = tl.sum(((offsets[:, None] == taken[None, :]) & is_taken[None, :]).to(tl.int32), axis=1) > 0
        tl.store(lists + num_taken + entries, tl.where(repeat, NO_OFFSET_VALUE, offsets), mask=in_list)


LOOKUP_BLOCK = 1024  # history positions a lookup program compares per step (a row that never matches at 8K: 8 steps)


def write_induction_keys(
    moved_offsets: torch.Tensor,
    num_taken: int,
    token_buffer: torch.Tensor,
    input_index: torch.Tensor,
    row_base: torch.Tensor,
    recent_start: torch.Tensor,
) -> None:
    """Triton `write_induction_keys_ref` (arguments there): two launches, grids from the shapes only
    (CUDA-graph safe). Rows sharing a slot race for its entries (on a GPU the reference's `index_copy_`
    does too); the engine gives every real row a slot of its own, only padding rows share the dummy's."""
    check_tensor("moved_offsets", moved_offsets, ndim=4, dtypes=(torch.int32,))
    device = moved_offsets.device
    check_tensor("token_buffer", token_buffer, ndim=2, dtypes=(torch.int64,), device=device)
    num_rows = input_index.shape[0]
    for name, tensor in (("input_index", input_index), ("row_base", row_base), ("recent_start", recent_start)):
        check_tensor(name, tensor, ndim=1, dtypes=(torch.int32, torch.int64), device=device, shape=(num_rows,))
    num_layers, _, num_kv_heads, total = moved_offsets.shape
    if not 0 <= num_taken <= total:
        raise ValueError(f"num_taken: expected an int in [0, {total}], got {num_taken!r}")
    if moved_offsets.stride(-1) != 1 or not token_buffer.is_contiguous():
        raise ValueError("moved_offsets: expected unit-stride lists; token_buffer: expected a contiguous buffer")
    num_entries, width = total - num_taken, token_buffer.shape[1]
    if num_rows == 0 or num_entries == 0:
        return
    entries_pad = triton.next_power_of_2(num_entries)
    if width < 2:  # no column after any position: nothing to find
        offsets = torch.full((num_rows, num_entries), NO_OFFSET, dtype=torch.int32, device=device)
    else:
        offsets = torch.empty((num_rows, num_entries), dtype=torch.int32, device=device)
        _induction_lookup_kernel[(num_rows,)](
            token_buffer, input_index, row_base, recent_start, offsets, width,
            NUM_ENTRIES=num_entries, ENTRIES_PAD=entries_pad, BLOCK=LOOKUP_BLOCK, NO_OFFSET_VALUE=NO_OFFSET,
        )  # fmt: skip
    _write_induction_kernel[(num_rows, num_layers)](
        moved_offsets, offsets, row_base, width, num_kv_heads, num_taken,
        moved_offsets.stride(0), moved_offsets.stride(1), moved_offsets.stride(2),
        NUM_ENTRIES=num_entries, ENTRIES_PAD=entries_pad, TAKEN_PAD=triton.next_power_of_2(max(num_taken, 1)),
        NO_OFFSET_VALUE=NO_OFFSET,
    )  # fmt: skip
