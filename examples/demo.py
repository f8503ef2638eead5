"""Demo: SparseSpec on the embedded default model (SmolLM2-135M-Instruct), next to plain generate.

    make demo                     # or: python examples/demo.py [--max-new-tokens N] [--device cuda]

Prints the answer, the acceptance statistics and tokens/s of both on the same prompt and settings.
On a CPU the torch reference kernels run (slow); the speed-up needs a GPU and long generations.
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_sparsespec
from hf_sparsespec.demo_model import load_smollm2

QUESTION = (
    "A farmer has 17 sheep. All but 9 run away. Then he buys twice as many sheep as he has left. "
    "How many sheep does he have now? Reason step by step, then give the final answer."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tokenizer = load_smollm2(dtype, args.device)
    messages = [{"role": "user", "content": QUESTION}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = inputs.to(args.device)
    prompt_len = inputs["input_ids"].shape[1]
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.6, top_p=0.95)
    config = hf_sparsespec.SparseSpecConfig(num_draft_tokens=8, budget_ratio=0.05, min_budget=32)

    torch.manual_seed(args.seed)
    start = time.perf_counter()
    out = model.generate(
        **inputs, **settings, generation_strategy="sparsespec", sparsespec_config=config, return_dict_in_generate=True
    )
    sparse_seconds = time.perf_counter() - start
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    plain = model.generate(**inputs, **settings)
    plain_seconds = time.perf_counter() - start

    answer = out.sequences[0, prompt_len:]
    stats = out.sparsespec_stats.total
    print(f"\nQ: {QUESTION}\n\nA (SparseSpec): {tokenizer.decode(answer, skip_special_tokens=True).strip()}\n")
    print(f"acceptance: {stats.accepted_drafts}/{stats.drafted_tokens} drafts accepted over {stats.cycles} cycles, "
          f"mean {stats.mean_accepted_per_cycle:.2f} of {config.num_draft_tokens} per cycle")
    print(f"histogram of accepted drafts per cycle (0..{config.num_draft_tokens}): {stats.accepted_histogram}")
    plain_tokens = plain.shape[1] - prompt_len
    print(f"\n{'':14}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}")
    print(f"{'sparsespec':14}{len(answer):>8}{sparse_seconds:>10.2f}{len(answer) / sparse_seconds:>10.1f}")
    print(f"{'plain generate':14}{plain_tokens:>8}{plain_seconds:>10.2f}{plain_tokens / plain_seconds:>10.1f}")
    print(f"(device {args.device}, {dtype}, attention backend "
          f"{'triton' if args.device == 'cuda' else 'torch reference'}, sampling T=0.6 top_p=0.95)")


if __name__ == "__main__":
    main()
