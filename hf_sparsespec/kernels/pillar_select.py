"""PillarAttn: score the keys of each verification block by the exact attention the verify pass
computed, and keep the top-B per (request, KV head) for the next round of drafts.

score(j) of row `r`, KV head `h` = mean over the row's queries and the GQA group's query heads of the
softmax probability `exp(scale * q . k_j - lse)`, for the keys older than the block
(`j < num_old_keys[r]`, which every query of the block sees). The selection holds the
`budgets[r]` best keys, as positions sorted ascending, padded with -1 up to `max_budget`.

Triton (`pillar_scores`): a second pass after the verify attention, as the reference implementation
does: it reloads Q and K (not V) and turns logits into exact probabilities with the attention's final
LSE. It cannot be fused into the attention pass: a probability needs the row's *final* LSE, known only
after every key (and every split) was seen, and keeping the raw logits (queries x heads x keys) would
move about as many bytes as K itself. One program per (row, KV head, chunk of keys); a row's packed
tile (its queries x the group's heads) usually fits one `tl.dot` tile, so each K block is read once
and reduced over all of the tile's rows in registers. No host syncs: the grid depends only on shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._attention_tile import LOG2E, dot_precision, launch_config
from hf_sparsespec.kernels._checks import (
    INDEX,
    check_cache_pair,
    check_query_heads,
    check_tensor,
    last_dim_contiguous,
    next_power_of_2,
)
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


@triton.jit
def _pillar_scores_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_rows, max_pages] int32
    query_start_ptr,  # [num_rows + 1] int32
    lse_ptr,  # [num_tokens, num_q_heads] fp32, natural log
    num_old_keys_ptr,  # [num_rows] int32
    scores_ptr,  # [num_rows, num_kv_heads, max_num_old_keys] fp32
    max_num_old_keys,
    stride_q_tok,
    stride_q_head,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_head,
    stride_pt_row,
    stride_lse_tok,
    stride_scores_row,
    stride_scores_head,
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KEYS_PER_PROGRAM: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    q0 = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q0
    num_old = tl.load(num_old_keys_ptr + row)
    num_old = tl.where(q_len > 0, num_old, 0)  # no queries: nothing is scored
    inv_count = 1.0 / tl.maximum(q_len * GROUP, 1).to(tl.float32)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    d_valid = offs_d < HEAD_DIM
    page_row_ptr = page_table_ptr + row.to(tl.int64) * stride_pt_row
    k_base = k_cache_ptr + kv_head * stride_cache_head
    score_row_ptr = scores_ptr + row.to(tl.int64) * stride_scores_row + kv_head * stride_scores_head
    key_lo = chunk * KEYS_PER_PROGRAM
    key_hi = tl.minimum(key_lo + KEYS_PER_PROGRAM, max_num_old_keys)
    num_q_tiles = tl.maximum(tl.cdiv(q_len, BLOCK_M // GROUP), 1)
    # Usually one query tile; with more, the chunk's partial sums wait in `scores` between tiles.
    for q_tile in range(0, num_q_tiles):
        tile_q = q_tile * (BLOCK_M // GROUP) + q_idx  # (BLOCK_M,) query of the row
        m_valid = (q_idx < BLOCK_M // GROUP) & (tile_q < q_len)  # rows past the last whole query: padding
        tok = (q0 + tile_q).to(tl.int64)
        q = tl.load(
            q_ptr + (tok * stride_q_tok + q_head * stride_q_head)[:, None] + offs_d[None, :],
            mask=m_valid[:, None] & d_valid[None, :],
            other=0.0,
        )  # Q: (BLOCK_M, BLOCK_D)
        lse2 = tl.load(lse_ptr + tok * stride_lse_tok + q_head, mask=m_valid, other=0.0) * 1.4426950408889634
        is_last = (q_tile + 1) * (BLOCK_M // GROUP) >= q_len
        for start in range(key_lo, key_hi, BLOCK_N):
            key = start + offs_n  # (BLOCK_N,) positions
            in_range = key < key_hi
            n_valid = key < num_old
            page = tl.load(page_row_ptr + key // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
            k_offs = (page * stride_cache_page + (key % PAGE_SIZE) * stride_cache_slot)[:, None] + offs_d[None, :]
            k = tl.load(k_base + k_offs, mask=n_valid[:, None] & d_valid[None, :], other=0.0)  # K: (BLOCK_N, BLOCK_D)
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # S: (BLOCK_M, BLOCK_N)
            p = tl.where(m_valid[:, None], tl.exp2(s - lse2[:, None]), 0.0)
            total = tl.sum(p, axis=0)  # (BLOCK_N,)
            if q_tile > 0:
                total += tl.load(score_row_ptr + key, mask=in_range & n_valid, other=0.0)
            total = tl.where(is_last, total * inv_count, total)
            total = tl.where(n_valid, total, float("-inf"))
            tl.store(score_row_ptr + key, total, mask=in_range)


def pillar_scores(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    lse: torch.Tensor,
    num_old_keys: torch.Tensor,
    max_num_old_keys: int,
    scale: float,
) -> torch.Tensor:
    """Triton `pillar_scores_ref`.

    Args:
        query: `[num_tokens, num_q_heads, head_dim]` (the verification rows' queries, query_start from 0).
        k_cache: `[num_pages, page_size, num_kv_heads, head_dim]`, query's dtype.
        page_table: `[num_rows, max_pages]` int32; query_start: `[num_rows + 1]` int32.
        lse: `[num_tokens, num_q_heads]` fp32, from `paged_attention`/`mixed_attention`.
        num_old_keys: `[num_rows]` int32 (each <= max_num_old_keys).
        max_num_old_keys: width of the result; scale: softmax scale.

    Returns:
        `scores [num_rows, num_kv_heads, max_num_old_keys]` fp32, -inf at `j >= num_old_keys[r]`.
    """
    check_cache_pair(k_cache)
    group = check_query_heads(query, k_cache)
    if query.dtype != k_cache.dtype:
        raise TypeError(f"query: expected the cache dtype {k_cache.dtype}, got {query.dtype}")
    device = query.device
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    check_tensor("page_table", page_table, ndim=2, dtypes=INDEX, device=device)
    num_rows = page_table.shape[0]
    check_tensor("query_start", query_start, dtypes=INDEX, device=device, shape=(num_rows + 1,))
    check_tensor("lse", lse, dtypes=(torch.float32,), device=device, shape=(num_tokens, num_q_heads))
    check_tensor("num_old_keys", num_old_keys, dtypes=INDEX, device=device, shape=(num_rows,))
    if not isinstance(max_num_old_keys, int) or max_num_old_keys < 0:
        raise ValueError(f"max_num_old_keys: expected an int >= 0, got {max_num_old_keys!r}")
    query, page_table, lse = last_dim_contiguous(query), last_dim_contiguous(page_table), last_dim_contiguous(lse)
    scores = torch.empty((num_rows, num_kv_heads, max_num_old_keys), dtype=torch.float32, device=device)
    if num_rows == 0 or max_num_old_keys == 0:
        return scores
    # The tile holds a whole verification block when the rows are even (k+1 queries each); from the
    # shapes alone, so no sync. Larger blocks loop over query tiles.
    mean_q = max(1, -(-num_tokens // num_rows))
    block_m = max(16, next_power_of_2(group), min(128, next_power_of_2(mean_q * group)))
    config = launch_config("score", head_dim)
    keys_per_program = config["KEYS_PER_PROGRAM"]
    grid = (num_rows, num_kv_heads, triton.cdiv(max_num_old_keys, keys_per_program))
    _pillar_scores_kernel[grid](
        query, k_cache, page_table, query_start, lse, num_old_keys, scores, max_num_old_keys,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), lse.stride(0), scores.stride(0), scores.stride(1), scale * LOG2E,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], BLOCK_D=triton.next_power_of_2(head_dim),
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], KEYS_PER_PROGRAM=keys_per_program,
        INPUT_PRECISION=dot_precision(query.dtype), num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return scores


def pillar_select(
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
    """Triton scores then `select_top_keys`: `[num_rows, num_kv_heads, max_budget]` int32 positions (-1 padded)."""
    scores = pillar_scores(query, k_cache, page_table, query_start, lse, num_old_keys, max_num_old_keys, scale)
    return select_top_keys(scores, budgets, max_budget)
