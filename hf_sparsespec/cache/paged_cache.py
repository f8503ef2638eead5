"""SparseSpecCache: the transformers `Cache` that holds every request's KV in pages.

Storage (per layer, one `PagedLayer` each):

    keys / values   [num_pages, page_size, num_kv_heads, head_dim]
                     page 0   page 1   page 2   ...
    request A   ->  [  7   ,   2   ,   9  ]      page table: positions 0..page_size-1 in page 7, ...
    request B   ->  [  0   ,   4  ]

and, shared by all layers:

    selected        [num_layers, num_slots, num_kv_heads, max_budget] int32
                     PillarAttn's selected-index store: token *positions* (not slots), so a request's
                     selection stays valid when its pages move (rollback, host offload).

Invariants:
- a request's positions `0 .. length-1` live in its page table (`PageAllocator`); a rollback only
  shortens the table: the pages past the committed length go back to the free list, nothing moves;
- the K/V of a position is written by `update` during a forward, at the slot the active step's
  `slot_mapping` names; a verification overwrites what the drafts wrote at the same positions;
- `offload_request` + `restore_request` is a bit-exact round trip of a request's K/V (new pages,
  same positions).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_sparsespec.cache.page_allocator import PageAllocator


class PagedLayer(CacheLayerMixin):
    """One model layer's pages. `keys`/`values` are the page pools, allocated up front."""

    is_compileable = False
    is_sliding = False

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype, self.device = dtype, torch.device(device)
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


@dataclass
class HostKV:
    """A request's K/V moved to host memory: `[num_layers, length, num_kv_heads, head_dim]` each."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int


class SparseSpecCache(Cache):
    """Paged KV cache of SparseSpec requests, shared by every request of an engine.

    Args:
        num_layers, num_kv_heads, head_dim, dtype, device: the model's KV geometry.
        num_pages, page_size: the page pool of each layer.
        num_slots: requests that can hold a selection at once (the engine's device slots).
        max_budget: the most keys a selection can hold per (layer, KV head).
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
    ) -> None:
        layers = [PagedLayer(num_pages, page_size, num_kv_heads, head_dim, dtype, device) for _ in range(num_layers)]
        super().__init__(layers=layers)
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.allocator = PageAllocator(num_pages, page_size)
        self.selected = torch.full(
            (num_layers, num_slots, num_kv_heads, max_budget), -1, dtype=torch.int32, device=device
        )
        self._offloaded_reservations: dict[Hashable, int] = {}
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
        layer = self.layers[layer_idx]
        key, value = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        if step.compiled:
            from hf_sparsespec import ops

            ops.store_kv(key, value, layer.keys, layer.values, step.slot_mapping, step.backend.name)
        else:
            step.backend.store_kv(key, value, layer.keys, layer.values, step.slot_mapping)
        return key_states, value_states

    # --- host tier: whole requests out and back --------------------------------------------------
    def offload_request(self, request_id: Hashable) -> HostKV:
        """Copy a request's K/V to (pinned, where possible) host memory and free its pages."""
        length = self.allocator.length(request_id)
        pages = torch.tensor(self.allocator.page_table(request_id), dtype=torch.long, device=self.layers[0].keys.device)
        pin = self.layers[0].keys.device.type == "cuda"

        def take(pool: str) -> torch.Tensor:
            rows = torch.stack([getattr(layer, pool)[pages].flatten(0, 1)[:length] for layer in self.layers])
            return rows.to("cpu").pin_memory() if pin else rows.clone()

        host = HostKV(keys=take("keys"), values=take("values"), length=length)
        self._offloaded_reservations[request_id] = self.allocator.reserved_pages(request_id)
        self.allocator.free(request_id)
        return host

    def restore_request(self, request_id: Hashable, host: HostKV) -> None:
        """Bring an offloaded request back into fresh pages (same positions, bit-exact)."""
        reserved_pages = self._offloaded_reservations.pop(request_id)
        self.allocator.reserve(request_id, reserved_pages * self.page_size)
        self.allocator.ensure(request_id, host.length)
        device = self.layers[0].keys.device
        slots = torch.tensor(
            [self.allocator.slot(request_id, p) for p in range(host.length)], dtype=torch.long, device=device
        )
        for index, layer in enumerate(self.layers):
            layer.keys.view(-1, self.num_kv_heads, self.head_dim)[slots] = host.keys[index].to(device, non_blocking=True)
            layer.values.view(-1, self.num_kv_heads, self.head_dim)[slots] = host.values[index].to(device, non_blocking=True)
