"""What the mixed attention kernel asks of a multiprocessor, found without a GPU.

The kernel is compiled ahead of time for a CUDA target with Triton's own `ptxas`, with the argument
specialisations a real launch gets (pointers and the query, cache and output strides 16-byte aligned:
without them Triton neither vectorises nor pipelines the loads, so an unspecialised compile misleads).
For each launch configuration it prints the registers and stack (spills) a thread takes, the shared
memory a CTA takes, the loads the pipeliner made asynchronous (`async_copy_global_to_local` in the
TTGIR; 0 means every K/V block is loaded, waited for and only then multiplied), and how many CTAs one
SM can hold by registers and by shared memory. Two row shapes: SparseSpec's (verifications of k + 1
queries, the full-row tile `block_sizes(k + 1, group)`) and our AR's (one query a row).

    python benchmarks/kernel_resources.py                              # the engine's configuration, sm_90
    python benchmarks/kernel_resources.py --configs engine,64:128:4:2,64:128:8:3 --arch 90

A configuration is `engine` or `BLOCK_N_FULL:BLOCK_N_DRAFT:num_warps:num_stages`. Run it without
`TRITON_INTERPRET` (the interpreter replaces the kernels this compiles). Prints a table last; `--out`
writes JSON. The compiler is this machine's Triton, which may differ from the GPU machine's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_sparsespec.kernels._attention_tile import dot_precision, launch_config  # noqa: E402
from hf_sparsespec.kernels.attention_plan import block_sizes  # noqa: E402
from hf_sparsespec.kernels.mixed_attention import _mixed_attention_kernel  # noqa: E402

# Per SM: 32-bit registers, shared memory a CTA can be given in all (bytes; 1 KiB of it reserved per
# CTA), resident threads and CTAs (CUDA occupancy tables, compute capability 8.0 and 9.0).
SM_LIMITS = {
    80: dict(registers=65536, shared=167936, threads=2048, ctas=32),
    90: dict(registers=65536, shared=233472, threads=2048, ctas=32),
}
SHARED_RESERVED_PER_CTA = 1024
REGISTER_ALLOCATION_UNIT = 256  # registers are given to a warp in chunks of this many
FLOAT_POINTERS = ("lse_ptr", "part_out_ptr", "part_lse_ptr")  # fp32; q, k, v and out in the model's dtype
MODEL_POINTERS = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")
ALIGNED_STRIDES = ("stride_q_tok", "stride_q_head", "stride_cache_page", "stride_cache_slot", "stride_cache_head",
                   "stride_out_tok", "stride_out_head")  # fmt: skip
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def parse_config(text: str, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    if text == "engine":
        return launch_config("mixed", head_dim, dtype)
    fields = text.split(":")
    if len(fields) != 4 or not all(f.isdigit() for f in fields):
        raise SystemExit(f"--configs: expected 'engine' or BLOCK_N_FULL:BLOCK_N_DRAFT:num_warps:num_stages, got {text!r}")
    block_n_full, block_n_draft, warps, stages = map(int, fields)
    return dict(BLOCK_N_FULL=block_n_full, BLOCK_N_DRAFT=block_n_draft, num_warps=warps, num_stages=stages)


def compile_mixed(constexprs: dict, dtype: torch.dtype, warps: int, stages: int, arch: int):
    """The mixed kernel compiled for `sm_<arch>` with a real launch's alignment specialisations."""
    params = list(inspect.signature(_mixed_attention_kernel.fn).parameters)
    signature, attrs = {}, {}
    for index, name in enumerate(params):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            kind = TRITON_TYPES[dtype] if name in MODEL_POINTERS else "fp32" if name in FLOAT_POINTERS else "i32"
            signature[name] = "*" + kind
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
        if name.endswith("_ptr") or name in ALIGNED_STRIDES:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=_mixed_attention_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers and stack bytes a thread takes, read from the cubin with Triton's bundled `cuobjdump`."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return dict(registers=int(fields["REG"]), stack=int(fields["STACK"]))


