"""PillarAttn: score the keys of each verification block by the exact attention the verify pass
computed, and keep the top-B per (request, KV head) for the next round of drafts.

score(j) of row `r`, KV head `h` = mean over the row's queries and the GQA group's query heads of the
softmax probability `exp(scale * q . k_j - lse)`, for the keys older than the block
(`j < num_old_keys[r]`, which every query of the block sees). The selection holds the
`budgets[r]` best keys, as positions sorted ascending, padded with -1 up to `max_budget`.
"""

from __future__ import annotations

import torch

from hf_sparsespec.kernels._paging import gather_context


def pillar_scores_ref(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: torch.Tensor,  # [num_rows, max_pages] int32
    query_start: torch.Tensor,  # [num_rows + 1] int32
    lse: torch.Tensor,  # [num_tokens, num_q_heads] float32, from paged_attention
    num_old_keys: torch.Tensor,  # [num_rows] int32, keys older than the row's query block
    max_num_old_keys: int,
    scale: float,
) -> torch.Tensor:
    """Reference: returns `scores [num_rows, num_kv_heads, max_num_old_keys]` float32; entries at
    `j >= num_old_keys[r]` are -inf."""
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_rows = page_table.shape[0]
    scores = torch.full(
        (num_rows, num_kv_heads, max_num_old_keys), float("-inf"), dtype=torch.float32, device=query.device
    )
    starts = query_start.tolist()
    for row, n_old in enumerate(num_old_keys.tolist()):
        q0, q1 = starts[row], starts[row + 1]
        if n_old == 0 or q1 == q0:
            continue
        q = query[q0:q1].float().view(q1 - q0, num_kv_heads, group, head_dim)
        k = gather_context(k_cache, page_table[row], n_old).float()  # [n_old, kvh, d]
        logits = torch.einsum("qhgd,khd->qhgk", q, k) * scale
        row_lse = lse[q0:q1].view(q1 - q0, num_kv_heads, group)
        probs = torch.exp(logits - row_lse[..., None])
        scores[row, :, :n_old] = probs.mean(dim=(0, 2))
    return scores


def select_top_keys(
    scores: torch.Tensor,  # [num_rows, num_kv_heads, width] float32, -inf = not selectable
    budgets: torch.Tensor,  # [num_rows] int32, keys to keep per row (<= selectable keys)
    max_budget: int,
) -> torch.Tensor:
    """Top-`budgets[r]` positions per (row, KV head), sorted ascending, padded with -1 to `max_budget`.

    Runs on device without host syncs (shared by every backend).
    """
    num_rows, num_kv_heads, width = scores.shape
    if width < max_budget:
        scores = torch.nn.functional.pad(scores, (0, max_budget - width), value=float("-inf"))
    top = scores.topk(max_budget, dim=-1, sorted=True).indices  # [rows, kvh, max_budget], best first
    rank = torch.arange(max_budget, device=scores.device)
    keep = rank[None, None, :] < budgets.to(scores.device)[:, None, None]
    sentinel = torch.iinfo(torch.int32).max
    top = torch.where(keep, top, sentinel).sort(dim=-1).values
    return torch.where(top == sentinel, -1, top).to(torch.int32)


def pillar_select_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    lse: torch.Tensor,
    num_old_keys: torch.Tensor,
    budgets: torch.Tensor,
    max_num_old_keys: int,
    max_budget: int,
    scale: float,
) -> torch.Tensor:
    """Scores then selection: `[num_rows, num_kv_heads, max_budget]` int32 positions (-1 padded)."""
    scores = pillar_scores_ref(query, k_cache, page_table, query_start, lse, num_old_keys, max_num_old_keys, scale)
    return select_top_keys(scores, budgets, max_budget)
