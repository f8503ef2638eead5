"""mixed_attention: the attention of one unified-scheduler batch in one call.

Rows come ordered: the first `num_full_rows` rows (prefill chunks, verifications) attend fully and
causally (`paged_attention`); every later row is a draft step with one query that attends sparsely
(`sparse_draft_attention`). Tokens follow the row order, so draft tokens are the tail of the batch.
"""

from __future__ import annotations

import torch

from hf_sparsespec.kernels.paged_attention import paged_attention_ref
from hf_sparsespec.kernels.sparse_attention import sparse_draft_attention_ref


def mixed_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: torch.Tensor,  # [num_rows, max_pages] int32
    query_start: torch.Tensor,  # [num_rows + 1] int32
    context_lens: torch.Tensor,  # [num_rows] int32
    num_full_rows: int,
    recent_start: torch.Tensor,  # [num_rows] int32 (read for draft rows)
    selected: torch.Tensor,  # [num_slots, num_kv_heads, max_budget] int32
    selection_slot: torch.Tensor,  # [num_rows] int32 (read for draft rows)
    num_selected: torch.Tensor,  # [num_rows] int32 (read for draft rows)
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `(out [num_tokens, num_q_heads, head_dim], lse [num_tokens, num_q_heads] float32)`;
    the LSE of draft tokens is left at -inf (only verification rows need it)."""
    num_tokens, num_q_heads, _ = query.shape
    num_full_tokens = int(query_start[num_full_rows])
    out = torch.empty_like(query)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=query.device)
    if num_full_rows > 0:
        out[:num_full_tokens], lse[:num_full_tokens] = paged_attention_ref(
            query[:num_full_tokens],
            k_cache,
            v_cache,
            page_table[:num_full_rows],
            query_start[: num_full_rows + 1],
            context_lens[:num_full_rows],
            scale,
        )
    if num_tokens > num_full_tokens:
        out[num_full_tokens:] = sparse_draft_attention_ref(
            query[num_full_tokens:],
            k_cache,
            v_cache,
            page_table[num_full_rows:],
            context_lens[num_full_rows:],
            recent_start[num_full_rows:],
            selected,
            selection_slot[num_full_rows:],
            num_selected[num_full_rows:],
            scale,
        )
    return out, lse
