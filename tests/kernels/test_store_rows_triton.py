"""store_rows (Triton) writes exactly the reference's rows into the draft-probability store and
leaves the rows of negative indices (plain steps, bucket padding) untouched."""

from __future__ import annotations

import pytest
import torch

from hf_sparsespec.kernels.store_rows import store_rows, store_rows_ref


@pytest.mark.parametrize("cols", [1, 97, 4096, 9000])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_rows_matches_the_reference(device, cols, src_dtype, index_dtype):
    generator = torch.Generator().manual_seed(cols)
    store = torch.rand(11, cols, generator=generator).to(device)
    src = torch.rand(7, cols, generator=generator).to(src_dtype).to(device)
    index = torch.tensor([3, -1, 0, 10, -1, -1, 6], dtype=index_dtype, device=device)
    expected, got = store.clone(), store.clone()
    store_rows_ref(expected, index, src)
    store_rows(got, index, src)
    assert torch.equal(got, expected)
    untouched = [r for r in range(11) if r not in (3, 0, 10, 6)]
    assert torch.equal(got[untouched], store[untouched])  # rows no index names keep their values
    assert torch.equal(got[[3, 0, 10, 6]], src[[0, 2, 3, 6]].float())


def test_store_rows_reads_strided_rows_and_skips_an_all_negative_index(device):
    base = torch.zeros(6, 2, 300, device=device)
    store = base[:, 1]  # rows 600 floats apart
    src = torch.randn(3, 2, 300, device=device)[:, 0]
    store_rows(store, torch.tensor([5, -1, 2], dtype=torch.int32, device=device), src)
    assert torch.equal(store[5], src[0]) and torch.equal(store[2], src[2])
    assert not base[:, 0].any() and not store[[0, 1, 3, 4]].any()
    before = store.clone()
    store_rows(store, torch.full((3,), -1, dtype=torch.int32, device=device), src)
    assert torch.equal(store, before)


def test_store_rows_rejects_mismatched_inputs(device):
    store = torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="src: expected shape"):
        store_rows(store, torch.zeros(2, dtype=torch.int32, device=device), torch.zeros(2, 9, device=device))
    with pytest.raises(ValueError, match="index: expected shape"):
        store_rows(store, torch.zeros(3, dtype=torch.int32, device=device), torch.zeros(2, 8, device=device))
    with pytest.raises(ValueError, match="unit-stride"):
        store_rows(store.t().contiguous().t(), torch.zeros(2, dtype=torch.int32, device=device),
                   torch.zeros(2, 8, device=device))  # columns 4 floats apart  # fmt: skip
