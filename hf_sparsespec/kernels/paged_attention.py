"""paged_attention: causal attention of variable-length query blocks against each request's paged KV.

Serves prefill chunks and verification blocks (and dense decoding). Row `r` owns queries
`query_start[r]:query_start[r+1]`; they sit at the last `q_len` positions of its context, so query `i`
of the row (position `context_lens[r] - q_len + i`) attends keys `0 .. position` (bottom-right
aligned causal mask). GQA: query head `h` reads KV head `h // (num_q_heads // num_kv_heads)`.
Returns the output and the natural-log log-sum-exp of the scaled logits per (token, query head),
which PillarAttn scoring reuses.

Triton: one program per (work item, KV head) of an `AttentionPlan` (query tile x key split, see
`attention_plan.py`); split tiles are combined by `merge_splits`. All query heads of a KV head are
packed into one tile, so each K/V block is read once per KV head.
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
from hf_sparsespec.kernels._paging import gather_context
from hf_sparsespec.kernels.attention_plan import AttentionPlan, plan_from_tensors


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: torch.Tensor,  # [num_rows, max_pages] int32
    query_start: torch.Tensor,  # [num_rows + 1] int32
    context_lens: torch.Tensor,  # [num_rows] int32, keys visible to the row's last query
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (and CPU backend): returns `(out [num_tokens, num_q_heads, head_dim] in query.dtype,
    lse [num_tokens, num_q_heads] float32)`. Computed in float32."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=query.device)
    starts = query_start.tolist()
    for row, ctx in enumerate(context_lens.tolist()):
        q0, q1 = starts[row], starts[row + 1]
        if q1 == q0:
            continue
        q_len = q1 - q0
        q = query[q0:q1].float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        k = gather_context(k_cache, page_table[row], ctx).float().transpose(0, 1)  # [kvh, ctx, d]
        v = gather_context(v_cache, page_table[row], ctx).float().transpose(0, 1)
        logits = torch.einsum("hgqd,hkd->hgqk", q, k) * scale  # [kvh, g, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        allowed = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        logits = logits.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)  # [kvh, g, q_len]
        probs = torch.exp(logits - row_lse[..., None])
        row_out = torch.einsum("hgqk,hkd->qhgd", probs, v).reshape(q_len, num_q_heads, head_dim)
        out[q0:q1] = row_out.to(query.dtype)
        lse[q0:q1] = row_lse.permute(2, 0, 1).reshape(q_len, num_q_heads)
    return out, lse


@triton.jit
def _full_item(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_rows, max_pages] int32
    query_start_ptr,  # [num_rows + 1] int32
    context_lens_ptr,  # [num_rows] int32
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    lse_ptr,  # [num_tokens, num_q_heads] fp32
    part_out_ptr,  # [num_part_rows, num_q_heads, head_dim] fp32
    part_lse_ptr,  # [num_part_rows, num_q_heads] fp32
    row,
    q_begin,
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
    INPUT_PRECISION: tl.constexpr,
):
    """One work item of a full (causal) row: a tile of its queries against keys [key_begin, key_end)."""
    q0 = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q0
    context_len = tl.load(context_lens_ptr + row)
    num_q = tl.minimum(q_len - q_begin, BLOCK_M // GROUP)
    out, lse = _attend_tile(
        q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr + row.to(tl.int64) * stride_pt_row, page_table_ptr,
        page_table_ptr, stride_q_tok, stride_q_head, stride_cache_page, stride_cache_slot, stride_cache_head,
        q0 + q_begin, num_q, context_len - q_len + q_begin, kv_head, key_begin, key_end, 0, 0, 0, qk_scale,
        GROUP, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE_SIZE, False, INPUT_PRECISION,
    )  # fmt: skip
    if part_row < 0:
        _store_tile(
            out, lse, out_ptr, lse_ptr, stride_out_tok, stride_out_head, stride_lse_tok, q0 + q_begin, num_q,
            kv_head, 0, GROUP, BLOCK_M, BLOCK_D, HEAD_DIM, True,
        )  # fmt: skip
    else:
        _store_tile(
            out, lse, part_out_ptr, part_lse_ptr, stride_out_tok, stride_out_head, stride_lse_tok, part_row, num_q,
            kv_head, 0, GROUP, BLOCK_M, BLOCK_D, HEAD_DIM, True,
        )  # fmt: skip


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_rows, max_pages] int32
    query_start_ptr,  # [num_rows + 1] int32
    context_lens_ptr,  # [num_rows] int32
    work_ptr,  # [num_work, 5] int32: row, q_begin, key_begin, key_end, part_row
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
):
    item = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    row = tl.load(work_ptr + item * 5)
    q_begin = tl.load(work_ptr + item * 5 + 1)
    key_begin = tl.load(work_ptr + item * 5 + 2)
    key_end = tl.load(work_ptr + item * 5 + 3)
    part_row = tl.load(work_ptr + item * 5 + 4)
    if row >= 0:  # row -1: a padding item of a fixed grid
        _full_item(
            q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, query_start_ptr, context_lens_ptr,
            out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, row, q_begin, key_begin, key_end, part_row, kv_head,
            stride_q_tok, stride_q_head, stride_cache_page, stride_cache_slot, stride_cache_head, stride_pt_row,
            stride_out_tok, stride_out_head, stride_lse_tok, qk_scale,
            GROUP, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE_SIZE, INPUT_PRECISION,
        )  # fmt: skip


def check_rows(
    page_table: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor, device: torch.device
) -> int:
    """The row count, after checking the per-row metadata tensors."""
    check_tensor("page_table", page_table, ndim=2, dtypes=INDEX, device=device)
    num_rows = page_table.shape[0]
    check_tensor("query_start", query_start, dtypes=INDEX, device=device, shape=(num_rows + 1,))
    check_tensor("context_lens", context_lens, dtypes=INDEX, device=device, shape=(num_rows,))
    return num_rows


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `paged_attention_ref`.

    Args:
        query: `[num_tokens, num_q_heads, head_dim]` fp16/bf16/fp32.
        k_cache, v_cache: `[num_pages, page_size, num_kv_heads, head_dim]`, query's dtype, same strides.
        page_table: `[num_rows, max_pages]` int32.
        query_start: `[num_rows + 1]` int32; context_lens: `[num_rows]` int32.
        scale: softmax scale.
        plan: the work decomposition (`plan_attention` with every row full); None plans here,
            reading the lengths back to the host (a sync).

    Returns:
        `(out [num_tokens, num_q_heads, head_dim] in query.dtype, lse [num_tokens, num_q_heads] fp32)`.
    """
    check_cache_pair(k_cache, v_cache)
    group = check_query_heads(query, k_cache)
    if query.dtype != k_cache.dtype:
        raise TypeError(f"query: expected the cache dtype {k_cache.dtype}, got {query.dtype}")
    num_rows = check_rows(page_table, query_start, context_lens, query.device)
    query, page_table = last_dim_contiguous(query), last_dim_contiguous(page_table)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if plan is None:
        plan = plan_from_tensors(
            query_start, context_lens, num_rows, None, None, group=group, num_kv_heads=num_kv_heads
        )
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=query.device)
    if plan.num_work == 0:
        return out, lse
    part_out, part_lse = plan.workspace(num_q_heads, head_dim, query.device)
    config = launch_config("decode" if plan.block_m_full <= 16 else "full", head_dim, query.dtype)
    _paged_attention_kernel[(plan.num_work, num_kv_heads)](
        query, k_cache, v_cache, page_table, query_start, context_lens, plan.work, out, lse, part_out, part_lse,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), out.stride(0), out.stride(1), lse.stride(0), scale * LOG2E,
        GROUP=group, BLOCK_M=plan.block_m_full, BLOCK_N=config["BLOCK_N"], BLOCK_D=triton.next_power_of_2(head_dim),
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], INPUT_PRECISION=dot_precision(query.dtype),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    merge_splits(plan, part_out, part_lse, out, lse)
    return out, lse
