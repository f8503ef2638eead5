"""Keyed sampling noise: the hash, the Triton kernel against its reference, the statistics of the draws
(uniform, independent across keys, exact rejection sampling), and the engine property it buys: a
request's sampled output does not depend on which requests share its iterations."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from models import tiny_model
from scipy import stats
from transformers import GenerationConfig

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.kernels.keyed_sample import (
    accept_drafts,
    accept_drafts_ref,
    hash32_ref,
    keyed_sample,
    keyed_sample_ref,
    keyed_sample_residual,
    keyed_sample_residual_ref,
    keyed_uniform,
    keyed_uniform_ref,
    position_keys_ref,
    probabilities_at,
    probabilities_at_ref,
)
from hf_sparsespec.kernels.keyed_sample import position_keys as device_position_keys
from hf_sparsespec.kernels.tempered_softmax import (
    softmax_stats,
    softmax_stats_ref,
    tempered_softmax,
    tempered_softmax_ref,
    truncated_softmax,
    truncated_softmax_ref,
    truncation_stats,
    truncation_stats_ref,
)
from hf_sparsespec.sampling import (
    ACCEPT_NOISE,
    DRAFT_NOISE,
    TARGET_NOISE,
    accept_sampled,
    position_keys,
    rejection_test,
    sample_keys,
    stream_keys,
)


def lowbias32(x: int) -> int:
    """The 32-bit hash in plain Python integers (the oracle)."""
    mask = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & mask
    x ^= x >> 15
    x = (x * 0x735A2D97) & mask
    return x ^ (x >> 15)


def fit(counts: np.ndarray, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of counts against probabilities."""
    probs = probs.double().numpy()
    return stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue


def test_hash_matches_the_integer_oracle():
    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 0xDEADBEEF, 2**32 - 1]
    assert hash32_ref(torch.tensor(values)).tolist() == [lowbias32(v) for v in values]
    keys = torch.tensor([[0x12345678, -5]], dtype=torch.int32)  # words as int32 bit patterns
    u = keyed_uniform_ref(keys, torch.tensor([7]))
    h = lowbias32((2**32 - 5) ^ lowbias32(0x12345678 ^ 7))
    assert u.item() == ((h >> 9) + 0.5) / 2**23  # exact in float32


def test_device_position_keys_equal_the_host_twin():
    streams = stream_keys(5, np.arange(7), [DRAFT_NOISE, TARGET_NOISE, ACCEPT_NOISE, 1, 2, 3, 1])
    positions = np.array([0, 1, 9, 2**31 + 5, 100, 3, 16383])
    device = position_keys_ref(torch.from_numpy(streams), torch.from_numpy(positions))
    assert device.to(torch.int32).tolist() == position_keys(streams, positions).tolist()
    assert sample_keys(5, 2, 9, ACCEPT_NOISE).tolist() == position_keys(streams[2:3], 9).tolist()


def test_keys_are_distinct_per_request_position_and_purpose():
    rid, pos, purpose = np.meshgrid(np.arange(50), np.arange(200), [DRAFT_NOISE, TARGET_NOISE, ACCEPT_NOISE])
    keys = sample_keys(7, rid.ravel(), pos.ravel(), purpose.ravel())
    assert keys.dtype == np.int32 and keys.shape == (30000, 2)
    assert len({tuple(k) for k in keys.tolist()}) == 30000
    assert not np.array_equal(sample_keys(8, 1, 2, DRAFT_NOISE), sample_keys(7, 1, 2, DRAFT_NOISE))
    assert np.array_equal(sample_keys(7, [3], [4], DRAFT_NOISE), sample_keys(7, 3, 4, DRAFT_NOISE))


