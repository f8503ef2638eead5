"""write_induction_keys (Triton) writes exactly the reference's induction entries into the moved-key
store: the latest matches first, past several scan blocks, the diagonal's offsets dropped per layer
and KV head, and nothing outside the induction entries of the rows' slots."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sparsespec.kernels import induction_keys
from hf_sparsespec.kernels.induction_keys import write_induction_keys, write_induction_keys_ref
from hf_sparsespec.kernels.moved_keys import NO_OFFSET

ANY_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # hypothesis cases take no fixtures


def _case(generator, num_slots, width, vocab, num_rows, recent_margin):
    """A token buffer, and draft rows (slot, left padding, position read, recent window start); one row a
    slot, as in the engine (rows sharing a slot, only ever padding rows, write it in no defined order)."""
    tokens = torch.randint(0, vocab, (num_slots, width), generator=generator)
    num_rows = min(num_rows, num_slots)
    slots = torch.randperm(num_slots, generator=generator)[:num_rows]
    padding = torch.randint(0, max(1, width // 4), (num_rows,), generator=generator)
    position = torch.stack([torch.randint(0, width - int(p), (1,), generator=generator)[0] for p in padding])
    recent = (position + 1 - torch.randint(0, recent_margin + 1, (num_rows,), generator=generator)).clamp(min=0)
    row_base = slots * width + padding
    return tokens, row_base + position, row_base, recent.to(torch.int32)


def _store(generator, num_layers, num_slots, num_kv_heads, num_taken, num_entries, tokens_pool):
    """A store whose diagonal entries hold offsets the lookups will find (and NO_OFFSET), the rest -7."""
    store = torch.full((num_layers, num_slots, num_kv_heads, num_taken + num_entries), -7, dtype=torch.int32)
    if num_taken:
        picks = torch.randint(0, len(tokens_pool), (num_layers, num_slots, num_kv_heads, num_taken),
                              generator=generator)  # fmt: skip
        store[..., :num_taken] = torch.tensor(tokens_pool, dtype=torch.int32)[picks]
    return store


def _compare(device, tokens, reads, row_base, recent, store, num_taken):
    expected, got = store.clone(), store.clone().to(device)
    write_induction_keys_ref(expected, num_taken, tokens, reads, row_base, recent)
    write_induction_keys(got, num_taken, tokens.to(device), reads.to(device), row_base.to(device), recent.to(device))
    assert torch.equal(got.cpu(), expected)
    return expected


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 4),  # slots
    st.integers(2, 700),  # width (past the scan block: several blocks per row)
    st.integers(1, 6),  # vocabulary (small: many matches) or large below
    st.integers(1, 9),  # rows
    st.integers(0, 20),  # entries
    st.sampled_from([0, 3, 9]),  # diagonal entries before them
    st.integers(0, 12),  # how far before the read position the recent window starts
    st.sampled_from([16, 128, induction_keys.LOOKUP_BLOCK]),  # scan block: many, a few or one per row
    st.integers(0, 2**31 - 1),
)
def test_matches_the_reference(num_slots, width, vocab, num_rows, num_entries, num_taken, margin, block, seed):
    generator = torch.Generator().manual_seed(seed)
    vocab = vocab if seed % 3 else 500  # some cases with few matches: whole histories scanned
    tokens, reads, row_base, recent = _case(generator, num_slots + 1, width, vocab, num_rows, margin)
    store = _store(generator, 2, num_slots + 1, 2, num_taken, num_entries, [NO_OFFSET, -1, -2, -5, -9, -30, -200])
    with mock.patch.object(induction_keys, "LOOKUP_BLOCK", block):
        _compare(ANY_DEVICE, tokens, reads, row_base, recent, store, num_taken)


@pytest.mark.parametrize("num_taken", [0, 18])
def test_long_histories_on_the_device(device, num_taken):
    """Rows whose 16 latest matches lie several scan blocks back, rows that never match, rows sharing
    no slot; every layer's and KV head's entries, the diagonal's offsets dropped."""
    generator = torch.Generator().manual_seed(num_taken)
    width, num_slots = 3 * induction_keys.LOOKUP_BLOCK + 37, 6
    tokens = torch.randint(10, 1000, (num_slots, width), generator=generator)
    tokens[1, ::40] = 3  # a token every 40 columns: 16 matches need ~640 columns, three blocks
    tokens[2, -5] = 4  # a token never seen before in its row
    row_base = torch.tensor([1, 2, 3, 4, 5]) * width + torch.tensor([0, 7, 0, 2, 1])
    reads = row_base + torch.tensor([width - 5, width - 12, width - 3, 100, 0])
    reads[0] = width * 1 + (width - 1) // 40 * 40  # slot 1 reads its last 3
    tokens[3, -3] = tokens[3, 50]
    recent = torch.tensor([(width - 1) // 40 * 40, width - 14, width - 3, 101, 0], dtype=torch.int32)
    pool = [-39, -79, -119, NO_OFFSET, -1]  # slot 1's three latest offsets among them
    store = _store(generator, 3, num_slots, 2, num_taken, 16, pool)
    expected = _compare(device, tokens, reads, row_base, recent, store, num_taken)
    latest = [-39 - 40 * i for i in range(16)]  # slot 1's 16 latest 3s, latest first, three blocks back
    for layer in range(3):
        for head in range(2):
            taken = set(store[layer, 1, head, :num_taken].tolist())
            want = [NO_OFFSET if offset in taken else offset for offset in latest]
            assert expected[layer, 1, head, num_taken:].tolist() == want
    assert (expected[:, 2, :, num_taken:] == NO_OFFSET).all()  # slot 2's token occurs nowhere before
    assert (expected[:, 0, :, num_taken:] == -7).all()  # no row of slot 0: its induction entries untouched


def test_rejects_bad_arguments(device):
    store = torch.zeros(2, 3, 2, 5, dtype=torch.int32, device=device)
    tokens = torch.zeros(3, 8, dtype=torch.long, device=device)
    index = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="num_taken"):
        write_induction_keys(store, 6, tokens, index, index, index)
    with pytest.raises(TypeError, match="moved_offsets"):
        write_induction_keys(store.long(), 2, tokens, index, index, index)
    with pytest.raises(ValueError, match="recent_start: expected shape"):
        write_induction_keys(store, 2, tokens, index, index, index[:1])
