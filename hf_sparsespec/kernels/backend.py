"""The backend seam: which implementation of the attention ops a step uses.

`TorchBackend` runs the float32 references (the CPU backend and the oracle); `TritonBackend` runs
the Triton kernels (CUDA, or the CPU interpreter under `TRITON_INTERPRET=1`). Both expose the same
per-layer calls: `store_kv`, `mixed_attention` (with the step's `AttentionPlan` when `needs_plan`;
with `offsets`, draft rows also attend their moved keys, `moved_keys.py`) and `score_verification`
(PillarAttn: score the verification rows' keys into the layer's plane of the scores workspace; or,
`SparseSpecConfig.score_after_forward`, `score_layers` once after the forward, from copies of every
layer's verification queries and LSE, `gather_queries`), then
once per step `select_verified_keys` (every layer's top keys into the selected-index store; for
`"diagonal"`, every layer's moved-key offsets: the Triton backend from its best-key workspace, the
reference already while scoring), and the sampler's `keyed_sample` (one token per row from keyed
noise), `keyed_sample_residual` (the same from `max(p - q, 0)` of rows read in place: the
verifications' recovered and bonus tokens; both take probabilities, or logits with their stats),
`probabilities_at` (the acceptance test's probabilities of the drafted tokens), `position_keys` (each
draw's key from its stream and position) and `accept_drafts` (the acceptance tests, their uniforms hashed in),
`softmax_stats` (each row's maximum and inverse sum of its tempered logits: the sampling distributions,
read from the logits, when temperature is the only logits processor), `truncation_stats` (the same
with top-k / top-p, without sorting the vocabulary, plus each row's smallest kept logit),
`tempered_softmax` and `truncated_softmax` (those distributions written out), `store_rows` (the drafts' distributions into their store; rows indexed -1
skipped), `write_induction_keys` (the `"induction"` selection's lookup of every draft row's
induction keys into the moved-key store, `induction_keys.py`) and `shift_speculative_rows` (the
delayed verification's speculative rows moved by the accepted counts, `shifts.py`). The Triton
calls never read device memory back (CUDA-graph safe).
"""

from __future__ import annotations

from typing import Protocol

import torch

from hf_sparsespec.kernels.induction_keys import write_induction_keys_ref
from hf_sparsespec.kernels.keyed_sample import (
    accept_drafts_ref,
    keyed_sample_ref,
    keyed_sample_residual_ref,
    position_keys_ref,
    probabilities_at_ref,
)
from hf_sparsespec.kernels.mixed_attention import mixed_attention_ref
from hf_sparsespec.kernels.pillar_select import gather_queries_ref, score_verification_ref, select_verified_keys_ref
from hf_sparsespec.kernels.shifts import shift_speculative_rows_ref
from hf_sparsespec.kernels.store_kv import store_kv_ref
from hf_sparsespec.kernels.store_rows import store_rows_ref
from hf_sparsespec.kernels.tempered_softmax import (
    softmax_stats_ref,
    tempered_softmax_ref,
    truncated_softmax_ref,
    truncation_stats_ref,
)