@pytest.mark.parametrize("words", [torch.int32, torch.int64])
def test_triton_key_hashes_equal_the_references(words, device):
    """position_keys and keyed_uniform in one launch each: the same bits as the references, for stream
    words as int32 bit patterns (negative ones too) or int64, positions past 2^31, leading dimensions of
    any shape, a strided view, and more rows than one program's block."""
    generator = torch.Generator().manual_seed(0)
    streams = torch.randint(-(2**31), 2**31, (3, 700, 2), generator=generator, dtype=torch.int64)
    streams = (streams if words == torch.int64 else streams.to(torch.int32)).to(device)
    positions = torch.randint(0, 2**33, (3, 700), generator=generator).to(device)
    keys = device_position_keys(streams, positions)
    expected = position_keys_ref(streams, positions)
    assert keys.dtype == torch.int64 and keys.shape == (3, 700, 2)
    assert torch.equal(keys, expected)
    strided = streams[:, ::2]  # rows 2 apart: not one contiguous block
    assert torch.equal(device_position_keys(strided, positions[:, ::2]), position_keys_ref(strided, positions[:, ::2]))
    uniform = keyed_uniform(keys.to(words))
    assert uniform.dtype == torch.float32 and uniform.shape == (3, 700)
    assert torch.equal(uniform, keyed_uniform_ref(keys))
    assert ((uniform > 0) & (uniform < 1)).all()
    assert device_position_keys(streams[:0], positions[:0]).shape == (0, 700, 2)
    one = device_position_keys(streams[1, 5:6], positions[1, 5:6])  # a one-row launch (a batch's last request)
    assert torch.equal(one, position_keys_ref(streams[1, 5:6], positions[1, 5:6]))
    assert torch.equal(keyed_uniform(one), keyed_uniform_ref(one))
    with pytest.raises(ValueError, match="last dimension of 2"):
        device_position_keys(streams[..., :1], positions)
    with pytest.raises(ValueError, match="positions"):
        device_position_keys(streams, positions[:, :5])


