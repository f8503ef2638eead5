"""Tiny random decoder models of every supported architecture, a matching character tokenizer, and the
greedy-equality check."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def tiny_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    kwargs = {**COMMON, **overrides}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kwargs))
    elif arch == "mistral":
        kwargs.setdefault("sliding_window", None)
        model = MistralForCausalLM(MistralConfig(**kwargs))
    elif arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **kwargs)
        )
    else:
        raise ValueError(arch)
    return model.eval()


def on_backend_device(model: torch.nn.Module, backend: str | None) -> torch.nn.Module:
    """The model where `backend`'s kernels run: Triton's on CUDA tensors where a GPU is present (the
    interpreter, on CPU tensors, only without one: see conftest.py)."""
    return model.cuda() if backend == "triton" and torch.cuda.is_available() else model


# one token per character: pad, eos, newline and the printable ASCII characters ' ' .. '|' (VOCAB in all)
TOKENS = ["<pad>", "</s>", "\n"] + [chr(c) for c in range(32, 125)]
assert len(TOKENS) == VOCAB


def tiny_tokenizer():
    """A character-level fast tokenizer over the tiny models' vocabulary (pad 0, eos 1)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=[], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", padding_side="left")


def ragged_batch(lengths: list[int], seed: int = 0, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of random prompts of the given lengths: (input_ids, attention_mask)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def assert_greedy_equal(
    model: torch.nn.Module,
    expected: torch.Tensor,
    actual: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    tie_tolerance: float = 1e-4,
) -> int:
    """Sequences equal token for token, except after a position where plain decoding's top-2 logits
    are within `tie_tolerance` (a numeric tie). Returns the number of rows that diverged at a tie."""
    assert expected.shape[0] == actual.shape[0]
    ties = 0
    for row in range(expected.shape[0]):
        exp, act = expected[row].tolist(), actual[row].tolist()
        if exp == act:
            continue
        first = next((i for i, (a, b) in enumerate(zip(exp, act)) if a != b), min(len(exp), len(act)))
        num_pad = 0 if attention_mask is None else int((attention_mask[row] == 0).sum())
        prefix = torch.tensor([exp[num_pad:first]])
        with torch.no_grad():
            logits = model(input_ids=prefix).logits[0, -1]
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < tie_tolerance, (
            f"row {row} diverges at position {first} where plain decoding has a top-2 gap of {gap:.2e} "
            f"(not a numeric tie)\nexpected {exp[first:first + 8]}\nactual   {act[first:first + 8]}"
        )
        ties += 1
    return ties


def shortened_cycles(stats, k: int, max_new_tokens: int) -> int:
    """Cycles of one request (`RequestStats`) that drafted fewer than k for another reason than the length
    limit (k drafts, or as many as leave room for the cycle's last token): adaptive draft lengths."""
    generated, shortened = 1, 0  # the first token comes from the prefill
    for drafted, accepted in zip(stats.cycle_drafted, stats.cycle_accepted):
        shortened += drafted < min(k, max_new_tokens - generated - 1)
        generated += accepted + 1
    return shortened


def assert_same_decoding(engine_a, requests_a, engine_b, requests_b) -> None:
    """Two engine runs over the same requests decoded the same: tokens and acceptance per request, the KV
    of every page either run wrote (page pools start zeroed) and the token histories of every real slot
    (the dummy slot, which padding rows write, may differ)."""
    for a, b in zip(requests_a, requests_b):
        assert a.generated == b.generated and a.stats.accepted_histogram == b.stats.accepted_histogram
    for la, lb in zip(engine_a.cache.layers, engine_b.cache.layers):
        torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(la.values, lb.values, rtol=0, atol=1e-5)
    num_slots = engine_a.layout.num_slots
    assert torch.equal(engine_a.runner.token_buffer[:num_slots], engine_b.runner.token_buffer[:num_slots])


def assert_fused_draws_the_unfused_tokens(monkeypatch, owner, name: str, fused_property: str, generate, seed: int = 7):
    """Sampling through a fused path (`owner.name`, a function of a module or a method of a class, is
    counted) gives exactly the tokens of the processors-then-softmax path (`LogitsPipeline.<fused_property>`
    turned off), under the same seed; returns the fused run's output."""
    from hf_sparsespec.sampling import LogitsPipeline

    calls = []
    fused = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args: calls.append(1) or fused(*args))
    torch.manual_seed(seed)
    out = generate()
    assert calls, f"the fused path {name} did not run"
    monkeypatch.setattr(LogitsPipeline, fused_property, property(lambda self: None))
    torch.manual_seed(seed)
    unfused = generate()
    assert torch.equal(getattr(out, "sequences", out), getattr(unfused, "sequences", unfused))
    return out
