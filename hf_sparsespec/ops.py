"""The attention ops of a step as `torch.library` custom ops, for a `torch.compile`d forward.

`torch.compile` fuses the modeling code's elementwise work (norms, rotary embeddings, activations,
residuals: most of an iteration's ~40 kernels per layer), but must not trace into the Triton wrappers
(host-side checks, Python planning objects). Wrapped as custom ops, `store_kv`, `mixed_attention` and
`score_verification` are opaque calls in the compiled graph: tensors in and out, the backend named by a
string, shapes of the outputs given by fake implementations. The eager path calls the backends
directly (no dispatch cost); `SparseSpecConfig(compile_forward=True)` routes through these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from hf_sparsespec.kernels.attention_plan import AttentionPlan
from hf_sparsespec.kernels.backend import get_backend


def _backend(name: str, device: torch.device):
    return get_backend(name, device)


@torch.library.custom_op("hf_sparsespec::store_kv", mutates_args=("key_pool", "value_pool"))
def store_kv(
    key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, layer: int,
    slot_mapping: torch.Tensor, backend: str,
) -> None:  # fmt: skip
    """Writes `layer`'s pages of the pools (`[num_layers, num_pages, page_size, kv_heads, head_dim]`,
    `SparseSpecCache.key_pool`/`value_pool`): the layer an argument, not a view, so that layers can
    share one compiled graph (`ModelRunner`, `compile_forward="layers"`)."""
    _backend(backend, key.device).store_kv(key, value, key_pool[layer], value_pool[layer], slot_mapping)


@store_kv.register_fake
def _(key, value, key_pool, value_pool, layer, slot_mapping, backend) -> None:
    return None


@torch.library.custom_op("hf_sparsespec::mixed_attention", mutates_args=("part_out", "part_lse"))
def mixed_attention(
    query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, page_table: torch.Tensor,
    query_start: torch.Tensor, context_lens: torch.Tensor, num_full_rows: torch.Tensor, recent_start: torch.Tensor,
    selected: torch.Tensor, layer: int, selection_slot: torch.Tensor, num_selected: torch.Tensor, scale: float,
    work: torch.Tensor | None, merge: torch.Tensor | None, part_out: torch.Tensor | None,
    part_lse: torch.Tensor | None, block_m_full: int, block_m_draft: int, backend: str,
    moved_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`num_full_rows`: a one-element tensor (read by the reference backend only); the pools (as
    `store_kv`'s), `selected` (and `moved_offsets`, the diagonal selection's, or None): whole stores
    `[num_layers, ...]`, of which `layer` is read."""
    k_cache, v_cache = key_pool[layer], value_pool[layer]
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
def _(query, key_pool, value_pool, page_table, query_start, context_lens, num_full_rows, recent_start, selected, layer,
      selection_slot, num_selected, scale, work, merge, part_out, part_lse, block_m_full, block_m_draft, backend,
      moved_offsets=None):  # fmt: skip
    return torch.empty_like(query), query.new_empty(query.shape[:2], dtype=torch.float32)


@functools.cache
def scoring_stream(device_index: int) -> torch.cuda.Stream:
    """The second stream the scoring passes run on (`SparseSpecConfig.overlap_scoring`), one per device:
    the compiled forward's custom op finds the runner's stream here, not through an argument."""
    return torch.cuda.Stream(device=device_index)


@dataclasses.dataclass
class ScoringAside:
    """Where the scoring passes run beside the forward (`SparseSpecConfig.overlap_scoring`): the second
    stream, and the copies of the verification rows' queries and LSE they read (the forward may reuse
    the originals' memory as soon as a layer is done)."""

    stream: torch.cuda.Stream | None  # None: the copies scored on the current stream (the same data path)
    query: torch.Tensor  # [num_layers, copies, num_q_heads, head_dim]: the runner's store (or a layer's slice)
    lse: torch.Tensor  # [num_layers, copies, num_q_heads] fp32 (or a layer's slice)
    tokens: torch.Tensor  # [n] int64, the step's tokens copied (the verification rows', then padding)
    query_start: torch.Tensor  # [num_verify_rows + 1] int32, the rows' starts among the copies
    deferred: bool = False  # `score_after_forward`: the layers only copy; the runner scores them all after

    @classmethod
    def for_step(
        cls, stream, query_store: torch.Tensor, lse_store: torch.Tensor, verify_query_start: torch.Tensor, count: int,
        num_tokens: int, deferred: bool = False,
    ) -> ScoringAside:  # fmt: skip
        """The `count` tokens from the first verification row's (its rows', then whatever follows:
        never read) of a step of `num_tokens`, and the rows' starts among them (device ops only)."""
        first = verify_query_start[:1]
        tokens = (first.long() + torch.arange(count, device=verify_query_start.device)).clamp_(max=num_tokens - 1)
        return cls(stream, query_store, lse_store, tokens, verify_query_start - first, deferred)

    def for_layer(self, layer: int) -> ScoringAside:
        """The same with the copies of `layer` (`[n, ...]`)."""
        n = self.tokens.shape[0]
        return dataclasses.replace(self, query=self.query[layer, :n], lse=self.lse[layer, :n])


