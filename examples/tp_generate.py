"""SparseSpec under transformers' tensor parallelism, one process per GPU (or per CPU process, gloo).

    torchrun --nproc-per-node 2 examples/tp_generate.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct
    torchrun --nproc-per-node 2 examples/tp_generate.py --model DIR --device cpu --out results/   # gloo

`from_pretrained(..., tp_plan="auto")` shards the model's linear layers over the processes
(transformers' own plan and collectives); every process runs the same SparseSpec engine on its share
of the attention heads and KV cache, and the processes agree on every token: greedy choices agree by
themselves (the logits are all-reduced), sampled choices and acceptances are the first process's,
broadcast. Each process writes its outputs to `--out/rank<R>.json` (plain greedy `generate`,
SparseSpec greedy, SparseSpec sampled with a different seed per process) and rank 0 prints them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig

PROMPTS = [[5, 17, 3, 8, 22, 1], [9, 9, 30, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def left_pad(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="hub name or local folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("out/tp"))
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", dtype=dtype)
    device = next(model.parameters()).device
    pad = model.generation_config.pad_token_id or 0
    ids, mask = left_pad(PROMPTS, pad, device)
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens)
    config = SparseSpecConfig(num_draft_tokens=args.num_draft_tokens, min_budget=4, page_size=4)
    plain = model.generate(**settings, do_sample=False)
    greedy = model.generate(**settings, do_sample=False, generation_strategy="sparsespec", sparsespec_config=config,
                            return_dict_in_generate=True)  # fmt: skip
    torch.manual_seed(1000 + rank)  # different random streams: the tokens must still agree
    sampled = model.generate(**settings, do_sample=True, temperature=0.9, generation_strategy="sparsespec",
                             sparsespec_config=config, return_dict_in_generate=True)  # fmt: skip
    result = {
        "rank": rank, "world_size": dist.get_world_size(), "tp_size": model.tp_size,
        "plain": plain.tolist(), "sparsespec_greedy": greedy.sequences.tolist(),
        "sparsespec_sampled": sampled.sequences.tolist(),
        "greedy_stats": greedy.sparsespec_stats.total.as_dict(), "sampled_stats": sampled.sparsespec_stats.total.as_dict(),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        print(f"tensor parallel over {dist.get_world_size()} processes, hf_sparsespec {hf_sparsespec.__name__}")
        print("greedy SparseSpec equals plain generate:", result["sparsespec_greedy"] == result["plain"])
        print("mean accepted drafts per cycle (greedy):", round(result["greedy_stats"]["mean_accepted_per_cycle"], 2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
