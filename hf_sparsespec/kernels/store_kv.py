"""store_kv: write the new key/value rows of a step into the paged cache.

Invariant: token `t` goes to flat slot `slot_mapping[t]` (`page * page_size + offset`); a slot of -1
marks padding and is skipped.

Triton: one program per token copies its `[num_kv_heads, head_dim]` key and value rows (int64 slot
arithmetic; the cache may be a strided view).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import HALF_AND_FLOAT, check_cache_pair, check_tensor


def store_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Reference (and CPU backend) of `store_kv`; writes in place."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid].to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_page,  # k_cache and v_cache share their strides
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        # K, V: (BLOCK_H, BLOCK_D)
        k = tl.load(key_ptr + token * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask)
        v = tl.load(
            value_ptr + token * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :], mask=mask
        )
        page = slot // PAGE_SIZE
        dst = page * stride_cache_page + (slot % PAGE_SIZE) * stride_cache_slot
        dst_offs = dst + offs_h[:, None] * stride_cache_head + offs_d[None, :]
        tl.store(k_cache_ptr + dst_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton `store_kv_ref`; writes in place.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]` fp16/bf16/fp32 (cast to the cache dtype).
        k_cache, v_cache: `[num_pages, page_size, num_kv_heads, head_dim]`, same strides.
        slot_mapping: `[num_tokens]` int64 flat slots (`page * page_size + offset`), -1 = skip.
    """
    check_cache_pair(k_cache, v_cache)
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    check_tensor("key", key, ndim=3, dtypes=HALF_AND_FLOAT, device=device, shape=(None, num_kv_heads, head_dim))
    num_tokens = key.shape[0]
    check_tensor("value", value, dtypes=HALF_AND_FLOAT, device=device, shape=(num_tokens, num_kv_heads, head_dim))
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), device=device, shape=(num_tokens,))
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )  # fmt: skip
