"""StepBatch: what the attention function and the cache read during one model forward.

The batch is packed: `input_ids` is `[1, num_tokens]`; rows come ordered prefill, verify, draft (then
padding rows of a bucket); a row's tokens are contiguous and follow the row order. Every tensor here
is a view of the runner's static device buffers, and every Python number is a constant of the
iteration's shape, so the same object serves an eager forward and a CUDA-graph capture (whose
replays see new buffer contents, never new Python values). It reaches the cache's `update` through
`SparseSpecCache.active_step` and the attention function as the forward kwarg `sparsespec_step`;
nothing about a step lives in module globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_sparsespec.kernels.attention_plan import AttentionPlan
from hf_sparsespec.kernels.backend import AttentionBackend


@dataclass
class StepBatch:
    backend: AttentionBackend
    cache: object  # SparseSpecCache (typed loosely to avoid an import cycle)
    num_full_rows: int  # prefill + real verify rows (read by the reference backend only)
    # --- per token ---
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each token's new K/V (-1: none)
    # --- per row ---
    page_table: torch.Tensor  # [num_rows, max_pages] int32
    query_start: torch.Tensor  # [num_rows + 1] int32
    context_lens: torch.Tensor  # [num_rows] int32
    recent_start: torch.Tensor  # [num_rows] int32 (draft rows; 0 elsewhere)
    selection_slot: torch.Tensor  # [num_rows] int32 (draft rows; 0 elsewhere)
    num_selected: torch.Tensor  # [num_rows] int32 (draft rows; 0 elsewhere)
    plan: AttentionPlan | None  # the Triton backend's work lists
    # --- verification rows (PillarAttn) ---
    num_verify_rows: int  # verify slots of the shape (real rows first; padding has no queries)
    spec_len: int  # k + 1: the most queries of a verification row
    verify_page_table: torch.Tensor  # [num_verify_rows, max_pages] int32
    verify_query_start: torch.Tensor  # [num_verify_rows + 1] int32, absolute token offsets
    num_old_keys: torch.Tensor  # [num_verify_rows] int32, keys older than each verification block
    budgets: torch.Tensor  # [num_verify_rows] int32, keys PillarAttn keeps per (layer, KV head)
    verify_slots: torch.Tensor  # [num_verify_rows] int64, slots whose selection the rows rewrite
    scores: torch.Tensor | None  # [num_layers, num_verify_rows, num_kv_heads, width] fp32 workspace
    # the workspace's rows: the most verify slots any shape has (fixes the scoring kernel's compiled row
    # padding, so a bucket with fewer rows compiles nothing mid-run)
    max_verify_rows: int | None
    score_verify_rows: bool  # PillarAttn (and "diagonal") scores keys inside the verification attention
    # --- the "diagonal" moved keys (None otherwise) ---
    best: torch.Tensor | None  # [num_layers, num_verify_rows, num_kv_heads, verify_moves] int64 (Triton), zeros between steps
    max_context: int  # the longest context any request of the engine reaches (sliding-window guard)
    attention_calls: int = field(default=0)
    compiled: bool = False  # inside a torch.compile'd forward: call the ops through `hf_sparsespec.ops`
    num_full_rows_tensor: torch.Tensor | None = None  # [1] int32, `num_full_rows` for the custom op
    # entries of the moved-key store the verifications write: its first (k + 1) x group ("diagonal",
    # "induction_diagonal"); 0: none. "induction" keys (the rest of the store) are filled before the forward
    verify_moves: int = 0
    # `overlap_scoring`: the scoring pass's stream and copies (`ops.ScoringAside`, with `query` and `lse`
    # the runner's whole `[num_layers, ...]` stores, sliced per layer); None: scored in line
    aside: object | None = None
    # `score_after_forward`: the one softmax scale the runner scores every layer with (`runner.attention_scales`)
    score_scale: float | None = None
