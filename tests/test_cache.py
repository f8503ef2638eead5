"""SparseSpecCache: a transformers Cache whose K/V live in pages; rollback and host round trips."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.cache_utils import Cache

from hf_sparsespec import SparseSpecCache
from hf_sparsespec.kernels.backend import TorchBackend


def make_cache(num_pages=16, page_size=4):
    return SparseSpecCache(
        num_layers=3, num_kv_heads=2, head_dim=8, num_pages=num_pages, page_size=page_size, num_slots=4,
        max_budget=6, dtype=torch.float32, device="cpu",
    )


def test_is_a_transformers_cache_with_paged_layers():
    cache = make_cache()
    assert isinstance(cache, Cache) and len(cache) == 3
    assert cache.layers[0].keys.shape == (16, 4, 2, 8)
    assert cache.selected.shape == (3, 4, 2, 6)
    assert cache.is_sliding == [False, False, False]


def test_update_writes_the_active_steps_slots():
    cache = make_cache()
    allocator = cache.allocator
    allocator.reserve("r", 10)
    allocator.ensure("r", 6)
    slots = torch.tensor([allocator.slot("r", p) for p in range(6)])
    key, value = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(RuntimeError, match="only written inside an hf_sparsespec engine step"):
        cache.update(key, value, 1)
    for compiled in (False, True):  # the backend directly, or the custom op a compiled forward calls
        cache.layers[1].keys.zero_()
        cache.active_step = SimpleNamespace(backend=TorchBackend(), slot_mapping=slots, compiled=compiled)
        returned = cache.update(key, value, 1)
        assert returned[0] is key
        flat = cache.layers[1].keys.view(-1, 2, 8)
        assert torch.equal(flat[slots], key[0].transpose(0, 1))
        assert cache.layers[0].keys.abs().sum() == 0  # other layers untouched


def test_offload_and_restore_is_bit_exact_into_new_pages():
    cache = make_cache()
    allocator = cache.allocator
    for name, length in (("a", 9), ("b", 7)):
        allocator.reserve(name, 16)
        allocator.ensure(name, length)
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()

    def read(name):
        slots = torch.tensor([allocator.slot(name, p) for p in range(allocator.length(name))])
        return [(layer.keys.view(-1, 2, 8)[slots].clone(), layer.values.view(-1, 2, 8)[slots].clone()) for layer in cache.layers]

    before = read("a")
    old_table = list(allocator.page_table("a"))
    host = cache.offload_request("a")
    assert allocator.is_parked("a") and allocator.num_pages_of("a") == 0 and host.length == 9
    assert host.num_bytes == 3 * 2 * 3 * 4 * 2 * 8 * 4  # 3 pages of 3 layers' K and V, fp32
    allocator.reserve("c", 12)  # someone else takes the freed pages
    allocator.ensure("c", 12)
    cache.restore_request("a", host)
    assert not allocator.is_parked("a") and allocator.page_table("a") != old_table
    for (k0, v0), (k1, v1) in zip(before, read("a")):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    allocator.check_invariants()
