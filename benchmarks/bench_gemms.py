"""The forward's GEMMs at the token counts a decode iteration has: how far each runs from its roofline.

An iteration's GEMMs follow its tokens (AR: one per row; SparseSpec: one per draft row plus k + 1 per
verification, ~1.9x AR's). For each projection of a model shape (the packed siblings: q/k/v as one
GEMM, gate/up as one; then o, down and the LM head) and each token count, the median time of
`torch.nn.functional.linear` in bf16 (cuBLAS, as the model runs it), its TFLOP/s and GB/s, and the
larger of bytes / bandwidth and FLOPs / tensor rate as the ideal. The layer's projections run once
per layer, so the table's "forward" row sums them x layers plus the LM head once.

    python benchmarks/bench_gemms.py --model qwen2.5-1.5b --tokens 64,120,136,256,480,492,510,512,580
    python benchmarks/bench_gemms.py --tokens 56:168:8,240:656:16      # ranges start:stop:step (stop excluded)
    python benchmarks/bench_gemms.py --autotune --mlp --tokens 64,136,496   # and inductor's autotuned choices
    python benchmarks/bench_gemms.py --blas cublas,cublaslt --chain --tokens 64,120,136,496   # both libraries, chained

`--blas` times each projection under each of torch's CUDA BLAS libraries (`preferred_blas_library`:
`cublas`, torch's default, or `cublaslt`, whose heuristics may pick other kernels for skinny GEMMs).
`--chain` also times the forward's GEMMs back to back as one CUDA graph (every layer's own weights, as a
decode iteration replays them), where one launch's ramp may hide behind the last one's tail: the
isolated timings (each after an L2 flush) add up to more than a forward pays when that happens.

Prints a table last; writes JSON to `--out` (a folder) when given.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from triton.testing import do_bench

# (hidden, q heads x head_dim, kv heads x head_dim, intermediate, vocab, layers)
SHAPES = {"qwen2.5-1.5b": (1536, 1536, 256, 8960, 151936, 28), "qwen3-8b": (4096, 4096, 1024, 12288, 151936, 36)}


def projections(name: str) -> list[tuple[str, int, int, int]]:
    """(projection, in features, out features, times per forward)."""
    hidden, q, kv, inter, vocab, layers = SHAPES[name]
    return [("qkv (packed)", hidden, q + 2 * kv, layers), ("o", q, hidden, layers),
            ("gate_up (packed)", hidden, 2 * inter, layers), ("down", inter, hidden, layers),
            ("lm_head", hidden, vocab, 1)]  # fmt: skip


def measure(tokens: int, features_in: int, weight_shapes: list[tuple[int, int]],
            op=torch.nn.functional.linear) -> float:  # fmt: skip
    """Median ms of `op(x, *weights)` for `x [tokens, features_in]`; rotates over enough copies of the
    weights (~120 MB) that the L2 holds none of them, as a forward reads them."""
    x = torch.randn(tokens, features_in, dtype=torch.bfloat16, device="cuda")
    copies = max(2, int(120e6 // sum(2 * rows * cols for rows, cols in weight_shapes)) + 1)
    weights = [[torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.02 for shape in weight_shapes]
               for _ in range(copies)]  # fmt: skip
    index = [0]

    def step():
        index[0] = (index[0] + 1) % copies
        op(x, *weights[index[0]])

    return do_bench(step, warmup=25, rep=200, return_mode="median")


def chain_ms(tokens: int, model: str, replays: int = 20) -> float:
    """Median ms of one CUDA-graph replay of the forward's GEMMs back to back: per layer the packed q/k/v,
    o, packed gate/up and down with that layer's own weights (no layer's weights fit the L2 next to the
    others'), then the LM head. Inputs are fixed (no layer feeds the next): only the GEMMs are timed."""
    hidden, q, kv, inter, vocab, layers = SHAPES[model]

    def randn(*shape):
        return torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.02

    weights = [(randn(q + 2 * kv, hidden), randn(hidden, q), randn(2 * inter, hidden), randn(hidden, inter))
               for _ in range(layers)]  # fmt: skip
    head, x, attended, activated = randn(vocab, hidden), randn(tokens, hidden), randn(tokens, q), randn(tokens, inter)

    def forward():
        for qkv, o, gate_up, down in weights:
            torch.nn.functional.linear(x, qkv)
            torch.nn.functional.linear(attended, o)
            torch.nn.functional.linear(x, gate_up)
            torch.nn.functional.linear(activated, down)
        torch.nn.functional.linear(x, head)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def autotuned_linear():
    """`linear` compiled by inductor with GEMM autotuning (its Triton templates against cuBLAS, per shape)."""
    torch._dynamo.config.cache_size_limit = 1024
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 1024
    return torch.compile(torch.nn.functional.linear, mode="max-autotune-no-cudagraphs", dynamic=False)


