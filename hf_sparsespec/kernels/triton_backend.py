"""TritonBackend: the attention ops of an engine step on the Triton kernels (CUDA, or the CPU
interpreter under `TRITON_INTERPRET=1`).

Per layer: `store_kv`, `mixed_attention(..., plan=p)` (one launch over the step's work list plus one
merge launch) and, for verification rows, `score_verification` (the layer's scores, and for the
diagonal selection its best keys); after the forward, `select_verified_keys` (every layer's top keys
straight into the selected-index store in one launch, and the moved-key offsets in another). Grids come from the shapes and the plan's capacity, never from lengths
read back from the device, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from hf_sparsespec.kernels.attention_plan import AttentionPlan
from hf_sparsespec.kernels.induction_keys import write_induction_keys
from hf_sparsespec.kernels.keyed_sample import (
    accept_drafts,
    keyed_sample,
    keyed_sample_residual,
    position_keys,
    probabilities_at,
)
from hf_sparsespec.kernels.mixed_attention import mixed_attention
from hf_sparsespec.kernels.pillar_select import (
    gather_queries,
    pillar_scores_into,
    pillar_scores_layers_into,
    select_verified_keys,
)
from hf_sparsespec.kernels.shifts import shift_speculative_rows
from hf_sparsespec.kernels.store_kv import store_kv
from hf_sparsespec.kernels.store_rows import store_rows
from hf_sparsespec.kernels.tempered_softmax import (
    softmax_stats,
    tempered_softmax,
    truncated_softmax,
    truncation_stats,
)


class TritonBackend:
    """Triton kernels behind the `AttentionBackend` calls."""

    name = "triton"
    needs_plan = True

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def mixed_attention(
        self, query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
        recent_start, selected, selection_slot, num_selected, scale, plan: AttentionPlan | None = None, offsets=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return mixed_attention(
            query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
            recent_start, selected, selection_slot, num_selected, scale, plan=plan, offsets=offsets,
        )  # fmt: skip

    def score_verification(
        self, query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale, slots,
        max_queries=None, offsets=None, best=None, max_rows=None,
    ) -> None:  # fmt: skip
        """`offsets` are written by `select_verified_keys`, from `best`."""
        pillar_scores_into(query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale, max_queries,
                           best=best, max_rows=max_rows)  # fmt: skip

    def gather_queries(self, query, lse, tokens, out_query, out_lse) -> None:
        gather_queries(query, lse, tokens, out_query, out_lse)

    def score_layers(
        self, query, key_pool, page_table, query_start, lse, num_old_keys, scores, scale, slots,
        max_queries=None, offsets=None, best=None, max_rows=None,
    ) -> None:  # fmt: skip
        """Every layer's scores in one launch; `offsets` are written by `select_verified_keys`, from `best`."""
        pillar_scores_layers_into(query, key_pool, page_table, query_start, lse, num_old_keys, scores, scale,
                                  max_queries, best=best, max_rows=max_rows)  # fmt: skip

    def select_verified_keys(
        self, scores, num_old_keys, budgets, selected, slots, offsets=None, best=None, group=1,
        num_selectable_keys=None,
    ) -> None:  # fmt: skip
        select_verified_keys(scores, num_old_keys, budgets, selected, slots, offsets, best, group, num_selectable_keys)

    def keyed_sample(self, probs, keys, stats=None, temperature=1.0) -> torch.Tensor:
        return keyed_sample(probs, keys, stats, temperature)

    def keyed_sample_residual(self, probs, rows, store, store_rows, keys, stats=None, store_stats=None,
                              temperature=1.0) -> torch.Tensor:  # fmt: skip
        return keyed_sample_residual(probs, rows, store, store_rows, keys, stats, store_stats, temperature)

    def probabilities_at(self, values, rows, tokens, stats=None, temperature=1.0) -> torch.Tensor:
        return probabilities_at(values, rows, tokens, stats, temperature)

    def accept_drafts(self, p, q, accept_keys, num_drafts, draft_rows, target_keys) -> tuple[torch.Tensor, ...]:
        return accept_drafts(p, q, accept_keys, num_drafts, draft_rows, target_keys)

    def position_keys(self, streams, positions) -> torch.Tensor:
        return position_keys(streams, positions)

    def tempered_softmax(self, logits, temperature) -> torch.Tensor:
        return tempered_softmax(logits, temperature)

    def softmax_stats(self, logits, temperature) -> torch.Tensor:
        return softmax_stats(logits, temperature)

    def truncated_softmax(self, logits, temperature, top_k, top_p, min_tokens_to_keep) -> torch.Tensor:
        return truncated_softmax(logits, temperature, top_k, top_p, min_tokens_to_keep)

    def truncation_stats(self, logits, temperature, top_k, top_p, min_tokens_to_keep) -> torch.Tensor:
        return truncation_stats(logits, temperature, top_k, top_p, min_tokens_to_keep)

    def store_rows(self, dst, index, src) -> None:
        store_rows(dst, index, src)

    def write_induction_keys(self, moved_offsets, num_taken, token_buffer, input_index, row_base, recent_start):
        write_induction_keys(moved_offsets, num_taken, token_buffer, input_index, row_base, recent_start)

    def shift_speculative_rows(self, *args) -> tuple[torch.Tensor, ...]:
        return shift_speculative_rows(*args)
