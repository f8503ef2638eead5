"""PillarAttn: score the keys of each verification block by the exact attention the verify pass
computed, and keep the top-B per (request, KV head) for the next round of drafts.

score(j) of row `r`, KV head `h` = mean over the row's queries and the GQA group's query heads of the
softmax probability `exp(scale * q . k_j - lse)`, for the keys older than the block
(`j < num_old_keys[r]`, which every query of the block sees). The selection holds the
`budgets[r]` best keys, as positions sorted ascending, padded with -1 up to `max_budget`.

Triton, two kernels, grids fixed by the shapes (no host syncs, CUDA-graph safe):
- `pillar_scores`: a second pass after the verify attention, as the reference implementation does:
  it reloads Q and K (not V) and turns logits into exact probabilities with the attention's final
  LSE. It cannot be fused into the attention pass: a probability needs the row's *final* LSE, known
  only after every key (and every split) was seen, and keeping the raw logits (queries x heads x keys)
  would move about as many bytes as K itself. The work is every row's chunks of old keys, numbered
  row after row (each program finds the rows' chunk counts by a prefix sum of `num_old_keys`), and
  program `(p, KV head)` of P takes chunks `p, p + P, ...`: rows with nothing to score (no queries,
  no old keys, a verification that keeps its selection: `selection_refresh_interval`) cost their
  programs nothing, and long rows spread over programs the short ones leave. A chunk holds the
  keys to score divided by P, doubled up to `SCORE_PREFERRED_KEYS_PER_CHUNK` (so that half the
  programs still get one) and at least `SCORE_MIN_KEYS_PER_CHUNK`, computed on the device each launch:
  8 verifications of 1K keys spread over 64 programs per KV head, not 16 (a program's few key blocks
  are latency-bound: docs/measurements.md section 20). A row's packed tile (its
  queries x the group's heads) usually fits one `tl.dot` tile, so each K block is read once and
  reduced over all of the tile's rows in registers.
- `select_top_keys_into` (`top_keys.py`): the top B of each (row, KV head), straight into the
  selected-index store.

The engine splits the refresh in two (`pillar_scores_into` / `select_verified_keys`): each layer's
attention scores into that layer's plane of a `[num_layers, rows, KV heads, width]` workspace, and
after the forward one launch selects every layer's keys (and one stores every layer's moved keys).
A top-B program's latency is its sweeps over a row's keys, and one layer has only rows x KV heads
of them (58 at 256 requests): 28 such launches in a row cost 0.84 ms per iteration at 8K contexts
(docs/measurements.md 12, before the histogram search); one launch of all layers' programs fills the GPU.
- `"diagonal"` selection (`moved_keys.py`): the same scoring pass also keeps each (query, head)'s most
  attended old key (`TRACK_BEST`), and `store_moved_offsets` writes them as offsets into their store.
  A program keeps a running best over a chunk's keys (a plain max per key block; the position search
  only in the few blocks that beat it) and folds it into the row's entry by one atomic max per chunk
  and query tile, not per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels import attention_plan
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
from hf_sparsespec.kernels.attention_plan import num_sms
from hf_sparsespec.kernels.moved_keys import moved_offsets_ref, store_moved_offsets
from hf_sparsespec.kernels.top_keys import select_top_keys, select_top_keys_into

# The scoring pass's grid and chunks (read at each launch; benchmarks set them): programs per SM
# over the KV heads; the fewest keys a chunk holds (rounded up to the launch's BLOCK_N); and the keys a
# chunk grows to while at least half the programs still get one: a chunk of one key block costs
# about as much in fixed work (Q, LSE, the best-key atomics) as in keys, so 4 rows of 8K keys score
# 17 % faster in chunks of 256 than of 128 (docs/measurements.md section 22).
SCORE_PROGRAMS_PER_SM = 4
SCORE_MIN_KEYS_PER_CHUNK = 128
SCORE_PREFERRED_KEYS_PER_CHUNK = 256
# The fewest rows the scoring kernel's prefix sum over the rows is padded to: launches of up to this many
# verifications share one compiled variant. A batch's tail shrinks through ever fewer verifications, and
# each new power of 2 (or a single row, which Triton specializes) compiled the kernel again in the middle
# of decoding (0.9 s at iteration 8,752 of 8,907 at 256 x 8192: docs/measurements.md 23).
SCORE_MIN_ROWS_PAD = 32


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


@triton.jit(do_not_specialize=["num_rows"])
def _pillar_scores_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_rows, max_pages] int32
    query_start_ptr,  # [num_rows + 1] int32
    lse_ptr,  # [num_tokens, num_q_heads] fp32, natural log
    num_old_keys_ptr,  # [num_rows] int32
    scores_ptr,  # [num_rows, num_kv_heads, width] fp32 (written at j < num_old_keys[row])
    best_ptr,  # [num_rows, num_kv_heads, num_entries] int64, packed best key per (query, head) (TRACK_BEST)
    num_rows,
    num_entries,  # (k + 1) x group (TRACK_BEST)
    stride_q_tok,
    stride_q_head,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_head,
    stride_pt_row,
    stride_lse_tok,
    stride_scores_row,
    stride_scores_head,
    stride_best_row,
    stride_best_head,
    stride_q_layer,  # the layer strides (grid axis 2; 0 for one layer)
    stride_lse_layer,
    stride_cache_layer,
    stride_scores_layer,
    stride_best_layer,
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MIN_KEYS_PER_CHUNK: tl.constexpr,  # a multiple of BLOCK_N
    PREFERRED_KEYS_PER_CHUNK: tl.constexpr,
    ROWS_PAD: tl.constexpr,  # a power of 2 >= num_rows
    INPUT_PRECISION: tl.constexpr,
    TRACK_BEST: tl.constexpr,
):
    kv_head = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)  # every layer's pass in one launch: its own programs
    q_ptr += layer * stride_q_layer
    lse_ptr += layer * stride_lse_layer
    k_cache_ptr += layer * stride_cache_layer
    scores_ptr += layer * stride_scores_layer
    best_ptr += layer * stride_best_layer
    # The work: every row's chunks of `chunk_keys` old keys, numbered row after row; program p
    # takes chunks p, p + P, ... So rows with no keys to score (no queries, nothing old, or a
    # verification that keeps its selection) leave their share to the others.
    rows = tl.arange(0, ROWS_PAD)
    row_valid = rows < num_rows
    row_q = tl.load(query_start_ptr + rows + 1, mask=row_valid, other=0) - tl.load(
        query_start_ptr + rows, mask=row_valid, other=0
    )
    row_old = tl.where(row_q > 0, tl.load(num_old_keys_ptr + rows, mask=row_valid, other=0), 0)
    # about one chunk per program, or up to PREFERRED_KEYS_PER_CHUNK keys while half the programs keep
    # one; in whole key blocks
    per_program = tl.cdiv(tl.sum(row_old, axis=0), tl.num_programs(0))
    chunk_keys = tl.maximum(per_program, tl.minimum(2 * per_program, PREFERRED_KEYS_PER_CHUNK))
    chunk_keys = tl.maximum(tl.cdiv(chunk_keys, BLOCK_N) * BLOCK_N, MIN_KEYS_PER_CHUNK)
    row_chunks = tl.cdiv(row_old, chunk_keys)
    chunk_end = tl.cumsum(row_chunks, axis=0)  # (ROWS_PAD,) each row's first chunk number past its own
    chunk_start = chunk_end - row_chunks
    num_chunks = tl.max(chunk_end, axis=0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    d_valid = offs_d < HEAD_DIM
    k_base = k_cache_ptr + kv_head * stride_cache_head
    for work in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        row = tl.sum((chunk_end <= work).to(tl.int32), axis=0)
        chunk = work - tl.sum(tl.where(rows == row, chunk_start, 0), axis=0)
        q0 = tl.load(query_start_ptr + row)
        q_len = tl.load(query_start_ptr + row + 1) - q0
        num_old = tl.load(num_old_keys_ptr + row)
        inv_count = 1.0 / tl.maximum(q_len * GROUP, 1).to(tl.float32)
        page_row_ptr = page_table_ptr + row.to(tl.int64) * stride_pt_row
        score_row_ptr = scores_ptr + row.to(tl.int64) * stride_scores_row + kv_head * stride_scores_head
        best_row_ptr = best_ptr + row.to(tl.int64) * stride_best_row + kv_head * stride_best_head
        key_lo = chunk * chunk_keys
        key_hi = tl.minimum(key_lo + chunk_keys, num_old)
        num_q_tiles = tl.maximum(tl.cdiv(q_len, BLOCK_M // GROUP), 1)
        # Usually one query tile; with more, the chunk's partial sums wait in `scores` between tiles
        # (this program owns the chunk in every tile, so it reads back only what it wrote).
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
            # TRACK_BEST: each (query, head)'s best probability over the chunk's keys and its lowest key
            best_p = tl.full([BLOCK_M], -1.0, tl.float32)
            best_key = tl.zeros([BLOCK_M], tl.int32)
            for start in range(key_lo, key_hi, BLOCK_N):
                key = start + offs_n  # (BLOCK_N,) positions
                n_valid = key < key_hi
                page = tl.load(page_row_ptr + key // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
                k_offs = (page * stride_cache_page + (key % PAGE_SIZE) * stride_cache_slot)[:, None] + offs_d[None, :]
                k = tl.load(k_base + k_offs, mask=n_valid[:, None] & d_valid[None, :], other=0.0)  # K: (BLOCK_N, BLOCK_D)
                s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # S: (BLOCK_M, BLOCK_N)
                p = tl.where(m_valid[:, None], tl.exp2(s - lse2[:, None]), 0.0)
                total = tl.sum(p, axis=0)  # (BLOCK_N,)
                if q_tile > 0:
                    total += tl.load(score_row_ptr + key, mask=n_valid, other=0.0)
                total = tl.where(is_last, total * inv_count, total)
                tl.store(score_row_ptr + key, total, mask=n_valid)
                if TRACK_BEST:
                    # a plain max per block; the position search runs only in blocks that beat the
                    # running best (keys ascend, so the first maximum is kept)
                    p_valid = tl.where(n_valid[None, :], p, -1.0)
                    top = tl.max(p_valid, axis=1)
                    improved = top > best_p
                    if tl.max(improved.to(tl.int32), axis=0) > 0:
                        first = tl.min(tl.where(p_valid == top[:, None], offs_n[None, :], BLOCK_N), axis=1)
                        best_key = tl.where(improved, start + first, best_key)
                        best_p = tl.where(improved, top, best_p)
            if TRACK_BEST:
                # packed (probability bits, 2^31 - 1 - key): the atomic max across chunks keeps the best
                # probability and, on ties, the lowest key; 0 means none
                packed = (best_p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - best_key).to(tl.int64)
                entry = tile_q * GROUP + offs_m % GROUP  # (BLOCK_M,) the (query, head)'s entry of the row's list
                track = m_valid & (entry < num_entries) & (best_p >= 0.0)
                tl.atomic_max(best_row_ptr + entry, packed, mask=track)


def _check_score_inputs(query, k_cache, page_table, query_start, lse, num_old_keys) -> int:
    """The GQA group, after checking the scoring inputs."""
    check_cache_pair(k_cache)
    group = check_query_heads(query, k_cache)
    if query.dtype != k_cache.dtype:
        raise TypeError(f"query: expected the cache dtype {k_cache.dtype}, got {query.dtype}")
    device = query.device
    num_tokens, num_q_heads, _ = query.shape
    check_tensor("page_table", page_table, ndim=2, dtypes=INDEX, device=device)
    num_rows = page_table.shape[0]
    check_tensor("query_start", query_start, dtypes=INDEX, device=device, shape=(num_rows + 1,))
    check_tensor("lse", lse, dtypes=(torch.float32,), device=device, shape=(num_tokens, num_q_heads))
    check_tensor("num_old_keys", num_old_keys, dtypes=INDEX, device=device, shape=(num_rows,))
    return group


def pillar_scores_into(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    lse: torch.Tensor,
    num_old_keys: torch.Tensor,
    scores: torch.Tensor,
    scale: float,
    max_queries: int | None = None,
    best: torch.Tensor | None = None,
    max_rows: int | None = None,
) -> None:
    """Triton scores of `pillar_scores_ref` written into `scores [num_rows, num_kv_heads, width]` at
    `j < num_old_keys[r]` (the rest is left as it was). Every other argument as `pillar_scores`;
    `num_old_keys[r] <= width`. `max_queries`: the most queries a row has (a verification block, k + 1),
    which sizes the tile; None: `query`'s tokens spread evenly over the rows. The grid depends only
    on the shapes (CUDA-graph safe). `best [num_rows, num_kv_heads, (k + 1) x group]` int64 (zeros on
    entry): also fold each (query, head)'s best old key into it (`moved_keys.py`). `max_rows`: the most
    verifications any launch over these buffers has (the engine's workspace rows), which fixes the
    kernel's compile-time row padding, so that every row count reuses one compiled kernel; None: this
    launch's rows."""
    group = pillar_scores_inputs_check(query, k_cache, page_table, query_start, lse, num_old_keys, scores, best,
                                       max_rows)  # fmt: skip
    if page_table.shape[0] == 0 or scores.shape[2] == 0:
        return
    query, page_table, lse = last_dim_contiguous(query), last_dim_contiguous(page_table), last_dim_contiguous(lse)
    _launch_scores(query[None], k_cache[None], page_table, query_start, lse[None], num_old_keys, scores[None],
                   scale, group, max_queries, best[None] if best is not None else None, max_rows)  # fmt: skip


def gather_queries_ref(query, lse, tokens, out_query, out_lse) -> None:
    """Reference of `gather_queries`: `out_query[i] = query[tokens[i]]`, `out_lse[i] = lse[tokens[i]]`."""
    torch.index_select(query, 0, tokens, out=out_query)
    torch.index_select(lse, 0, tokens, out=out_lse)


@triton.jit
def _gather_queries_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    lse_ptr,  # [num_tokens, num_q_heads] fp32
    tokens_ptr,  # [n] int64
    out_q_ptr,  # [n, num_q_heads, head_dim]
    out_lse_ptr,  # [n, num_q_heads] fp32
    stride_q_tok,
    stride_q_head,
    stride_lse_tok,
    stride_out_q_tok,
    stride_out_q_head,
    stride_out_lse_tok,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    tok = tl.load(tokens_ptr + i).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, BLOCK_D)
    head_valid = heads < NUM_HEADS
    mask = head_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + tok * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :], mask=mask)
    tl.store(out_q_ptr + i * stride_out_q_tok + heads[:, None] * stride_out_q_head + dims[None, :], q, mask=mask)
    lse = tl.load(lse_ptr + tok * stride_lse_tok + heads, mask=head_valid)
    tl.store(out_lse_ptr + i * stride_out_lse_tok + heads, lse, mask=head_valid)


