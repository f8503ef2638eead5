"""linear: `y = x W^T (+ b)` at the token counts of a decode iteration, split over K when the output
has too few tiles to keep every multiprocessor busy.

Why: at 64-600 tokens a layer's projections are short GEMMs. cuBLAS runs Qwen2.5-1.5B's at 1.3-5x
their ideal time on the H100 (`benchmarks/bench_gemms.py`, docs/measurements.md 36): the o and q/k/v
projections (1.5-2K outputs) are ~10 us launches of 48-64 output tiles on 132 SMs, the down projection
(1,536 outputs, 8,960 inputs) streams its weight through as few tiles. Splitting K gives each of
`split_k` programs per tile a slice of the inputs; their float32 partial tiles are summed (with the bias)
in a fixed order by a second launch, so results are deterministic.

Triton, one or two launches, grids fixed by the shapes:
- `_linear_kernel`: program `(n tile, m tile, k split)` accumulates `x[m tile, k slice] @ W[n tile,
  k slice]^T` in float32 and writes the output (`split_k = 1`, plus the bias) or its partial tile.
- `_sum_splits_kernel`: the partial tiles of every split, summed in split order, plus the bias.

`choose_linear_config` picks the tiles from the shape; `TunedLinear` (the `hf_sparsespec::linear` op of
the compiled forward, `linear_ops.py`) times cuBLAS against a few configs once per shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._attention_tile import dot_precision
from hf_sparsespec.kernels._checks import next_power_of_2


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: `x @ weight.T + bias` in float32 (`x [..., K]`, `weight [N, K]`, `bias [N]`)."""
    out = x.float() @ weight.float().T
    return out + bias.float() if bias is not None else out


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] (SPLIT_K == 1) or float32 partials [SPLIT_K, M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + offs_k
        k_valid = k < k_end
        x = tl.load(x_rows + k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)
    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = out_ptr + (pid_k * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr,  # [SPLIT_K, M, N] float32
    b_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (output row, block of columns): the splits summed in split order."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + offs_n, mask=n_valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_valid)


def choose_linear_config(m: int, n: int, k: int, num_sms: int) -> LinearConfig:
    """Tiles for an `[m, k] x [n, k]^T` product: the token tile covers up to 128 tokens; the feature tile
    is 128 wide where that still gives every SM two tiles, else 64; K splits until the programs number at
    least two per SM, each split keeping >= 4 blocks of K."""
    block_m = min(128, max(16, next_power_of_2(m)))
    block_k = 64
    tiles_m = -(-m // block_m)
    block_n = 128 if -(-n // 128) * tiles_m >= 2 * num_sms else 64
    tiles = -(-n // block_n) * tiles_m
    split_k = 1
    while tiles * split_k < 2 * num_sms and k // (2 * split_k) >= 4 * block_k:
        split_k *= 2
    return LinearConfig(block_m, block_n, block_k, split_k)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: expected x [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"linear: expected one dtype, got x {x.dtype}, weight {weight.dtype}, "
                        f"bias {None if bias is None else bias.dtype}")  # fmt: skip
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: expected bias [{weight.shape[0]}], got {tuple(bias.shape)}")
    if x.device != weight.device or (bias is not None and bias.device != weight.device):
        raise ValueError("linear: x, weight and bias must be on one device")


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: LinearConfig | None = None
) -> torch.Tensor:
    """Triton `linear_ref`: `[..., N]` in x's dtype (float32 accumulation). `config`: the tiles (by
    default `choose_linear_config`'s). The weight's rows may be strided (a view of a packed buffer), its
    last dimension must be contiguous."""
    _check_linear(x, weight, bias)
    n, k = weight.shape
    leading = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*leading, n)
    if config is None:
        from hf_sparsespec.kernels.attention_plan import num_sms

        config = choose_linear_config(m, n, k, num_sms(x.device))
    k_per_split = -(-k // (config.split_k * config.block_k)) * config.block_k
    split_k = -(-k // k_per_split)  # no empty split
    target = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split_k)
    has_bias = bias is not None
    _linear_kernel[grid](
        x2, weight, bias if has_bias else weight, target, m, n, k, x2.stride(0), weight.stride(0), out.stride(0),
        k_per_split, HAS_BIAS=has_bias, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split_k, INPUT_PRECISION=dot_precision(x.dtype), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if split_k > 1:
        block = 256
        _sum_splits_kernel[(m, triton.cdiv(n, block))](
            target, bias if has_bias else weight, out, m, n, out.stride(0), HAS_BIAS=has_bias, SPLIT_K=split_k,
            BLOCK_N=block, num_warps=2,
        )  # fmt: skip
    return out.reshape(*leading, n)
