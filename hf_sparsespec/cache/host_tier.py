"""HostTier: whole requests' K/V copied between the device pages and a host pool, in chunks, on a copy
stream.

    offload(pages, length) -> HostKV    device pages --gather--> staging --D2H--> pinned host chunks
    restore(host, pages)   -> Transfer  pinned host chunks --H2D--> staging --scatter--> device pages

A *chunk* holds `chunk_pages` pages of every layer's K and V: `[2, num_layers, chunk_pages, page_size,
num_kv_heads, head_dim]` (the last chunk of a request may be partly used). The pool hands out at most
`capacity_bytes // chunk_bytes` chunks, allocated (pinned, on CUDA) the first time they are needed and
recycled afterwards; an offload that does not fit raises `HostMemoryError`.

Ordering on CUDA (nothing here waits on the host):
- every copy runs on one dedicated stream, so chunk reuse, the staging buffer and an offload followed
  by a restore of the same chunks are ordered by the stream itself;
- a copy first waits for the compute stream (`wait_stream`): it sees every iteration launched before
  it (an offload reads the last K/V those iterations wrote; a restore writes pages that an earlier
  iteration may still have been reading or writing before they were freed);
- each transfer records an event after its last chunk. Pages an offload read may be written by others
  only after `Transfer.order_before_compute()` (the compute stream waits on that event) and pages a
  restore wrote may be read only after it, too. `done()` polls the event without blocking.
On CPU the copies run synchronously and a transfer is done when it returns.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch


class HostMemoryError(RuntimeError):
    """The host pool cannot take an offload (raise `SparseSpecConfig.host_pool_bytes`)."""


@dataclass
class Transfer:
    """Copies of one request in flight on the copy stream (`event` None: complete)."""

    event: torch.cuda.Event | None
    num_bytes: int
    device: torch.device | None = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def order_before_compute(self) -> None:
        """Make later work on the compute stream wait for this transfer (no host wait)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def wait(self) -> None:
        """Block the host until the transfer is complete (only when nothing else can run)."""
        if self.event is not None:
            self.event.synchronize()


@dataclass
class HostKV:
    """A request's K/V in host chunks: positions `0 .. length - 1`, in position order."""

    chunks: list[torch.Tensor]
    length: int
    offload: Transfer  # the copy that filled the chunks
    num_bytes: int = field(default=0)


