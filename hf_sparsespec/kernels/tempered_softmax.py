"""tempered_softmax: the sampling distributions of an iteration's logits rows, `softmax(logits / T)`
in float32, straight from the model's logits (bf16 on the GPU).

Why: sampling with temperature alone (transformers' `TemperatureLogitsWarper`; min-length processors
allowed, `LogitsPipeline.fused_temperature`) went through three full passes over `[rows, vocab]` float32 (the float copy of the logits, the division, the
softmax): ~0.67 ms of an 8 ms SparseSpec iteration at 256 requests (500 logits rows x 152K vocabulary,
docs/measurements.md 15). Here they are one read of the logits for the row statistics and one read
plus the write of the probabilities.

`tempered_softmax_ref` (the torch backend, and what the engine ran before): `softmax(logits.float() /
temperature)`, exactly transformers' processor then `torch.softmax`. Triton: a row's vocabulary is
split over several programs when the rows alone would not fill the device. Two launches with grids
fixed by the shapes (CUDA-graph safe):
- `_softmax_partials_kernel`: each (row, split) program's running maximum and its sum of
  `exp(x - max)` over its split;
- `_softmax_write_kernel`: each program folds its row's partials into the row's maximum and sum, then
  writes `exp(x - max) / sum` over its split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import HALF_AND_FLOAT, check_tensor
from hf_sparsespec.kernels.keyed_sample import vocabulary_splits

SOFTMAX_PROGRAMS_PER_SM = 8  # rows x splits per SM the split aims at
_LOG2E = tl.constexpr(1.4426950408889634)


def tempered_softmax_ref(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`[rows, vocab]` float32 probabilities of `logits / temperature` (transformers' order of ops)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


@triton.jit
def _softmax_partials_kernel(
    logits_ptr,  # [num_rows, vocab]
    max_ptr,  # [num_rows, num_splits] fp32
    sum_ptr,  # [num_rows, num_splits] fp32
    vocab,
    split_size,
    stride_row,
    temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs = tl.arange(0, BLOCK_V)
    first = split * split_size
    last = tl.minimum(first + split_size, vocab)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    for start in range(first, last, BLOCK_V):
        index = start + offs
        x = tl.load(logits_ptr + row * stride_row + index, mask=index < last, other=float("-inf")).to(tl.float32)
        x = x / temperature
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # a split of -inf only (masked tokens) keeps max -inf and sum 0: no inf - inf
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp2((running_max - safe_max) * _LOG2E) + tl.sum(
            tl.exp2((x - safe_max) * _LOG2E), axis=0
        )
        running_max = new_max
    tl.store(max_ptr + row * num_splits + split, running_max)
    tl.store(sum_ptr + row * num_splits + split, running_sum)


@triton.jit
def _softmax_write_kernel(
    logits_ptr,  # [num_rows, vocab]
    max_ptr,  # [num_rows, num_splits] fp32
    sum_ptr,  # [num_rows, num_splits] fp32
    probs_ptr,  # [num_rows, vocab] fp32
    vocab,
    split_size,
    stride_row,
    stride_probs_row,
    temperature,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    splits = tl.arange(0, BLOCK_S)
    valid = splits < num_splits
    maxima = tl.load(max_ptr + row * num_splits + splits, mask=valid, other=float("-inf"))
    sums = tl.load(sum_ptr + row * num_splits + splits, mask=valid, other=0.0)
    row_max = tl.max(maxima, axis=0)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    weights = tl.where(maxima == float("-inf"), 0.0, tl.exp2((maxima - safe_max) * _LOG2E))
    inv_sum = 1.0 / tl.sum(sums * weights, axis=0)
    offs = tl.arange(0, BLOCK_V)
    first = split * split_size
    last = tl.minimum(first + split_size, vocab)
    for start in range(first, last, BLOCK_V):
        index = start + offs
        mask = index < last
        x = tl.load(logits_ptr + row * stride_row + index, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp2((x / temperature - safe_max) * _LOG2E) * inv_sum
        tl.store(probs_ptr + row * stride_probs_row + index, p, mask=mask)


def tempered_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Triton `tempered_softmax_ref`.

    Args:
        logits: `[num_rows, vocab]` fp16/bf16/fp32, unit stride over the vocabulary.
        temperature: a float > 0.
    Returns:
        `[num_rows, vocab]` float32 probabilities.
    """
    check_tensor("logits", logits, ndim=2, dtypes=HALF_AND_FLOAT, device=logits.device)
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    num_rows, vocab = logits.shape
    probs = torch.empty(num_rows, vocab, dtype=torch.float32, device=logits.device)
    if num_rows == 0 or vocab == 0:
        return probs
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    block, split_size, num_splits = vocabulary_splits(num_rows, vocab, SOFTMAX_PROGRAMS_PER_SM, logits.device)
    maxima = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxima)
    warps = 4 if block >= 1024 else 1
    temperature = float(temperature)
    _softmax_partials_kernel[(num_rows, num_splits)](
        logits, maxima, sums, vocab, split_size, logits.stride(0), temperature, BLOCK_V=block, num_warps=warps,
    )  # fmt: skip
    _softmax_write_kernel[(num_rows, num_splits)](
        logits, maxima, sums, probs, vocab, split_size, logits.stride(0), probs.stride(0), temperature,
        BLOCK_V=block, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=warps,
    )  # fmt: skip
    return probs
