"""Page-table and rollback invariants of the allocator under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sparsespec.cache import OutOfPagesError, PageAllocator

operations = st.lists(
    st.tuples(st.sampled_from(["reserve", "ensure", "truncate", "free", "sync"]), st.integers(0, 5), st.integers(0, 70)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 24), page_size=st.integers(1, 8), ops=operations)
def test_random_operations_keep_invariants(num_pages, page_size, ops):
    allocator = PageAllocator(num_pages, page_size)
    model: dict[int, int] = {}  # request -> length, the expected state
    mirror: dict[int, list[int]] = {}  # what a device copy kept current with `take_changed` holds
    for op, request, tokens in ops:
        if op == "reserve" and request not in model:
            if allocator.can_reserve(tokens):
                allocator.reserve(request, tokens)
                model[request] = 0
            else:
                with pytest.raises(OutOfPagesError):
                    allocator.reserve(request, tokens)
        elif op == "ensure" and request in model:
            if allocator.pages_for(tokens) <= allocator.reserved_pages(request):
                allocator.ensure(request, tokens)  # never fails within the reservation
                model[request] = max(model[request], tokens)
            else:
                with pytest.raises(OutOfPagesError):
                    allocator.ensure(request, tokens)
        elif op == "truncate" and request in model:
            allocator.truncate(request, tokens)
            model[request] = min(model[request], tokens)
        elif op == "free" and request in model:
            allocator.free(request)
            del model[request]
        allocator.check_invariants()
        for rid in list(mirror):
            if rid not in model:
                del mirror[rid]
        if op == "sync" and request in model:  # what an iteration sends to the device page table
            table, first = allocator.page_table(request), allocator.take_changed(request)
            copy = mirror.setdefault(request, [])
            copy[first:] = table[first:]
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
