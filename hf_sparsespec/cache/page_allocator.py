"""PageAllocator: the free list of KV pages and every request's page table (host side, pure Python).

A request is added either with a reservation (`reserve`: its worst case is promised up front, the
`"reserve"` KV policy) or without one (`add`: it grows while pages are free, the `"dynamic"` policy,
where `kv_manager.KVManager` offloads requests when they run out). An offloaded request is *parked*:
its table is empty, its pages are *in transit* (a copy to the host may still read them) until
`release` hands them back to the free list, and the allocator remembers how many positions it held
(`parked_length`), shortened by any rollback that arrives meanwhile; `unpark` gives it fresh pages for
those positions.

Invariants (checked by `check_invariants`, property-tested):
- every page is exactly one of: free, owned by one request, in transit;
- a request that holds `n` token positions owns exactly `ceil(n / page_size)` pages, in position order;
  a parked request holds none;
- `reserve` never promises more pages than exist: the sum of reservations is at most `num_pages`,
  so a request that reserved its worst case never runs out mid-decode;
- `take_changed(request)` names the first page-table index that changed since the last call (a
  rollback or an offload frees pages that a later growth or restore may replace with others), so a
  device copy of the tables can be kept current by sending only those entries; `changed_requests`
  holds the requests for which it may name any (every other request's call would name its table's end).
"""

from __future__ import annotations

from collections.abc import Hashable


