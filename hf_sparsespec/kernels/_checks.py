"""Argument checks shared by the Triton wrappers: one place that turns a bad tensor into an
"expected X, got Y" error before a kernel reads memory it should not.
"""

from __future__ import annotations

import torch

HALF_AND_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
INDEX = (torch.int32,)


def check_tensor(
    name: str,
    x: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> None:
    """Raise TypeError/ValueError unless `x` is a tensor of the given rank, dtype, device and shape
    (`None` in `shape` matches any size)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {x.device}")
    if shape is not None:
        if len(shape) != x.dim() or any(s is not None and s != t for s, t in zip(shape, x.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dimension is unit-stride (the kernels' vector loads need it), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor | None = None) -> None:
    check_tensor("k_cache", k_cache, ndim=4, dtypes=HALF_AND_FLOAT)
    if k_cache.stride(-1) != 1:
        raise ValueError(f"k_cache: expected a unit-stride last dimension, got strides {k_cache.stride()}")
    if v_cache is None:
        return
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), device=k_cache.device, shape=tuple(k_cache.shape))
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache: expected the strides of k_cache {k_cache.stride()}, got {v_cache.stride()}")


def check_query_heads(query: torch.Tensor, k_cache: torch.Tensor) -> int:
    """The GQA group size (query heads per KV head), after checking that the heads and head_dim agree."""
    check_tensor("query", query, ndim=3, dtypes=HALF_AND_FLOAT, device=k_cache.device)
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"query: expected head_dim {k_cache.shape[3]} (the cache's), got {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query: expected a multiple of {num_kv_heads} heads (the cache's KV heads), got {num_q_heads}"
        )
    return num_q_heads // num_kv_heads


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
