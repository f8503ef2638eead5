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
(`unique_offsets`: the Triton draft kernels do not look for repeats within a list). The lookup is a
handful of vectorised torch ops over the rows' token histories: on the
device, with shapes fixed per bucket (CUDA-graph safe), after the speculative rows' positions were
shifted on the device.
"""

from __future__ import annotations

import torch

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
