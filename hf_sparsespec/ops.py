"""The attention ops of a step as `torch.library` custom ops, for a `torch.compile`d forward.

`torch.compile` fuses the modeling code's elementwise work (norms, rotary embeddings, activations,
residuals: most of an iteration's ~40 kernels per layer), but must not trace into the Triton wrappers
(host-side checks, Python planning objects). Wrapped as custom ops, `store_kv`, `mixed_attention` and
`score_verification` are opaque calls in the compiled graph: tensors in and out, the backend named by a
string, shapes of the outputs given by fake implementations. The eager path calls the backends
directly (no dispatch cost); `SparseSpecConfig(compile_forward=True)` routes through these.
"""

from __future__ import annotations

import torch

from hf_sparsespec.kernels.attention_plan import AttentionPlan
from hf_sparsespec.kernels.backend import get_backend


def _backend(name: str, device: torch.device):
    return get_backend(name, device)


@torch.library.custom_op("hf_sparsespec::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    backend: str,
) -> None:  # fmt: skip
    _backend(backend, key.device).store_kv(key, value, k_cache, v_cache, slot_mapping)


@store_kv.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, backend) -> None:
    return None


@torch.library.custom_op("hf_sparsespec::mixed_attention", mutates_args=("part_out", "part_lse"))
def mixed_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    query_start: torch.Tensor, context_lens: torch.Tensor, num_full_rows: torch.Tensor, recent_start: torch.Tensor,
    selected: torch.Tensor, layer: int, selection_slot: torch.Tensor, num_selected: torch.Tensor, scale: float,
    work: torch.Tensor | None, merge: torch.Tensor | None, part_out: torch.Tensor | None,
    part_lse: torch.Tensor | None, block_m_full: int, block_m_draft: int, backend: str,
    moved_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`num_full_rows`: a one-element tensor (read by the reference backend only); `selected` (and
    `moved_offsets`, the diagonal selection's, or None): the whole store `[num_layers, slots,
    kv_heads, width]`, of which `layer` is read."""
    plan, full_rows = None, 0  # with a plan the kernels never read the count: no host read (CUDA-graph capture)
    if work is None:
        full_rows = int(num_full_rows)
    else:
        group = query.shape[1] // k_cache.shape[2]
        plan = AttentionPlan(work, merge, part_out.shape[0], block_m_full, block_m_draft, group, k_cache.shape[2],
                             part_out, part_lse)  # fmt: skip
    return _backend(backend, query.device).mixed_attention(
        query, k_cache, v_cache, page_table, query_start, context_lens, full_rows, recent_start,
        selected[layer], selection_slot, num_selected, scale, plan=plan,
        offsets=moved_offsets[layer] if moved_offsets is not None else None,
    )  # fmt: skip


@mixed_attention.register_fake
def _(query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows, recent_start, selected, layer,
      selection_slot, num_selected, scale, work, merge, part_out, part_lse, block_m_full, block_m_draft, backend,
      moved_offsets=None):  # fmt: skip
    return torch.empty_like(query), query.new_empty(query.shape[:2], dtype=torch.float32)


@torch.library.custom_op("hf_sparsespec::score_verification", mutates_args=("scores", "moved_offsets", "best"))
def score_verification(
    query: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor, query_start: torch.Tensor,
    lse: torch.Tensor, num_old_keys: torch.Tensor, scores: torch.Tensor, layer: int, slots: torch.Tensor,
    scale: float, max_queries: int, backend: str, moved_offsets: torch.Tensor | None, best: torch.Tensor | None,
    num_moves: int,
) -> None:  # fmt: skip
    """Writes `scores[layer]` (and, for the diagonal selection, `best[layer]` on Triton or the first
    `num_moves` entries of `moved_offsets[layer]` on the reference); the whole stores are the mutated
    arguments: a compiled graph loses mutations of a view of a tensor it did not receive as an input.
    The optional mutated arguments have no defaults: torch 2.10-2.11 drop arguments equal to their
    defaults and then fail to find them (IndexError, pytorch/pytorch#176078)."""
    _backend(backend, query.device).score_verification(
        query, k_cache, page_table, query_start, lse, num_old_keys, scores[layer], scale, slots, max_queries,
        offsets=moved_offsets[layer][..., :num_moves] if moved_offsets is not None else None,
        best=best[layer] if best is not None else None,
    )


@score_verification.register_fake
def _(query, k_cache, page_table, query_start, lse, num_old_keys, scores, layer, slots, scale, max_queries, backend,
      moved_offsets, best, num_moves):  # fmt: skip
    return None