class OutOfPagesError(RuntimeError):
    """A request asked for more pages than are free."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"expected num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._reserved: dict[Hashable, int | None] = {}  # None: no promise (grows while pages are free)
        self._changed: dict[Hashable, int] = {}  # first table index changed since `take_changed`
        # the requests whose table changed since their last `take_changed` (others have nothing to send)
        self.changed_requests: set[Hashable] = set()
        self._parked: dict[Hashable, int] = {}  # offloaded request -> positions it holds on the host
        self._in_transit: set[int] = set()  # pages taken from parked requests, not yet released
        self.peak_used_pages = 0  # most pages owned or in transit at once

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_unreserved_pages(self) -> int:
        return self.num_pages - sum(n for n in self._reserved.values() if n is not None)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_table(self, request_id: Hashable) -> list[int]:
        return self._tables[request_id]

    def length(self, request_id: Hashable) -> int:
        return self._lengths[request_id]

    def num_pages_of(self, request_id: Hashable) -> int:
        return len(self._tables[request_id])

    def reserved_pages(self, request_id: Hashable) -> int | None:
        return self._reserved[request_id]

    def is_parked(self, request_id: Hashable) -> bool:
        return request_id in self._parked

    def parked_length(self, request_id: Hashable) -> int:
        return self._parked[request_id]

    def slot(self, request_id: Hashable, position: int) -> int:
        """Flat cache slot (`page * page_size + offset`) of a token position of the request."""
        page = self._tables[request_id][position // self.page_size]
        return page * self.page_size + position % self.page_size

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._tables

    # --- admission -----------------------------------------------------------------------------
    def can_reserve(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.num_unreserved_pages

    def reserve(self, request_id: Hashable, num_tokens: int) -> None:
        """Promise `request_id` room for `num_tokens` positions; pages are taken lazily by `ensure`."""
        needed = self.pages_for(num_tokens)
        if needed > self.num_unreserved_pages:
            raise OutOfPagesError(
                f"request {request_id!r} needs {needed} pages, {self.num_unreserved_pages} are unreserved"
            )
        self._register(request_id, needed)

    def add(self, request_id: Hashable) -> None:
        """Register `request_id` without a promise: `ensure` grows it while pages are free."""
        self._register(request_id, None)

    def _register(self, request_id: Hashable, reserved: int | None) -> None:
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds pages")
        self._reserved[request_id] = reserved
        self._tables[request_id] = []
        self._lengths[request_id] = 0
        self._changed[request_id] = 0

    # --- allocation ----------------------------------------------------------------------------
    def ensure(self, request_id: Hashable, num_tokens: int) -> None:
        """Grow the request to hold positions `0 .. num_tokens - 1` (never shrinks)."""
        assert request_id not in self._parked, f"request {request_id!r} is offloaded"
        table = self._tables[request_id]
        if num_tokens > len(table) * self.page_size:  # grows (most calls fit the pages they hold)
            needed = self.pages_for(num_tokens)
            reserved = self._reserved[request_id]
            if reserved is not None and needed > reserved:
                raise OutOfPagesError(f"request {request_id!r} needs {needed} pages but reserved {reserved}")
            grow = needed - len(table)
            if grow > len(self._free):
                raise OutOfPagesError(f"request {request_id!r} needs {grow} more pages, {len(self._free)} are free")
            for _ in range(grow):
                table.append(self._free.pop())
            self.changed_requests.add(request_id)
            self.peak_used_pages = max(self.peak_used_pages, self.num_used_pages)
        if num_tokens > self._lengths[request_id]:
            self._lengths[request_id] = num_tokens

    def truncate(self, request_id: Hashable, num_tokens: int) -> None:
        """Roll the request back to positions `0 .. num_tokens - 1`, freeing the pages past them (a
        parked request only forgets the positions past them)."""
        if request_id in self._parked:
            self._parked[request_id] = min(self._parked[request_id], num_tokens)
            return
        table = self._tables[request_id]
        keep = self.pages_for(num_tokens)
        if len(table) > keep:
            self._changed[request_id] = min(self._changed[request_id], keep)
            self.changed_requests.add(request_id)
        while len(table) > keep:
            self._free.append(table.pop())
        self._lengths[request_id] = min(self._lengths[request_id], num_tokens)

    def free(self, request_id: Hashable) -> None:
        """Release every page and the reservation of the request (a parked request's pages in transit
        are released separately, with `release`)."""
        table = self._tables.pop(request_id)
        self._free.extend(reversed(table))
        del self._lengths[request_id]
        del self._reserved[request_id]
        del self._changed[request_id]
        self.changed_requests.discard(request_id)
        self._parked.pop(request_id, None)

    # --- offload (host tier) -------------------------------------------------------------------
    def park(self, request_id: Hashable) -> list[int]:
        """Take every page from the request (it keeps its id and reservation) and return them, in
        position order; they stay in transit until `release`. The request remembers its length."""
        assert request_id not in self._parked, f"request {request_id!r} is already offloaded"
        pages = self._tables[request_id]
        self._parked[request_id] = self._lengths[request_id]
        self._tables[request_id] = []
        self._lengths[request_id] = 0
        self._changed[request_id] = 0
        self.changed_requests.add(request_id)
        self._in_transit.update(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        """Hand pages in transit back to the free list (once the copy that reads them is ordered
        before any later write to them)."""
        for page in pages:
            self._in_transit.remove(page)
        self._free.extend(reversed(pages))

    def unpark(self, request_id: Hashable) -> list[int]:
        """Give a parked request fresh pages for the positions it held; returns them (position order)."""
        length = self._parked[request_id]
        needed = self.pages_for(length)
        if needed > len(self._free):
            raise OutOfPagesError(f"request {request_id!r} needs {needed} pages to return, {len(self._free)} are free")
        del self._parked[request_id]
        self.ensure(request_id, length)
        return list(self._tables[request_id])

    def take_changed(self, request_id: Hashable) -> int:
        """The first index of the request's page table that may differ from what it was at the last
        call (entries before it are unchanged); the next call starts from the table's current end."""
        first = min(self._changed[request_id], len(self._tables[request_id]))
        self._changed[request_id] = len(self._tables[request_id])
        self.changed_requests.discard(request_id)
        return first

    def check_invariants(self) -> None:
        owned = [page for table in self._tables.values() for page in table]
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert not set(owned) & set(self._free), "a page is both owned and free"
        assert not set(owned) & self._in_transit, "a page is both owned and in transit"
        assert not self._in_transit & set(self._free), "a page is both in transit and free"
        assert len(owned) + len(self._free) + len(self._in_transit) == self.num_pages, "a page was lost"
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        for request_id, table in self._tables.items():
            assert len(table) == self.pages_for(self._lengths[request_id]), f"{request_id!r}: pages != length"
            reserved = self._reserved[request_id]
            assert reserved is None or len(table) <= reserved, f"{request_id!r}: beyond its reservation"
            assert request_id not in self._parked or not table, f"{request_id!r}: parked with pages"
        assert set(self._parked) <= set(self._tables), "a parked request is unknown"
        assert self.num_unreserved_pages >= 0, "over-reserved"
        assert self.peak_used_pages >= self.num_used_pages, "peak below current use"
