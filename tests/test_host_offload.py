"""Offload/restore through the host tier under random admit/grow/rollback/offload/release/restore/finish
sequences: no page owned twice, free + owned + in transit = total, host chunks accounted for, and every
position of every request reads back bit-exact whatever moved in between (pages freed by an offload are
reused and overwritten by others before the request comes back)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sparsespec.cache import HostMemoryError, SparseSpecCache

LAYERS, HEADS, DIM = 2, 2, 3
OPS = ["admit", "grow", "grow", "rollback", "offload", "release", "restore", "finish"]
operations = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2), st.integers(0, 24)), min_size=20, max_size=60)


class Contents:
    """What every position of every request must read back: a distinct value per write."""

    def __init__(self) -> None:
        self.counter = 0
        self.values: dict[int, list[torch.Tensor]] = {}  # request -> [length] of [2, LAYERS, HEADS, DIM]

    def write(self, cache: SparseSpecCache, request: int, start: int, end: int) -> None:
        rows = self.values.setdefault(request, [])
        del rows[start:]
        for position in range(start, end):
            value = torch.arange(2 * LAYERS * HEADS * DIM, dtype=torch.float32).view(2, LAYERS, HEADS, DIM)
            value = value + 1000.0 * self.counter
            self.counter += 1
            slot = cache.allocator.slot(request, position)
            for layer_index, layer in enumerate(cache.layers):
                layer.keys.view(-1, HEADS, DIM)[slot] = value[0, layer_index]
                layer.values.view(-1, HEADS, DIM)[slot] = value[1, layer_index]
            rows.append(value)

    def check(self, cache: SparseSpecCache, request: int) -> None:
        for position, value in enumerate(self.values.get(request, [])[: cache.allocator.length(request)]):
            slot = cache.allocator.slot(request, position)
            for layer_index, layer in enumerate(cache.layers):
                assert torch.equal(layer.keys.view(-1, HEADS, DIM)[slot], value[0, layer_index]), (request, position)
                assert torch.equal(layer.values.view(-1, HEADS, DIM)[slot], value[1, layer_index]), (request, position)


@settings(max_examples=120, deadline=None)
@given(
    num_pages=st.integers(2, 16), page_size=st.integers(1, 4), chunk_tokens=st.integers(1, 9),
    host_chunks=st.integers(0, 6), ops=operations,
)  # fmt: skip
def test_random_offload_sequences_restore_every_byte(num_pages, page_size, chunk_tokens, host_chunks, ops):
    probe = SparseSpecCache(LAYERS, HEADS, DIM, 1, page_size, 1, 1, torch.float32, "cpu", 0, chunk_tokens)
    cache = SparseSpecCache(
        num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, num_pages=num_pages, page_size=page_size, num_slots=2,
        max_budget=1, dtype=torch.float32, device="cpu", host_pool_bytes=host_chunks * probe.host.chunk_bytes,
        offload_chunk_tokens=chunk_tokens,
    )  # fmt: skip
    allocator, host_tier = cache.allocator, cache.host
    contents = Contents()
    running: set[int] = set()
    hosts = {}  # offloaded request -> HostKV
    in_transit: list[list[int]] = []
    for op, request, tokens in ops:
        if op == "admit" and request not in running and request not in hosts:
            allocator.add(request)
            running.add(request)
        elif op == "grow" and request in running:
            length = allocator.length(request)
            if allocator.pages_for(tokens) - allocator.num_pages_of(request) <= allocator.num_free_pages:
                allocator.ensure(request, tokens)
                contents.write(cache, request, length, allocator.length(request))
        elif op == "rollback" and (request in running or request in hosts):
            allocator.truncate(request, tokens)
        elif op == "offload" and request in running:
            held = allocator.num_pages_of(request)
            if not host_tier.can_hold(held):
                with pytest.raises(HostMemoryError, match="host KV pool is full"):
                    host_tier.offload(list(range(held)), allocator.length(request))
                continue
            length = allocator.length(request)
            pages = allocator.park(request)
            hosts[request] = host_tier.offload(pages, length)
            assert hosts[request].offload.done()  # synchronous on CPU
            in_transit.append(pages)
            running.remove(request)
        elif op == "release" and in_transit:
            pages = in_transit.pop(tokens % len(in_transit))
            allocator.release(pages)
            for page in pages:  # whoever gets them next overwrites them
                for layer in cache.layers:
                    layer.keys[page] = -1.0
                    layer.values[page] = -1.0
        elif op == "restore" and request in hosts:
            if allocator.pages_for(allocator.parked_length(request)) <= allocator.num_free_pages:
                pages = allocator.unpark(request)
                transfer = host_tier.restore(hosts[request], pages)
                assert transfer.done() and transfer.num_bytes == len(pages) * host_tier.page_bytes
                host_tier.release(hosts.pop(request))
                running.add(request)
        elif op == "finish" and (request in running or request in hosts):
            allocator.free(request)
            running.discard(request)
            if request in hosts:
                host_tier.release(hosts.pop(request))
            contents.values.pop(request, None)
        allocator.check_invariants()
        held_chunks = sum(len(host.chunks) for host in hosts.values())
        assert host_tier.num_free_chunks + held_chunks == host_tier.capacity == host_chunks
        owned = sum(allocator.num_pages_of(r) for r in running)
        assert allocator.num_free_pages + owned + sum(map(len, in_transit)) == num_pages
        for rid in running:
            contents.check(cache, rid)
