"""Device code shared by the attention kernels: one packed query tile against a range of keys, the
tile store, and the merge of split-KV partial results.

Packing (GQA): tile row `m` is query `m // GROUP` of the tile and query head `kv_head * GROUP + m % GROUP`,
so every query head that reads one KV head shares each K/V block that is loaded (a verify block of
9 queries x 6 heads is 54 rows of one 64-row tile). Keys are addressed by *key index*: for full rows
the index is the position; for draft rows (`SPARSE`) indices `< num_sel` are the selected positions,
then (`MOVED`, the diagonal selection) `num_moved` moved keys `query position + offset` (masked when
outside `[0, recent_start)` or selected; a list holds each offset once: `moved_keys.py`), and the
rest the recent window `recent_start + (index - num_sel - num_moved)`. Positions go through the row's page
table (`page_table[row, pos // PAGE_SIZE]`, offset `pos % PAGE_SIZE`) in int64.

Softmax runs online in base 2 (`qk_scale` already holds `log2(e)`); the LSE leaves in natural log.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` precision: exact fp32 products for fp32 inputs (the tests' fp32 tolerances need it)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _attend_tile(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_row_ptr,  # [max_pages] int32, this row's page table
    sel_ptr,  # [max_budget] int32, this row's selected positions for `kv_head` (read if SPARSE)
    moved_ptr,  # [num_moved] int32, this row's moved-key offsets for `kv_head` (read if MOVED)
    stride_q_tok,
    stride_q_head,
    stride_cache_page,  # k_cache and v_cache share their strides
    stride_cache_slot,
    stride_cache_head,
    q_tok0,  # token of the tile's first query
    num_q,  # queries in the tile
    first_q_pos,  # position of the tile's first query (causal mask of full rows)
    kv_head,
    key_begin,  # key indices [key_begin, key_end) of this program
    key_end,
    num_sel,  # selected keys (SPARSE)
    recent_start,  # first position of the recent window (SPARSE)
    num_moved,  # moved keys after the selected ones (MOVED)
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPARSE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    MOVED: tl.constexpr = False,
    SEARCH_STEPS: tl.constexpr = 1,  # binary-search steps over the selection (bit length of max_budget)
):
    """Returns `(out, lse)`: out (BLOCK_M, BLOCK_D) fp32 normalized over this program's keys, lse (BLOCK_M,)
    natural log (-inf where no key was visible)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = offs_m // GROUP  # (BLOCK_M,) query of the tile
    q_head = kv_head * GROUP + offs_m % GROUP  # (BLOCK_M,)
    m_valid = q_idx < num_q
    d_valid = offs_d < HEAD_DIM
    q_offs = (q_tok0 + q_idx).to(tl.int64) * stride_q_tok + q_head * stride_q_head
    # Q: (BLOCK_M, BLOCK_D)
    q = tl.load(q_ptr + q_offs[:, None] + offs_d[None, :], mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    q_pos = first_q_pos + q_idx  # (BLOCK_M,)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_cache_head
    v_base = v_cache_ptr + kv_head * stride_cache_head
    for start in range(key_begin, key_end, BLOCK_N):
        key = start + offs_n  # (BLOCK_N,) key indices
        n_valid = key < key_end
        if SPARSE:
            is_sel = key < num_sel
            sel = tl.load(sel_ptr + key, mask=n_valid & is_sel, other=0)
            if MOVED:
                pos = tl.where(is_sel, sel, recent_start + key - num_sel - num_moved)
                if (start < num_sel + num_moved) & (start + BLOCK_N > num_sel):  # the block holds moved keys
                    entry = key - num_sel
                    is_moved = n_valid & (entry >= 0) & (entry < num_moved)
                    moved, keep = _moved_positions(
                        moved_ptr, sel_ptr, entry, is_moved, num_sel, first_q_pos, recent_start, SEARCH_STEPS,
                    )  # fmt: skip
                    pos = tl.where(is_moved, moved, pos)
                    n_valid = n_valid & (keep | ~is_moved)
            else:
                pos = tl.where(is_sel, sel, recent_start + key - num_sel)
        else:
            pos = key
        page = tl.load(page_row_ptr + pos // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        kv_mask = n_valid[:, None] & d_valid[None, :]
        kv_offs = (page * stride_cache_page + slot * stride_cache_slot)[:, None] + offs_d[None, :]
        k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0)  # K: (BLOCK_N, BLOCK_D)
        v = tl.load(v_base + kv_offs, mask=kv_mask, other=0.0)  # V: (BLOCK_N, BLOCK_D)

        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # S: (BLOCK_M, BLOCK_N)
        if SPARSE:
            visible = n_valid[None, :]
        else:
            visible = n_valid[None, :] & (key[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that saw no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # P: (BLOCK_M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def _moved_positions(
    moved_ptr,  # [num_moved] int32 offsets, each at most once (NO_OFFSET aside: `moved_keys.unique_offsets`)
    sel_ptr,  # [num_sel] int32, ascending positions
    entry,  # (BLOCK_N,) entry of each key index in the moved list (read where `is_moved`)
    is_moved,  # (BLOCK_N,) bool
    num_sel,
    query_pos,
    recent_start,
    SEARCH_STEPS: tl.constexpr,
):
    """`(positions, keep)` of moved keys: `query_pos + offset`, kept when inside `[0, recent_start)` and
    not in the selection (a binary search). The list's writers dropped repeated offsets: comparing every
    entry with every earlier one here cost more than the rest of the moved keys (docs/measurements.md 23)."""
    pos = query_pos + tl.load(moved_ptr + entry, mask=is_moved, other=-(2**30))
    keep = is_moved & (pos >= 0) & (pos < recent_start)
    # lower bound of `pos` in the ascending selection
    lo = tl.zeros_like(pos)
    hi = lo + num_sel
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(sel_ptr + mid, mask=keep & active, other=0) < pos
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    found = tl.load(sel_ptr + lo, mask=keep & (lo < num_sel), other=-1) == pos
    keep = keep & ~found
    return tl.where(keep, pos, 0), keep


@triton.jit
def _store_tile(
    out,  # (BLOCK_M, BLOCK_D) fp32
    lse,  # (BLOCK_M,) fp32
    dst_ptr,  # [rows, num_q_heads, head_dim] out or fp32 partials
    dst_lse_ptr,  # [rows, num_q_heads] fp32
    stride_dst_tok,
    stride_dst_head,
    stride_lse_tok,
    dst_tok0,  # destination row of the tile's first query
    num_q,
    kv_head,
    lse_is_inf,  # store -inf instead of `lse` (final rows of draft tokens)
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    m_valid = q_idx < num_q
    row = (dst_tok0 + q_idx).to(tl.int64)
    offs = row * stride_dst_tok + q_head * stride_dst_head
    mask = m_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(dst_ptr + offs[:, None] + offs_d[None, :], out.to(dst_ptr.dtype.element_ty), mask=mask)
    if STORE_LSE:
        lse = tl.where(lse_is_inf != 0, float("-inf"), lse)
        tl.store(dst_lse_ptr + row * stride_lse_tok + q_head, lse, mask=m_valid)


# Splits a merge program reads at once: the partials of a long row (a verification at 8K contexts has
# ~16-25) arrive in a few rounds of loads instead of one L2 round trip each. End to end at 64 x 8192 on
# the H100 neutral against 1 (-0.4 % device time, inside the noise: docs/measurements.md 37).
MERGE_SPLIT_BLOCK = 8


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # [num_part_rows, num_q_heads, head_dim] fp32
    part_lse_ptr,  # [num_part_rows, num_q_heads] fp32, natural log
    merge_ptr,  # [num_merge, 5] int32: token, first part row, split stride, num splits, keep_lse
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    lse_ptr,  # [num_tokens, num_q_heads] fp32
    stride_part_row,
    stride_part_head,
    stride_plse_row,
    stride_out_tok,
    stride_out_head,
    stride_lse_tok,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
):
    """One program per (merge entry, query head): softmax-weighted sum of the splits' outputs, read
    `SPLIT_BLOCK` splits at a time. Entries with `num_splits = 0` are padding (fixed grids) and write
    nothing."""
    item = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_splits = tl.load(merge_ptr + item * 5 + 3)
    if num_splits > 0:
        token = tl.load(merge_ptr + item * 5)
        part0 = tl.load(merge_ptr + item * 5 + 1)
        split_stride = tl.load(merge_ptr + item * 5 + 2)
        keep_lse = tl.load(merge_ptr + item * 5 + 4)
        offs_d = tl.arange(0, BLOCK_D)
        offs_s = tl.arange(0, SPLIT_BLOCK)
        d_valid = offs_d < HEAD_DIM

        m = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)  # sum of the split weights
        acc = tl.zeros([BLOCK_D], tl.float32)
        for first in range(0, num_splits, SPLIT_BLOCK):
            split = first + offs_s
            s_valid = split < num_splits
            rows = (part0 + split * split_stride).to(tl.int64)  # (SPLIT_BLOCK,)
            lse_s = tl.load(part_lse_ptr + rows * stride_plse_row + head, mask=s_valid, other=float("-inf"))
            lse_s = lse_s * 1.4426950408889634
            o_s = tl.load(
                part_out_ptr + (rows * stride_part_row + head * stride_part_head)[:, None] + offs_d[None, :],
                mask=s_valid[:, None] & d_valid[None, :],
                other=0.0,
            )  # (SPLIT_BLOCK, BLOCK_D)
            m_new = tl.maximum(m, tl.max(lse_s, axis=0))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse_s - m_safe)  # (SPLIT_BLOCK,): 0 for splits that saw no key, and past the last
            acc = acc * alpha + tl.sum(w[:, None] * o_s, axis=0)
            total = total * alpha + tl.sum(w, axis=0)
            m = m_new
        total_safe = tl.where(total > 0.0, total, 1.0)
        out = acc / total_safe
        lse = tl.where(total > 0.0, (m + tl.log2(total_safe)) * 0.6931471805599453, float("-inf"))
        lse = tl.where(keep_lse != 0, lse, float("-inf"))
        tok = token.to(tl.int64)
        tl.store(
            out_ptr + tok * stride_out_tok + head * stride_out_head + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=d_valid,
        )
        tl.store(lse_ptr + tok * stride_lse_tok + head + tl.zeros([1], tl.int32), lse)


