"""merge_splits (Triton) against its float32 reference: entries with 1 split up to several blocks of
`MERGE_SPLIT_BLOCK` splits (and a partial last block), splits that saw no key (-inf LSE), draft entries
whose LSE is reported as -inf, padding entries that must write nothing, and a head_dim below its block."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import poison_outputs  # noqa: F401

from hf_sparsespec.kernels import _attention_tile
from hf_sparsespec.kernels._attention_tile import merge_splits, merge_splits_ref


class _Plan:  # what `merge_splits` reads of an AttentionPlan
    def __init__(self, merge):
        self.merge = merge

    @property
    def num_merge(self):
        return self.merge.shape[0]


@pytest.mark.parametrize("split_block", [_attention_tile.MERGE_SPLIT_BLOCK, 4])
def test_merge_splits_matches_the_reference(device, split_block, monkeypatch):
    monkeypatch.setattr(_attention_tile, "MERGE_SPLIT_BLOCK", split_block)
    gen = torch.Generator().manual_seed(0)
    num_heads, head_dim, num_tokens = 3, 24, 7
    # (token, num_splits, split stride, keep_lse): strides interleave the queries of a tile
    entries = [(0, 1, 1, 1), (1, 3, 2, 1), (2, 8, 1, 0), (4, 9, 3, 1), (5, 19, 1, 1), (6, 5, 1, 1), (3, 0, 1, 1)]
    merge, first = [], 0
    for token, num_splits, stride, keep in entries:
        merge.append([token, first, stride, num_splits, keep])
        first += max(num_splits, 1) * stride
    part_out = torch.randn(first, num_heads, head_dim, generator=gen)
    part_lse = torch.randn(first, num_heads, generator=gen) * 4
    part_lse[merge[1][1] + 2] = float("-inf")  # a split that saw no key
    for s in range(5):  # an entry none of whose splits saw a key
        part_lse[merge[5][1] + s] = float("-inf")
        part_out[merge[5][1] + s] = 0.0
    merge = torch.tensor(merge, dtype=torch.int32)
    out = torch.full((num_tokens, num_heads, head_dim), 7.0)
    lse = torch.full((num_tokens, num_heads), 7.0)
    expected_out, expected_lse = out.clone(), lse.clone()
    merge_splits_ref(part_out, part_lse, merge, expected_out, expected_lse)
    assert torch.equal(expected_out[3], out[3]) and torch.equal(expected_lse[6], torch.full((3,), float("-inf")))

    out, lse = out.to(device), lse.to(device)
    merge_splits(_Plan(merge.to(device)), part_out.to(device), part_lse.to(device), out, lse)
    torch.testing.assert_close(out.cpu(), expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu(), expected_lse, rtol=1e-5, atol=1e-5)
