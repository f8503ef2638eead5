"""What a model must offer to run under SparseSpec, and its KV geometry.

Refusals happen here, before any work: encoder-decoders, attention that does not go through
transformers' `AttentionInterface`, sliding-window layers whose window the generation would exceed,
chunked/linear/state-space layers, and multi-head latent attention (MLA).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

_FULL = "full_attention"
_SLIDING = "sliding_attention"


@dataclass(frozen=True)
class ModelGeometry:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_geometry(model: torch.nn.Module) -> ModelGeometry:
    config = _text_config(model)
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    parameter = next(model.parameters())
    return ModelGeometry(
        num_layers=config.num_hidden_layers,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        dtype=parameter.dtype,
        device=parameter.device,
    )


def cache_kwarg_name(model: torch.nn.Module) -> str:
    """transformers 5.24 renamed the forward argument `past_key_values` to `cache`."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def supports_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def check_model_supported(model: torch.nn.Module, max_total_len: int) -> None:
    """Raise NotImplementedError naming what the model does that SparseSpec cannot."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{name} is an encoder-decoder model; hf_sparsespec supports decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{name} does not route its attention through transformers' AttentionInterface, so "
            "hf_sparsespec cannot replace it"
        )
    config = _text_config(model)
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        raise NotImplementedError(f"{name} uses multi-head latent attention (MLA), which hf_sparsespec does not support")
    if getattr(config, "attention_chunk_size", None):
        raise NotImplementedError(f"{name} uses chunked attention, which hf_sparsespec does not support")
    window = getattr(config, "sliding_window", None)
    uses_window = window is not None and getattr(config, "use_sliding_window", True)
    layer_types = getattr(config, "layer_types", None) or (
        [_SLIDING if uses_window else _FULL] * config.num_hidden_layers
    )
    for layer_type in set(layer_types):
        if layer_type == _FULL:
            continue
        if layer_type == _SLIDING and window is not None and window >= max_total_len:
            continue  # the window never cuts anything off for this generation
        if layer_type == _SLIDING:
            raise NotImplementedError(
                f"{name} uses sliding-window attention (window {window}) and this generation reaches "
                f"{max_total_len} tokens; hf_sparsespec supports full attention only"
            )
        raise NotImplementedError(f"{name} has '{layer_type}' layers; hf_sparsespec supports full attention only")
