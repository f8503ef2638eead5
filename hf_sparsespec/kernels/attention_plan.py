"""The plan of an attention launch: which program attends which keys of which row.

Why a plan: one request with a 32K context and 255 drafting requests with 1K keys each must not be
one program per row (the long row would run alone at the end), and the kernels must not read lengths
back to the host every layer. So once per engine step, from host-side lengths, the work is cut into
items of about equal key counts (vectorised with numpy), and every layer's launch reuses the list.

A work item is `(row, q_begin, key_begin, key_end, part_row)`:
- `row` owns queries `query_start[row] + q_begin ...` (a tile of up to `BLOCK_M // group` queries) of
  a full (causal) row, or, when `q_begin = -1`, the single query of a draft row; it attends its key
  indices `[key_begin, key_end)`: for full rows key index = position, for draft rows the selected
  positions come first, then the `num_moved` moved keys of the diagonal selection, then the recent
  window (`sparse_attention`);
- `part_row = -1`: the item covers all its tile's keys and writes `out`/`lse` directly; otherwise it
  writes fp32 partial rows `part_row + i` (query `i` of the tile), and the merge kernel combines the
  splits of each query: merge entry `(token, first_part_row, split_stride, num_splits, keep_lse)`
  (`keep_lse = 0` for draft tokens, whose LSE is reported as -inf);
- `row = -1` (work) or `num_splits = 0` (merge): padding, a no-op.
The grid is `(num_work, num_kv_heads)`: every (work item, KV head) pair is one program.

Fixed grids (CUDA graphs): `plan_capacity` bounds the work items, merge entries and partial rows of
any batch of a given shape, so a captured launch can keep its grid while the lists change each step
(`plan_work_lists(..., capacity=...)` pads them with no-op entries).

Invariant: a plan is only valid with the lengths it was made from (the kernels read the same
`query_start`/`context_lens`/`num_selected`/`recent_start` from device tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hf_sparsespec.kernels._checks import next_power_of_2

# Keys of one block of the kernels' inner loop; split boundaries are rounded to it.
KEY_ALIGN = 64
# The fewest keys a split gets, for draft tiles, full rows of one query (plain steps) and tiles of full
# rows with several queries (verifications, prefill chunks): below this, the per-program cost (loading
# Q, writing fp32 partials, merging) stops being small next to the keys' bytes. The floors decide only
# where `total keys / items` is below them: small batches, short contexts. A 256-key floor slowed AR's
# one-query rows at 2K-4K contexts (52 -> 59 us per layer at 64 x 2K), but once the drafts' moved keys
# lost their repeat check it made the mixed launch's verifications the shorter path at 64 x 1K
# (38 -> 21 us) and 256 x 1K (55 -> 49) (docs/measurements.md sections 20 and 23).
MIN_KEYS_PER_SPLIT = 256
MIN_KEYS_PER_FULL_SPLIT = 1024
MIN_KEYS_PER_VERIFY_SPLIT = 256
# A wider floor for the verification tiles, taken when the launch keeps at least WIDE_VERIFY_MIN_SHARE of
# the programs it aims for with it (0: never). One layer's mixed launch on the H100 (docs/measurements.md
# 31, floors 512 against 256) took 8 % less at 64 rows x 8K and 3-5 % less at 256 x 1K-2K, where 512
# leaves >= 3 programs an SM, the same at 64 x 4K (2.6) and at 256 x 4K-8K, and 12-25 % more at 64 x 1K-2K
# (~1), where the share keeps 256. In the engine (H100, random weights, 64 requests at 8K contexts) an
# iteration took 4.37 ms against 4.50 (-2.9 %; docs/measurements.md 41); end to end at 64 x 8192 (H100,
# measurements 42) 0.8 % less GPU time an iteration over the run, the same tok/s (16,389 against 16,381).
# `_verifywide0` runs take 256 everywhere, as before.
WIDE_KEYS_PER_VERIFY_SPLIT = 512
WIDE_VERIFY_MIN_SHARE = 0.75
# Programs the decomposition aims for, per multiprocessor (several waves hide the tail).
PROGRAMS_PER_SM = 4
# The largest packed query tile (queries x GQA group) of full rows. Longer rows take several tiles,
# whose pieces of one key range run side by side (`plan_work_lists`); `_maxtile64` runs of the
# benchmarks give k = 16's 17-query verifications (102 rows with a group of 6) two 64-row tiles.
MAX_BLOCK_M = 128
WORK_FIELDS = 5
MERGE_FIELDS = 5


@dataclass(frozen=True)
class PlanCapacity:
    """Upper bounds of a plan's lists for batches of one shape (see `plan_capacity`)."""

    num_work: int
    num_merge: int
    num_part_rows: int


