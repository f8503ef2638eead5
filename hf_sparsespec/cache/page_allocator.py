"""PageAllocator: the free list of KV pages and every request's page table (host side, pure Python).

Invariants (checked by `check_invariants`, property-tested):
- every page is either free or owned by exactly one request;
- a request that holds `n` token positions owns exactly `ceil(n / page_size)` pages, in position order;
- `reserve` never promises more pages than exist: the sum of reservations is at most `num_pages`,
  so a request that reserved its worst case never runs out mid-decode;
- `take_changed(request)` names the first page-table index that changed since the last call (a
  rollback frees pages that a later growth may replace with others), so a device copy of the
  tables can be kept current by sending only those entries.
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
        self._reserved: dict[Hashable, int] = {}
        self._changed: dict[Hashable, int] = {}  # first table index changed since `take_changed`

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_unreserved_pages(self) -> int:
        return self.num_pages - sum(self._reserved.values())

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_table(self, request_id: Hashable) -> list[int]:
        return self._tables[request_id]

    def length(self, request_id: Hashable) -> int:
        return self._lengths[request_id]

    def reserved_pages(self, request_id: Hashable) -> int:
        return self._reserved[request_id]

    def slot(self, request_id: Hashable, position: int) -> int:
        """Flat cache slot (`page * page_size + offset`) of a token position of the request."""
        page = self._tables[request_id][position // self.page_size]
        return page * self.page_size + position % self.page_size

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._tables

    # --- reservation (admission control) -------------------------------------------------------
    def can_reserve(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.num_unreserved_pages

    def reserve(self, request_id: Hashable, num_tokens: int) -> None:
        """Promise `request_id` room for `num_tokens` positions; pages are taken lazily by `ensure`."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds pages")
        needed = self.pages_for(num_tokens)
        if needed > self.num_unreserved_pages:
            raise OutOfPagesError(
                f"request {request_id!r} needs {needed} pages, {self.num_unreserved_pages} are unreserved"
            )
        self._reserved[request_id] = needed
        self._tables[request_id] = []
        self._lengths[request_id] = 0
        self._changed[request_id] = 0

    # --- allocation ----------------------------------------------------------------------------
    def ensure(self, request_id: Hashable, num_tokens: int) -> None:
        """Grow the request to hold positions `0 .. num_tokens - 1` (never shrinks)."""
        table = self._tables[request_id]
        needed = self.pages_for(num_tokens)
        if needed > self._reserved[request_id]:
            raise OutOfPagesError(
                f"request {request_id!r} needs {needed} pages but reserved {self._reserved[request_id]}"
            )
        grow = needed - len(table)
        if grow > len(self._free):
            raise OutOfPagesError(f"request {request_id!r} needs {grow} more pages, {len(self._free)} are free")
        for _ in range(grow):
            table.append(self._free.pop())
        self._lengths[request_id] = max(self._lengths[request_id], num_tokens)

    def truncate(self, request_id: Hashable, num_tokens: int) -> None:
        """Roll the request back to positions `0 .. num_tokens - 1`, freeing the pages past them."""
        table = self._tables[request_id]
        keep = self.pages_for(num_tokens)
        if len(table) > keep:
            self._changed[request_id] = min(self._changed[request_id], keep)
        while len(table) > keep:
            self._free.append(table.pop())
        self._lengths[request_id] = min(self._lengths[request_id], num_tokens)

    def free(self, request_id: Hashable) -> None:
        """Release every page and the reservation of the request."""
        table = self._tables.pop(request_id)
        self._free.extend(reversed(table))
        del self._lengths[request_id]
        del self._reserved[request_id]
        del self._changed[request_id]

    def take_changed(self, request_id: Hashable) -> int:
        """The first index of the request's page table that may differ from what it was at the last
        call (entries before it are unchanged); the next call starts from the table's current end."""
        first = min(self._changed[request_id], len(self._tables[request_id]))
        self._changed[request_id] = len(self._tables[request_id])
        return first

    def check_invariants(self) -> None:
        owned = [page for table in self._tables.values() for page in table]
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert not set(owned) & set(self._free), "a page is both owned and free"
        assert len(owned) + len(self._free) == self.num_pages, "a page was lost"
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        for request_id, table in self._tables.items():
            assert len(table) == self.pages_for(self._lengths[request_id]), f"{request_id!r}: pages != length"
            assert len(table) <= self._reserved[request_id], f"{request_id!r}: beyond its reservation"
        assert sum(self._reserved.values()) <= self.num_pages, "over-reserved"
