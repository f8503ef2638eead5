"""Shared helpers of the torch references: reading a request's keys/values out of the paged cache.

Layout everywhere: `k_cache`/`v_cache` are `[num_pages, page_size, num_kv_heads, head_dim]`; token
position `p` of a request lives in page `page_table[row, p // page_size]`, offset `p % page_size`.
"""

from __future__ import annotations

import torch


def gather_positions(cache: torch.Tensor, page_table_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of `cache` at the given token positions of one request.

    Args:
        cache: `[num_pages, page_size, num_kv_heads, head_dim]`.
        page_table_row: `[max_pages]` int32, the request's pages.
        positions: `[n]` or `[num_kv_heads, n]` int, token positions.

    Returns:
        `[n, num_kv_heads, head_dim]` for 1-D positions, `[num_kv_heads, n, head_dim]` for per-head positions.
    """
    page_size = cache.shape[1]
    positions = positions.long()
    pages = page_table_row.long()[positions // page_size]
    offsets = positions % page_size
    if positions.dim() == 1:
        return cache[pages, offsets]  # [n, kv_heads, d]
    heads = torch.arange(cache.shape[2], device=cache.device)[:, None].expand_as(positions)
    return cache[pages, offsets, heads]  # [kv_heads, n, d]


def gather_context(cache: torch.Tensor, page_table_row: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` token rows of one request: `[context_len, num_kv_heads, head_dim]`."""
    page_size = cache.shape[1]
    num_pages = -(-context_len // page_size)
    rows = cache[page_table_row[:num_pages].long()].flatten(0, 1)
    return rows[:context_len]
