"""Paged KV storage of SparseSpec: the page allocator and the transformers `Cache` built on it."""

from hf_sparsespec.cache.page_allocator import OutOfPagesError, PageAllocator
from hf_sparsespec.cache.paged_cache import HostKV, PagedLayer, SparseSpecCache

__all__ = ["HostKV", "OutOfPagesError", "PageAllocator", "PagedLayer", "SparseSpecCache"]
