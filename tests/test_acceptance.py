"""The acceptance rules, tested three ways: forced cases, seeded determinism, and the statistical
property that rejection sampling outputs exactly the target distribution."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from hf_sparsespec.sampling import accept_greedy, accept_sampled


@pytest.mark.parametrize(
    "drafts, num_drafts, targets, accepted, next_token",
    [
        ([1, 2, 3], 3, [1, 2, 3, 4], 3, 4),  # all accepted: bonus token
        ([1, 2, 3], 3, [5, 2, 3, 4], 0, 5),  # first rejected: the target's token
        ([1, 2, 3], 3, [1, 7, 3, 4], 1, 7),  # a later match after a mismatch does not count
        ([1, 2, 3], 2, [1, 2, 3, 4], 2, 3),  # drafts past m are ignored; bonus at position m
        ([1, 2, 3], 0, [6, 2, 3, 4], 0, 6),  # no drafts: a plain decoding step
    ],
)
def test_greedy_forced_cases(drafts, num_drafts, targets, accepted, next_token):
    got_accepted, got_next = accept_greedy(torch.tensor([drafts]), torch.tensor([num_drafts]), torch.tensor([targets]))
    assert got_accepted.tolist() == [accepted] and got_next.tolist() == [next_token]


def test_sampled_forced_cases():
    vocab, k = 5, 3
    target = torch.zeros(2, k + 1, vocab)
    draft = torch.zeros(2, k, vocab)
    # row 0: target puts all mass on the drafts -> accept all, bonus from position k
    target[0, torch.arange(k), torch.tensor([1, 2, 3])] = 1.0
    target[0, k, 4] = 1.0
    draft[0, torch.arange(k), torch.tensor([1, 2, 3])] = 1.0
    # row 1: target gives the first draft probability 0 -> reject it, recover from max(0, p - q)
    target[1, :, 0] = 1.0
    draft[1, :, 2] = 1.0
    accepted, next_token = accept_sampled(torch.tensor([[1, 2, 3], [2, 2, 2]]), torch.tensor([3, 3]), target, draft)
    assert accepted.tolist() == [3, 0] and next_token.tolist() == [4, 0]


def test_sampled_is_deterministic_under_a_seed():
    generator = torch.Generator().manual_seed(0)
    target = torch.rand(16, 5, 11, generator=generator).softmax(-1)
    draft = torch.rand(16, 4, 11, generator=generator).softmax(-1)
    drafts = torch.multinomial(draft.view(-1, 11), 1, generator=generator).view(16, 4)
    runs = []
    for _ in range(3):
        torch.manual_seed(123)
        runs.append(accept_sampled(drafts, torch.full((16,), 4), target, draft))
    for accepted, next_token in runs[1:]:
        assert torch.equal(accepted, runs[0][0]) and torch.equal(next_token, runs[0][1])


def test_sampled_reads_a_store_of_draft_rows_as_the_dense_drafts():
    """The engine's form: draft distributions left in a larger store, found through `draft_rows`."""
    generator = torch.Generator().manual_seed(1)
    target = torch.rand(16, 5, 11, generator=generator).pow(4).softmax(-1)
    draft = torch.rand(16, 4, 11, generator=generator).pow(4).softmax(-1)
    drafts = torch.multinomial(draft.view(-1, 11), 1, generator=generator).view(16, 4)
    uniform = torch.rand(16, 4, generator=generator)
    num_drafts = torch.randint(0, 5, (16,), generator=generator)
    rows = torch.randperm(100, generator=generator)[:64].view(16, 4)
    store = torch.rand(100, 11, generator=generator)
    store[rows.flatten()] = draft.view(-1, 11)

    def first_token(probs, accepted):
        return probs.argmax(-1)

    dense = accept_sampled(drafts, num_drafts, target, draft, uniform, first_token)
    stored = accept_sampled(drafts, num_drafts, target, store, uniform, first_token, draft_rows=rows)
    assert torch.equal(dense[0], stored[0]) and torch.equal(dense[1], stored[1])
    assert 0 < (dense[0] < num_drafts).sum() < 16  # rejections (the store's residual rows) and full accepts


def goodness_of_fit(counts, probs) -> float:
    probs = probs.double().numpy()
    expected = probs / probs.sum() * counts.sum()
    return stats.chisquare(counts, expected).pvalue


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_rejection_sampling_reproduces_the_target_distribution(num_drafts):
    """Goodness of fit of the first committed token (and of the second, given the first draft was
    accepted) against the exact target distribution. False-alarm rate: 1e-3 per test."""
    torch.manual_seed(7)
    vocab, k, n = 6, 3, 60_000
    target = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    draft = torch.tensor([0.10, 0.30, 0.20, 0.25, 0.05, 0.10])  # deliberately far from the target
    target_probs = target.expand(n, k + 1, vocab).contiguous()
    draft_probs = draft.expand(n, k, vocab).contiguous()
    drafts = torch.multinomial(draft, n * k, replacement=True).view(n, k)
    accepted, next_token = accept_sampled(drafts, torch.full((n,), num_drafts), target_probs, draft_probs)
    first = torch.where(accepted > 0, drafts[:, 0], next_token)
    counts = torch.bincount(first, minlength=vocab).numpy()
    assert goodness_of_fit(counts, target) > 1e-3
    assert 0.2 < accepted.float().mean() / num_drafts < 0.9  # both branches were exercised
    rejected_first = accepted == 0
    assert 0 < rejected_first.sum() < n
    # the recovered tokens alone follow norm(max(0, p - q))
    residual = (target - draft).clamp(min=0)
    recovered = torch.bincount(next_token[rejected_first], minlength=vocab).numpy()
    mask = (residual > 0).numpy()
    assert recovered[~mask].sum() == 0
    assert goodness_of_fit(recovered[mask], residual[mask]) > 1e-3
