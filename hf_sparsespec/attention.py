"""The attention function registered with transformers as `"sparsespec"`.

Modeling code calls it once per layer with the step's queries; the keys/values of the step were
already written into the pages by `SparseSpecCache.update`. It reads everything else from the
`sparsespec_step` forward kwarg: prefill and verification rows attend fully and causally, draft rows
attend to their PillarAttn selection (plus, for `"diagonal"` and `"induction"`, their moved keys)
plus their recent window, and verification rows score this layer's keys by the exact attention
probabilities they just computed (and, for `"diagonal"`, their most attended keys). The runner turns
every layer's scores into the new selections (and moved-key offsets) after the forward, in one launch.

The matching mask function returns None: the attention derives all masking from the step metadata,
and a dense `[num_tokens, kv_len]` mask of a packed batch would cost quadratic memory.
"""

from __future__ import annotations

import contextlib

import torch

from hf_sparsespec import ops

ATTENTION_NAME = "sparsespec"
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


def sparsespec_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_q_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim] (already in the pages)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    step = kwargs.get("sparsespec_step")
    if step is None:
        raise RuntimeError(
            "attn_implementation='sparsespec' only runs inside hf_sparsespec's engine; call "
            "model.generate(..., generation_strategy='sparsespec') or switch the model back with "
            "model.set_attn_implementation('sdpa')"
        )
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"hf_sparsespec does not support attention with `{name}` ({type(module).__name__})")
    window = kwargs.get("sliding_window")
    if window is not None and window < step.max_context:
        raise NotImplementedError(
            f"{type(module).__name__} uses sliding-window attention (window {window}) and the context "
            f"reached {step.max_context} tokens; hf_sparsespec supports full attention only"
        )
    layer_idx = module.layer_idx
    moved_store = step.cache.moved_offsets  # [layers, slots, kv_heads, num_moved] or None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [num_tokens, num_q_heads, head_dim]
    rows = (step.page_table, step.query_start, step.context_lens)
    score = step.score_verify_rows and step.num_verify_rows > 0
    if score and step.score_scale is not None and scale != step.score_scale:
        raise NotImplementedError(
            f"SparseSpecConfig.score_after_forward scores every layer with the scale {step.score_scale}, "
            f"but layer {module.layer_idx} ({type(module).__name__}) attends with {scale}: set "
            "SparseSpecConfig(score_after_forward=False) for this model"
        )
    verify = (step.verify_page_table, step.verify_query_start)
    if step.compiled:  # opaque custom ops in the compiled graph: whole stores and the layer's index (ops.py)
        plan, store, cache = step.plan, step.cache.selected, step.cache
        out, lse = ops.mixed_attention(
            q, cache.key_pool, cache.value_pool, *rows, step.num_full_rows_tensor, step.recent_start, store, layer_idx,
            step.selection_slot, step.num_selected, scale,
            plan.work if plan else None, plan.merge if plan else None, plan.part_out if plan else None,
            plan.part_lse if plan else None, plan.block_m_full if plan else 0, plan.block_m_draft if plan else 0,
            step.backend.name, moved_store,
        )  # fmt: skip
        if score:
            aside = step.aside
            ops.score_verification(q, cache.key_pool, *verify, lse, step.num_old_keys, step.scores, layer_idx,
                                   step.verify_slots, scale, step.spec_len, step.max_verify_rows, step.backend.name,
                                   moved_store if step.verify_moves else None, step.best, step.verify_moves,
                                   *(aside.query, aside.lse, aside.tokens, aside.query_start) if aside else (None,) * 4,
                                   aside is not None and aside.stream is not None,
                                   aside is not None and aside.deferred)  # fmt: skip
        return out[None], None
    layer = step.cache.layers[layer_idx]
    offsets = moved_store[layer_idx] if moved_store is not None else None
    draft = (step.recent_start, step.cache.selected[layer_idx], step.selection_slot, step.num_selected)
    out, lse = step.backend.mixed_attention(q, layer.keys, layer.values, *rows, step.num_full_rows, *draft, scale,
                                            plan=step.plan, offsets=offsets)  # fmt: skip
    if score:
        aside = step.aside.for_layer(layer_idx) if step.aside is not None else None
        ops.score_layer(step.backend, q, layer.keys, *verify, lse, step.num_old_keys, step.scores[layer_idx], scale,
                        step.verify_slots, step.spec_len,
                        offsets=offsets[..., : step.verify_moves] if step.verify_moves else None,
                        best=step.best[layer_idx] if step.best is not None else None, aside=aside,
                        max_rows=step.max_verify_rows)  # fmt: skip
    step.attention_calls += 1
    return out[None], None


def sparsespec_mask(*args, **kwargs) -> None:
    """Mask function registered for `"sparsespec"`: no mask, see the module docstring."""
    return None


def register_attention() -> None:
    """Register `"sparsespec"` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, sparsespec_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sparsespec_mask)


@contextlib.contextmanager
def use_attention(model: torch.nn.Module, name: str = ATTENTION_NAME):
    """Switch `model` to the attention implementation `name` and restore the previous one on exit."""
    register_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
