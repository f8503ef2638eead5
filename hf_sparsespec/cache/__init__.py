"""Paged KV storage of SparseSpec: the page allocator, the transformers `Cache` built on it, and its host tier."""

from hf_sparsespec.cache.host_tier import HostKV, HostMemoryError, HostTier
from hf_sparsespec.cache.page_allocator import OutOfPagesError, PageAllocator
from hf_sparsespec.cache.paged_cache import PagedLayer, SparseSpecCache

__all__ = ["HostKV", "HostMemoryError", "HostTier", "OutOfPagesError", "PageAllocator", "PagedLayer", "SparseSpecCache"]
