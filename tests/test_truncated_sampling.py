"""`truncated_softmax_ref` (the torch backend's, and the Triton kernel's reference): transformers' temperature -> top-k -> top-p -> softmax without sorting the
vocabulary, against the processors themselves: the same support and probabilities where no tie
straddles the top-p boundary, every token tied at the k-th score kept (as transformers), and at a
tied top-p boundary the whole tie group kept (transformers' unstable sort keeps an arbitrary part of
it). `LogitsPipeline.fused_truncation` takes only the pipelines it reproduces."""

from __future__ import annotations

import pytest
import torch
import transformers.generation.logits_process as lp
from transformers import LogitsProcessorList

from hf_sparsespec.kernels.tempered_softmax import truncated_softmax_ref
from hf_sparsespec.sampling import MAX_FUSED_TOP_K, LogitsPipeline


def _processors(temperature: float, top_k: int, top_p: float, keep: int) -> list:
    processors = [lp.TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    processors.append(lp.TopKLogitsWarper(top_k, min_tokens_to_keep=keep))
    if top_p < 1.0:
        processors.append(lp.TopPLogitsWarper(top_p, min_tokens_to_keep=keep))
    return processors


def truncated_probs(scores: torch.Tensor, truncation) -> torch.Tensor:
    t = truncation
    return truncated_softmax_ref(scores, t.temperature, t.top_k, t.top_p, t.min_tokens_to_keep)


def _reference(processors: list, scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(LogitsProcessorList(processors)(None, scores.clone()), dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.4])
@pytest.mark.parametrize("top_k, top_p, keep", [(1, 0.9, 1), (5, 0.3, 2), (20, 0.8, 1), (50, 0.95, 1), (50, 1.0, 1),
                                                (40, 0.0, 3), (700, 0.999, 1), (1000, 0.5, 1)])  # fmt: skip
def test_matches_the_processors_on_distinct_scores(temperature, top_k, top_p, keep):
    """Scores without ties (a permutation of spaced values, shuffled per row): the same kept tokens and
    the same probabilities; vocabularies smaller than top_k keep everything top-p allows."""
    generator = torch.Generator().manual_seed(top_k * 7 + keep)
    vocab = 900
    spread = torch.linspace(-12.0, 9.0, vocab)
    scores = torch.stack([spread[torch.randperm(vocab, generator=generator)] for _ in range(6)])
    scores += torch.rand(6, 1, generator=generator) * 3.0  # rows at different offsets
    processors = _processors(temperature, top_k, top_p, keep)
    truncation = LogitsPipeline(processors).fused_truncation
    assert truncation is not None
    ours, expected = truncated_probs(scores.clone(), truncation), _reference(processors, scores)
    assert torch.equal(ours > 0, expected > 0)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)


def test_ties_at_the_kth_score_are_all_kept():
    """Top-k keeps every token equal to the k-th largest score (more than k of them), as transformers."""
    scores = torch.full((2, 60), -5.0)
    scores[:, :3] = torch.tensor([4.0, 3.0, 2.0])
    scores[0, [10, 20, 30, 40, 50]] = 1.0  # the 4th-7th largest tie with the k-th (k = 4)
    scores[1, [7, 8]] = 1.0
    processors = _processors(1.0, 4, 1.0, 1)
    ours = truncated_probs(scores.clone(), LogitsPipeline(processors).fused_truncation)
    expected = _reference(processors, scores)
    assert (ours[0] > 0).sum() == 8 and (ours[1] > 0).sum() == 5
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)


def test_a_tie_group_on_the_top_p_boundary_is_kept_whole():
    """Scores 3, 2, 2, 2, 0...: top-p 0.6 needs the first 2 (mass above it: 0.46 < 0.6, mass above the
    third 2-token: 0.63); transformers keeps some of the tied 2-tokens, by its sort's order, this
    keeps all three. Where transformers keeps a token, so does this."""
    scores = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0, 0.0, -1.0, -1.0]])
    processors = _processors(1.0, 6, 0.6, 1)
    ours = truncated_probs(scores.clone(), LogitsPipeline(processors).fused_truncation)
    expected = _reference(processors, scores)
    assert torch.equal(ours[0] > 0, torch.tensor([True, True, True, True, False, False, False, False]))
    assert ((expected > 0) <= (ours > 0)).all()
    torch.testing.assert_close(ours.sum(), torch.tensor(1.0))
    torch.testing.assert_close(ours[0, :4], torch.softmax(scores[0, :4], dim=0))


def test_fused_truncation_takes_only_the_pipelines_it_reproduces():
    min_new = lp.MinNewTokensLengthLogitsProcessor(3, 5, eos_token_id=2)
    penalty = lp.RepetitionPenaltyLogitsProcessor(1.1)
    top_k, top_p, temperature = lp.TopKLogitsWarper(20), lp.TopPLogitsWarper(0.9), lp.TemperatureLogitsWarper(0.7)
    truncation = LogitsPipeline([min_new, penalty, temperature, top_k, top_p]).fused_truncation
    assert (truncation.num_history_steps, truncation.temperature, truncation.top_k, truncation.top_p) == (2, 0.7, 20, 0.9)
    assert not truncation.bans_only  # the penalty needs the float scores
    assert LogitsPipeline([min_new, temperature, top_k]).fused_truncation.bans_only
    assert LogitsPipeline([top_k]).fused_truncation.top_p == 1.0
    for pipeline in (
        [temperature],  # no top-k: tempered_softmax's case
        [top_p],  # top-p alone could keep most of the vocabulary
        [temperature, top_p, top_k],  # not transformers' order
        [top_k, temperature],
        [temperature, top_k, min_new],  # a ban after the truncation changes it
        [temperature, top_k, lp.MinPLogitsWarper(0.1)],
        [lp.TopKLogitsWarper(20, filter_value=-1e4)],
        [lp.TopKLogitsWarper(MAX_FUSED_TOP_K + 1)],
    ):
        assert LogitsPipeline(pipeline).fused_truncation is None, pipeline


def test_history_steps_run_before_the_truncation():
    """The engine's path: the pipeline's first steps (here the repetition penalty) on the scores, then
    the truncation; the same probabilities as every processor then softmax."""
    from hf_sparsespec.sampling import LogitsRows

    penalty, top_k, top_p = lp.RepetitionPenaltyLogitsProcessor(1.5), lp.TopKLogitsWarper(8), lp.TopPLogitsWarper(0.7)
    pipeline = LogitsPipeline([penalty, top_k, top_p])
    truncation = pipeline.fused_truncation
    scores = torch.linspace(-3.0, 4.0, 40)[torch.randperm(40, generator=torch.Generator().manual_seed(1))][None]
    history = torch.tensor([[int(scores.argmax()), 5, 9, 0]])
    rows = LogitsRows(slot=torch.tensor([0]), prefix_len=torch.tensor([3]), params=torch.zeros((1, 1), dtype=torch.long))
    processed = pipeline(scores.clone(), history, rows, truncation.num_history_steps)
    ours = truncated_probs(processed, truncation)
    expected = _reference([top_k, top_p], penalty(history[:, :3], scores.clone()))  # the penalty reads the history
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
