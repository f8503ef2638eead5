"""SparseSpecCache: the transformers `Cache` that holds every request's KV in pages.

Storage (per layer, one `PagedLayer` each):

    keys / values   [num_pages, page_size, num_kv_heads, head_dim]
                     page 0   page 1   page 2   ...
    request A   ->  [  7   ,   2   ,   9  ]      page table: positions 0..page_size-1 in page 7, ...
    request B   ->  [  0   ,   4  ]

(each layer's a view of `key_pool` / `value_pool` `[num_layers, num_pages, page_size, num_kv_heads,
head_dim]`) and, shared by all layers:

    selected        [num_layers, num_slots, num_kv_heads, max_budget] int32
                     PillarAttn's selected-index store: token *positions* (not slots), so a request's
                     selection stays valid when its pages move (rollback, host offload).
    moved_offsets   [num_layers, num_slots, num_kv_heads, num_moved] int32 (the `"diagonal"` selection)
                     each slot's moved-key offsets (key - query position), written by its verifications
                     (`kernels/moved_keys.py`); relative, so valid wherever the pages go, like `selected`.

Invariants:
- a request's positions `0 .. length-1` live in its page table (`PageAllocator`); a rollback only
  shortens the table: the pages past the committed length go back to the free list, nothing moves;
- the K/V of a position is written by `update` during a forward, at the slot the active step's
  `slot_mapping` names; a verification overwrites what the drafts wrote at the same positions;
- `offload_request` + `restore_request` is a bit-exact round trip of a request's K/V (new pages,
  same positions), through the host tier (`host_tier.HostTier`: pinned chunks, a copy stream); the
  engine's `KVManager` drives the same copies without waiting for them.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_sparsespec.cache.host_tier import HostKV, HostTier
from hf_sparsespec.cache.page_allocator import PageAllocator
from hf_sparsespec.kernels.moved_keys import NO_OFFSET


class PagedLayer(CacheLayerMixin):
    """One model layer's pages: `keys`/`values` `[num_pages, page_size, num_kv_heads, head_dim]`, this
    layer's views of the cache's pools (allocated up front)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError("PagedLayer is written through SparseSpecCache.update during an engine step")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()


class SparseSpecCache(Cache):
    """Paged KV cache of SparseSpec requests, shared by every request of an engine.

    Args:
        num_layers, num_kv_heads, head_dim, dtype, device: the model's KV geometry.
        num_pages, page_size: the page pool of each layer.
        num_slots: requests that can hold a selection at once (the engine's device slots).
        max_budget: the most keys a selection can hold per (layer, KV head).
        num_moved: moved-key entries per (layer, slot, KV head), `(k + 1) x group` for the diagonal
            selection; 0: no store (`moved_offsets` is None).
        host_pool_bytes: the most host memory offloaded requests may hold (pinned on CUDA).
        offload_chunk_tokens: token positions per host chunk (the unit of the offload copies).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        num_slots: int,
        max_budget: int,
        dtype: torch.dtype,
        device: torch.device | str,
        host_pool_bytes: int = 2**30,
        offload_chunk_tokens: int = 1024,
        num_moved: int = 0,
    ) -> None:
        # every layer's pages in one allocation, each layer's a view: one launch can read every layer's
        # keys (`pillar_select.pillar_scores_into` over `key_pool`, `SparseSpecConfig.score_after_forward`)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.key_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.value_pool = torch.zeros(shape, dtype=dtype, device=device)
        super().__init__(layers=[PagedLayer(self.key_pool[i], self.value_pool[i]) for i in range(num_layers)])
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.allocator = PageAllocator(num_pages, page_size)
        self.selected = torch.full(
            (num_layers, num_slots, num_kv_heads, max_budget), -1, dtype=torch.int32, device=device
        )
        self.moved_offsets = None
        if num_moved:
            shape = (num_layers, num_slots, num_kv_heads, num_moved)
            self.moved_offsets = torch.full(shape, NO_OFFSET, dtype=torch.int32, device=device)
        self.host = HostTier(self, offload_chunk_tokens, host_pool_bytes)
        self.active_step = None  # the StepBatch of the forward in flight, set by `Engine` around it

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's new K/V (`[1, num_kv_heads, num_tokens, head_dim]`) at the active step's
        slots; returns the inputs unchanged (the attention reads the pages, not these)."""
        step = self.active_step
        if step is None:
            raise RuntimeError(
                "SparseSpecCache is only written inside an hf_sparsespec engine step; "
                "use model.generate(..., generation_strategy='sparsespec')"
            )
        key, value = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        if step.compiled:  # the pools and the layer's index: no per-layer view in the compiled graph
            from hf_sparsespec import ops

            ops.store_kv(key, value, self.key_pool, self.value_pool, layer_idx, step.slot_mapping, step.backend.name)
        else:
            layer = self.layers[layer_idx]
            step.backend.store_kv(key, value, layer.keys, layer.values, step.slot_mapping)
        return key_states, value_states

    # --- host tier: whole requests out and back --------------------------------------------------
    def offload_request(self, request_id: Hashable) -> HostKV:
        """Copy a request's K/V to the host pool and free its pages; the request stays known to the
        allocator (parked). Waits for the copy (the engine's `KVManager` does not)."""
        length = self.allocator.length(request_id)
        pages = self.allocator.park(request_id)
        host = self.host.offload(pages, length)
        host.offload.wait()
        self.allocator.release(pages)
        return host

    def restore_request(self, request_id: Hashable, host: HostKV) -> None:
        """Bring an offloaded request back into fresh pages (same positions, bit-exact) and return its
        host chunks to the pool. Waits for the copy."""
        pages = self.allocator.unpark(request_id)
        self.host.restore(host, pages).wait()
        self.host.release(host)