def mlp_block(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A Qwen2/Llama MLP on packed gate/up weights: down(silu(gate) * up), as the packed forward runs it."""
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)


def token_counts(spec: str) -> list[int]:
    """`64,120` and ranges `start:stop:step` (stop excluded), comma-separated, in order, without repeats."""
    counts: list[int] = []
    for part in spec.split(","):
        bounds = [int(v) for v in part.split(":")]
        values = range(*bounds) if len(bounds) > 1 else bounds
        counts += [v for v in values if v not in counts]
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="64,120,136,256,480,492,510,512,580")
    parser.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes / s (H100 ~3.0e12, H200 ~4.26e12)")
    parser.add_argument("--flops", type=float, default=740e12, help="bf16 FLOP / s (measured, not the sheet's)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--autotune", action="store_true",
                        help="also time inductor's autotuned GEMM (max-autotune: Triton templates or cuBLAS) per shape")
    parser.add_argument("--mlp", action="store_true",
                        help="also time the MLP block (gate/up, SiLU x up, down) compiled by inductor, default and "
                        "max-autotune (where a Triton template wins, the SiLU product can fuse into its epilogue)")
    parser.add_argument("--blas", default="cublas",
                        help="comma list of torch's CUDA BLAS libraries to time each GEMM under: cublas, cublaslt")
    parser.add_argument("--chain", action="store_true",
                        help="also time the forward's GEMMs back to back in one CUDA graph (per library)")
    args = parser.parse_args()
    libraries = args.blas.split(",")
    default_library = torch.backends.cuda.preferred_blas_library()
    tuned = autotuned_linear() if args.autotune else None
    blocks = {}
    if args.mlp:
        torch._dynamo.config.cache_size_limit = 1024
        blocks = {"MLP block, compiled": torch.compile(mlp_block, dynamic=False),
                  "MLP block, compiled max-autotune": torch.compile(mlp_block, mode="max-autotune-no-cudagraphs",
                                                                    dynamic=False)}  # fmt: skip
    counts = token_counts(args.tokens)
    hidden, _, _, inter, _, layers = SHAPES[args.model]
    rows = []

    def progress(row):  # one line per timing as it lands, so a run cut short still shows what it measured
        rows.append(row)
        print(f"# {row['tokens']} tokens, {row['projection']}: {row['ms']:.4f} ms", flush=True)

    for tokens, library in itertools.product(counts, libraries):
        torch.backends.cuda.preferred_blas_library(library)
        tag = f", {library}" if len(libraries) > 1 else ""
        forward_ms = forward_ideal = 0.0
        for projection, fan_in, fan_out, times in projections(args.model):
            projection += tag
            ms = measure(tokens, fan_in, [(fan_out, fan_in)])
            flops = 2 * tokens * fan_in * fan_out
            moved = 2 * (fan_in * fan_out + tokens * (fan_in + fan_out))
            ideal = max(moved / args.bandwidth, flops / args.flops) * 1e3
            progress({"tokens": tokens, "projection": projection, "ms": ms, "tflops": flops / ms / 1e9,
                      "gbps": moved / ms / 1e6, "ideal_ms": ideal, "times": times})  # fmt: skip
            if tuned is not None:
                tuned_ms = measure(tokens, fan_in, [(fan_out, fan_in)], tuned)
                progress({"tokens": tokens, "projection": f"{projection}, autotuned", "ms": tuned_ms,
                          "tflops": flops / tuned_ms / 1e9, "gbps": moved / tuned_ms / 1e6, "ideal_ms": ideal,
                          "times": times})  # fmt: skip
            forward_ms += ms * times
            forward_ideal += ideal * times
        for label, block in blocks.items():
            ms = measure(tokens, hidden, [(2 * inter, hidden), (hidden, inter)], block)
            flops = 2 * tokens * 3 * hidden * inter
            moved = 2 * (3 * hidden * inter + tokens * 2 * hidden)
            ideal = max(moved / args.bandwidth, flops / args.flops) * 1e3
            progress({"tokens": tokens, "projection": label, "ms": ms, "tflops": flops / ms / 1e9,
                      "gbps": moved / ms / 1e6, "ideal_ms": ideal, "times": layers})  # fmt: skip
        rows.append({"tokens": tokens, "projection": f"forward{tag}", "ms": forward_ms, "tflops": None, "gbps": None,
                     "ideal_ms": forward_ideal, "times": 1})  # fmt: skip
        if args.chain:
            progress({"tokens": tokens, "projection": f"forward chained (one graph){tag}",
                      "ms": chain_ms(tokens, args.model), "tflops": None, "gbps": None, "ideal_ms": forward_ideal,
                      "times": 1})  # fmt: skip
    torch.backends.cuda.preferred_blas_library(default_library)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model}
        (args.out / f"bench_gemms_{args.model}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model}, bf16")
    print("| tokens | projection | ms | TFLOP/s | GB/s | ideal ms | ms / ideal | x per forward |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tflops = "-" if r["tflops"] is None else f"{r['tflops']:.0f}"
        gbps = "-" if r["gbps"] is None else f"{r['gbps']:.0f}"
        print(f"| {r['tokens']} | {r['projection']} | {r['ms']:.4f} | {tflops} | {gbps} | {r['ideal_ms']:.4f} | "
              f"{r['ms'] / r['ideal_ms']:.2f} | {r['times']} |")


if __name__ == "__main__":
    main()
