"""shift_speculative_rows (Triton) moves the speculative rows exactly as the torch reference: tokens
of shifted rows to their new positions and cache slots (through the page table), rows without a
verification in flight and padding (row `num_rows`, the dummy slot) unmoved."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sparsespec.kernels.shifts import shift_speculative_rows, shift_speculative_rows_ref

ANY_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # hypothesis cases take no fixtures


def _case(generator, num_rows, tokens_per_row, num_single, num_logits, page_size, index_dtype):
    """An iteration's shift inputs: rows of 1-9 tokens (then padding tokens), some rows shifted."""
    num_slots, max_pages = num_rows + 3, 12
    results = torch.randint(0, 9, (40,), generator=generator)
    shift_index = torch.randint(-1, 40, (num_rows,), generator=generator)
    shift_index[torch.rand(num_rows, generator=generator) < 0.3] = -1
    row_slot = torch.randperm(num_slots, generator=generator)[:num_rows]
    token_row = torch.repeat_interleave(torch.arange(num_rows), torch.tensor(tokens_per_row))
    token_row = torch.cat([token_row, torch.full((3,), num_rows)])  # padding tokens
    num_tokens = token_row.shape[0]
    start = torch.randint(0, page_size * 4, (num_rows + 1,), generator=generator)
    position = torch.cat([torch.arange(n) for n in tokens_per_row] + [torch.zeros(3, dtype=torch.long)])
    position = position + start[token_row]
    page_table = torch.randperm((num_slots + 1) * max_pages, generator=generator).view(num_slots + 1, max_pages)
    page_table = page_table.to(torch.int32)
    input_index = torch.randint(0, 10_000, (num_tokens,), generator=generator)
    kv_slot = torch.randint(0, 10_000, (num_tokens,), generator=generator)
    context_lens = torch.randint(1, 60, (num_rows,), generator=generator).to(torch.int32)
    single_row = torch.randint(0, num_rows + 1, (num_single,), generator=generator)
    logits_row = torch.randint(0, num_rows + 1, (num_logits,), generator=generator)
    single_write = torch.randint(0, 10_000, (num_single,), generator=generator)
    prefix_len = torch.randint(0, 100, (num_logits,), generator=generator)
    return (results, shift_index.to(index_dtype), token_row.to(index_dtype), row_slot.to(index_dtype),
            single_row.to(index_dtype), logits_row.to(index_dtype), page_table, page_size, position, input_index,
            kv_slot, context_lens, single_write, prefix_len)  # fmt: skip


def _check(args, device):
    expected = shift_speculative_rows_ref(*args)
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    got = shift_speculative_rows(*moved)
    for name, e, g in zip(("position", "input_index", "kv_slot", "context_lens", "single_write", "prefix_len"),
                          expected, got):  # fmt: skip
        assert g.dtype == e.dtype, name
        assert torch.equal(g.cpu(), e), name
    return expected


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=40),  # tokens per row (rows past the block: several programs)
    st.integers(0, 30),  # one-token rows
    st.integers(0, 300),  # logits rows
    st.sampled_from([2, 16]),  # page size
    st.sampled_from([torch.int32, torch.int64]),
    st.integers(0, 2**31 - 1),
)
def test_matches_the_reference(tokens_per_row, num_single, num_logits, page_size, index_dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    args = _case(generator, len(tokens_per_row), tokens_per_row, num_single, num_logits, page_size, index_dtype)
    _check(args, ANY_DEVICE)


def test_shifted_rows_move_and_the_rest_stay(device):
    generator = torch.Generator().manual_seed(3)
    args = list(_case(generator, 5, [9, 1, 9, 1, 1], 4, 12, 4, torch.int64))
    args[1] = torch.tensor([7, -1, 3, -1, 0])  # rows 0, 2, 4 move by results[7], results[3], results[0]
    args[0][[7, 3, 0]] = torch.tensor([5, 0, 2])  # row 2's verification accepted nothing
    position, _, kv_slot, context_lens, _, _ = _check(args, device)
    token_row, moved_by = args[2], torch.tensor([5, 0, 0, 0, 2, 0])
    assert torch.equal(position, args[8] + moved_by[token_row])
    assert torch.equal(context_lens, args[11] + moved_by[:5].int())
    unmoved = moved_by[token_row] == 0
    assert torch.equal(kv_slot[unmoved], args[10][unmoved])  # the planned slots where nothing moved
    assert not torch.equal(kv_slot[~unmoved], args[10][~unmoved])


def test_rejects_mismatched_lists(device):
    generator = torch.Generator().manual_seed(0)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a
            for a in _case(generator, 3, [2, 2, 2], 2, 4, 4, torch.int64)]  # fmt: skip
    bad = list(args)
    bad[2] = bad[2][:-1]
    with pytest.raises(ValueError, match="position: expected shape"):
        shift_speculative_rows(*bad)
    bad = list(args)
    bad[11] = bad[11].long()
    with pytest.raises(TypeError, match="context_lens"):
        shift_speculative_rows(*bad)
