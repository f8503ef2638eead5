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


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """transformers' tensor-parallel degree of the model (`from_pretrained(..., tp_plan="auto")`), 1 if none."""
    return getattr(model, "tp_size", None) or 1


def tensor_parallel_group(model: torch.nn.Module):
    """The process group of the model's tensor-parallel dimension, None without tensor parallelism."""
    if tensor_parallel_size(model) == 1:
        return None
    mesh = model._device_mesh
    return mesh["tp"].get_group() if "tp" in (mesh.mesh_dim_names or ()) else mesh.get_group()


def model_geometry(model: torch.nn.Module) -> ModelGeometry:
    """The KV geometry this process holds: under tensor parallelism, its share of the heads."""
    config = _text_config(model)
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    parameter = next(model.parameters())
    tp = tensor_parallel_size(model)
    return ModelGeometry(
        num_layers=config.num_hidden_layers,
        num_q_heads=num_q_heads // tp,
        num_kv_heads=num_kv_heads // tp,
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
    if isinstance(model, torch.nn.Module):
        _check_parallelism(model, config)
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


def _check_parallelism(model: torch.nn.Module, config) -> None:
    """Tensor parallelism is supported when every process holds whole KV heads; a model spread over
    devices layer by layer (`device_map` over several GPUs, pipeline stages) or sharded by FSDP is not."""
    name = type(model).__name__
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None and mesh.mesh_dim_names:
        for dim in ("pp", "fsdp"):
            if dim in mesh.mesh_dim_names and mesh[dim].size() > 1:
                what = "pipeline parallelism" if dim == "pp" else "FSDP sharding"
                raise NotImplementedError(f"{name} runs with {what} ({dim}={mesh[dim].size()}); hf_sparsespec "
                                          "supports tensor parallelism (tp_plan='auto') only")  # fmt: skip
    tp = tensor_parallel_size(model)
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    if num_kv_heads % tp or num_q_heads % tp:
        raise NotImplementedError(
            f"{name} has {num_kv_heads} KV heads and {num_q_heads} query heads, which do not split over a "
            f"tensor-parallel world of {tp}; hf_sparsespec needs whole KV heads on every process"
        )
    devices = {parameter.device for parameter in model.parameters()}
    if len(devices) > 1:
        raise NotImplementedError(
            f"{name} is spread over several devices {sorted(map(str, devices))} (device_map or pipeline "
            "stages); hf_sparsespec runs a model on one device per process: use one device, or tensor "
            "parallelism with tp_plan='auto' under torchrun"
        )
