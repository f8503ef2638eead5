"""The plan of an attention launch: which program attends which keys of which row.

Why a plan: one request with a 32K context and 255 drafting requests with 1K keys each must not be
one program per row (the long row would run alone at the end), and the kernels must not read lengths
back to the host every layer. So once per engine step, from host-side lengths, the work is cut into
items of about equal key counts, and every layer's launch reuses the uploaded list.

A work item is `(row, q_begin, key_begin, key_end, part_row)`:
- `row` owns queries `query_start[row] + q_begin ...` (a tile of up to `BLOCK_M // group` queries for
  full rows, the single query for draft rows) and attends its key indices `[key_begin, key_end)`;
  for full rows key index = position, for draft rows the selected positions come first, then the
  recent window (`sparse_attention`);
- `part_row = -1`: the item covers all its tile's keys and writes `out`/`lse` directly; otherwise it
  writes fp32 partial rows `part_row + i` (query `i` of the tile), and the merge kernel combines the
  splits of each query: merge entry `(token, first_part_row, split_stride, num_splits)`.
The grid is `(num_work, num_kv_heads)`: every (work item, KV head) pair is one program.

Invariant: a plan is only valid with the lengths it was made from (the kernels read the same
`query_start`/`context_lens`/`num_selected`/`recent_start` from device tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hf_sparsespec.kernels._checks import next_power_of_2

# Keys of one block of the kernels' inner loop; split boundaries are rounded to it.
KEY_ALIGN = 64
# The fewest keys a split gets, for full-row tiles and draft tiles: below this, the per-program cost
# (loading Q, writing fp32 partials, merging) stops being small next to the keys' bytes. A full tile's
# partials are up to BLOCK_M rows, a draft tile's one group, hence the different floors.
MIN_KEYS_PER_SPLIT = 256
MIN_KEYS_PER_FULL_SPLIT = 1024
# Programs the decomposition aims for, per multiprocessor (several waves hide the tail).
PROGRAMS_PER_SM = 4
# The largest packed query tile (queries x GQA group) of full rows.
MAX_BLOCK_M = 128


@dataclass
class AttentionPlan:
    """Device work lists of one attention launch (see the module docstring)."""

    work: torch.Tensor  # [num_work, 5] int32: row, q_begin, key_begin, key_end, part_row
    merge: torch.Tensor  # [num_merge, 4] int32: token, first part row, split stride, num splits
    num_part_rows: int
    block_m_full: int  # packed (query, head) rows of a full-row tile
    block_m_draft: int  # packed rows of a draft tile (the GQA group, padded to >= 16)
    group: int
    num_kv_heads: int
    _workspace: dict = field(default_factory=dict, repr=False)

    @property
    def num_work(self) -> int:
        return self.work.shape[0]

    @property
    def num_merge(self) -> int:
        return self.merge.shape[0]

    def workspace(self, num_q_heads: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 partial outputs `[num_part_rows, num_q_heads, head_dim]` and LSEs `[num_part_rows, num_q_heads]`,
        allocated once and shared by every layer that uses this plan (layers run one after another)."""
        key = (num_q_heads, head_dim, device)
        if key not in self._workspace:
            rows = max(self.num_part_rows, 1)
            self._workspace[key] = (
                torch.empty((rows, num_q_heads, head_dim), dtype=torch.float32, device=device),
                torch.empty((rows, num_q_heads), dtype=torch.float32, device=device),
            )
        return self._workspace[key]


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so that tests exercise splits


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list to a device int32 tensor without a host sync (pinned staging, async copy)."""
    host = torch.tensor(values, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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
    target_programs: int | None = None,
) -> AttentionPlan:
    """Cut one mixed batch (full rows first, then one-query draft rows) into work items.

    Args:
        query_start: `num_rows + 1` token offsets.
        context_lens: keys visible to each row's last query.
        num_full_rows: rows `[0, num_full_rows)` attend fully and causally.
        num_selected, recent_start: per row, read for draft rows (their keys are the selected
            positions plus `recent_start .. context_len - 1`).
        group, num_kv_heads: query heads per KV head, KV heads.
        min_keys_per_split, min_keys_per_full_split, target_programs: the split heuristics
            (module constants by default; tests lower them). `min_keys_per_split` alone sets both floors.
    """
    if min_keys_per_split is None:
        min_keys_per_split = MIN_KEYS_PER_SPLIT
        min_keys_per_full_split = (
            MIN_KEYS_PER_FULL_SPLIT if min_keys_per_full_split is None else min_keys_per_full_split
        )
    elif min_keys_per_full_split is None:
        min_keys_per_full_split = min_keys_per_split
    num_rows = len(context_lens)
    if len(query_start) != num_rows + 1:
        raise ValueError(f"query_start: expected {num_rows + 1} offsets, got {len(query_start)}")
    q_lens = [query_start[r + 1] - query_start[r] for r in range(num_rows)]
    max_full_q = max(q_lens[:num_full_rows], default=1)
    min_block = max(16, next_power_of_2(group))
    block_m_full = max(min_block, min(MAX_BLOCK_M, next_power_of_2(max(max_full_q, 1) * group)))
    block_m_draft = min_block
    tile_q = block_m_full // group

    # Tiles: (row, q_begin, queries in tile, keys the tile needs).
    tiles: list[tuple[int, int, int, int]] = []
    for r in range(num_full_rows):
        for q_begin in range(0, q_lens[r], tile_q):
            num_q = min(tile_q, q_lens[r] - q_begin)
            # Causal: the tile's last query sits at context_len - q_len + q_begin + num_q - 1.
            tiles.append((r, q_begin, num_q, context_lens[r] - q_lens[r] + q_begin + num_q))
    for r in range(num_full_rows, num_rows):
        if q_lens[r] != 1:
            raise ValueError(f"draft row {r}: expected 1 query, got {q_lens[r]}")
        tiles.append((r, 0, 1, num_selected[r] + context_lens[r] - recent_start[r]))

    total_keys = sum(t[3] for t in tiles)
    if target_programs is None:
        target_programs = PROGRAMS_PER_SM * _num_sms(device)
    target_items = max(1, target_programs // max(num_kv_heads, 1))
    chunk = math.ceil(total_keys / target_items)

    work: list[tuple[int, int, int, int, int]] = []
    merge: list[list[int]] = []
    num_part_rows = 0
    for row, q_begin, num_q, num_keys in tiles:
        floor = min_keys_per_full_split if row < num_full_rows else min_keys_per_split
        num_splits = max(1, math.ceil(num_keys / max(chunk, floor)))
        if num_splits == 1:
            work.append((row, q_begin, 0, num_keys, -1))
            continue
        size = math.ceil(num_keys / num_splits)
        size = math.ceil(size / KEY_ALIGN) * KEY_ALIGN if size > KEY_ALIGN else size
        num_splits = math.ceil(num_keys / size)
        for s in range(num_splits):
            work.append((row, q_begin, s * size, min((s + 1) * size, num_keys), num_part_rows + s * num_q))
        token = query_start[row] + q_begin
        merge.extend([token + i, num_part_rows + i, num_q, num_splits] for i in range(num_q))
        num_part_rows += num_splits * num_q
    # Longest items first, so the short ones fill the tail of the grid.
    work.sort(key=lambda item: item[2] - item[3])
    lists = _upload([v for w in work for v in w] + [v for m in merge for v in m], device)
    return AttentionPlan(
        work=lists[: 5 * len(work)].view(-1, 5),
        merge=lists[5 * len(work) :].view(-1, 4),
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
    num_rows = context_lens.shape[0]
    zeros = [0] * num_rows
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
