"""mixed_attention: the attention of one unified-scheduler batch in one call.

Rows come ordered: the first `num_full_rows` rows (prefill chunks, verifications) attend fully and
causally (`paged_attention`); every later row is a draft step with one query that attends sparsely
(`sparse_draft_attention`). Tokens follow the row order, so draft tokens are the tail of the batch.

Triton: ONE launch over the plan's work items `(row, query tile, key split) x KV head`, full and
draft items mixed, longest first, so the two kinds of rows share the machine instead of running one
after the other; then at most one merge launch for the split tiles. A program branches on its row
kind: full rows use a `block_m_full` tile (e.g. 64 rows for 9 queries x 6 heads) and the causal mask,
draft rows a 16-row tile over their selected (+ moved, `"diagonal"`) + recent keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._attention_tile import LOG2E, dot_precision, launch_config, merge_splits
from hf_sparsespec.kernels._checks import check_cache_pair, check_query_heads, last_dim_contiguous
from hf_sparsespec.kernels.attention_plan import AttentionPlan, plan_attention
from hf_sparsespec.kernels.paged_attention import _full_item, check_rows, paged_attention_ref
from hf_sparsespec.kernels.sparse_attention import (
    _draft_item,
    check_draft_rows,
    moved_key_args,
    sparse_draft_attention_ref,
)


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
    offsets: torch.Tensor | None = None,  # [num_slots, num_kv_heads, num_moved] int32 (`"diagonal"`)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `(out [num_tokens, num_q_heads, head_dim], lse [num_tokens, num_q_heads] float32)`;
    the LSE of draft tokens is left at -inf (only verification rows need it). Rows past the full
    ones with a context of 0 are padding (their tokens' outputs are 0), as are tokens of no row."""
    num_tokens, num_q_heads, _ = query.shape
    num_full_tokens = int(query_start[num_full_rows])
    out = torch.zeros_like(query)
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
    rows = [r for r, n in enumerate(context_lens.tolist()) if r >= num_full_rows and n > 0]
    if rows:
        rows = torch.tensor(rows, device=query.device)
        tokens = query_start[rows].long()
        out[tokens] = sparse_draft_attention_ref(
            query[tokens],
            k_cache,
            v_cache,
            page_table[rows],
            context_lens[rows],
            recent_start[rows],
            selected,
            selection_slot[rows],
            num_selected[rows],
            scale,
            offsets,
        )
    return out, lse


@triton.jit
def _mixed_attention_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_rows, max_pages] int32
    query_start_ptr,  # [num_rows + 1] int32
    context_lens_ptr,  # [num_rows] int32
    recent_start_ptr,  # [num_rows] int32
    selected_ptr,  # [num_slots, num_kv_heads, max_budget] int32
    selection_slot_ptr,  # [num_rows] int32
    num_selected_ptr,  # [num_rows] int32
    offsets_ptr,  # [num_slots, num_kv_heads, num_moved] int32 (MOVED)
    work_ptr,  # [num_work, 5] int32: row (-1 padding), q_begin (-1 draft), key_begin, key_end, part_row
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    lse_ptr,  # [num_tokens, num_q_heads] fp32
    part_out_ptr,  # [num_part_rows, num_q_heads, head_dim] fp32
    part_lse_ptr,  # [num_part_rows, num_q_heads] fp32
    stride_q_tok,
    stride_q_head,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_head,
    stride_pt_row,
    stride_sel_slot,
    stride_sel_head,
    stride_off_slot,
    stride_off_head,
    num_moved,
    stride_out_tok,
    stride_out_head,
    stride_lse_tok,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_M_FULL: tl.constexpr,
    BLOCK_N_FULL: tl.constexpr,
    BLOCK_M_DRAFT: tl.constexpr,
    BLOCK_N_DRAFT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    MOVED: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    item = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    row = tl.load(work_ptr + item * 5)
    q_begin = tl.load(work_ptr + item * 5 + 1)
    key_begin = tl.load(work_ptr + item * 5 + 2)
    key_end = tl.load(work_ptr + item * 5 + 3)
    part_row = tl.load(work_ptr + item * 5 + 4)
    if row >= 0:  # row -1: a padding item of a fixed grid
        if q_begin >= 0:  # a tile of a full (prefill / verification) row
            _full_item(
                q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, query_start_ptr, context_lens_ptr,
                out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, row, q_begin, key_begin, key_end, part_row, kv_head,
                stride_q_tok, stride_q_head, stride_cache_page, stride_cache_slot, stride_cache_head, stride_pt_row,
                stride_out_tok, stride_out_head, stride_lse_tok, qk_scale,
                GROUP, BLOCK_M_FULL, BLOCK_N_FULL, BLOCK_D, HEAD_DIM, PAGE_SIZE, INPUT_PRECISION,
            )  # fmt: skip
        else:  # q_begin -1: the query of a draft row
            _draft_item(
                q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, context_lens_ptr, recent_start_ptr, selected_ptr,
                selection_slot_ptr, num_selected_ptr, offsets_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                row, tl.load(query_start_ptr + row), key_begin, key_end, part_row, kv_head,
                stride_q_tok, stride_q_head, stride_cache_page, stride_cache_slot, stride_cache_head, stride_pt_row,
                stride_sel_slot, stride_sel_head, stride_off_slot, stride_off_head, num_moved,
                stride_out_tok, stride_out_head, stride_lse_tok, qk_scale,
                GROUP, BLOCK_M_DRAFT, BLOCK_N_DRAFT, BLOCK_D, HEAD_DIM, PAGE_SIZE, True, INPUT_PRECISION,
                MOVED, SEARCH_STEPS,
            )  # fmt: skip


