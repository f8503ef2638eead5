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


def repeat_kv_heads(model, factor: int):
    """Repeat every KV head of `model` `factor` times, in place: each row block of `k_proj`/`v_proj` (and
    bias) becomes `factor` copies and `num_key_value_heads` grows by `factor`. Query head h then reads KV
    head h // (group / factor), a copy of the one it read before, so the model computes the same function
    (the same tokens, the same acceptance) with `factor` x the KV bytes per token: a real model's weights
    in the KV-bound regime of models with more KV heads (Qwen2.5-Coder-1.5B has 2; Qwen3-1.7B and -8B 8).
    `factor` must divide the GQA group."""
    config = model.config.get_text_config()
    q_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if factor < 1 or (q_heads // kv_heads) % factor:
        raise ValueError(f"factor must divide the GQA group ({q_heads // kv_heads}), got {factor}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
    for layer in model.model.layers:
        attention = layer.self_attn
        for projection in (attention.k_proj, attention.v_proj):
            weight = projection.weight.data.view(kv_heads, head_dim, -1).repeat_interleave(factor, dim=0)
            projection.weight = torch.nn.Parameter(weight.reshape(kv_heads * factor * head_dim, -1).contiguous())
            if projection.bias is not None:
                bias = projection.bias.data.view(kv_heads, head_dim).repeat_interleave(factor, dim=0)
                projection.bias = torch.nn.Parameter(bias.reshape(-1).contiguous())
            projection.out_features = kv_heads * factor * head_dim
        attention.num_key_value_groups = q_heads // (kv_heads * factor)
    config.num_key_value_heads = kv_heads * factor
    return model


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
    parser.add_argument("--repeat-kv-heads", type=int, default=1, metavar="R",
                        help="repeat every KV head R times (repeat_kv_heads): the same model and outputs with "
                             "R x the KV bytes per token (R divides the GQA group)")


def load_model(args, dtype: torch.dtype, device: str):
    """(model, tokenizer or None) from `add_model_arguments`' arguments."""
    if args.gguf is not None:
        model, tokenizer = load_gguf(args.gguf, dtype, device)
    else:
        model, tokenizer = random_model(args.random, dtype, device)
    if args.repeat_kv_heads != 1:
        repeat_kv_heads(model, args.repeat_kv_heads)
    return model, tokenizer


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