class HostTier:
    """The host pool and the copy engine of one `SparseSpecCache` (see the module docstring).

    Args:
        cache: the `SparseSpecCache` whose layers' pages are copied.
        chunk_tokens: token positions per chunk (rounded down to whole pages, at least one page).
        capacity_bytes: the most host memory the pool may hold.
    """

    def __init__(self, cache, chunk_tokens: int, capacity_bytes: int) -> None:
        self.layers = cache.layers
        keys = cache.layers[0].keys
        self.device = keys.device
        self.page_size = cache.page_size
        self.chunk_pages = max(1, chunk_tokens // cache.page_size)
        self.chunk_shape = (2, len(cache.layers), self.chunk_pages, *keys.shape[1:])
        self.page_bytes = 2 * len(cache.layers) * keys[0].numel() * keys.element_size()
        self.chunk_bytes = self.chunk_pages * self.page_bytes
        self.capacity = max(0, capacity_bytes) // self.chunk_bytes  # chunks
        self._free_chunks: list[torch.Tensor] = []
        self._num_chunks = 0  # allocated so far
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: torch.Tensor | None = None

    # --- the pool ---------------------------------------------------------------------------------
    def chunks_for(self, num_pages: int) -> int:
        return -(-num_pages // self.chunk_pages)

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_chunks) + self.capacity - self._num_chunks

    def can_hold(self, num_pages: int) -> bool:
        return self.chunks_for(num_pages) <= self.num_free_chunks

    def _take_chunks(self, count: int) -> list[torch.Tensor]:
        if count > self.num_free_chunks:
            raise HostMemoryError(
                f"the host KV pool is full: an offload needs {count} chunks of {self.chunk_bytes / 2**20:.1f} MiB, "
                f"{self.num_free_chunks} of {self.capacity} are free ({self.capacity * self.chunk_bytes / 2**30:.2f} GiB "
                "in all); raise SparseSpecConfig.host_pool_bytes, lower max_num_requests, or give the device pool "
                "more pages (num_pages / gpu_memory_fraction)"
            )
        taken = [self._free_chunks.pop() for _ in range(min(count, len(self._free_chunks)))]
        while len(taken) < count:
            try:
                chunk = torch.empty(self.chunk_shape, dtype=self.layers[0].keys.dtype, pin_memory=self.cuda)
            except RuntimeError as error:
                self._free_chunks.extend(taken)
                raise HostMemoryError(
                    f"could not allocate {self.chunk_bytes / 2**20:.1f} MiB of {'pinned ' if self.cuda else ''}host "
                    f"memory for KV offload ({self._num_chunks} chunks held): {error}; lower "
                    "SparseSpecConfig.host_pool_bytes"
                ) from error
            self._num_chunks += 1
            taken.append(chunk)
        return taken

    def release(self, host: HostKV) -> None:
        """Return a request's chunks to the pool (copy-stream order makes reuse safe at once)."""
        self._free_chunks.extend(host.chunks)
        host.chunks = []

    # --- copies -----------------------------------------------------------------------------------
    def offload(self, pages: list[int], length: int) -> HostKV:
        """Copy `pages` (positions `0 .. length - 1` of a request, position order) to host chunks."""
        assert len(pages) == -(-length // self.page_size)
        chunks = self._take_chunks(self.chunks_for(len(pages)))
        num_bytes = len(pages) * self.page_bytes
        with self._copy_stream():
            for index, chunk in enumerate(chunks):
                ids = pages[index * self.chunk_pages : (index + 1) * self.chunk_pages]
                staging = self._staging_for(chunk)
                page_index = self._index(ids)
                for layer_index, layer in enumerate(self.layers):
                    torch.index_select(layer.keys, 0, page_index, out=staging[0, layer_index, : len(ids)])
                    torch.index_select(layer.values, 0, page_index, out=staging[1, layer_index, : len(ids)])
                if staging is not chunk:
                    chunk.copy_(staging, non_blocking=True)  # whole chunks: a contiguous D2H copy
        return HostKV(chunks, length, self._record(num_bytes), num_bytes)

    def restore(self, host: HostKV, pages: list[int]) -> Transfer:
        """Copy the first `len(pages)` pages of `host` into `pages` (fresh device pages)."""
        assert len(pages) <= len(host.chunks) * self.chunk_pages
        with self._copy_stream():
            for index in range(self.chunks_for(len(pages))):
                ids = pages[index * self.chunk_pages : (index + 1) * self.chunk_pages]
                chunk = host.chunks[index]
                staging = self._staging_for(chunk)
                if staging is not chunk:
                    staging.copy_(chunk, non_blocking=True)
                page_index = self._index(ids)
                for layer_index, layer in enumerate(self.layers):
                    layer.keys.index_copy_(0, page_index, staging[0, layer_index, : len(ids)])
                    layer.values.index_copy_(0, page_index, staging[1, layer_index, : len(ids)])
        return self._record(len(pages) * self.page_bytes)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _copy_stream(self):
        if self.stream is None:
            return nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after every launched iteration
        return torch.cuda.stream(self.stream)

    def _staging_for(self, chunk: torch.Tensor) -> torch.Tensor:
        """Where the gather/scatter kernels meet a chunk: the chunk itself on CPU, one device buffer
        (used only on the copy stream, allocated there) on CUDA."""
        if not self.cuda:
            return chunk
        if self._staging is None:
            self._staging = torch.empty(self.chunk_shape, dtype=chunk.dtype, device=self.device)
        return self._staging

    def _index(self, ids: list[int]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.long)
        if self.cuda:  # a pinned source: the caching host allocator keeps it until the copy ran
            index = index.pin_memory().to(self.device, non_blocking=True)
        return index

    def _record(self, num_bytes: int) -> Transfer:
        if self.stream is None:
            return Transfer(None, num_bytes)
        event = torch.cuda.Event()
        event.record(self.stream)
        return Transfer(event, num_bytes, self.device)
