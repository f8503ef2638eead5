"""Page-table and rollback invariants of the allocator under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sparsespec.cache import OutOfPagesError, PageAllocator

OPS = ["reserve", "add", "ensure", "truncate", "free", "sync", "park", "release", "unpark"]
operations = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 3), st.integers(0, 70)), min_size=20, max_size=80)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 24), page_size=st.integers(1, 8), ops=operations)
def test_random_operations_keep_invariants(num_pages, page_size, ops):
    allocator = PageAllocator(num_pages, page_size)
    model: dict[int, int] = {}  # request -> length, the expected state
    parked: dict[int, int] = {}  # offloaded request -> positions it will get back
    in_transit: list[list[int]] = []  # pages taken by `park`, not yet released
    mirror: dict[int, list[int]] = {}  # what a device copy kept current with `take_changed` holds
    for op, request, tokens in ops:
        if op in ("reserve", "add") and request not in model and request not in parked:
            if op == "add":
                allocator.add(request)  # no promise: grows while pages are free
                model[request] = 0
            elif allocator.can_reserve(tokens):
                allocator.reserve(request, tokens)
                model[request] = 0
            else:
                with pytest.raises(OutOfPagesError):
                    allocator.reserve(request, tokens)
        elif op == "ensure" and request in model:
            reserved = allocator.reserved_pages(request)
            grow = allocator.pages_for(tokens) - len(allocator.page_table(request))
            if (reserved is None or allocator.pages_for(tokens) <= reserved) and grow <= allocator.num_free_pages:
                allocator.ensure(request, tokens)  # never fails within the reservation and the free pages
                model[request] = max(model[request], tokens)
            else:
                with pytest.raises(OutOfPagesError):
                    allocator.ensure(request, tokens)
        elif op == "truncate" and request in model:
            allocator.truncate(request, tokens)
            model[request] = min(model[request], tokens)
        elif op == "truncate" and request in parked:
            allocator.truncate(request, tokens)  # a rollback read while the request is on the host
            parked[request] = min(parked[request], tokens)
        elif op == "free" and (request in model or request in parked):
            allocator.free(request)
            model.pop(request, None)
            parked.pop(request, None)
        elif op == "park" and request in model:
            pages = allocator.park(request)
            assert len(pages) == allocator.pages_for(model[request]) and allocator.page_table(request) == []
            in_transit.append(pages)
            parked[request] = model.pop(request)
        elif op == "release" and in_transit:
            allocator.release(in_transit.pop(tokens % len(in_transit)))
        elif op == "unpark" and request in parked:
            needed = allocator.pages_for(parked[request])
            if needed <= allocator.num_free_pages:
                pages = allocator.unpark(request)
                assert len(pages) == needed
                model[request] = parked.pop(request)
            else:
                with pytest.raises(OutOfPagesError):
                    allocator.unpark(request)
        allocator.check_invariants()
        transit = sum(len(pages) for pages in in_transit)
        owned = sum(len(allocator.page_table(rid)) for rid in model)
        assert allocator.num_free_pages + owned + transit == num_pages
        for rid, length in parked.items():
            assert allocator.is_parked(rid) and allocator.parked_length(rid) == length
        for rid in list(mirror):
            if rid not in model and rid not in parked:  # a parked request's device row stays stale
                del mirror[rid]
        if op == "sync" and request in model:  # what an iteration sends to the device page table
            table, copy = allocator.page_table(request), mirror.setdefault(request, [])
            if request in allocator.changed_requests:  # as the batch builder: only these have entries to send
                first = allocator.take_changed(request)
                copy[first:] = table[first:]
                assert request not in allocator.changed_requests
            else:
                assert allocator.take_changed(request) == len(table)  # it would send nothing
            assert copy[: len(table)] == table
        for rid, length in model.items():
            assert allocator.length(rid) == length
            table = allocator.page_table(rid)
            slots = [allocator.slot(rid, p) for p in range(length)]
            assert len(set(slots)) == length  # distinct slots per position
            assert all(slot // page_size in table for slot in slots)


def test_rollback_keeps_surviving_slots():
    allocator = PageAllocator(num_pages=8, page_size=4)
    allocator.reserve("a", 32)
    allocator.ensure("a", 13)
    before = [allocator.slot("a", p) for p in range(9)]
    allocator.truncate("a", 9)
    assert [allocator.slot("a", p) for p in range(9)] == before
    assert len(allocator.page_table("a")) == 3
    assert allocator.num_free_pages == 5


def test_reservations_cannot_exceed_the_pool():
    allocator = PageAllocator(num_pages=4, page_size=4)
    allocator.reserve("a", 12)
    assert not allocator.can_reserve(5)
    with pytest.raises(OutOfPagesError, match="needs 2 pages, 1 are unreserved"):
        allocator.reserve("b", 5)
    with pytest.raises(ValueError, match="already holds pages"):
        allocator.reserve("a", 1)


def test_take_changed_reports_pages_replaced_after_a_rollback():
    allocator = PageAllocator(num_pages=14, page_size=1)
    allocator.reserve("a", 8)
    allocator.ensure("a", 8)
    assert allocator.take_changed("a") == 0
    mirror = list(allocator.page_table("a"))
    allocator.truncate("a", 2)  # frees 6 pages ...
    allocator.reserve("b", 6)
    allocator.ensure("b", 6)  # ... which b takes
    allocator.ensure("a", 8)  # a grows back onto other pages
    first = allocator.take_changed("a")
    assert first == 2
    mirror[first:] = allocator.page_table("a")[first:]
    assert mirror == allocator.page_table("a") and mirror[2:] != allocator.page_table("b")
    assert allocator.take_changed("a") == 8  # nothing changed since


def test_park_and_unpark_move_a_request_to_fresh_pages():
    allocator = PageAllocator(num_pages=10, page_size=2)
    allocator.add("a")
    allocator.ensure("a", 7)
    assert allocator.reserved_pages("a") is None and allocator.take_changed("a") == 0
    old = allocator.park("a")
    assert len(old) == 4 and allocator.num_free_pages == 6 and allocator.num_used_pages == 4  # in transit
    allocator.truncate("a", 5)  # a rollback read while it is away
    assert allocator.parked_length("a") == 5
    new = allocator.unpark("a")
    assert len(new) == 3 and not set(new) & set(old) and allocator.length("a") == 5
    assert allocator.take_changed("a") == 0  # the device row must be rewritten from its first page
    allocator.release(old)
    assert allocator.num_free_pages == 7 and allocator.peak_used_pages == 7
    allocator.check_invariants()
    with pytest.raises(OutOfPagesError, match="needs 13 more pages, 7 are free"):
        allocator.ensure("a", 31)
