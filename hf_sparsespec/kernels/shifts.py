"""shift_speculative_rows: move an iteration's speculative rows by what the previous iteration's
verifications accepted, on the device.

With delayed verification the host builds iteration t+1 before it has read iteration t's results: a
request whose verification is in flight gets rows built as if it accepted no draft, and
`shift_index[row]` names the entry of the result buffer that will hold its accepted count `a` (-1: a
row with nothing in flight). Before the forward, every token of such a row moves `a` positions on
(its position, the token it reads, and the cache slot it writes: the page table's slot of the new
position), the row's context grows by `a`, and so do its one-token row's write index and its logits
rows' history lengths. Row index `num_rows` is the padding's: never shifted, the dummy slot.

Reference: the torch ops (~25 small launches). Triton: one launch, programs over blocks of the
longest of the four index lists (tokens, rows, one-token rows, logits rows), grid from the shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)


def shift_speculative_rows_ref(
    results: torch.Tensor,  # [num_results] int64, the previous iterations' results (accepted counts among them)
    shift_index: torch.Tensor,  # [num_rows] int, where a row's accepted count is in `results`, -1 none
    token_row: torch.Tensor,  # [num_tokens] int, each token's row (num_rows: padding)
    row_slot: torch.Tensor,  # [num_rows] int, each row's slot
    single_row: torch.Tensor,  # [num_single] int, each one-token row's row (num_rows: padding)
    logits_row: torch.Tensor,  # [num_logits] int, each logits row's row (num_rows: padding)
    page_table: torch.Tensor,  # [num_slots + 1, max_pages] int32, the last row the dummy slot's
    page_size: int,
    position: torch.Tensor,  # [num_tokens] int64
    input_index: torch.Tensor,  # [num_tokens] int64, flat index into the token buffer
    kv_slot: torch.Tensor,  # [num_tokens] int64, the cache slot each token writes
    context_lens: torch.Tensor,  # [num_rows] int32
    single_write: torch.Tensor,  # [num_single] int64
    prefix_len: torch.Tensor,  # [num_logits] int64
) -> tuple[torch.Tensor, ...]:
    """`(position, input_index, kv_slot, context_lens, single_write, prefix_len)` shifted (new tensors;
    see the module docstring)."""
    num_rows = shift_index.shape[0]
    shift = torch.where(shift_index >= 0, results[shift_index.clamp(min=0).long()], 0)
    shift = torch.cat([shift, shift.new_zeros(1)])  # row `num_rows`: padding, never shifted
    token_row = token_row.long()
    token_shift = shift[token_row]
    position, input_index = position + token_shift, input_index + token_shift
    dummy = page_table.shape[0] - 1
    slots = torch.cat([row_slot.long(), row_slot.new_full((1,), dummy).long()])[token_row]
    page = page_table[slots, position // page_size].long()
    moved = page * page_size + position % page_size
    kv_slot = torch.where(token_shift != 0, moved, kv_slot)
    context_lens = (context_lens + shift[:num_rows]).to(torch.int32)
    single_write = single_write + shift[single_row.long()]
    prefix_len = prefix_len + shift[logits_row.long()]
    return position, input_index, kv_slot, context_lens, single_write, prefix_len


@triton.jit
def _row_shift(results_ptr, shift_index_ptr, row, mask, num_rows):
    """The accepted count that moves `row` (0 for padding rows, rows with nothing in flight, masked lanes)."""
    real = mask & (row < num_rows)
    index = tl.load(shift_index_ptr + row, mask=real, other=-1).to(tl.int64)
    return tl.load(results_ptr + index, mask=real & (index >= 0), other=0).to(tl.int64)


@triton.jit
def _shift_kernel(
    results_ptr, shift_index_ptr, token_row_ptr, row_slot_ptr, single_row_ptr, logits_row_ptr, page_table_ptr,
    position_ptr, input_index_ptr, kv_slot_ptr, context_lens_ptr, single_write_ptr, prefix_len_ptr,
    out_position_ptr, out_input_index_ptr, out_kv_slot_ptr, out_context_lens_ptr, out_single_write_ptr,
    out_prefix_len_ptr, num_rows, num_tokens, num_single, num_logits, stride_page_table,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # tokens: position, token read and cache slot
    is_token = i < num_tokens
    row = tl.load(token_row_ptr + i, mask=is_token, other=0).to(tl.int64)
    shift = _row_shift(results_ptr, shift_index_ptr, row, is_token, num_rows)
    position = tl.load(position_ptr + i, mask=is_token, other=0) + shift
    tl.store(out_position_ptr + i, position, mask=is_token)
    tl.store(out_input_index_ptr + i, tl.load(input_index_ptr + i, mask=is_token, other=0) + shift, mask=is_token)
    moves = is_token & (shift != 0)
    slot = tl.load(row_slot_ptr + row, mask=moves, other=0)  # padding tokens never move
    page = tl.load(page_table_ptr + slot.to(tl.int64) * stride_page_table + position // PAGE_SIZE, mask=moves, other=0)
    kv_slot = tl.where(moves, page.to(tl.int64) * PAGE_SIZE + position % PAGE_SIZE,
                       tl.load(kv_slot_ptr + i, mask=is_token, other=0))  # fmt: skip
    tl.store(out_kv_slot_ptr + i, kv_slot, mask=is_token)
    # rows: context lengths
    is_row = i < num_rows
    shift = _row_shift(results_ptr, shift_index_ptr, i, is_row, num_rows)
    context = tl.load(context_lens_ptr + i, mask=is_row, other=0) + shift
    tl.store(out_context_lens_ptr + i, context.to(tl.int32), mask=is_row)
    # one-token rows: where their token goes
    is_single = i < num_single
    row = tl.load(single_row_ptr + i, mask=is_single, other=0).to(tl.int64)
    shift = _row_shift(results_ptr, shift_index_ptr, row, is_single, num_rows)
    tl.store(out_single_write_ptr + i, tl.load(single_write_ptr + i, mask=is_single, other=0) + shift, mask=is_single)
    # logits rows: the history length each conditions on
    is_logits = i < num_logits
    row = tl.load(logits_row_ptr + i, mask=is_logits, other=0).to(tl.int64)
    shift = _row_shift(results_ptr, shift_index_ptr, row, is_logits, num_rows)
    tl.store(out_prefix_len_ptr + i, tl.load(prefix_len_ptr + i, mask=is_logits, other=0) + shift, mask=is_logits)


SHIFT_BLOCK = 256


def shift_speculative_rows(
    results, shift_index, token_row, row_slot, single_row, logits_row, page_table, page_size, position, input_index,
    kv_slot, context_lens, single_write, prefix_len,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Triton `shift_speculative_rows_ref` (arguments and results there), one launch."""
    device = results.device
    check_tensor("results", results, ndim=1, dtypes=(torch.int64,))
    check_tensor("page_table", page_table, ndim=2, dtypes=(torch.int32,), device=device)
    num_rows, num_tokens = shift_index.shape[0], token_row.shape[0]
    num_single, num_logits = single_row.shape[0], logits_row.shape[0]
    lists = {"shift_index": (shift_index, num_rows), "token_row": (token_row, num_tokens),
             "row_slot": (row_slot, num_rows), "single_row": (single_row, num_single),
             "logits_row": (logits_row, num_logits)}  # fmt: skip
    for name, (tensor, size) in lists.items():
        check_tensor(name, tensor, ndim=1, dtypes=INDEX_DTYPES, device=device, shape=(size,))
    values = {"position": (position, num_tokens, torch.int64), "input_index": (input_index, num_tokens, torch.int64),
              "kv_slot": (kv_slot, num_tokens, torch.int64), "context_lens": (context_lens, num_rows, torch.int32),
              "single_write": (single_write, num_single, torch.int64),
              "prefix_len": (prefix_len, num_logits, torch.int64)}  # fmt: skip
    for name, (tensor, size, dtype) in values.items():
        check_tensor(name, tensor, ndim=1, dtypes=(dtype,), device=device, shape=(size,))
    if page_table.stride(1) != 1:
        raise ValueError(f"page_table: expected unit-stride rows, got strides {page_table.stride()}")
    outputs = tuple(torch.empty_like(tensor) for tensor, _, _ in values.values())
    longest = max(num_rows, num_tokens, num_single, num_logits)
    if longest:
        _shift_kernel[(triton.cdiv(longest, SHIFT_BLOCK),)](
            results, shift_index, token_row, row_slot, single_row, logits_row, page_table,
            *(tensor for tensor, _, _ in values.values()), *outputs,
            num_rows, num_tokens, num_single, num_logits, page_table.stride(0),
            PAGE_SIZE=page_size, BLOCK=SHIFT_BLOCK,
        )  # fmt: skip
    return outputs
