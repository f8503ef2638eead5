"""Loading benchmark models on a machine without a model hub: a GGUF file (dequantized by
transformers, slow: ~50 s for Qwen2.5-Coder-1.5B), cached as a state dict next to it so that later
processes on the same machine rebuild the model in seconds; or random weights of a real shape."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config

# Random-weight stand-ins with the shapes of the real models (throughput only: acceptance needs real weights).
RANDOM_SHAPES = {
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),  # smoke tests of the scripts on CPU
}  # fmt: skip


def load_gguf(path: Path, dtype: torch.dtype, device: str):
    """(model, tokenizer) from a GGUF file, through a state-dict cache in `<path>.state/`."""
    path = Path(path).expanduser()
    cache = path.with_suffix(".state")
    if (cache / "weights.pt").is_file():
        config = AutoConfig.from_pretrained(cache)
        with torch.device(device):  # non-persistent buffers (rotary frequencies) come from the config
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(torch.load(cache / "weights.pt", map_location="cpu", mmap=True))
        model.generation_config = GenerationConfig.from_pretrained(cache)
        tokenizer = AutoTokenizer.from_pretrained(cache)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        cache.mkdir(exist_ok=True)
        torch.save(model.state_dict(), cache / "weights.pt")
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (cache / "config.json").write_text(json.dumps(config))
        model.generation_config.save_pretrained(cache)
        tokenizer.save_pretrained(cache)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    if tokenizer.pad_token is None:
        pad = model.generation_config.pad_token_id
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad if pad is not None else 0)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def random_model(name: str, dtype: torch.dtype, device: str, seed: int = 0):
    """A Qwen2 model with random weights and the shape `RANDOM_SHAPES[name]` (no tokenizer)."""
    torch.manual_seed(seed)
    config = Qwen2Config(**RANDOM_SHAPES[name], max_position_embeddings=32768, bos_token_id=None, eos_token_id=None,
                         pad_token_id=0)  # fmt: skip
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), None


def add_model_arguments(parser) -> None:
    """`--gguf PATH` (real weights) or `--random SHAPE` (random weights of a real shape), one required."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path)
    source.add_argument("--random", choices=sorted(RANDOM_SHAPES))


def main() -> None:
    """`python benchmarks/loading.py --gguf PATH [--dtype bfloat16] [--export DIR]`: dequantize once (fills
    the state-dict cache) and optionally write a plain transformers folder (`from_pretrained(DIR)`), for
    tools that take a model folder, such as `python -m hf_sparsespec.eval --model DIR`."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--export", type=Path, default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    model, tokenizer = load_gguf(args.gguf, getattr(torch, args.dtype), "cpu")
    print(f"loaded {args.gguf.name} in {time.perf_counter() - started:.0f} s", flush=True)
    if args.export is not None:
        if getattr(model.config, "quantization_config", None) is not None:  # loaded from the GGUF itself:
            model, tokenizer = load_gguf(args.gguf, getattr(torch, args.dtype), "cpu")  # rebuilt from the cache
        model.save_pretrained(args.export)
        model.generation_config.save_pretrained(args.export)
        tokenizer.save_pretrained(args.export)
        print(f"wrote {args.export}", flush=True)


if __name__ == "__main__":
    main()
