"""The device work an iteration launches outside the model's forward, counted on the CPU: torch ops
(each a kernel on a GPU; views and allocations left out) and Triton launches, per iteration, by
source line. The count does not depend on the device, so it can be watched without a GPU: each
small launch costs ~2-3 us of a CUDA graph's replay on an H100 whatever its size.

    TRITON_INTERPRET=1 python benchmarks/count_step_ops.py --k 8 --selection induction_diagonal
    TRITON_INTERPRET=1 python benchmarks/count_step_ops.py --k 0          # our autoregressive mode
    TRITON_INTERPRET=1 python benchmarks/count_step_ops.py --k 8 --min-draft-context 10000   # plain steps of k = 8
    TRITON_INTERPRET=1 python benchmarks/count_step_ops.py --k 8 --top-k 20 --top-p 0.8 --repetition-penalty 1.05

A tiny random Qwen2 model (tests/models.py), 12 requests of 40-73 prompt tokens, sampling at T=0.65
(the fused temperature path, as the end-to-end benchmark; `--top-k`, `--top-p`, `--repetition-penalty`
or `--greedy` for others), the Triton backend (interpreted: set `TRITON_INTERPRET=1`), `--warm`
iterations, then `--iterations` counted. Prints the totals (and the torch ops that write a tensor as
wide as the vocabulary: each a pass over `[logits rows, vocabulary]`, ~0.1 ms at 256 requests), the
Triton launches, and the torch ops by `hf_sparsespec` source line and by op.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# ops that launch nothing on a GPU (views, metadata, allocations)
NO_KERNEL = ("view", "unsqueeze", "slice", "select", "expand", "squeeze", "unbind", "empty", "set_", "alias",
             "aten.t.default", "transpose", "permute", "_reshape_alias", "as_strided", "detach", "lift_fresh")  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts the torch ops that would launch a kernel, inside or outside the model's forward, and
    where in hf_sparsespec they come from (ops inside the Triton interpreter are the kernels' own)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.in_forward = False
        self.ops: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self.vocabulary_wide: collections.Counter = collections.Counter()  # ops outside the forward writing [n, vocab]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        out = func(*args, **(kwargs or {}))
        if not any(part in name for part in NO_KERNEL):
            stack = traceback.extract_stack(limit=40)
            if not any("triton/runtime/interpreter" in frame.filename for frame in stack):
                where = "forward" if self.in_forward else "outside"
                self.ops[(where, name)] += 1
                if where == "outside":
                    ours = [frame for frame in stack if "hf_sparsespec" in frame.filename]
                    site = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}" if ours else "?"
                    self.sites[site] += 1
                    scattered = any(part in name for part in ("scatter_", "index_copy_", "index_put_"))  # its indices
                    wide = isinstance(out, torch.Tensor) and out.ndim == 2 and out.shape[-1] == self.vocab
                    if wide and not scattered:  # a pass over [rows, vocabulary]
                        self.vocabulary_wide[name] += 1
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--selection", default="induction_diagonal")
    parser.add_argument("--warm", type=int, default=25)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--top-k", type=int, default=0, help="sampling's top-k (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling's top-p (1.0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0: off")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling at T=0.65")
    parser.add_argument("--half", action="store_true", help="the model in float16 (as bf16 on a GPU: float32 copies "
                        "of its logits count)")  # fmt: skip
    parser.add_argument("--min-draft-context", type=int, default=0,
                        help="SparseSpecConfig.min_draft_context (e.g. 10000: every counted iteration plain steps)")
    scoring = parser.add_mutually_exclusive_group()
    scoring.add_argument("--score-after-forward", dest="score_after_forward", action="store_const", const=True,
                         help="SparseSpecConfig.score_after_forward=True (None, the default, is the same here)")
    scoring.add_argument("--per-layer-scoring", dest="score_after_forward", action="store_const", const=False,
                         help="SparseSpecConfig.score_after_forward=False: each layer scored inside the forward")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("set TRITON_INTERPRET=1 before running (the Triton backend on the CPU)")
    import triton.runtime.interpreter as interpreter
    from models import tiny_model
    from transformers import GenerationConfig

    from hf_sparsespec import SparseSpecConfig
    from hf_sparsespec.engine import Engine
    from hf_sparsespec.generation import prepare_batch

    model = tiny_model("qwen2").to(torch.float16 if args.half else torch.float32)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (40 + 3 * i,), generator=generator).tolist() for i in range(12)]
    n = args.warm + args.iterations + 30
    sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=0.65, top_k=args.top_k,
                                                               top_p=args.top_p)  # fmt: skip
    gen = GenerationConfig(**sampling, repetition_penalty=args.repetition_penalty, max_new_tokens=n, min_new_tokens=n,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    job = prepare_batch(model, prompts, gen)
    fields = dict(num_draft_tokens=args.k, backend="triton")
    if args.k:
        fields |= dict(selection=args.selection, min_budget=8, min_draft_context=args.min_draft_context,
                       score_after_forward=args.score_after_forward)  # fmt: skip
    engine = Engine(model, job.requests, SparseSpecConfig(**fields), job.pipeline, job.do_sample, job.stop_checker)
    runner, counter = engine.runner, OpCounter(model.config.vocab_size)
    launches: collections.Counter = collections.Counter()
    forward, step, run = runner._forward, runner._step, interpreter.InterpretedFunction.run

    def counted_forward(*a, **kw):
        counter.in_forward = True
        try:
            return forward(*a, **kw)
        finally:
            counter.in_forward = False

    shapes = []

    def counted_step(views, batch):
        shapes.append(views.shape)
        with counter:
            return step(views, batch)

    def counted_launch(self, *a, **kw):
        launches[("forward" if counter.in_forward else "outside", self.fn.__name__)] += 1
        return run(self, *a, **kw)

    with engine.running():
        runner._forward = counted_forward
        for _ in range(args.warm):
            engine.step()
        runner._step = counted_step
        interpreter.InterpretedFunction.run = counted_launch
        try:
            for _ in range(args.iterations):
                engine.step()
        finally:
            interpreter.InterpretedFunction.run = run
    count = len(shapes)
    totals = collections.Counter()
    for (where, _), value in counter.ops.items():
        totals[where] += value
    triton_outside = sum(v for (where, _), v in launches.items() if where == "outside")
    print(f"k={args.k} selection={args.selection if args.k else '-'}: {count} iterations "
          f"(verify / one-token rows: {[(s.num_verify_rows, s.num_single_rows) for s in shapes]})")  # fmt: skip
    print(f"per iteration outside the forward: {totals['outside'] / count:.1f} torch ops + "
          f"{triton_outside / count:.1f} Triton launches; inside (eager, 2 layers): {totals['forward'] / count:.1f} "
          f"torch ops")  # fmt: skip
    wide = sum(counter.vocabulary_wide.values()) / count
    print(f"torch ops writing [rows, vocabulary] outside the forward: {wide:.1f} per iteration",
          {name: v / count for name, v in counter.vocabulary_wide.most_common()})  # fmt: skip
    print("Triton launches per iteration:", {f"{w}:{k}": v / count for (w, k), v in sorted(launches.items())})
    print("torch ops outside the forward by line:")
    for site, value in counter.sites.most_common(args.top):
        print(f"  {value / count:5.1f}  {site}")
    print("torch ops outside the forward by op:")
    for (where, name), value in counter.ops.most_common():
        if where == "outside":
            print(f"  {value / count:5.1f}  {name}")


if __name__ == "__main__":
    main()
