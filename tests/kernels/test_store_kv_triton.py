"""store_kv (Triton) writes exactly what the reference writes, and skips -1 slots."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import poison_outputs  # noqa: F401

from hf_sparsespec.kernels.store_kv import store_kv, store_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size, num_kv_heads, head_dim", [(1, 1, 16), (16, 3, 32), (16, 2, 64), (5, 3, 24)])
def test_store_kv_matches_reference(device, dtype, page_size, num_kv_heads, head_dim):
    num_pages, num_tokens = 16, 11
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim).to(dtype).to(device)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_pages * page_size)[:num_tokens]
    slots[[1, 4, 9 % num_tokens]] = -1  # padding tokens
    slot_mapping = slots.to(device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    value = torch.randn_like(key)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slot_mapping)
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_store_kv_casts_and_reads_strided_inputs(device):
    k_cache = torch.randn(4, 16, 2, 32, dtype=torch.float16, device=device)
    v_cache = torch.randn_like(k_cache)
    kv = torch.randn(2, 7, 2, 32, device=device)  # float32, sliced views of one tensor
    slot_mapping = torch.tensor([3, 17, -1, 40, 63, 0, 22], device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(kv[0], kv[1], k_ref, v_ref, slot_mapping)
    store_kv(kv[0], kv[1], k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_rejects_bad_arguments(device):
    k_cache = torch.randn(4, 16, 2, 32, device=device)
    key = torch.randn(3, 2, 32, device=device)
    with pytest.raises(TypeError, match="slot_mapping: expected dtype"):
        store_kv(key, key, k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="key: expected shape"):
        store_kv(key[:, :1], key, k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.int64, device=device))
