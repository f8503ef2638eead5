"""StepBatch: everything one model forward of the engine needs, built once per iteration.

The batch is packed and unpadded: `input_ids` is `[1, num_tokens]`. Rows come ordered prefill,
verify, draft; a row's tokens are contiguous and follow the row order, so the verification tokens are
the range `verify_tokens` and the draft tokens are the tail. The same object reaches the cache's
`update` (through `SparseSpecCache.active_step`) and the attention function (as the forward kwarg
`sparsespec_step`); nothing about a step lives in module globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_sparsespec.kernels.backend import AttentionBackend


@dataclass
class HostPlan:
    """Host copies of the per-row metadata (what a backend plans its work from)."""

    query_start: list[int]
    context_lens: list[int]
    num_full_rows: int
    recent_start: list[int]
    num_selected: list[int]
    device: torch.device


@dataclass
class StepBatch:
    backend: AttentionBackend
    cache: object  # SparseSpecCache (typed loosely to avoid an import cycle)
    num_prefill_rows: int
    num_verify_rows: int
    num_draft_rows: int
    verify_tokens: tuple[int, int]  # [start, end) of the verification tokens in the packed batch
    # --- per token ---
    input_ids: torch.Tensor  # [1, num_tokens] int64
    position_ids: torch.Tensor  # [1, num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each token's new K/V
    # --- per row (prefill, verify, draft) ---
    page_table: torch.Tensor  # [num_rows, max_pages] int32
    query_start: torch.Tensor  # [num_rows + 1] int32
    context_lens: torch.Tensor  # [num_rows] int32
    recent_start: torch.Tensor  # [num_rows] int32 (draft rows; 0 elsewhere)
    selection_slot: torch.Tensor  # [num_rows] int32 (draft rows; 0 elsewhere)
    num_selected: torch.Tensor  # [num_rows] int32 (draft rows; 0 elsewhere)
    # --- verification rows ---
    verify_query_start: torch.Tensor  # [num_verify_rows + 1] int32, rebased to the first verify token
    verify_slots: torch.Tensor  # [num_verify_rows] int64, slots whose selection the rows rewrite
    num_old_keys: torch.Tensor  # [num_verify_rows] int32, keys older than each verification block
    budgets: torch.Tensor  # [num_verify_rows] int32, keys PillarAttn keeps per (layer, KV head)
    max_num_old_keys: int
    max_budget: int  # width of the selected-index store
    score_verify_rows: bool  # PillarAttn selects inside the verification attention
    max_context: int  # longest context in the batch (for sliding-window checks)
    logits_indices: torch.Tensor  # [num_logits_rows] int64, packed tokens whose logits are sampled
    plan: object = None  # the backend's per-step work decomposition
    host: HostPlan | None = None
    attention_calls: int = field(default=0)

    @property
    def num_rows(self) -> int:
        return self.num_prefill_rows + self.num_verify_rows + self.num_draft_rows

    @property
    def num_full_rows(self) -> int:
        return self.num_prefill_rows + self.num_verify_rows
