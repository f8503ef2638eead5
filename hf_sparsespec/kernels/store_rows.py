"""store_rows: copy rows of a matrix into the rows of another that an index names, skipping the rows
whose index is negative.

The runner keeps each draft's sampling distribution (a vocabulary-wide row) until its verification.
An iteration's one-token rows are plain steps and drafts, in proportions only the data knows (a CUDA
graph replays one shape for every mix), plus the padding of its bucket: with an index of -1, plain
steps and padding rows cost a masked load and store that move no bytes, where an `index_put` would
write all of them (~0.6 MB a row at a 152K vocabulary). Triton: programs `(row, column block)`, the
grid from the shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import HALF_AND_FLOAT, check_tensor

BLOCK = 4096  # columns per program


def store_rows_ref(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """Reference: `dst[index[i]] = src[i]` for every row `i` with `index[i] >= 0` (cast to `dst`'s dtype)."""
    keep = index >= 0
    dst[index[keep].long()] = src[keep].to(dst.dtype)


@triton.jit
def _store_rows_kernel(dst_ptr, index_ptr, src_ptr, num_cols, stride_dst, stride_src, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(index_ptr + row).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < tl.where(target >= 0, num_cols, 0)  # a negative index: nothing is read or written
    values = tl.load(src_ptr + row.to(tl.int64) * stride_src + cols, mask=mask, other=0.0)
    tl.store(dst_ptr + target * stride_dst + cols, values.to(dst_ptr.dtype.element_ty), mask=mask)


def store_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """Triton `store_rows_ref`. `dst [n, cols]`, `src [rows, cols]` (float, unit-stride rows), `index
    [rows]` int32/int64 with entries in `[-1, n)`; indices that repeat write one of their rows."""
    check_tensor("dst", dst, ndim=2, dtypes=HALF_AND_FLOAT)
    check_tensor("src", src, ndim=2, dtypes=HALF_AND_FLOAT, device=dst.device, shape=(None, dst.shape[1]))
    check_tensor("index", index, ndim=1, dtypes=(torch.int32, torch.int64), device=dst.device, shape=(src.shape[0],))
    if dst.stride(-1) != 1 or src.stride(-1) != 1:
        raise ValueError(f"dst, src: expected unit-stride rows, got strides {dst.stride()} and {src.stride()}")
    rows, cols = src.shape
    if rows == 0 or cols == 0:
        return
    block = min(BLOCK, triton.next_power_of_2(cols))
    _store_rows_kernel[(rows, triton.cdiv(cols, block))](dst, index, src, cols, dst.stride(0), src.stride(0),
                                                          BLOCK=block)  # fmt: skip
