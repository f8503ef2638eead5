"""The mixed-attention kernel's error against its float32 reference under launch variants: which
launch parameter a wrong result depends on (the float32 failure of
`tests/kernels/test_kernels_gpu.py::test_mixed_attention[128-6-2-fp32]` on the H200).

    python benchmarks/attention_variants.py                      # the GPU test's case, on CUDA
    TRITON_INTERPRET=1 python benchmarks/attention_variants.py --device cpu --sms 132   # the interpreter

Variants: the tile config as shipped, then num_stages 1 and 2, and the largest packed query tile
(`attention_plan.MAX_BLOCK_M`) 64 instead of 128. Prints, per variant, the (token, head) pairs whose
output is off by more than 1e-3, the largest error and the first wrong tokens.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / name) for name in ("kernels", "")]
from kernel_cases import i32, make_paged_kv, query_offsets, random_selection  # noqa: E402

import hf_sparsespec.kernels.attention_plan as attention_plan  # noqa: E402
import hf_sparsespec.kernels.mixed_attention as mixed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sms", type=int, default=None, help="multiprocessors the work split assumes (CPU: 4)")
    args = parser.parse_args()
    if args.sms is not None:
        attention_plan.num_sms = lambda device: args.sms
    dtype, device = getattr(torch, args.dtype), args.device
    torch.manual_seed(0)
    head_dim, group, kv_heads = 128, 6, 2  # Qwen2.5-1.5B
    full, drafts = [(2048, 9), (300, 9), (150, 150)], [2100, 700, 97, 15]  # the GPU test's float32 case
    recent = [max(0, c - 1 - (i % 9)) for i, c in enumerate(drafts)]
    num_selected = [min(r, math.ceil(0.05 * c)) for r, c in zip(recent, drafts)]
    num_selected[-1] = 0
    context_lens = [c for c, _ in full] + drafts
    starts = query_offsets([q for _, q in full] + [1] * len(drafts))
    recent_start, num_sel = [0] * len(full) + recent, [0] * len(full) + num_selected
    k_cache, v_cache, page_table = make_paged_kv(context_lens, 16, kv_heads, head_dim, dtype, device)
    selected, slots = random_selection(context_lens, [max(r, 1) for r in recent_start], num_sel, kv_heads, 1700, device)
    query = torch.randn(starts[-1], kv_heads * group, head_dim, device=device).to(dtype)
    call = (query, k_cache, v_cache, page_table, i32(starts, device), i32(context_lens, device), len(full),
            i32(recent_start, device), selected, slots, i32(num_sel, device), head_dim**-0.5)  # fmt: skip
    reference, _ = mixed.mixed_attention_ref(*call)
    shipped, shipped_block = dict(mixed.launch_config("mixed", head_dim)), attention_plan.MAX_BLOCK_M
    variants = [("as shipped", {}, shipped_block), ("num_stages 1", {"num_stages": 1}, shipped_block),
                ("num_stages 2", {"num_stages": 2}, shipped_block), ("MAX_BLOCK_M 64", {}, 64)]  # fmt: skip
    print(
        f"{args.device} {args.dtype}, query tokens {starts[-1]}, shipped config {shipped}, MAX_BLOCK_M {shipped_block}"
    )
    for name, change, block in variants:
        attention_plan.MAX_BLOCK_M = block
        mixed.launch_config = lambda kind, size, change=change: dict(shipped, **change)
        try:
            out, _ = mixed.mixed_attention(*call)
        except Exception as error:  # e.g. out of shared memory
            print(f"{name}: {type(error).__name__}: {str(error)[:160]}")
            continue
        error = (out.float() - reference.float()).abs()
        bad = (error > 1e-3).any(-1)
        tokens = bad.any(-1).nonzero().flatten().tolist()
        print(f"{name}: {int(bad.sum())} wrong (token, head) pairs, largest error {float(error.max()):.3g}, "
              f"tokens {tokens[:8]}{' ...' if len(tokens) > 8 else ''}")  # fmt: skip


if __name__ == "__main__":
    main()
