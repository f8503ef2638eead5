"""Host offload on a GPU: the copy stream, pinned chunks and events (the CPU tests run the same copies
synchronously). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from models import assert_greedy_equal, ragged_batch, tiny_model

import hf_sparsespec  # noqa: F401  (registers the strategy)
from hf_sparsespec import SparseSpecCache, SparseSpecConfig

pytestmark = pytest.mark.gpu

LENGTHS = [3, 11, 7, 5, 9, 4, 10, 6, 8, 3, 11, 5, 7, 9, 4, 6]


def test_copies_are_asynchronous_ordered_and_bit_exact():
    """An offload is queued behind the compute stream's writes and returns before it is done; pages are
    reused only after `order_before_compute`; a restore reads back every byte."""
    cache = SparseSpecCache(
        num_layers=4, num_kv_heads=2, head_dim=64, num_pages=512, page_size=16, num_slots=2, max_budget=1,
        dtype=torch.bfloat16, device="cuda", host_pool_bytes=2**30, offload_chunk_tokens=256,
    )  # fmt: skip
    allocator = cache.allocator
    allocator.add("a")
    allocator.ensure("a", 4000)  # 250 pages: 16 chunks of 16 pages
    # a first round trip allocates the pinned chunks and the device staging buffer (allocations may
    # synchronize with the device); the copies below reuse them, as a long run's offloads do
    warm = cache.host.offload(allocator.page_table("a"), allocator.length("a"))
    cache.host.synchronize()
    cache.host.release(warm)
    torch.cuda.synchronize()
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
    pages = allocator.page_table("a")
    expected = [(layer.keys[pages].clone(), layer.values[pages].clone()) for layer in cache.layers]

    def rewrite_every_layer():
        for layer in cache.layers:
            layer.keys.mul_(1)
            layer.values.mul_(1)

    # The first launch of a kernel loads its module (CUDA's lazy loading), which waits for the device:
    # on the H200 the first `mul_` after the sleep below blocked the host for the sleep's 250 ms, and
    # the offload then found the compute stream idle (benchmarks/async_copies.py: every primitive of
    # an offload returns in < 0.4 ms). So that kernel runs once before the sleep.
    rewrite_every_layer()
    torch.cuda.synchronize()  # (indexing with a host list waits for the stream: no such wait below)
    torch.cuda._sleep(500_000_000)  # a long kernel (~0.25 s) on the compute stream, then its writes
    rewrite_every_layer()
    length = allocator.length("a")
    parked = allocator.park("a")
    host = cache.host.offload(parked, length)
    assert not host.offload.done(), "the offload waited for the compute stream on the host"
    assert all(chunk.is_pinned() for chunk in host.chunks) and len(host.chunks) == 16
    host.offload.order_before_compute()
    allocator.release(parked)
    allocator.add("b")
    allocator.ensure("b", 4000)  # b takes a's old pages and overwrites them on the compute stream
    for layer in cache.layers:
        layer.keys[allocator.page_table("b")] = 0
        layer.values[allocator.page_table("b")] = 0
    allocator.free("b")
    restored = allocator.unpark("a")
    transfer = cache.host.restore(host, restored)
    transfer.order_before_compute()
    for (keys, values), layer in zip(expected, cache.layers):
        assert torch.equal(layer.keys[restored], keys) and torch.equal(layer.values[restored], values)
    cache.host.release(host)
    allocator.check_invariants()


@pytest.mark.parametrize("chunk_tokens", [8, 1024])
def test_greedy_and_sampled_under_pressure_equal_the_unpressured_run(chunk_tokens):
    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch(LENGTHS, seed=4))
    base = dict(num_draft_tokens=4, min_budget=4, page_size=4, offload_chunk_tokens=chunk_tokens)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=60, do_sample=False)
    for kwargs in (dict(do_sample=False), dict(do_sample=True, temperature=0.8, top_p=0.95)):
        outs = []
        for config in (SparseSpecConfig(**base), SparseSpecConfig(**base, num_pages=45)):
            torch.manual_seed(3)
            outs.append(model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=60, generation_strategy="sparsespec",
                sparsespec_config=config, return_dict_in_generate=True, **kwargs,
            ))  # fmt: skip
        free, pressured = outs
        kv = pressured.sparsespec_stats.kv
        assert kv.offloads > 0 and kv.restores == kv.offloads and kv.recomputed_prefill_tokens == 0
        assert torch.equal(free.sequences, pressured.sequences)
        if not kwargs["do_sample"]:
            assert_greedy_equal(model, expected, pressured.sequences, mask)