@dataclass
class AttentionPlan:
    """Device work lists of one attention launch (see the module docstring)."""

    work: torch.Tensor  # [num_work, 5] int32: row, q_begin, key_begin, key_end, part_row
    merge: torch.Tensor  # [num_merge, 5] int32: token, first part row, split stride, num splits, keep_lse
    num_part_rows: int
    block_m_full: int  # packed (query, head) rows of a full-row tile
    block_m_draft: int  # packed rows of a draft tile (the GQA group, padded to >= 16)
    group: int
    num_kv_heads: int
    part_out: torch.Tensor | None = None  # [>= num_part_rows, num_q_heads, head_dim] fp32, or allocated lazily
    part_lse: torch.Tensor | None = None  # [>= num_part_rows, num_q_heads] fp32

    @property
    def num_work(self) -> int:
        return self.work.shape[0]

    @property
    def num_merge(self) -> int:
        return self.merge.shape[0]

    def workspace(self, num_q_heads: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 partial outputs `[rows, num_q_heads, head_dim]` and LSEs `[rows, num_q_heads]`, given or
        allocated once, shared by every layer that uses this plan (layers run one after another)."""
        if self.part_out is None:
            rows = max(self.num_part_rows, 1)
            self.part_out = torch.empty((rows, num_q_heads, head_dim), dtype=torch.float32, device=device)
            self.part_lse = torch.empty((rows, num_q_heads), dtype=torch.float32, device=device)
        return self.part_out, self.part_lse


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so that tests exercise splits


def block_sizes(max_full_q: int, group: int) -> tuple[int, int]:
    """`(block_m_full, block_m_draft)`: packed tile rows for full rows of up to `max_full_q` queries
    and for one-query draft rows."""
    min_block = max(16, next_power_of_2(group))
    return max(min_block, min(MAX_BLOCK_M, next_power_of_2(max(max_full_q, 1) * group))), min_block


def target_items(num_kv_heads: int, device: torch.device, target_programs: int | None = None) -> int:
    """Work items the decomposition aims for (programs over KV heads)."""
    if target_programs is None:
        target_programs = PROGRAMS_PER_SM * num_sms(device)
    return max(1, target_programs // max(num_kv_heads, 1))


def plan_capacity(max_tiles: int, max_tokens: int, tile_q: int, items: int) -> PlanCapacity:
    """Bounds for any batch of at most `max_tiles` query tiles and `max_tokens` tokens.

    A tile is split only when it has more than `chunk >= total_keys / items` keys, into at most
    `ceil(keys / chunk) <= 2 keys / chunk` pieces, so the splits of all tiles number at most `2 * items`.
    """
    return PlanCapacity(num_work=max_tiles + 2 * items, num_merge=max_tokens, num_part_rows=tile_q * 2 * items)


def plan_work_lists(
    query_start,
    context_lens,
    num_full_rows: int,
    num_selected,
    recent_start,
    *,
    group: int,
    block_m_full: int,
    items: int,
    min_keys_per_split: int | None = None,
    min_keys_per_full_split: int | None = None,
    min_keys_per_verify_split: int | None = None,
    capacity: PlanCapacity | None = None,
    num_moved: int = 0,
) -> tuple[np.ndarray, np.ndarray, int]:
    """`(work [n, 5], merge [m, 5], num_part_rows)` int32 arrays for one batch (host, vectorised).

    Args: host sequences (lists or arrays) of `num_rows + 1` query offsets and `num_rows` context
    lengths / selected counts / recent starts; rows `[0, num_full_rows)` attend fully and causally, the
    rest are one-query draft rows. `capacity`: pad both lists to its sizes with no-op entries (and
    check the bounds). `num_moved`: moved-key entries every draft row attends besides its selection
    (the diagonal selection; the kernel masks the ones that fall outside or are selected). The floors
    (draft tiles, one-query full rows, tiles of full rows with several queries) default to the module
    constants as they are at the call (benchmarks set them).
    """
    min_keys_per_split = MIN_KEYS_PER_SPLIT if min_keys_per_split is None else min_keys_per_split
    min_keys_per_full_split = MIN_KEYS_PER_FULL_SPLIT if min_keys_per_full_split is None else min_keys_per_full_split
    if min_keys_per_verify_split is None:
        min_keys_per_verify_split = MIN_KEYS_PER_VERIFY_SPLIT
    query_start = np.asarray(query_start, dtype=np.int64)
    context_lens = np.asarray(context_lens, dtype=np.int64)
    num_rows = context_lens.shape[0]
    if query_start.shape[0] != num_rows + 1:
        raise ValueError(f"query_start: expected {num_rows + 1} offsets, got {query_start.shape[0]}")
    q_lens = np.diff(query_start)
    if np.any(q_lens[num_full_rows:] != 1):
        bad = num_full_rows + int(np.argmax(q_lens[num_full_rows:] != 1))
        raise ValueError(f"draft row {bad}: expected 1 query, got {int(q_lens[bad])}")
    tile_q = block_m_full // group

    # Tiles of full rows: (row, q_begin, queries, keys the tile needs); causal: the tile's last
    # query sits at context_len - q_len + q_begin + num_q - 1.
    tiles_per_row = -(-q_lens[:num_full_rows] // tile_q)
    full_row = np.repeat(np.arange(num_full_rows), tiles_per_row)
    first_tile = np.repeat(np.cumsum(tiles_per_row) - tiles_per_row, tiles_per_row)
    full_q_begin = (np.arange(full_row.shape[0]) - first_tile) * tile_q
    full_num_q = np.minimum(tile_q, q_lens[full_row] - full_q_begin)
    full_keys = context_lens[full_row] - q_lens[full_row] + full_q_begin + full_num_q
    # Draft rows: one query; selected keys plus the recent window.
    draft_row = np.arange(num_full_rows, num_rows)
    draft_keys = np.asarray(num_selected, dtype=np.int64)[num_full_rows:] + num_moved + context_lens[num_full_rows:]
    draft_keys = draft_keys - np.asarray(recent_start, dtype=np.int64)[num_full_rows:]

    row = np.concatenate([full_row, draft_row])
    q_begin = np.concatenate([full_q_begin, np.full(draft_row.shape[0], -1)])
    num_q = np.concatenate([full_num_q, np.ones(draft_row.shape[0], dtype=np.int64)])
    num_keys = np.maximum(np.concatenate([full_keys, draft_keys]), 1)
    is_full = q_begin >= 0

    chunk = -(-int(num_keys.sum()) // items) if num_keys.size else 1
    several_queries = q_lens[row] > 1
    floor = np.where(is_full, np.where(several_queries, min_keys_per_verify_split, min_keys_per_full_split),
                     min_keys_per_split)  # fmt: skip
    if WIDE_KEYS_PER_VERIFY_SPLIT > min_keys_per_verify_split:
        wide = np.where(is_full & several_queries, WIDE_KEYS_PER_VERIFY_SPLIT, floor)
        if np.maximum(1, -(-num_keys // np.maximum(chunk, wide))).sum() >= WIDE_VERIFY_MIN_SHARE * items:
            floor = wide
    num_splits = np.maximum(1, -(-num_keys // np.maximum(chunk, floor)))
    size = -(-num_keys // num_splits)
    size = np.where(size > KEY_ALIGN, -(-size // KEY_ALIGN) * KEY_ALIGN, size)
    num_splits = -(-num_keys // size)
    split = num_splits > 1

    # Whole tiles write out/lse directly.
    whole = np.stack([row, q_begin, np.zeros_like(row), num_keys, np.full_like(row, -1)], axis=1)[~split]
    # Split tiles: piece s covers keys [s * size, (s + 1) * size) and writes partial rows.
    s_rows, s_splits, s_num_q = row[split], num_splits[split], num_q[split]
    part_base = np.cumsum(s_splits * s_num_q) - s_splits * s_num_q
    piece_tile = np.repeat(np.arange(s_rows.shape[0]), s_splits)
    piece = np.arange(piece_tile.shape[0]) - np.repeat(np.cumsum(s_splits) - s_splits, s_splits)
    s_size, s_keys = size[split][piece_tile], num_keys[split][piece_tile]
    pieces = np.stack(
        [
            s_rows[piece_tile],
            q_begin[split][piece_tile],
            piece * s_size,
            np.minimum((piece + 1) * s_size, s_keys),
            part_base[piece_tile] + piece * s_num_q[piece_tile],
        ],
        axis=1,
    )
    # A row's query tiles read the same keys: the pieces of one key range go side by side (row, then
    # key range, then tile), so the second tile's loads find the first's in L2.
    pieces = pieces[np.lexsort((pieces[:, 1], pieces[:, 2], pieces[:, 0]))]
    work = np.concatenate([whole, pieces])
    # Longest items first, so the short ones fill the tail of the grid.
    work = work[np.argsort(work[:, 2] - work[:, 3], kind="stable")]
    # Merge entries: one per query of a split tile.
    query_tile = np.repeat(np.arange(s_rows.shape[0]), s_num_q)
    query = np.arange(query_tile.shape[0]) - np.repeat(np.cumsum(s_num_q) - s_num_q, s_num_q)
    merge = np.stack(
        [
            query_start[s_rows][query_tile] + np.maximum(q_begin[split][query_tile], 0) + query,
            part_base[query_tile] + query,
            s_num_q[query_tile],
            s_splits[query_tile],
            is_full[split][query_tile].astype(np.int64),
        ],
        axis=1,
    )
    num_part_rows = int((s_splits * s_num_q).sum())
    if capacity is not None:
        if work.shape[0] > capacity.num_work or merge.shape[0] > capacity.num_merge:
            raise AssertionError(f"plan exceeds its capacity {capacity}: {work.shape[0]} items, {merge.shape[0]} merges")
        if num_part_rows > capacity.num_part_rows:
            raise AssertionError(f"plan exceeds its capacity {capacity}: {num_part_rows} partial rows")
        work = np.concatenate([work, np.tile([[-1, 0, 0, 0, -1]], (capacity.num_work - work.shape[0], 1))])
        merge = np.concatenate([merge, np.zeros((capacity.num_merge - merge.shape[0], MERGE_FIELDS), np.int64)])
        num_part_rows = capacity.num_part_rows
    return work.astype(np.int32).reshape(-1, WORK_FIELDS), merge.astype(np.int32).reshape(-1, MERGE_FIELDS), num_part_rows


def plan_attention(
    query_start: list[int],
    context_lens: list[int],
    num_full_rows: int,
    num_selected: list[int],
    recent_start: list[int],
    *,
    group: int,
    num_kv_heads: int,
    device: torch.device,
    min_keys_per_split: int | None = None,
    min_keys_per_full_split: int | None = None,
    min_keys_per_verify_split: int | None = None,
    target_programs: int | None = None,
    num_moved: int = 0,
) -> AttentionPlan:
    """Cut one mixed batch (full rows first, then one-query draft rows) into work items, uploaded.

    Args:
        query_start: `num_rows + 1` token offsets.
        context_lens: keys visible to each row's last query.
        num_full_rows: rows `[0, num_full_rows)` attend fully and causally.
        num_selected, recent_start: per row, read for draft rows (their keys are the selected
            positions plus `recent_start .. context_len - 1`).
        group, num_kv_heads: query heads per KV head, KV heads.
        min_keys_per_split, min_keys_per_full_split, min_keys_per_verify_split, target_programs: the
            split heuristics (module constants by default; tests lower them). `min_keys_per_split`
            alone sets all three floors.
        num_moved: moved-key entries of every draft row (the diagonal selection), 0 otherwise.
    """
    if min_keys_per_full_split is None:  # None on all: the module's floors, resolved by `plan_work_lists`
        min_keys_per_full_split = min_keys_per_split
    if min_keys_per_verify_split is None:
        min_keys_per_verify_split = min_keys_per_full_split
    q_lens = np.diff(np.asarray(query_start))
    block_m_full, block_m_draft = block_sizes(int(q_lens[:num_full_rows].max(initial=1)), group)
    work, merge, num_part_rows = plan_work_lists(
        query_start, context_lens, num_full_rows, num_selected, recent_start, group=group,
        block_m_full=block_m_full, items=target_items(num_kv_heads, torch.device(device), target_programs),
        min_keys_per_split=min_keys_per_split, min_keys_per_full_split=min_keys_per_full_split,
        min_keys_per_verify_split=min_keys_per_verify_split, num_moved=num_moved,
    )  # fmt: skip
    lists = torch.from_numpy(np.concatenate([work.reshape(-1), merge.reshape(-1)]))
    if torch.device(device).type == "cuda":
        lists = lists.pin_memory().to(device, non_blocking=True)
    else:
        lists = lists.to(device)
    return AttentionPlan(
        work=lists[: work.size].view(-1, WORK_FIELDS),
        merge=lists[work.size :].view(-1, MERGE_FIELDS),
        num_part_rows=num_part_rows,
        block_m_full=block_m_full,
        block_m_draft=block_m_draft,
        group=group,
        num_kv_heads=num_kv_heads,
    )


def plan_from_tensors(
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    num_full_rows: int,
    num_selected: torch.Tensor | None,
    recent_start: torch.Tensor | None,
    *,
    group: int,
    num_kv_heads: int,
) -> AttentionPlan:
    """A plan made by reading the lengths back to the host (a sync): for tests and one-off calls."""
    zeros = [0] * context_lens.shape[0]
    return plan_attention(
        query_start.tolist(),
        context_lens.tolist(),
        num_full_rows,
        num_selected.tolist() if num_selected is not None else zeros,
        recent_start.tolist() if recent_start is not None else zeros,
        group=group,
        num_kv_heads=num_kv_heads,
        device=context_lens.device,
    )

