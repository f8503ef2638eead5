"""The embedded default model, SmolLM2-135M-Instruct (real weights), through both front doors."""

from __future__ import annotations

import pytest
import torch
from models import assert_greedy_equal

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.demo_model import load_smollm2

QUESTIONS = [
    "What is 12 times 13? Think step by step.",
    "Name three primary colors and explain why they are called primary.",
]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_smollm2(torch.float32)
    tokenizer.padding_side = "left"
    return model, tokenizer


def encode(tokenizer, questions):
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.slow
def test_greedy_matches_plain_generate_on_a_padded_batch(smollm2):
    model, tokenizer = smollm2
    enc = encode(tokenizer, QUESTIONS)
    expected = model.generate(**enc, max_new_tokens=48, do_sample=False)
    config = SparseSpecConfig(num_draft_tokens=8, min_budget=16, budget_ratio=0.05)
    out = model.generate(
        **enc, max_new_tokens=48, do_sample=False, generation_strategy="sparsespec", sparsespec_config=config,
        return_dict_in_generate=True,
    )
    assert_greedy_equal(model, expected, out.sequences, enc["attention_mask"])
    total = out.sparsespec_stats.total
    assert total.cycles > 0 and 0 < total.accepted_drafts < total.drafted_tokens


@pytest.mark.slow
def test_generate_batch_samples_coherently(smollm2):
    model, tokenizer = smollm2
    prompts = [encode(tokenizer, [q])["input_ids"][0].tolist() for q in QUESTIONS]
    model.generation_config.do_sample = True
    try:
        generation_config = model.generation_config.__class__(
            max_new_tokens=32, do_sample=True, temperature=0.6, top_p=0.95,
            eos_token_id=model.generation_config.eos_token_id, pad_token_id=model.generation_config.pad_token_id,
        )
        torch.manual_seed(0)
        results = hf_sparsespec.generate_batch(model, prompts, generation_config, SparseSpecConfig(min_budget=16))
    finally:
        model.generation_config.do_sample = False
    for result in results:
        assert 1 <= len(result.generated_ids) <= 32
        assert result.stats.generated_tokens == len(result.generated_ids)
        assert tokenizer.decode(result.generated_ids).strip()


@pytest.mark.slow
def test_stop_strings_through_the_wrapper(smollm2):
    """transformers drops the tokenizer for custom_generate callables; the wrapper turns stop_strings
    into a StopStringCriteria so they still stop generation where plain generate stops."""
    model, tokenizer = smollm2
    enc = encode(tokenizer, QUESTIONS[:1])
    kwargs = dict(max_new_tokens=40, do_sample=False, stop_strings=["."], tokenizer=tokenizer)
    expected = model.generate(**enc, **kwargs)
    out = model.generate(**enc, **kwargs, generation_strategy="sparsespec")
    assert torch.equal(out, expected)
    text = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.rstrip().endswith(".") and text.count(".") == 1
    with pytest.raises(ValueError, match="stop_strings need the tokenizer"):
        model.generate(**enc, max_new_tokens=5, stop_strings=["\n"], generation_strategy="sparsespec")
