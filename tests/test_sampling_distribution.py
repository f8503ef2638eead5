"""Sampled SparseSpec outputs are distributed as plain sampling's (lossless speculative sampling).

A small model (vocabulary 8, sharp logits) continues one prompt many times, with sparse drafts poor
enough that a good share are rejected (k = 1: the first cycle after prefill drafts densely, every later
one sparsely; the noise of every draw is keyed per request, `sampling.sample_keys`; with adaptive
draft lengths, k = 3, rejections shorten later cycles). Two-sample
chi-square tests compare, position by position, the token marginals and the consecutive-pair
distributions of SparseSpec's samples and plain `generate`'s. Overall false-alarm rate: 1e-3
(Bonferroni over the tests of one case).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from models import shortened_cycles
from scipy.stats import chi2_contingency
from transformers import LlamaConfig, LlamaForCausalLM

from hf_sparsespec import SparseSpecConfig

VOCAB, NEW_TOKENS, SAMPLES = 8, 6, 4000
FALSE_ALARM = 1e-3


def sharp_model() -> LlamaForCausalLM:
    torch.manual_seed(11)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.5, bos_token_id=None,
        eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def two_sample_pvalue(a: Counter, b: Counter) -> float:
    keys = [key for key in set(a) | set(b) if a[key] + b[key] >= 10]  # drop sparse cells
    if len(keys) < 2:
        return 1.0
    table = [[a[key] for key in keys], [b[key] for key in keys]]
    return chi2_contingency(table).pvalue


def sample_both(sampling: dict, config: SparseSpecConfig, new_tokens: int):
    """Plain `generate`'s samples of one prompt, SparseSpec's, and SparseSpec's statistics (total, per request)."""
    model = sharp_model()
    prompt = torch.tensor([[3, 1, 4]]).repeat(SAMPLES, 1)
    torch.manual_seed(0)
    plain = model.generate(input_ids=prompt, max_new_tokens=new_tokens, do_sample=True, **sampling)[:, 3:]
    torch.manual_seed(1)
    out = model.generate(
        input_ids=prompt, max_new_tokens=new_tokens, do_sample=True, generation_strategy="sparsespec",
        sparsespec_config=config, return_dict_in_generate=True, **sampling,
    )
    stats = out.sparsespec_stats
    return plain, out.sequences[:, 3:], stats.total, stats.per_request


def assert_same_distribution(plain: torch.Tensor, ours: torch.Tensor) -> None:
    """Chi-square tests of every position's token and every consecutive pair, Bonferroni-corrected."""
    new_tokens = plain.shape[1]
    tests = []
    for t in range(new_tokens):
        tests.append(two_sample_pvalue(Counter(plain[:, t].tolist()), Counter(ours[:, t].tolist())))
    for t in range(new_tokens - 1):
        pairs_plain = Counter(map(tuple, plain[:, t : t + 2].tolist()))
        pairs_ours = Counter(map(tuple, ours[:, t : t + 2].tolist()))
        tests.append(two_sample_pvalue(pairs_plain, pairs_ours))
    assert min(tests) > FALSE_ALARM / len(tests), tests


@pytest.mark.parametrize("num_draft_tokens", [1, 0], ids=["sparsespec", "autoregressive"])
@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=1.0, top_k=0),
        dict(temperature=0.7, top_k=5, top_p=0.9),
        # processors that read each row's history (drafts included) and an EOS that ends rows early
        dict(temperature=1.0, top_k=0, min_p=0.05, repetition_penalty=1.5, no_repeat_ngram_size=3, eos_token_id=2,
             min_new_tokens=3, pad_token_id=0),  # fmt: skip
    ],
    ids=["plain", "temperature-topk-topp", "history-processors-eos"],
)
def test_output_distribution_equals_plain_sampling(sampling, num_draft_tokens):
    config = SparseSpecConfig(num_draft_tokens=num_draft_tokens, min_budget=1, budget_ratio=0.01, page_size=2,
                              max_num_requests=SAMPLES)  # fmt: skip
    plain, ours, total, _ = sample_both(sampling, config, NEW_TOKENS)
    if num_draft_tokens:
        assert 0.05 < total.acceptance_rate < 0.95, total.as_dict()  # rejections and acceptances both happened
    else:
        assert total.drafted_tokens == 0 and total.cycles == total.generated_tokens - SAMPLES  # one token a cycle
        eos = sampling.get("eos_token_id")
        lengths = [row.index(eos) + 1 if eos in row else NEW_TOKENS for row in ours.tolist()]  # up to a row's EOS
        assert total.generated_tokens == sum(lengths)
    assert_same_distribution(plain, ours)


def test_pillar_selection_keeps_the_distribution():
    """The paper's selection (the tests above run the default, `"induction_diagonal"`)."""
    config = SparseSpecConfig(num_draft_tokens=1, min_budget=1, budget_ratio=0.01, page_size=2,
                              max_num_requests=SAMPLES, selection="pillar")  # fmt: skip
    plain, ours, total, _ = sample_both(dict(temperature=1.0, top_k=0), config, NEW_TOKENS)
    assert 0.05 < total.acceptance_rate < 0.95, total.as_dict()
    assert_same_distribution(plain, ours)


def test_adaptive_draft_lengths_keep_the_distribution():
    """k = 3, min 1, 10 new tokens: after the dense first cycle, rejections shorten later cycles."""
    config = SparseSpecConfig(num_draft_tokens=3, min_budget=1, budget_ratio=0.01, page_size=2,
                              max_num_requests=SAMPLES, adaptive_draft_tokens=True, min_draft_tokens=1)  # fmt: skip
    plain, ours, total, per_request = sample_both(dict(temperature=1.0, top_k=0), config, 10)
    assert 0.05 < total.acceptance_rate < 0.95, total.as_dict()
    assert sum(shortened_cycles(stats, 3, 10) > 0 for stats in per_request) > SAMPLES // 10
    assert_same_distribution(plain, ours)
