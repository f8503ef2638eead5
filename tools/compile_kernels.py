"""Compile every Triton kernel of the engine for a GPU target on a machine without a GPU.

    python tools/compile_kernels.py [--arch 90]

Triton lowers and assembles (ptxas ships with it) without a driver, so a kernel that would not
compile on the H200 (type errors in loops, unsupported ops) fails here in seconds instead of in a
device lease. It checks compilation only: run the kernel tests (interpreter, GPU) for correctness.
"""

from __future__ import annotations

import argparse
import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_sparsespec.kernels._attention_tile import _merge_splits_kernel
from hf_sparsespec.kernels.keyed_sample import _keyed_sample_kernel
from hf_sparsespec.kernels.mixed_attention import _mixed_attention_kernel
from hf_sparsespec.kernels.paged_attention import _paged_attention_kernel
from hf_sparsespec.kernels.pillar_select import _pillar_scores_kernel
from hf_sparsespec.kernels.sparse_attention import _sparse_draft_attention_kernel
from hf_sparsespec.kernels.store_kv import _store_kv_kernel
from hf_sparsespec.kernels.top_keys import _select_top_keys_kernel

DATA = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "key_ptr", "value_ptr")
FLOAT = ("lse_ptr", "part_out_ptr", "part_lse_ptr", "scores_ptr", "probs_ptr")


def signature(kernel, dtype: str, constexprs: dict, int64=()) -> dict:
    types = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in DATA:
            types[name] = f"*{dtype}"
        elif name in FLOAT:
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*i64" if name in int64 else "*i32"
        elif name == "qk_scale":
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def cases(head_dim: int, group: int, page_size: int, dtype: str):
    d = triton.next_power_of_2(head_dim)
    block_full = max(16, min(128, triton.next_power_of_2(9 * group)))
    block_draft = max(16, triton.next_power_of_2(group))
    precision = "ieee" if dtype == "fp32" else "tf32"
    common = dict(GROUP=group, BLOCK_D=d, HEAD_DIM=head_dim, PAGE_SIZE=page_size, INPUT_PRECISION=precision)
    yield _mixed_attention_kernel, dict(common, BLOCK_M_FULL=block_full, BLOCK_N_FULL=64, BLOCK_M_DRAFT=block_draft,
                                        BLOCK_N_DRAFT=64), (), {}
    yield _paged_attention_kernel, dict(common, BLOCK_M=block_full, BLOCK_N=64), (), {}
    yield _sparse_draft_attention_kernel, dict(common, BLOCK_M=block_draft, BLOCK_N=64), (), {}
    yield _merge_splits_kernel, dict(HEAD_DIM=head_dim, BLOCK_D=d), (), {}
    yield _store_kv_kernel, dict(NUM_KV_HEADS=2, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_H=2, BLOCK_D=d), \
        ("slot_mapping_ptr",), {}
    yield _pillar_scores_kernel, dict(common, BLOCK_M=block_full, BLOCK_N=128, KEYS_PER_PROGRAM=512), (), {}
    yield _select_top_keys_kernel, dict(BLOCK=256, NUM_THRESHOLDS=16, NUM_PASSES=8), ("slots_ptr",), {}
    yield _keyed_sample_kernel, dict(BLOCK_V=4096), ("keys_ptr", "out_ptr"), {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    for head_dim, group, page_size, dtype in ((128, 6, 16, "bf16"), (64, 3, 16, "bf16"), (16, 2, 4, "fp32")):
        for kernel, constexprs, int64, _ in cases(head_dim, group, page_size, dtype):
            source = ASTSource(fn=kernel, signature=signature(kernel, dtype, constexprs, int64), constexprs=constexprs)
            compiled = triton.compile(source, target=target)
            print(f"ok  {kernel.fn.__name__:34s} d{head_dim} g{group} ps{page_size} {dtype}: "
                  f"{compiled.n_regs if hasattr(compiled, 'n_regs') else '?'} regs, {compiled.metadata.shared} B shared")


if __name__ == "__main__":
    main()
