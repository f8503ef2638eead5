"""sparse_draft_attention: one draft query per request against its selected keys plus its recent window.

Row `r` (a draft step) attends, for KV head `h`, the positions
`selected[selection_slot[r], h, :num_selected[r]]` (all older than `recent_start[r]`) and every
position in `recent_start[r] .. context_lens[r] - 1` (everything written since the last
verification, the current token included). A row with `recent_start = 0, num_selected = 0` is dense.
"""

from __future__ import annotations

import torch

from hf_sparsespec.kernels._paging import gather_positions


def sparse_draft_attention_ref(
    query: torch.Tensor,  # [num_rows, num_q_heads, head_dim], one query per row
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: torch.Tensor,  # [num_rows, max_pages] int32
    context_lens: torch.Tensor,  # [num_rows] int32
    recent_start: torch.Tensor,  # [num_rows] int32
    selected: torch.Tensor,  # [num_slots, num_kv_heads, max_budget] int32, positions (the layer's store)
    selection_slot: torch.Tensor,  # [num_rows] int32, row -> slot of `selected`
    num_selected: torch.Tensor,  # [num_rows] int32
    scale: float,
) -> torch.Tensor:
    """Reference (and CPU backend): returns `out [num_rows, num_q_heads, head_dim]` in query.dtype."""
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    rows = zip(context_lens.tolist(), recent_start.tolist(), selection_slot.tolist(), num_selected.tolist())
    for row, (ctx, recent, slot, count) in enumerate(rows):
        recent_pos = torch.arange(recent, ctx, device=query.device)
        positions = torch.cat(
            [selected[slot, :, :count].long(), recent_pos[None, :].expand(num_kv_heads, -1)], dim=1
        )  # [kvh, n]
        k = gather_positions(k_cache, page_table[row], positions).float()  # [kvh, n, d]
        v = gather_positions(v_cache, page_table[row], positions).float()
        q = query[row].float().view(num_kv_heads, group, head_dim)
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, k) * scale, dim=-1)
        out[row] = torch.einsum("hgn,hnd->hgd", probs, v).reshape(num_q_heads, head_dim).to(query.dtype)
    return out
