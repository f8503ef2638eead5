"""TritonBackend: the attention ops of an engine step on the Triton kernels (CUDA, or the CPU
interpreter under `TRITON_INTERPRET=1`).

Call pattern per engine step: `plan(host)` once, from host-side lengths (no device reads), then per
layer `store_kv`, `mixed_attention(..., plan=p)` and, for verification rows, `pillar_select(..., plan=p)`.
The plan's device work list is built the first time a layer needs it (the GQA shape comes with the
first call) and reused by every later layer; nothing in the per-layer calls reads device memory back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_sparsespec.kernels.attention_plan import AttentionPlan, plan_attention
from hf_sparsespec.kernels.mixed_attention import mixed_attention
from hf_sparsespec.kernels.pillar_select import pillar_select
from hf_sparsespec.kernels.store_kv import store_kv


@dataclass
class TritonStepPlan:
    """Host lengths of one step and the device work lists made from them (one per GQA shape)."""

    query_start: list[int]  # num_rows + 1
    context_lens: list[int]  # num_rows
    num_full_rows: int
    num_selected: list[int]  # num_rows (draft rows; 0 for others)
    recent_start: list[int]  # num_rows
    device: torch.device
    attention: dict[tuple[int, int], AttentionPlan] = field(default_factory=dict)

    def attention_plan(self, group: int, num_kv_heads: int) -> AttentionPlan:
        key = (group, num_kv_heads)
        if key not in self.attention:
            self.attention[key] = plan_attention(
                self.query_start,
                self.context_lens,
                self.num_full_rows,
                self.num_selected,
                self.recent_start,
                group=group,
                num_kv_heads=num_kv_heads,
                device=self.device,
            )
        return self.attention[key]


class TritonBackend:
    """Triton kernels behind the `AttentionBackend` calls."""

    name = "triton"

    def __init__(self) -> None:
        self._gqa_shape: tuple[int, int] | None = None  # (group, num_kv_heads) of the last call

    def plan(self, host) -> TritonStepPlan:
        """Once per step. `host` has `query_start` (len R+1), `context_lens`, `num_full_rows`,
        `num_selected`, `recent_start` (lists of ints) and `device`."""
        step = TritonStepPlan(
            query_start=list(host.query_start),
            context_lens=list(host.context_lens),
            num_full_rows=int(host.num_full_rows),
            num_selected=list(host.num_selected),
            recent_start=list(host.recent_start),
            device=torch.device(host.device),
        )
        if self._gqa_shape is not None:  # the model is known after the first step: build now
            step.attention_plan(*self._gqa_shape)
        return step

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def mixed_attention(
        self, query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
        recent_start, selected, selection_slot, num_selected, scale, plan: TritonStepPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        attention_plan = None
        num_kv_heads = k_cache.shape[2]
        if plan is not None:
            if num_kv_heads == 0 or query.shape[1] % num_kv_heads:
                raise ValueError(f"query: expected a multiple of {num_kv_heads} heads, got {query.shape[1]}")
            if plan.num_full_rows != num_full_rows:
                raise ValueError(f"num_full_rows: expected {plan.num_full_rows} (the plan's), got {num_full_rows}")
            self._gqa_shape = (query.shape[1] // num_kv_heads, num_kv_heads)
            attention_plan = plan.attention_plan(*self._gqa_shape)
        return mixed_attention(
            query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
            recent_start, selected, selection_slot, num_selected, scale, plan=attention_plan,
        )  # fmt: skip

    def pillar_select(
        self, query, k_cache, page_table, query_start, lse, num_old_keys, budgets,
        max_num_old_keys, max_budget, scale, plan: TritonStepPlan | None = None,
    ) -> torch.Tensor:  # fmt: skip
        # Scoring needs no plan: its grid follows from the shapes.
        return pillar_select(
            query, k_cache, page_table, query_start, lse, num_old_keys, budgets, max_num_old_keys, max_budget, scale
        )