def score_layer(
    backend, query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale, slots, max_queries,
    offsets=None, best=None, aside: ScoringAside | None = None, max_rows: int | None = None,
) -> None:  # fmt: skip
    """One layer's `score_verification` (`max_rows`: the workspace's rows, as `pillar_scores_into`); with
    `aside` (the layer's, `ScoringAside.for_layer`), from copies of what it reads, on its stream (the
    runner joins the stream after the forward, before selecting)."""
    if aside is None:
        backend.score_verification(query, k_cache, page_table, query_start, lse, num_old_keys, scores, scale, slots,
                                   max_queries, offsets=offsets, best=best, max_rows=max_rows)  # fmt: skip
        return
    backend.gather_queries(query, lse, aside.tokens, aside.query, aside.lse)
    if aside.deferred:  # every layer is scored after the forward, from these copies
        return
    if aside.stream is not None:
        aside.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(aside.stream) if aside.stream is not None else contextlib.nullcontext():
        backend.score_verification(aside.query, k_cache, page_table, aside.query_start, aside.lse, num_old_keys,
                                   scores, scale, slots, max_queries, offsets=offsets, best=best,
                                   max_rows=max_rows)  # fmt: skip


@torch.library.custom_op(
    "hf_sparsespec::score_verification", mutates_args=("scores", "moved_offsets", "best", "aside_query", "aside_lse")
)
def score_verification(
    query: torch.Tensor, key_pool: torch.Tensor, page_table: torch.Tensor, query_start: torch.Tensor,
    lse: torch.Tensor, num_old_keys: torch.Tensor, scores: torch.Tensor, layer: int, slots: torch.Tensor,
    scale: float, max_queries: int, max_rows: int, backend: str, moved_offsets: torch.Tensor | None,
    best: torch.Tensor | None, num_moves: int, aside_query: torch.Tensor | None, aside_lse: torch.Tensor | None,
    aside_tokens: torch.Tensor | None, aside_query_start: torch.Tensor | None, aside_on_stream: bool,
    aside_deferred: bool,
) -> None:  # fmt: skip
    """Writes `scores[layer]` (and, for the diagonal selection, `best[layer]` on Triton or the first
    `num_moves` entries of `moved_offsets[layer]` on the reference); the whole stores are the mutated
    arguments: a compiled graph loses mutations of a view of a tensor it did not receive as an input.
    `aside_*` (`ScoringAside`'s; the query None: none): score from the copies in
    `aside_query[layer]`/`aside_lse[layer]`, on the device's `scoring_stream` if `aside_on_stream`, or
    (`aside_deferred`) only copy there: the runner scores every layer after the forward. The optional mutated arguments have no
    defaults: torch 2.10-2.11 drop arguments equal to their defaults and then fail to find them
    (IndexError, pytorch/pytorch#176078)."""
    aside = None
    if aside_query is not None:
        stream = scoring_stream(query.device.index) if aside_on_stream else None
        aside = ScoringAside(stream, aside_query, aside_lse, aside_tokens, aside_query_start,
                             aside_deferred).for_layer(layer)  # fmt: skip
    score_layer(
        _backend(backend, query.device), query, key_pool[layer], page_table, query_start, lse, num_old_keys, scores[layer],
        scale, slots, max_queries, offsets=moved_offsets[layer][..., :num_moves] if moved_offsets is not None else None,
        best=best[layer] if best is not None else None, aside=aside, max_rows=max_rows,
    )  # fmt: skip


@score_verification.register_fake
def _(query, key_pool, page_table, query_start, lse, num_old_keys, scores, layer, slots, scale, max_queries, max_rows,
      backend, moved_offsets, best, num_moves, aside_query, aside_lse, aside_tokens, aside_query_start, aside_on_stream,
      aside_deferred):  # fmt: skip
    return None
