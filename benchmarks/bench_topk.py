"""What `torch.topk` costs over an iteration's logits rows (the truncated sampling path's candidates), by
dtype and k, next to one read of the rows (the floor of any one-pass selection), their float32 copy,
and `tempered_softmax.largest_values` (the same values through the chunks' maxima) at each `--chunks`
size, checked equal to `torch.topk`'s. (A two-stage top-k that ran `torch.topk` over every chunk was
slower at every chunk for k = 20 and 50 on the H100: docs/measurements.md 37; it was removed.)

    python benchmarks/bench_topk.py --rows 484 --vocab 151936 --k 20,50,1024 --chunks 64,128,256,512

Prints a table (median ms, CUDA).
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from hf_sparsespec.kernels.tempered_softmax import largest_values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=484)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--k", default="20,50")
    parser.add_argument("--chunks", default="64,128,256,512", help="largest_values' chunk sizes")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, [{args.rows}, {args.vocab}]")
    print("| dtype | op | ms |")
    print("|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(args.rows, args.vocab, device="cuda").to(dtype)
        ops = [("amax (one read)", lambda x=x: x.amax(dim=-1)), ("float32 copy", lambda x=x: x.to(torch.float32, copy=True))]
        for k in (int(v) for v in args.k.split(",")):
            ops.append((f"topk k={k}", lambda x=x, k=k: torch.topk(x, k, dim=-1)))
            for chunk in (int(v) for v in args.chunks.split(",")):
                assert torch.equal(largest_values(x, k, chunk), torch.topk(x, k, dim=-1).values), (dtype, k, chunk)
                ops.append((f"largest_values k={k}, chunks of {chunk}", lambda x=x, k=k, c=chunk: largest_values(x, k, c)))
        for name, op in ops:
            print(f"| {dtype} | {name} | {do_bench(op, warmup=25, rep=200, return_mode='median'):.4f} |")

if __name__ == "__main__":
    main()