def gather_queries(query, lse, tokens, out_query, out_lse) -> None:
    """One launch for both of `gather_queries_ref`'s copies (a layer's verification queries and LSE,
    kept for a scoring pass that runs after the layer: `ops.ScoringAside`). `query [num_tokens,
    num_q_heads, head_dim]` and `out_query [n, ...]` of one dtype, `lse`/`out_lse` fp32, unit-stride
    last dimensions; `tokens [n]` int64 in [0, num_tokens)."""
    check_tensor("query", query, ndim=3)
    num_q_heads, head_dim = query.shape[1:]
    n = tokens.shape[0]
    check_tensor("tokens", tokens, ndim=1, dtypes=(torch.int64,), device=query.device)
    check_tensor("out_query", out_query, dtypes=(query.dtype,), device=query.device, shape=(n, num_q_heads, head_dim))
    check_tensor("lse", lse, dtypes=(torch.float32,), device=query.device, shape=(query.shape[0], num_q_heads))
    check_tensor("out_lse", out_lse, dtypes=(torch.float32,), device=query.device, shape=(n, num_q_heads))
    for name, x in (("query", query), ("lse", lse), ("out_query", out_query), ("out_lse", out_lse)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit-stride last dimension, got strides {x.stride()}")
    if n == 0:
        return
    _gather_queries_kernel[(n,)](
        query, lse, tokens, out_query, out_lse, query.stride(0), query.stride(1), lse.stride(0),
        out_query.stride(0), out_query.stride(1), out_lse.stride(0), NUM_HEADS=num_q_heads,
        HEADS_PAD=triton.next_power_of_2(num_q_heads), HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def pillar_scores_inputs_check(query, k_cache, page_table, query_start, lse, num_old_keys, scores, best,
                               max_rows) -> int:  # fmt: skip
    """The GQA group, after checking one layer's scoring inputs and outputs."""
    group = _check_score_inputs(query, k_cache, page_table, query_start, lse, num_old_keys)
    num_rows, num_kv_heads = page_table.shape[0], k_cache.shape[2]
    check_tensor("scores", scores, dtypes=(torch.float32,), device=query.device, shape=(num_rows, num_kv_heads, None))
    if scores.stride(-1) != 1:
        raise ValueError(f"scores: expected a unit-stride last dimension, got strides {scores.stride()}")
    if best is not None:
        check_tensor("best", best, dtypes=(torch.int64,), device=query.device, shape=(num_rows, num_kv_heads, None))
        if best.stride(-1) != 1:
            raise ValueError(f"best: expected a unit-stride last dimension, got strides {best.stride()}")
    if max_rows is not None and not num_rows <= max_rows:
        raise ValueError(f"max_rows: expected at least the {num_rows} rows of the launch, got {max_rows!r}")
    return group


def pillar_scores_layers_into(
    query: torch.Tensor,  # [num_layers, num_tokens, num_q_heads, head_dim]
    key_pool: torch.Tensor,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    lse: torch.Tensor,  # [num_layers, num_tokens, num_q_heads] fp32
    num_old_keys: torch.Tensor,
    scores: torch.Tensor,  # [num_layers, num_rows, num_kv_heads, width] fp32
    scale: float,
    max_queries: int | None = None,
    best: torch.Tensor | None = None,  # [num_layers, num_rows, num_kv_heads, num_entries] int64
    max_rows: int | None = None,
) -> None:
    """`pillar_scores_into` of every layer in one launch (`SparseSpecConfig.score_after_forward`): layer
    l scores `query[l]` (with `lse[l]`) against `key_pool[l]` into `scores[l]` (and `best[l]`). A
    layer's pass alone spreads a few verifications over the GPU in chunks of one or two key blocks,
    latency-bound at small batches; here each layer gets its share of the programs, and each program
    longer chunks."""
    if query.dim() != 4 or key_pool.dim() != 5 or lse.dim() != 3 or scores.dim() != 4:
        raise ValueError(
            "query, key_pool, lse and scores: expected a leading layer dimension, got shapes "
            f"{tuple(query.shape)}, {tuple(key_pool.shape)}, {tuple(lse.shape)}, {tuple(scores.shape)}"
        )
    num_layers = key_pool.shape[0]
    for name, x in (("query", query), ("lse", lse), ("scores", scores), ("best", best)):
        if x is not None and x.shape[0] != num_layers:
            raise ValueError(f"{name}: expected {num_layers} layers (key_pool's), got shape {tuple(x.shape)}")
    if num_layers == 0:
        return
    group = pillar_scores_inputs_check(query[0], key_pool[0], page_table, query_start, lse[0], num_old_keys,
                                       scores[0], best[0] if best is not None else None, max_rows)  # fmt: skip
    if page_table.shape[0] == 0 or scores.shape[3] == 0:
        return
    query, page_table, lse = last_dim_contiguous(query), last_dim_contiguous(page_table), last_dim_contiguous(lse)
    _launch_scores(query, key_pool, page_table, query_start, lse, num_old_keys, scores, scale, group, max_queries,
                   best, max_rows)  # fmt: skip


def _launch_scores(query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale, group, max_queries,
                   best, max_rows) -> None:  # fmt: skip
    """The scoring kernel over `[layers, ...]` inputs (checked), one grid plane per layer."""
    num_layers, num_tokens, _, head_dim = query.shape
    num_rows, num_kv_heads = page_table.shape[0], k_cache.shape[3]
    # The tile holds a whole verification block when the rows are even (k+1 queries each); from the
    # shapes alone, so no sync. Larger blocks loop over query tiles (up to the attention's largest tile,
    # `attention_plan.MAX_BLOCK_M`, read at the call as the attention plans read it).
    tile_q = max_queries if max_queries is not None else max(1, -(-num_tokens // num_rows))
    block_m = max(16, next_power_of_2(group), min(attention_plan.MAX_BLOCK_M, next_power_of_2(tile_q * group)))
    config = launch_config("score", head_dim, query.dtype)
    min_keys = triton.cdiv(SCORE_MIN_KEYS_PER_CHUNK, config["BLOCK_N"]) * config["BLOCK_N"]
    # up to SCORE_PROGRAMS_PER_SM per SM over the KV heads and layers (the grid from the shapes only);
    # the kernel sizes the chunks from the keys it finds
    programs = max(1, SCORE_PROGRAMS_PER_SM * num_sms(query.device) // (num_kv_heads * num_layers))
    programs = min(programs, num_rows * triton.cdiv(scores.shape[3], min_keys))
    b = best if best is not None else scores
    _pillar_scores_kernel[(programs, num_kv_heads, num_layers)](
        query, k_cache, page_table, query_start, lse, num_old_keys, scores, b,
        num_rows, best.shape[3] if best is not None else 0,
        query.stride(1), query.stride(2), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        page_table.stride(0), lse.stride(1), scores.stride(1), scores.stride(2),
        b.stride(1) if best is not None else 0, b.stride(2) if best is not None else 0,
        query.stride(0) if num_layers > 1 else 0, lse.stride(0) if num_layers > 1 else 0,
        k_cache.stride(0) if num_layers > 1 else 0, scores.stride(0) if num_layers > 1 else 0,
        b.stride(0) if best is not None and num_layers > 1 else 0, scale * LOG2E,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], BLOCK_D=triton.next_power_of_2(head_dim),
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[2], MIN_KEYS_PER_CHUNK=min_keys,
        PREFERRED_KEYS_PER_CHUNK=SCORE_PREFERRED_KEYS_PER_CHUNK,
        ROWS_PAD=score_rows_pad(num_rows if max_rows is None else max_rows),
        INPUT_PRECISION=dot_precision(query.dtype), TRACK_BEST=best is not None,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip


def score_rows_pad(max_rows: int) -> int:
    """The scoring kernel's `ROWS_PAD` (a compile-time constant) for launches of up to `max_rows` verifications."""
    return max(SCORE_MIN_ROWS_PAD, next_power_of_2(max_rows))


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
    if not isinstance(max_num_old_keys, int) or max_num_old_keys < 0:
        raise ValueError(f"max_num_old_keys: expected an int >= 0, got {max_num_old_keys!r}")
    shape = (page_table.shape[0], k_cache.shape[2], max_num_old_keys)
    scores = torch.full(shape, float("-inf"), dtype=torch.float32, device=query.device)
    pillar_scores_into(query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale)
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
    """Triton `pillar_select_ref`: `[num_rows, num_kv_heads, max_budget]` int32 positions (-1 padded)."""
    scores = pillar_scores(query, k_cache, page_table, query_start, lse, num_old_keys, max_num_old_keys, scale)
    num_rows, num_kv_heads = scores.shape[:2]
    selected = torch.full((num_rows, num_kv_heads, max_budget), -1, dtype=torch.int32, device=query.device)
    rows = torch.arange(num_rows, dtype=torch.int32, device=query.device)
    select_top_keys_into(scores, num_old_keys, budgets, selected, rows)
    return selected


def update_selection(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    lse: torch.Tensor,
    num_old_keys: torch.Tensor,
    budgets: torch.Tensor,
    selected: torch.Tensor,
    slots: torch.Tensor,
    scores: torch.Tensor,
    scale: float,
    max_queries: int | None = None,
    offsets: torch.Tensor | None = None,
    best: torch.Tensor | None = None,
    max_rows: int | None = None,
) -> None:
    """One layer's PillarAttn refresh on Triton: scores into the workspace `scores [num_rows,
    num_kv_heads, width]`, then the top keys straight into `selected[slots]` (no host syncs).
    `max_queries`, `max_rows`: as in `pillar_scores_into` (the verification block size, the workspace
    rows). `"diagonal"`: also the moved-key offsets into `offsets[slots]` (`[num_slots, num_kv_heads, num_entries]` int32), through
    the int64 workspace `best [num_rows, num_kv_heads, num_entries]` (zeros, and left zeroed)."""
    pillar_scores_into(query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale, max_queries,
                       best=best, max_rows=max_rows)  # fmt: skip
    select_verified_keys(scores, num_old_keys, budgets, selected, slots, offsets, best, query.shape[1] // k_cache.shape[2])


def select_verified_keys(
    scores: torch.Tensor,  # [num_layers, num_rows, num_kv_heads, width] fp32
    num_old_keys: torch.Tensor,  # [num_rows] int32
    budgets: torch.Tensor,  # [num_rows] int32
    selected: torch.Tensor,  # [num_layers, num_slots, num_kv_heads, max_budget] int32
    slots: torch.Tensor,  # [num_rows] int64
    offsets: torch.Tensor | None = None,  # [num_layers, num_slots, num_kv_heads, num_entries] int32
    best: torch.Tensor | None = None,  # [num_layers, num_rows, num_kv_heads, num_entries] int64
    group: int = 1,
    num_selectable_keys: torch.Tensor | None = None,  # [num_rows] int32, <= num_old_keys
) -> None:
    """The engine's selection after the forward, on Triton (each layer scored by `pillar_scores_into`
    into its plane): every layer's top keys into `selected[:, slots]` in one launch and, for
    `"diagonal"`, every layer's moved-key offsets into `offsets[:, slots]` from `best` (left zeroed)
    in another. Without the layer dimension (`update_selection`), one layer's. The top keys are
    taken among the first `num_selectable_keys[r]` old keys (the keys before the drafts' local
    window, `SparseSpecConfig.local_window`; None: all `num_old_keys[r]`); the moved keys' query
    positions stay `num_old_keys[r] + i`."""
    if (offsets is None) != (best is None):
        raise ValueError("offsets and best: expected both (the diagonal selection) or neither")
    selectable = num_old_keys if num_selectable_keys is None else num_selectable_keys
    select_top_keys_into(scores, selectable, budgets, selected, slots)
    if offsets is not None:
        store_moved_offsets(best, num_old_keys, offsets, slots, group)


def score_verification_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    lse: torch.Tensor,
    num_old_keys: torch.Tensor,
    scores: torch.Tensor,
    scale: float,
    slots: torch.Tensor,
    offsets: torch.Tensor | None = None,
) -> None:
    """The reference backend's `score_verification`: `pillar_scores_ref` into `scores [num_rows,
    num_kv_heads, width]` (-inf from `num_old_keys[r]` on) and, given, `moved_offsets_ref`'s rows
    straight into `offsets[slots]` (the reference has no best-key workspace to carry them)."""
    scores.copy_(pillar_scores_ref(query, k_cache, page_table, query_start, lse, num_old_keys, scores.shape[2], scale))
    if offsets is not None:
        moved = moved_offsets_ref(query, k_cache, page_table, query_start, num_old_keys, offsets.shape[2], scale)
        offsets.index_copy_(0, slots.long(), moved)


def select_verified_keys_ref(
    scores: torch.Tensor,  # [num_layers, num_rows, num_kv_heads, width] fp32
    num_old_keys: torch.Tensor,
    budgets: torch.Tensor,
    selected: torch.Tensor,  # [num_layers, num_slots, num_kv_heads, max_budget] int32
    slots: torch.Tensor,
) -> None:
    """Reference of `select_verified_keys`: each layer's `select_top_keys` rows into `selected[layer,
    slots]` (-1 padded); keys from `num_old_keys[r]` on are never selected, whatever the workspace
    holds there (the backend passes the keys before the local window as `num_old_keys`)."""
    width = scores.shape[-1]
    stale = torch.arange(width, device=scores.device)[None, None, :] >= num_old_keys.to(scores.device)[:, None, None]
    budgets = torch.minimum(budgets, num_old_keys)
    for layer in range(scores.shape[0]):
        rows = select_top_keys(scores[layer].masked_fill(stale, float("-inf")), budgets, selected.shape[-1])
        selected[layer].index_copy_(0, slots.long(), rows)


def update_selection_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    lse: torch.Tensor,
    num_old_keys: torch.Tensor,
    budgets: torch.Tensor,
    selected: torch.Tensor,
    slots: torch.Tensor,
    scores: torch.Tensor | None,
    scale: float,
    offsets: torch.Tensor | None = None,
) -> None:
    """Reference of `update_selection` (and the CPU backend): `selected[slots[r], :, :]` becomes
    `pillar_select_ref`'s rows (-1 padded), and, given, `offsets[slots[r]]` `moved_offsets_ref`'s.
    `scores` is unused (the reference allocates its own)."""
    width = int(num_old_keys.max()) if num_old_keys.numel() else 0
    rows = pillar_select_ref(
        query, k_cache, page_table, query_start, lse, num_old_keys, budgets, width, selected.shape[2], scale
    )
    selected.index_copy_(0, slots.long(), rows)
    if offsets is not None:
        moved = moved_offsets_ref(query, k_cache, page_table, query_start, num_old_keys, offsets.shape[2], scale)
        offsets.index_copy_(0, slots.long(), moved)