@pytest.mark.parametrize("vocab", [1, 97, 5000, 13000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_equals_the_reference(vocab, dtype, device):
    """Few rows over a large vocabulary split each row over several programs (2 and 4 splits at 5,000
    and 13,000 on the interpreter): the folded token is the reference's, including a row of zeros,
    whose maximum ties in every split (the reference's argmax: index 0)."""
    generator = torch.Generator().manual_seed(vocab)
    probs = torch.rand(9, vocab, generator=generator).softmax(-1)
    probs[:, 1::3] = 0.0  # masked tokens (top-k / top-p) are never drawn
    probs[4] = 0.0
    probs = probs.to(dtype).to(device)
    keys = torch.from_numpy(sample_keys(3, np.arange(9), 11, TARGET_NOISE)).to(device)
    expected = keyed_sample_ref(probs, keys)
    got = keyed_sample(probs, keys)
    assert got.tolist() == expected.tolist()
    assert got[4] == 0 and (probs[torch.arange(9), got][[0, 1, 2, 3, 5, 6, 7, 8]] > 0).all()
    assert keyed_sample(probs, keys.long()).tolist() == expected.tolist()  # int64 keys: the same words
    many = probs.repeat(8, 1)  # 72 rows: fewer splits per row
    assert keyed_sample(many, keys.repeat(8, 1)).tolist() == expected.tolist() * 8


@pytest.mark.parametrize("vocab", [1, 97, 5000, 13000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_residual_draws_equal_the_reference_and_the_materialised_residual(vocab, dtype, device):
    """`keyed_sample_residual` reads each draw's target row and store row in place: its tokens are the
    reference's, and the reference's are `keyed_sample` of the residual rows built explicitly (what the
    engine did before), for rejections (a store row subtracted), bonus tokens (-1: nothing subtracted),
    a row with nothing left of p - q (p equal to q: p's own draw) and rows drawn twice."""
    generator = torch.Generator().manual_seed(vocab + 1)
    probs = torch.rand(14, vocab, generator=generator).pow(3).softmax(-1)
    probs[:, 2::5] = 0.0
    store = torch.rand(9, vocab, generator=generator).pow(3).softmax(-1)
    store[6] = probs[5]  # draw 3 subtracts its own target row: nothing left, p's own draw
    rows = torch.tensor([0, 13, 7, 5, 7, 2, 11, 4])
    store_rows = torch.tensor([3, -1, 8, 6, 0, -1, 1, 3])
    probs, store = probs.to(dtype).to(device), store.to(dtype).to(device)
    rows, store_rows = rows.to(device), store_rows.to(device)
    keys = torch.from_numpy(sample_keys(7, np.arange(8), 40, TARGET_NOISE)).to(device)
    p, q = probs[rows].float(), store[store_rows.clamp(min=0)].float() * (store_rows >= 0)[:, None]
    residual = (p - q).clamp(min=0)
    assert (residual[3] == 0).all() and (vocab == 1 or (residual[[0, 2, 4, 6, 7]].sum(-1) > 0).all())
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    expected = keyed_sample_ref(residual, keys)
    assert keyed_sample_residual_ref(probs, rows, store, store_rows, keys).tolist() == expected.tolist()
    got = keyed_sample_residual(probs, rows, store, store_rows, keys)
    assert got.tolist() == expected.tolist()
    assert (residual[torch.arange(8, device=device), got] > 0).all()
    narrow = keyed_sample_residual(probs, rows.int(), store, store_rows.int(), keys.int())  # int32 indices and keys
    assert narrow.tolist() == expected.tolist()
    many = keyed_sample_residual(probs, rows.repeat(9), store, store_rows.repeat(9), keys.repeat(9, 1))  # fewer splits
    assert many.tolist() == expected.tolist() * 9
    assert keyed_sample_residual(probs, rows[:0], store, store_rows[:0], keys[:0]).shape == (0,)


def test_residual_draws_reject_inputs_that_do_not_match(device):
    probs, store = torch.rand(4, 10, device=device), torch.rand(3, 10, device=device)
    rows, keys = torch.tensor([0, 1], device=device), torch.zeros(2, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="store: expected shape"):
        keyed_sample_residual(probs, rows, torch.rand(3, 11, device=device), rows, keys)
    with pytest.raises(ValueError, match="store_rows: expected shape"):
        keyed_sample_residual(probs, rows, store, rows[:1], keys)
    with pytest.raises(ValueError, match="keys: expected shape"):
        keyed_sample_residual(probs, rows, store, rows, keys[:1])
    with pytest.raises(TypeError, match="rows: expected dtype"):
        keyed_sample_residual(probs, rows.float(), store, rows, keys)


def _truncated(top_k: int, top_p: float):
    """`(written, stats)` pairs of the Triton and reference truncation at `top_k`, `top_p` (the
    `tempered_softmax` signature)."""
    return [(lambda x, t, f=write: f(x, t, top_k, top_p, 1), lambda x, t, f=stats_of: f(x, t, top_k, top_p, 1))
            for write, stats_of in ((truncated_softmax, truncation_stats), (truncated_softmax_ref, truncation_stats_ref))]  # fmt: skip


@pytest.mark.parametrize("vocab", [97, 5000, 13000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("truncation", [None, (40, 1.0), (200, 0.9)], ids=["temperature", "top-k", "top-k-top-p"])
def test_draws_from_logits_equal_the_draws_from_the_written_softmax(vocab, dtype, truncation, device):
    """With temperature alone, or top-k / top-p, the engine never writes the probabilities: the samplers
    and `probabilities_at` read them from the logits and each row's stats (`softmax_stats`; with
    top-k / top-p `truncation_stats`, a third column: the smallest kept logit). Their tokens and
    probabilities are those of the written `tempered_softmax` / `truncated_softmax` to the bit (Triton:
    one expression, `stats_probability`; the references: `softmax` row by row), over split
    vocabularies, masked tokens (-inf, a whole split of them in one row), strided rows of a larger
    buffer, rejections, bonus tokens and draws of one row twice."""
    generator = torch.Generator().manual_seed(vocab + 2)
    temperature = 0.65
    buffer = (torch.randn(30, vocab, generator=generator) * 5).to(dtype)
    buffer[:, 3::7] = float("-inf")  # banned tokens
    if vocab > 8192:
        buffer[4, 4096:8192] = float("-inf")  # a whole split (of 4 on the interpreter)
    logits = buffer.to(device)[::2]  # 15 rows, strided
    store = (torch.randn(9, vocab, generator=generator) * 5).to(dtype).to(device)
    keys = torch.from_numpy(sample_keys(5, np.arange(15), 20, DRAFT_NOISE)).to(device)
    rows = torch.tensor([0, 14, 7, 4, 7, 2, 11, 4], device=device)
    store_rows = torch.tensor([3, -1, 8, 6, 0, -1, 1, 3], device=device)
    draw_keys = keys[:8]
    at_rows = torch.randint(0, 15, (4, 3), generator=generator).to(device)
    at_tokens = torch.randint(0, vocab, (4, 3), generator=generator).to(device)
    distributions = [(tempered_softmax, softmax_stats), (tempered_softmax_ref, softmax_stats_ref)]
    if truncation is not None:
        distributions = _truncated(*truncation)
    samplers = [(keyed_sample, keyed_sample_residual, probabilities_at),
                (keyed_sample_ref, keyed_sample_residual_ref, probabilities_at_ref)]  # fmt: skip
    for (softmax, stats_of), (sample, residual, at) in zip(distributions, samplers):
        probs, store_probs = softmax(logits, temperature), softmax(store, temperature)
        stats, store_stats = stats_of(logits, temperature), stats_of(store, temperature)
        assert stats.shape == (15, 2 if truncation is None else 3) and stats.dtype == torch.float32
        if truncation is not None:  # the tokens below the threshold are dropped (fp16 logits tie at the k-th)
            assert ((probs > 0).sum(-1) <= truncation[0] + (dtype == torch.float16) * 4).all()
        expected = sample(probs, keys)
        assert torch.equal(sample(logits, keys, stats, temperature), expected)
        assert (probs[torch.arange(15, device=device), expected] > 0).all()
        expected = residual(probs, rows, store_probs, store_rows, draw_keys)
        got = residual(logits, rows, store, store_rows, draw_keys, stats, store_stats, temperature)
        assert torch.equal(got, expected)
        assert torch.equal(at(logits, at_rows, at_tokens, stats, temperature), probs[at_rows, at_tokens])
        assert torch.equal(at(probs, at_rows, at_tokens), probs[at_rows, at_tokens])
    (_, triton_stats), (_, reference_stats) = distributions
    torch.testing.assert_close(triton_stats(logits, temperature), reference_stats(logits, temperature), rtol=2e-5,
                               atol=0)  # fmt: skip


def test_draws_from_logits_reject_inputs_that_do_not_match(device):
    logits, store = torch.randn(4, 10, device=device), torch.randn(3, 10, device=device)
    stats = softmax_stats(logits, 0.7)
    rows, keys = torch.tensor([0, 1], device=device), torch.zeros(2, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="stats: expected shape"):
        keyed_sample(logits, torch.zeros(4, 2, dtype=torch.int64, device=device), stats[:3], 0.7)
    with pytest.raises(ValueError, match="expected both"):
        keyed_sample_residual(logits, rows, store, rows, keys, stats, None, 0.7)
    with pytest.raises(ValueError, match="store_stats: expected shape"):
        keyed_sample_residual(logits, rows, store, rows, keys, stats, stats, 0.7)
    with pytest.raises(ValueError, match="temperature"):
        keyed_sample(logits, torch.zeros(4, 2, dtype=torch.int64, device=device), stats, 0.0)
    with pytest.raises(ValueError, match="tokens: expected shape"):
        probabilities_at(logits, rows, rows[:1], stats, 0.7)
    with pytest.raises(TypeError, match="stats: expected dtype"):
        probabilities_at(logits, rows, rows, stats.double(), 0.7)
    truncated = truncation_stats(logits, 0.7, 5, 0.9)
    with pytest.raises(ValueError, match="one kind"):  # softmax stats beside truncation stats
        keyed_sample_residual(logits, rows, store, rows, keys, truncated, softmax_stats(store, 0.7), 0.7)
    with pytest.raises(ValueError, match=r"stats: expected shape \(4, 2\) or \(4, 3\)"):
        keyed_sample(logits, torch.zeros(4, 2, dtype=torch.int64, device=device), torch.zeros(4, 4, device=device), 0.7)


def test_acceptance_with_residual_draws_equals_the_materialised_residual():
    """The engine's acceptance (`accept_drafts` on the drafted tokens' p and q, then `keyed_sample_residual`
    reading target and store rows by index) commits what `accept_sampled`, sampling the materialised
    residual rows, commits with the same keys, over rejections and full accepts."""
    generator = torch.Generator().manual_seed(2)
    n, k, vocab = 24, 4, 50
    target = torch.rand(n, k + 1, vocab, generator=generator).pow(4).softmax(-1)
    store = torch.rand(120, vocab, generator=generator).pow(4).softmax(-1)
    draft_rows = torch.randperm(120, generator=generator)[: n * k].view(n, k)
    drafts = torch.multinomial(store[draft_rows.flatten()], 1, generator=generator).view(n, k)
    num_drafts = torch.randint(0, k + 1, (n,), generator=generator)
    accept_keys = torch.from_numpy(sample_keys(9, np.arange(n)[:, None], np.arange(k)[None, :], ACCEPT_NOISE))
    accept_keys = accept_keys.view(n, k, 2)
    keys = sample_keys(9, np.arange(n)[:, None], np.arange(k + 1)[None, :], TARGET_NOISE)
    target_keys = torch.from_numpy(keys).view(n, k + 1, 2)
    rows = torch.arange(n)

    def sample(residual, accepted):
        return keyed_sample_ref(residual, target_keys[rows, accepted])

    uniform = keyed_uniform_ref(accept_keys)
    materialised = accept_sampled(drafts, num_drafts, target, store, uniform, sample, draft_rows=draft_rows)
    p = target[:, :k].gather(2, drafts[..., None]).squeeze(2)
    q = store[draft_rows, drafts]
    accepted, target_rows, store_rows, draw_keys = accept_drafts_ref(p, q, accept_keys, num_drafts, draft_rows,
                                                                     target_keys)  # fmt: skip
    in_place = accepted, keyed_sample_residual_ref(target.view(n * (k + 1), vocab), target_rows, store, store_rows,
                                                   draw_keys)  # fmt: skip
    assert torch.equal(materialised[0], in_place[0]) and torch.equal(materialised[1], in_place[1])
    assert 0 < (in_place[0] < num_drafts).sum() < n  # rejections and full accepts


@pytest.mark.parametrize("k", [1, 3, 8, 16])
@pytest.mark.parametrize("words", [torch.int32, torch.int64])
def test_accept_drafts_equals_the_reference_and_accept_sampled(k, words, device):
    """The verifications' acceptance tests in one launch (`accept_drafts`, the engine's): the reference's
    accepted counts, draw rows, store rows and keys to the bit, over rows of 0 to k drafts, a row whose
    every draft passes (p = 1), one whose first fails (p = 0), a tie (u * q = p fails), 37 rows (three
    programs), and int32 keys and counts; and the reference is `rejection_test` (what `accept_sampled`
    runs) with the same uniforms."""
    generator = torch.Generator().manual_seed(k)
    v = 37
    p, q = torch.rand(v, k, generator=generator), torch.rand(v, k, generator=generator)
    accept_keys = torch.from_numpy(sample_keys(4, np.arange(v)[:, None], np.arange(k)[None, :], ACCEPT_NOISE)).view(v, k, 2)
    uniform = keyed_uniform_ref(accept_keys)
    p[3], p[4], p[5] = 1.0, 0.0, uniform[5] * q[5]
    num_drafts = torch.randint(0, k + 1, (v,), generator=generator)
    num_drafts[3:6], num_drafts[6] = k, 0
    draft_rows = torch.randperm(v * k + 20, generator=generator)[: v * k].view(v, k)
    target_keys = torch.from_numpy(sample_keys(4, np.arange(v)[:, None], np.arange(k + 1)[None, :], TARGET_NOISE))
    target_keys = target_keys.view(v, k + 1, 2)
    expected = accept_drafts_ref(p, q, accept_keys, num_drafts, draft_rows, target_keys)
    inputs = (p, q, accept_keys.to(words), num_drafts.to(words), draft_rows, target_keys.to(words))
    got = accept_drafts(*(x.to(device) for x in inputs))
    assert [g.dtype for g in got] == [torch.int64] * 4 and got[3].shape == (v, 2)
    for name, g, e in zip(("accepted", "target_rows", "store_rows", "keys"), got, expected, strict=True):
        assert torch.equal(g.cpu(), e), name
    accepted, target_rows, store_rows, keys = expected
    assert accepted[3] == k and store_rows[3] == -1  # a bonus token: nothing subtracted
    assert accepted[4] == 0 and store_rows[4] == draft_rows[4, 0]
    assert accepted[5] == 0 and accepted[6] == 0 and store_rows[6] == -1
    assert (accepted <= num_drafts).all() and 0 < (accepted < num_drafts).sum() < v
    assert torch.equal(target_rows, torch.arange(v) * (k + 1) + accepted)
    assert torch.equal(keys, target_keys[torch.arange(v), accepted])
    reference = rejection_test(p, q, uniform, num_drafts, draft_rows)
    assert torch.equal(reference[0], accepted) and torch.equal(reference[1], store_rows)
    empty = accept_drafts(*(x[:0].to(device) for x in inputs))
    assert [tuple(e.shape) for e in empty] == [(0,), (0,), (0,), (0, 2)]


def test_accept_drafts_rejects_inputs_that_do_not_match(device):
    p = torch.rand(4, 3, device=device)
    keys, rows = torch.zeros(4, 3, 2, dtype=torch.int64, device=device), torch.zeros(4, 3, dtype=torch.int64, device=device)
    num_drafts, target_keys = torch.full((4,), 3, device=device), torch.zeros(4, 4, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="q: expected shape"):
        accept_drafts(p, p[:, :2], keys, num_drafts, rows, target_keys)
    with pytest.raises(ValueError, match="target_keys: expected shape"):
        accept_drafts(p, p, keys, num_drafts, rows, target_keys[:, :3])
    with pytest.raises(TypeError, match="p: expected dtype"):
        accept_drafts(p.half(), p, keys, num_drafts, rows, target_keys)
    with pytest.raises(ValueError, match="k >= 1"):
        accept_drafts(p[:, :0], p[:, :0], keys[:, :0], num_drafts, rows[:, :0], target_keys[:, :1])


def test_draws_follow_the_probabilities_and_uniforms_are_independent():
    n, p = 40_000, torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    keys = torch.from_numpy(sample_keys(11, np.arange(n), 0, DRAFT_NOISE))
    tokens = keyed_sample_ref(p.expand(n, -1), keys)
    counts = torch.bincount(tokens, minlength=6).numpy()
    assert counts[5] == 0 and fit(counts[:5], p[:5]) > 1e-3
    u = keyed_uniform_ref(keys[:, None, :], torch.arange(4)[None, :]).numpy()  # [n, 4] per key and index
    assert stats.kstest(u.ravel(), "uniform").pvalue > 1e-3
    assert np.abs(np.corrcoef(u.T)[np.triu_indices(4, 1)]).max() < 0.03  # across vocabulary indices
    nearby = keyed_uniform_ref(torch.from_numpy(sample_keys(11, np.arange(n), 1, DRAFT_NOISE)), 0).numpy()
    assert abs(np.corrcoef(u[:, 0], nearby)[0, 1]) < 0.03  # across positions
    table = np.histogram2d(u[:, 0], nearby, bins=5)[0]
    assert stats.chi2_contingency(table).pvalue > 1e-3


def test_keyed_rejection_sampling_reproduces_the_target_distribution():
    """The engine's draws end to end: drafts from draft noise, acceptance tests from acceptance noise,
    recovered tokens from target noise, all keyed by (request, position). First committed token against
    the target (false-alarm rate 1e-3)."""
    vocab, k, n = 6, 2, 60_000
    target = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    draft = torch.tensor([0.10, 0.30, 0.20, 0.25, 0.05, 0.10])  # far from the target
    requests, positions = np.arange(n)[:, None], 10 + np.arange(k + 1)[None, :]
    draft_keys = torch.from_numpy(sample_keys(5, requests, positions[:, :k], DRAFT_NOISE))
    drafts = keyed_sample_ref(draft.expand(n * k, -1), draft_keys).view(n, k)
    uniform = keyed_uniform_ref(torch.from_numpy(sample_keys(5, requests, positions[:, :k], ACCEPT_NOISE)).view(n, k, 2))
    target_keys = torch.from_numpy(sample_keys(5, requests, positions, TARGET_NOISE)).view(n, k + 1, 2)

    def sample(probs, accepted):
        return keyed_sample_ref(probs, target_keys[torch.arange(n), accepted])

    accepted, next_token = accept_sampled(
        drafts, torch.full((n,), k), target.expand(n, k + 1, vocab), draft.expand(n, k, vocab), uniform, sample
    )
    first = torch.where(accepted > 0, drafts[:, 0], next_token)
    counts = torch.bincount(first, minlength=vocab).numpy()
    assert fit(counts, target) > 1e-3
    second = torch.where(accepted > 1, drafts[:, 1], next_token)[accepted >= 1]  # given the first was a draft
    counts = torch.bincount(second, minlength=vocab).numpy()
    assert fit(counts, target) > 1e-3
    assert 0.2 < accepted.float().mean() / k < 0.9


@pytest.mark.parametrize("variant", [{}, dict(adaptive_draft_tokens=True), dict(min_draft_context=9)],
                         ids=["fixed-k", "adaptive-k", "plain-below-9"])  # fmt: skip
def test_sampled_outputs_do_not_depend_on_the_batch(variant):
    """Same seed: each request's sampled tokens are the same whether it runs with 7 others, with at
    most 3 at a time, under a tight page pool, with the naive scheduler, or without delayed verification;
    with adaptive draft lengths too (each request's lengths follow its own acceptance), and with plain
    steps until a request's context reaches 9 tokens (the switch is the request's own)."""
    model = tiny_model("llama")
    prompts = [[5, 17, 3], [9] * 11, [40, 41, 42, 43, 44, 45, 46], [2], [8, 9], [30, 31, 32, 33], [60] * 5, [1, 2, 3]]
    gc = GenerationConfig(max_new_tokens=30, do_sample=True, temperature=0.9, top_p=0.95, eos_token_id=None)

    def generated(**overrides):
        torch.manual_seed(3)
        config = SparseSpecConfig(**{"num_draft_tokens": 4, "min_budget": 4, "page_size": 4, **variant, **overrides})
        return [r.generated_ids for r in hf_sparsespec.generate_batch(model, prompts, gc, config)]

    reference = generated()
    for overrides in (dict(max_num_requests=3), dict(num_pages=20), dict(scheduler="naive"),
                      dict(delayed_verification=False)):  # fmt: skip
        assert generated(**overrides) == reference, overrides
    assert generated(num_draft_tokens=3) != reference  # other cycles, other drafts: other (equally valid) samples
    torch.manual_seed(4)
    assert [r.generated_ids for r in hf_sparsespec.generate_batch(model, prompts, gc)] != reference  # other seed


@pytest.mark.parametrize("top_k", [50, 0], ids=["top-k", "temperature"])
def test_every_draft_is_the_keyed_draw_at_its_true_position(monkeypatch, top_k):
    """A speculative draft's position is only known on the device (the accepted count shifts it): its
    noise must still be keyed at the position where its token lands, not at the row's unshifted one
    (that key belongs to the previous cycle's draft, whose noise an accepted token already used). The
    drafts are drawn from their logits and stats: two columns with temperature alone, three with top-k."""
    from hf_sparsespec.batch import BatchBuilder
    from hf_sparsespec.runner import ModelRunner

    seeds, checked = [], Counter()
    original_init, original_store = BatchBuilder.__init__, ModelRunner._store_drafts

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seeds.append(self.sample_seed)

    def store(self, write_index, prob_index, tokens, drafts):
        width = self.token_buffer.shape[1]
        assert drafts.from_logits and drafts.stats.shape[1] == (3 if top_k else 2)
        for i, (index, token) in enumerate(zip(write_index.tolist(), tokens.tolist())):
            slot, position = divmod(index, width)
            if slot == self.num_slots:
                continue  # a padding row
            key = torch.from_numpy(sample_keys(seeds[-1], slot, position, DRAFT_NOISE))  # request i holds slot i
            row = drafts[i : i + 1]
            assert token == keyed_sample_ref(row.values, key, row.stats, row.temperature).item(), (slot, position)
            checked["drafts"] += 1
        return original_store(self, write_index, prob_index, tokens, drafts)

    monkeypatch.setattr(BatchBuilder, "__init__", init)
    monkeypatch.setattr(ModelRunner, "_store_drafts", store)
    model = tiny_model("llama")
    torch.manual_seed(0)
    out = model.generate(
        input_ids=torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13], [3, 2, 1]]), max_new_tokens=40, do_sample=True,
        temperature=0.7, top_k=top_k, generation_strategy="sparsespec", sparsespec_config=SparseSpecConfig(num_draft_tokens=4),
        return_dict_in_generate=True,
    )  # fmt: skip
    total = out.sparsespec_stats.total
    # every draft was checked (and speculative drafts dropped at the length limit); accepted drafts moved
    # the speculative drafts that followed them
    assert checked["drafts"] >= total.drafted_tokens > 0 and total.accepted_drafts > 0