def merge_splits_ref(
    part_out: torch.Tensor,  # [num_part_rows, num_q_heads, head_dim] fp32
    part_lse: torch.Tensor,  # [num_part_rows, num_q_heads] fp32
    merge: torch.Tensor,  # [num_merge, 5] int32
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    lse: torch.Tensor,  # [num_tokens, num_q_heads] fp32
) -> None:
    """Reference of `merge_splits` (in place, float32): each entry's token gets the splits' outputs
    weighted by `softmax(lse)` over the splits and their log-sum-exp (-inf where `keep_lse` is 0 or no
    split saw a key); padding entries (`num_splits = 0`) write nothing."""
    for token, first, stride, num_splits, keep_lse in merge.tolist():
        if num_splits == 0:
            continue
        rows = first + stride * torch.arange(num_splits, device=part_lse.device)
        split_lse = part_lse[rows].float()  # [num_splits, heads]
        total = torch.logsumexp(split_lse, dim=0)  # -inf where every split is -inf
        weights = torch.where(total.isinf(), 0.0, torch.exp(split_lse - total))
        out[token] = (weights[..., None] * part_out[rows].float()).sum(dim=0).to(out.dtype)
        lse[token] = total if keep_lse else float("-inf")


def merge_splits(
    plan,  # AttentionPlan
    part_out: torch.Tensor,  # [num_part_rows, num_q_heads, head_dim] fp32
    part_lse: torch.Tensor,  # [num_part_rows, num_q_heads] fp32
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    lse: torch.Tensor,  # [num_tokens, num_q_heads] fp32
) -> None:
    """Launch the merge of the plan's split tiles into `out`/`lse` (nothing when the plan has no entry)."""
    if plan.num_merge == 0:
        return
    num_q_heads, head_dim = out.shape[1:]
    _merge_splits_kernel[(plan.num_merge, num_q_heads)](
        part_out,
        part_lse,
        plan.merge,
        out,
        lse,
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        SPLIT_BLOCK=MERGE_SPLIT_BLOCK,
        num_warps=1,
    )