def occupancy(registers: int, shared: int, warps: int, arch: int) -> dict[str, int]:
    """CTAs one SM holds, by registers, by shared memory and in all."""
    limits = SM_LIMITS[arch]
    per_warp = -(-registers * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    by_registers = limits["registers"] // (per_warp * warps)
    by_shared = limits["shared"] // (shared + SHARED_RESERVED_PER_CTA)
    by_threads = limits["threads"] // (32 * warps)
    return dict(ctas_by_registers=by_registers, ctas_by_shared=by_shared,
                ctas_per_sm=min(by_registers, by_shared, by_threads, limits["ctas"]))  # fmt: skip


def measure(shape: str, config_text: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    config = parse_config(config_text, args.head_dim, dtype)
    queries = args.k + 1 if shape == "sparsespec" else 1
    block_m_full, block_m_draft = block_sizes(queries, args.group)
    constexprs = dict(
        GROUP=args.group, BLOCK_M_FULL=block_m_full, BLOCK_N_FULL=config["BLOCK_N_FULL"], BLOCK_M_DRAFT=block_m_draft,
        BLOCK_N_DRAFT=config["BLOCK_N_DRAFT"], BLOCK_D=triton.next_power_of_2(args.head_dim), HEAD_DIM=args.head_dim,
        PAGE_SIZE=args.page_size, INPUT_PRECISION=dot_precision(dtype), MOVED=shape == "sparsespec",
        SEARCH_STEPS=max(args.max_budget, 1).bit_length(),
    )  # fmt: skip
    compiled = compile_mixed(constexprs, dtype, config["num_warps"], config["num_stages"], args.arch)
    usage = resource_usage(compiled.asm["cubin"])
    shared = int(compiled.metadata.shared)
    return dict(
        shape=shape, config=config_text, **config, block_m_full=block_m_full, **usage, shared=shared,
        async_copies=compiled.asm["ttgir"].count("async_copy_global_to_local"),
        **occupancy(usage["registers"], shared, config["num_warps"], args.arch),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="engine", help="comma-separated: engine or BNF:BND:warps:stages")
    parser.add_argument("--shapes", default="sparsespec,ar", help="sparsespec (k + 1 query tiles), ar (one query)")
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SM_LIMITS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=6, help="query heads per KV head (Qwen2.5-1.5B: 6)")
    parser.add_argument("--k", type=int, default=8, help="drafts per cycle (verifications hold k + 1 queries)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-budget", type=int, default=1024, help="the selection's capacity (binary-search steps)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: this compiles the kernels for a GPU target")
    rows = []
    for shape in args.shapes.split(","):
        if shape not in ("sparsespec", "ar"):
            parser.error(f"--shapes: expected sparsespec or ar, got {shape!r}")
        for config in args.configs.split(","):
            rows.append(measure(shape, config, args))
            print(json.dumps(rows[-1]), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = dict(triton=triton.__version__, torch=torch.__version__, arch=args.arch, dtype=args.dtype,
                    head_dim=args.head_dim, group=args.group, k=args.k)  # fmt: skip
        (args.out / "kernel_resources.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n_mixed_attention_kernel for sm_{args.arch}, {args.dtype}, head_dim {args.head_dim}, group {args.group}, "
          f"k {args.k}; Triton {triton.__version__}")  # fmt: skip
    print("| rows | config (BNF:BND:warps:stages) | full-row tile | registers / thread | stack B / thread | "
          "shared B / CTA | async copies | CTAs / SM (registers, shared) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        launch = f"{r['BLOCK_N_FULL']}:{r['BLOCK_N_DRAFT']}:{r['num_warps']}:{r['num_stages']}"
        label = launch if r["config"] == launch else f"{r['config']} ({launch})"
        print(f"| {r['shape']} | {label} | {r['block_m_full']} | {r['registers']} | {r['stack']} | "
              f"{r['shared']} | {r['async_copies']} | {r['ctas_per_sm']} ({r['ctas_by_registers']}, {r['ctas_by_shared']}) |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