class AttentionBackend(Protocol):
    name: str
    needs_plan: bool  # whether `mixed_attention` takes an `AttentionPlan` (built by the batch builder)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None: ...

    def mixed_attention(
        self, query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
        recent_start, selected, selection_slot, num_selected, scale, plan=None, offsets=None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def score_verification(
        self, query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale, slots,
        max_queries=None, offsets=None, best=None, max_rows=None,
    ) -> None: ...  # fmt: skip

    def score_layers(
        self, query, key_pool, page_table, query_start, lse, num_old_keys, scores, scale, slots,
        max_queries=None, offsets=None, best=None, max_rows=None,
    ) -> None: ...  # fmt: skip

    def gather_queries(self, query, lse, tokens, out_query, out_lse) -> None: ...

    def select_verified_keys(
        self, scores, num_old_keys, budgets, selected, slots, offsets=None, best=None, group=1,
        num_selectable_keys=None,
    ) -> None: ...  # fmt: skip

    def keyed_sample(self, probs, keys, stats=None, temperature=1.0) -> torch.Tensor: ...

    def keyed_sample_residual(self, probs, rows, store, store_rows, keys, stats=None, store_stats=None,
                              temperature=1.0) -> torch.Tensor: ...  # fmt: skip

    def probabilities_at(self, values, rows, tokens, stats=None, temperature=1.0) -> torch.Tensor: ...

    def accept_drafts(self, p, q, accept_keys, num_drafts, draft_rows, target_keys) -> tuple[torch.Tensor, ...]: ...

    def position_keys(self, streams, positions) -> torch.Tensor: ...

    def tempered_softmax(self, logits, temperature) -> torch.Tensor: ...

    def softmax_stats(self, logits, temperature) -> torch.Tensor: ...

    def truncated_softmax(self, logits, temperature, top_k, top_p, min_tokens_to_keep) -> torch.Tensor: ...

    def truncation_stats(self, logits, temperature, top_k, top_p, min_tokens_to_keep) -> torch.Tensor: ...

    def store_rows(self, dst, index, src) -> None: ...

    def write_induction_keys(self, moved_offsets, num_taken, token_buffer, input_index, row_base,
                             recent_start) -> None: ...  # fmt: skip

    def shift_speculative_rows(self, *args) -> tuple[torch.Tensor, ...]: ...  # arguments: `shifts.py`


class TorchBackend:
    """Float32 torch references; correct anywhere, fast nowhere (loops over requests on the host)."""

    name = "torch"
    needs_plan = False

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def mixed_attention(
        self, query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
        recent_start, selected, selection_slot, num_selected, scale, plan=None, offsets=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return mixed_attention_ref(
            query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
            recent_start, selected, selection_slot, num_selected, scale, offsets,
        )  # fmt: skip

    def score_verification(
        self, query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale, slots,
        max_queries=None, offsets=None, best=None, max_rows=None,
    ) -> None:  # fmt: skip
        """The moved-key offsets go straight into `offsets[slots]` (`best`, the Triton workspace, is unused)."""
        score_verification_ref(query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale, slots,
                               offsets)  # fmt: skip

    def gather_queries(self, query, lse, tokens, out_query, out_lse) -> None:
        gather_queries_ref(query, lse, tokens, out_query, out_lse)

    def score_layers(
        self, query, key_pool, page_table, query_start, lse, num_old_keys, scores, scale, slots,
        max_queries=None, offsets=None, best=None, max_rows=None,
    ) -> None:  # fmt: skip
        """Every layer's `score_verification` after the forward: `query [layers, tokens, ...]` and `lse`
        the layers' copies, `key_pool [layers, ...]`, `scores` and `offsets` with a layer dimension."""
        for layer in range(key_pool.shape[0]):
            score_verification_ref(query[layer], key_pool[layer], page_table, query_start, lse[layer], num_old_keys,
                                   scores[layer], scale, slots, offsets[layer] if offsets is not None else None)  # fmt: skip

    def select_verified_keys(
        self, scores, num_old_keys, budgets, selected, slots, offsets=None, best=None, group=1,
        num_selectable_keys=None,
    ) -> None:  # fmt: skip
        """`offsets` were written while scoring (from every old key)."""
        selectable = num_old_keys if num_selectable_keys is None else num_selectable_keys
        select_verified_keys_ref(scores, selectable, budgets, selected, slots)

    def keyed_sample(self, probs, keys, stats=None, temperature=1.0) -> torch.Tensor:
        return keyed_sample_ref(probs, keys, stats, temperature)

    def keyed_sample_residual(self, probs, rows, store, store_rows, keys, stats=None, store_stats=None,
                              temperature=1.0) -> torch.Tensor:  # fmt: skip
        return keyed_sample_residual_ref(probs, rows, store, store_rows, keys, stats, store_stats, temperature)

    def probabilities_at(self, values, rows, tokens, stats=None, temperature=1.0) -> torch.Tensor:
        return probabilities_at_ref(values, rows, tokens, stats, temperature)

    def accept_drafts(self, p, q, accept_keys, num_drafts, draft_rows, target_keys) -> tuple[torch.Tensor, ...]:
        return accept_drafts_ref(p, q, accept_keys, num_drafts, draft_rows, target_keys)

    def position_keys(self, streams, positions) -> torch.Tensor:
        return position_keys_ref(streams, positions)

    def tempered_softmax(self, logits, temperature) -> torch.Tensor:
        return tempered_softmax_ref(logits, temperature)

    def softmax_stats(self, logits, temperature) -> torch.Tensor:
        return softmax_stats_ref(logits, temperature)

    def truncated_softmax(self, logits, temperature, top_k, top_p, min_tokens_to_keep) -> torch.Tensor:
        return truncated_softmax_ref(logits, temperature, top_k, top_p, min_tokens_to_keep)

    def truncation_stats(self, logits, temperature, top_k, top_p, min_tokens_to_keep) -> torch.Tensor:
        return truncation_stats_ref(logits, temperature, top_k, top_p, min_tokens_to_keep)

    def store_rows(self, dst, index, src) -> None:
        store_rows_ref(dst, index, src)

    def write_induction_keys(self, moved_offsets, num_taken, token_buffer, input_index, row_base, recent_start):
        write_induction_keys_ref(moved_offsets, num_taken, token_buffer, input_index, row_base, recent_start)

    def shift_speculative_rows(self, *args) -> tuple[torch.Tensor, ...]:
        return shift_speculative_rows_ref(*args)


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """`"torch"`, `"triton"`, or `"auto"` (Triton on CUDA when its kernels import, torch otherwise)."""
    if name == "torch":
        return TorchBackend()
    if name == "auto" and device.type != "cuda":
        return TorchBackend()
    try:
        from hf_sparsespec.kernels.triton_backend import TritonBackend
    except ImportError as error:
        if name == "triton":
            raise NotImplementedError(f"the Triton backend is not available here: {error}") from error
        return TorchBackend()
    return TritonBackend()