# Launch configuration per (kernel family, head_dim): "full" = prefill/verify tiles, "decode" = full
# rows whose packed tile is 16 rows (one query per row), "draft" = one-query sparse tiles, "mixed" = the
# fused kernel (BLOCK_N of each path, one num_warps/num_stages), "score" = PillarAttn scoring. The
# head_dim 64/128 entries are the fastest of `benchmarks/bench_kernels.py --sweep` on an H200
# (Triton 3.6, docs/kernels.md); other head dims use the `None` entries.
LAUNCH_CONFIG: dict[tuple[str, int | None], dict[str, int]] = {
    ("full", None): {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    ("full", 128): {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    ("full", 64): {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    ("decode", None): {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    ("draft", None): {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    ("mixed", None): {"BLOCK_N_FULL": 64, "BLOCK_N_DRAFT": 64, "num_warps": 4, "num_stages": 2},
    ("mixed", 128): {"BLOCK_N_FULL": 64, "BLOCK_N_DRAFT": 128, "num_warps": 4, "num_stages": 3},
    ("mixed", 64): {"BLOCK_N_FULL": 128, "BLOCK_N_DRAFT": 64, "num_warps": 4, "num_stages": 3},
    ("score", None): {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
}


# Float32 tiles pipeline at most this deep: on the H200 (Triton 3.6) the mixed kernel's 3-stage
# pipeline over a 128-row packed fp32 tile at head_dim 128 gave wrong outputs (errors up to 3.5 in
# the 150-query row of `test_mixed_attention[128-6-2-fp32]`), while 1 or 2 stages, or a 64-row tile,
# were exact (`benchmarks/attention_variants.py`, docs/measurements.md 7). The CPU interpreter does
# not pipeline, so only a GPU shows it. bf16 and fp16 keep the measured configs.
MAX_FP32_STAGES = 2


def launch_config(kind: str, head_dim: int, dtype: torch.dtype | None = None) -> dict[str, int]:
    config = dict(LAUNCH_CONFIG.get((kind, head_dim), LAUNCH_CONFIG[(kind, None)]))
    if dtype is not None and dtype.itemsize >= 4:
        config["num_stages"] = min(config["num_stages"], MAX_FP32_STAGES)
    return config
