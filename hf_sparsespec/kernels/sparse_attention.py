"""sparse_draft_attention: one draft query per request against its selected keys plus its recent window.

Row `r` (a draft step) attends, for KV head `h`, the positions
`selected[selection_slot[r], h, :num_selected[r]]` (all older than `recent_start[r]`) and every
position in `recent_start[r] .. context_lens[r] - 1` (everything written since the last
verification, the current token included). A row with `recent_start = 0, num_selected = 0` is dense.
With `offsets` (the `"diagonal"` selection, `moved_keys.py`) it also attends its moved keys
`context_lens[r] - 1 + offsets[selection_slot[r], h, e]` that lie in `[0, recent_start[r])`, once each
(duplicates of each other or of a selected key are masked).

Triton: one program per (work item, KV head); a row's key list (selected, then recent) is split into
chunks of about equal size over the programs (`attention_plan.py`) and merged by `merge_splits`, so a
batch of 64-256 rows with only 2-3 KV heads still fills the GPU. The tile packs the GQA group's query
heads (padded to 16 rows for `tl.dot`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._attention_tile import (
    LOG2E,
    _attend_tile,
    _store_tile,
    dot_precision,
    launch_config,
    merge_splits,
)
from hf_sparsespec.kernels._checks import INDEX, check_cache_pair, check_query_heads, check_tensor, last_dim_contiguous
from hf_sparsespec.kernels._paging import gather_positions
from hf_sparsespec.kernels.attention_plan import AttentionPlan, plan_attention
from hf_sparsespec.kernels.moved_keys import moved_positions_ref


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
    offsets: torch.Tensor | None = None,  # [num_slots, num_kv_heads, num_moved] int32, moved-key offsets
) -> torch.Tensor:
    """Reference (and CPU backend): returns `out [num_rows, num_q_heads, head_dim]` in query.dtype."""
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    rows = zip(context_lens.tolist(), recent_start.tolist(), selection_slot.tolist(), num_selected.tolist())
    for row, (ctx, recent, slot, count) in enumerate(rows):
        recent_pos = torch.arange(recent, ctx, device=query.device)
        chosen = selected[slot, :, :count].long()
        parts, attend = [chosen, recent_pos[None, :].expand(num_kv_heads, -1)], None
        if offsets is not None:
            moved, keep = moved_positions_ref(offsets[slot], ctx - 1, recent, chosen)
            parts.insert(1, moved)
            attend = torch.cat([torch.ones_like(chosen, dtype=torch.bool), keep,
                                torch.ones_like(parts[-1], dtype=torch.bool)], dim=1)  # fmt: skip
        positions = torch.cat(parts, dim=1)  # [kvh, n]
        k = gather_positions(k_cache, page_table[row], positions).float()  # [kvh, n, d]
        v = gather_positions(v_cache, page_table[row], positions).float()
        q = query[row].float().view(num_kv_heads, group, head_dim)
        logits = torch.einsum("hgd,hnd->hgn", q, k) * scale
        if attend is not None:
            logits = logits.masked_fill(~attend[:, None, :], float("-inf"))
        # exp/sum rather than torch.softmax: on CPU, softmax of tiny tensors between other ops wakes the
        # OpenMP pool every call (~0.4 ms each with 2 threads), which dominated the reference backend
        probs = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        probs = probs / probs.sum(dim=-1, keepdim=True)
        out[row] = torch.einsum("hgn,hnd->hgd", probs, v).reshape(num_q_heads, head_dim).to(query.dtype)
    return out


@triton.jit
def _draft_item(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_rows, max_pages] int32
    context_lens_ptr,  # [num_rows] int32
    recent_start_ptr,  # [num_rows] int32
    selected_ptr,  # [num_slots, num_kv_heads, max_budget] int32
    selection_slot_ptr,  # [num_rows] int32
    num_selected_ptr,  # [num_rows] int32
    offsets_ptr,  # [num_slots, num_kv_heads, num_moved] int32 (MOVED)
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    lse_ptr,  # [num_tokens, num_q_heads] fp32
    part_out_ptr,  # [num_part_rows, num_q_heads, head_dim] fp32
    part_lse_ptr,  # [num_part_rows, num_q_heads] fp32
    row,
    token,  # the row's query token
    key_begin,
    key_end,
    part_row,
    kv_head,
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
    num_moved,  # moved-key entries per row (MOVED)
    stride_out_tok,  # out and the partials share these (both allocated contiguous)
    stride_out_head,
    stride_lse_tok,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    STORE_LSE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    MOVED: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """One work item of a draft row: its query against key indices [key_begin, key_end) of its list."""
    context_len = tl.load(context_lens_ptr + row)
    recent_start = tl.load(recent_start_ptr + row)
    slot = tl.load(selection_slot_ptr + row).to(tl.int64)
    num_sel = tl.load(num_selected_ptr + row)
    # a plan may give a row more keys than it has (room for a speculative row's shift): clamp
    key_end = tl.minimum(key_end, num_sel + num_moved + context_len - recent_start)
    sel_row_ptr = selected_ptr + slot * stride_sel_slot + kv_head * stride_sel_head
    moved_row_ptr = offsets_ptr + slot * stride_off_slot + kv_head * stride_off_head
    out, lse = _attend_tile(
        q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr + row.to(tl.int64) * stride_pt_row, sel_row_ptr,
        moved_row_ptr, stride_q_tok, stride_q_head, stride_cache_page, stride_cache_slot, stride_cache_head,
        token, 1, context_len - 1, kv_head, key_begin, key_end, num_sel, recent_start, num_moved, qk_scale,
        GROUP, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE_SIZE, True, INPUT_PRECISION, MOVED, SEARCH_STEPS,
    )  # fmt: skip
    if part_row < 0:
        _store_tile(
            out, lse, out_ptr, lse_ptr, stride_out_tok, stride_out_head, stride_lse_tok, token, 1,
            kv_head, 1, GROUP, BLOCK_M, BLOCK_D, HEAD_DIM, STORE_LSE,
        )  # fmt: skip
    else:
        _store_tile(
            out, lse, part_out_ptr, part_lse_ptr, stride_out_tok, stride_out_head, stride_lse_tok, part_row, 1,
            kv_head, 0, GROUP, BLOCK_M, BLOCK_D, HEAD_DIM, True,
        )  # fmt: skip


@triton.jit
def _sparse_draft_attention_kernel(
    q_ptr,  # [num_rows, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_rows, max_pages] int32
    context_lens_ptr,  # [num_rows] int32
    recent_start_ptr,  # [num_rows] int32
    selected_ptr,  # [num_slots, num_kv_heads, max_budget] int32
    selection_slot_ptr,  # [num_rows] int32
    num_selected_ptr,  # [num_rows] int32
    offsets_ptr,  # [num_slots, num_kv_heads, num_moved] int32 (MOVED)
    work_ptr,  # [num_work, 5] int32: row, q_begin (0), key_begin, key_end, part_row
    out_ptr,  # [num_rows, num_q_heads, head_dim]
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    key_begin = tl.load(work_ptr + item * 5 + 2)
    key_end = tl.load(work_ptr + item * 5 + 3)
    part_row = tl.load(work_ptr + item * 5 + 4)
    if row >= 0:  # row -1: a padding item of a fixed grid
        _draft_item(
            q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, context_lens_ptr, recent_start_ptr, selected_ptr,
            selection_slot_ptr, num_selected_ptr, offsets_ptr, out_ptr, part_lse_ptr, part_out_ptr, part_lse_ptr,
            row, row, key_begin, key_end, part_row, kv_head,
            stride_q_tok, stride_q_head, stride_cache_page, stride_cache_slot, stride_cache_head, stride_pt_row,
            stride_sel_slot, stride_sel_head, stride_off_slot, stride_off_head, num_moved,
            stride_out_tok, stride_out_head, stride_lse_tok, qk_scale,
            GROUP, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE_SIZE, False, INPUT_PRECISION, MOVED, SEARCH_STEPS,
        )  # fmt: skip


def check_draft_rows(
    num_rows: int,
    recent_start: torch.Tensor,
    selected: torch.Tensor,
    selection_slot: torch.Tensor,
    num_selected: torch.Tensor,
    num_kv_heads: int,
    device: torch.device,
) -> None:
    check_tensor("recent_start", recent_start, dtypes=INDEX, device=device, shape=(num_rows,))
    check_tensor("selected", selected, ndim=3, dtypes=INDEX, device=device, shape=(None, num_kv_heads, None))
    if selected.stride(-1) != 1:
        raise ValueError(f"selected: expected a unit-stride last dimension, got strides {selected.stride()}")
    check_tensor("selection_slot", selection_slot, dtypes=INDEX, device=device, shape=(num_rows,))
    check_tensor("num_selected", num_selected, dtypes=INDEX, device=device, shape=(num_rows,))


SEARCH_STEPS_FLOOR = 16  # binary-search steps over a selection of up to 65,535 keys (a 1.3M-token context at 5 %)


def moved_key_args(offsets: torch.Tensor | None, selected: torch.Tensor, num_kv_heads: int) -> dict:
    """The draft kernels' moved-key arguments: `offsets [num_slots, num_kv_heads, num_moved]` int32
    (checked) or None (no moved keys)."""
    if offsets is None:
        return dict(ptr=selected, stride_slot=0, stride_head=0, num_moved=0, MOVED=False, SEARCH_STEPS=1)
    check_tensor("offsets", offsets, ndim=3, dtypes=(torch.int32,), device=selected.device,
                 shape=(selected.shape[0], num_kv_heads, None))  # fmt: skip
    if offsets.stride(-1) != 1:
        raise ValueError(f"offsets: expected a unit-stride last dimension, got strides {offsets.stride()}")
    num_moved = offsets.shape[2]
    # the binary search's steps are a constant, not the bit length of this call's selection width: that width
    # follows max_new_tokens, and every new bit length compiled both draft kernels again (~5 s each on the
    # H200, in the middle of a timed run: docs/measurements.md 11); steps past lo == hi change nothing
    search_steps = max(SEARCH_STEPS_FLOOR, selected.shape[2].bit_length())
    return dict(ptr=offsets, stride_slot=offsets.stride(0), stride_head=offsets.stride(1), num_moved=num_moved,
                MOVED=num_moved > 0, SEARCH_STEPS=search_steps)


def sparse_draft_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    recent_start: torch.Tensor,
    selected: torch.Tensor,
    selection_slot: torch.Tensor,
    num_selected: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton `sparse_draft_attention_ref`.

    Args:
        query: `[num_rows, num_q_heads, head_dim]` fp16/bf16/fp32, one query per row.
        k_cache, v_cache: `[num_pages, page_size, num_kv_heads, head_dim]`, query's dtype, same strides.
        page_table: `[num_rows, max_pages]` int32; context_lens, recent_start: `[num_rows]` int32.
        selected: `[num_slots, num_kv_heads, max_budget]` int32 positions; selection_slot,
            num_selected: `[num_rows]` int32.
        scale: softmax scale.
        plan: the work decomposition (`plan_attention` with `num_full_rows=0, num_moved=num_moved`);
            None plans here, reading the lengths back to the host (a sync).
        offsets: `[num_slots, num_kv_heads, num_moved]` int32 moved-key offsets (`"diagonal"`), or None.

    Returns:
        `out [num_rows, num_q_heads, head_dim]` in query.dtype.
    """
    check_cache_pair(k_cache, v_cache)
    group = check_query_heads(query, k_cache)
    if query.dtype != k_cache.dtype:
        raise TypeError(f"query: expected the cache dtype {k_cache.dtype}, got {query.dtype}")
    device = query.device
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    check_tensor("page_table", page_table, ndim=2, dtypes=INDEX, device=device, shape=(num_rows, None))
    check_tensor("context_lens", context_lens, dtypes=INDEX, device=device, shape=(num_rows,))
    check_draft_rows(num_rows, recent_start, selected, selection_slot, num_selected, num_kv_heads, device)
    moved = moved_key_args(offsets, selected, num_kv_heads)
    query, page_table = last_dim_contiguous(query), last_dim_contiguous(page_table)
    if plan is None:
        plan = plan_attention(
            list(range(num_rows + 1)), context_lens.tolist(), 0, num_selected.tolist(), recent_start.tolist(),
            group=group, num_kv_heads=num_kv_heads, device=device, num_moved=moved["num_moved"],
        )  # fmt: skip
    out = torch.empty((num_rows, num_q_heads, head_dim), dtype=query.dtype, device=device)
    if plan.num_work == 0:
        return out
    part_out, part_lse = plan.workspace(num_q_heads, head_dim, device)
    config = launch_config("draft", head_dim, query.dtype)
    _sparse_draft_attention_kernel[(plan.num_work, num_kv_heads)](
        query, k_cache, v_cache, page_table, context_lens, recent_start, selected, selection_slot, num_selected,
        moved["ptr"], plan.work, out, part_out, part_lse,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), selected.stride(0), selected.stride(1), moved["stride_slot"], moved["stride_head"],
        moved["num_moved"], out.stride(0), out.stride(1), part_lse.stride(0), scale * LOG2E,
        GROUP=group, BLOCK_M=plan.block_m_draft, BLOCK_N=config["BLOCK_N"], BLOCK_D=triton.next_power_of_2(head_dim),
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], INPUT_PRECISION=dot_precision(query.dtype),
        MOVED=moved["MOVED"], SEARCH_STEPS=moved["SEARCH_STEPS"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    if plan.num_merge:
        lse = torch.empty((num_rows, num_q_heads), dtype=torch.float32, device=device)  # draft LSE: unused
        merge_splits(plan, part_out, part_lse, out, lse)
    return out