def mixed_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    num_full_rows: int,
    recent_start: torch.Tensor,
    selected: torch.Tensor,
    selection_slot: torch.Tensor,
    num_selected: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `mixed_attention_ref`: one attention launch (+ one merge) for a whole unified batch.

    Args: as `mixed_attention_ref` (shapes there); `plan` is the step's `AttentionPlan` (made from the
    same lengths and `num_moved = offsets.shape[2]`); None plans here, reading the lengths back to
    the host (a sync).

    Returns:
        `(out [num_tokens, num_q_heads, head_dim] in query.dtype, lse [num_tokens, num_q_heads] fp32)`,
        the LSE of draft tokens -inf.
    """
    check_cache_pair(k_cache, v_cache)
    group = check_query_heads(query, k_cache)
    if query.dtype != k_cache.dtype:
        raise TypeError(f"query: expected the cache dtype {k_cache.dtype}, got {query.dtype}")
    device = query.device
    num_rows = check_rows(page_table, query_start, context_lens, device)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if not 0 <= num_full_rows <= num_rows:
        raise ValueError(f"num_full_rows: expected an int in [0, {num_rows}], got {num_full_rows}")
    check_draft_rows(num_rows, recent_start, selected, selection_slot, num_selected, num_kv_heads, device)
    moved = moved_key_args(offsets, selected, num_kv_heads)
    query, page_table = last_dim_contiguous(query), last_dim_contiguous(page_table)
    if plan is None:
        plan = plan_attention(
            query_start.tolist(), context_lens.tolist(), num_full_rows, num_selected.tolist(), recent_start.tolist(),
            group=group, num_kv_heads=num_kv_heads, device=device, num_moved=moved["num_moved"],
        )  # fmt: skip
    elif plan.group != group or plan.num_kv_heads != num_kv_heads:
        raise ValueError(
            f"plan: expected one made for group {group} and {num_kv_heads} KV heads, "
            f"got group {plan.group} and {plan.num_kv_heads}"
        )
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=device)
    lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=device)
    if plan.num_work == 0:
        return out, lse
    part_out, part_lse = plan.workspace(num_q_heads, head_dim, device)
    config = launch_config("mixed", head_dim, query.dtype)
    _mixed_attention_kernel[(plan.num_work, num_kv_heads)](
        query, k_cache, v_cache, page_table, query_start, context_lens, recent_start, selected, selection_slot,
        num_selected, moved["ptr"], plan.work, out, lse, part_out, part_lse,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), selected.stride(0), selected.stride(1), moved["stride_slot"], moved["stride_head"],
        moved["num_moved"], out.stride(0), out.stride(1), lse.stride(0), scale * LOG2E,
        GROUP=group, BLOCK_M_FULL=plan.block_m_full, BLOCK_N_FULL=config["BLOCK_N_FULL"],
        BLOCK_M_DRAFT=plan.block_m_draft, BLOCK_N_DRAFT=config["BLOCK_N_DRAFT"], BLOCK_D=triton.next_power_of_2(head_dim),
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], INPUT_PRECISION=dot_precision(query.dtype),
        MOVED=moved["MOVED"], SEARCH_STEPS=moved["SEARCH_STEPS"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    merge_splits(plan, part_out, part_lse, out, lse)
    return out, lse
