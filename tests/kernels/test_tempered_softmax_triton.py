"""tempered_softmax (Triton) against `softmax(logits.float() / T)` (float32): rows fewer and more than
the device's programs (split and unsplit vocabularies), vocabularies across block edges, masked
tokens (-inf) including a whole split of them, half-precision logits, strided rows; the pipeline's
test of when the engine may use it, and the fused path against the processors then softmax.

truncated_softmax (Triton: temperature -> top-k -> top-p -> softmax) against `truncated_softmax_ref`
(itself tested against transformers' processors in tests/test_truncated_sampling.py): the same kept
tokens and probabilities over the same shapes, with ties at the k-th logit beyond the k, a tie group
on the top-p boundary, masked tokens, more candidates than finite logits, and min_tokens_to_keep; and
with the candidates found through the chunks' maxima (`largest_values`, itself against `torch.topk`)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import poison_outputs  # noqa: F401
from transformers.generation import logits_process as lp

from hf_sparsespec.kernels import tempered_softmax as module
from hf_sparsespec.kernels.tempered_softmax import (
    largest_values,
    tempered_softmax,
    tempered_softmax_ref,
    truncated_softmax,
    truncated_softmax_ref,
)
from hf_sparsespec.sampling import LogitsPipeline


def _dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])


@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 97), (5, 5000), (3, 13000), (70, 4100)])
@pytest.mark.parametrize("temperature", [0.65, 1.0, 2.5])
def test_matches_reference(device, rows, vocab, temperature):
    generator = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=generator) * 6
    logits[:, 1::7] = float("-inf")  # masked tokens
    if vocab > 8192:
        logits[1, 4096:8192] = float("-inf")  # a whole split (of 4 on the interpreter) masked
    for dtype in _dtypes(device):
        x = logits.to(dtype).to(device)
        expected = tempered_softmax_ref(x, temperature)
        got = tempered_softmax(x, temperature)
        assert got.dtype == torch.float32 and got.shape == (rows, vocab)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=1e-9)
        assert (got[:, 1::7] == 0).all()
        torch.testing.assert_close(got.sum(-1), torch.ones(rows, device=device), rtol=0, atol=1e-5)


def test_strided_rows_and_split_settings(device, monkeypatch):
    """Rows of a larger buffer (the logits of some rows only), and one program per row."""
    logits = torch.randn(12, 6000, generator=torch.Generator().manual_seed(1)).to(device) * 4
    view = logits[::3]
    expected = tempered_softmax_ref(view, 0.7)
    torch.testing.assert_close(tempered_softmax(view, 0.7), expected, rtol=2e-5, atol=1e-9)
    monkeypatch.setattr(module, "SOFTMAX_PROGRAMS_PER_SM", 0)  # no split
    torch.testing.assert_close(tempered_softmax(view, 0.7), expected, rtol=2e-5, atol=1e-9)
    assert tempered_softmax(view[:0], 0.7).shape == (0, 6000)
    with pytest.raises(ValueError, match="temperature"):
        tempered_softmax(view, 0.0)


def test_pipeline_fuses_temperature_and_min_length_bans_only():
    min_new = lp.MinNewTokensLengthLogitsProcessor(5, 30, eos_token_id=[2, 7])
    assert LogitsPipeline([]).fused_temperature == 1.0
    assert LogitsPipeline([lp.TemperatureLogitsWarper(0.6)]).fused_temperature == 0.6
    assert LogitsPipeline([min_new, lp.TemperatureLogitsWarper(0.6)]).fused_temperature == 0.6
    assert LogitsPipeline([lp.MinLengthLogitsProcessor(9, eos_token_id=2)]).fused_temperature == 1.0
    assert LogitsPipeline([lp.TemperatureLogitsWarper(0.6), lp.TopKLogitsWarper(20)]).fused_temperature is None
    assert LogitsPipeline([lp.TopPLogitsWarper(0.9)]).fused_temperature is None
    two = [lp.TemperatureLogitsWarper(0.6), lp.TemperatureLogitsWarper(0.5)]
    assert LogitsPipeline(two).fused_temperature is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_equals_the_pipeline_then_softmax(dtype):
    """The engine's two paths on the same logits: eos banned in place on the model's logits, then
    `tempered_softmax_ref`, against transformers' processors on float32 scores, then `torch.softmax`.
    Rows below their minimum length (`prefix_len < params`) lose both eos tokens; the others keep them."""
    from hf_sparsespec.sampling import LogitsRows

    min_new = lp.MinNewTokensLengthLogitsProcessor(5, 30, eos_token_id=[2, 7])
    pipeline = LogitsPipeline([min_new, lp.TemperatureLogitsWarper(0.6)])
    logits = (torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    rows = LogitsRows(slot=torch.arange(6), prefix_len=torch.tensor([3, 40, 12, 29, 30, 31]),
                      params=torch.full((1, 6), 30))  # fmt: skip
    expected = torch.softmax(pipeline(logits.float().clone(), torch.zeros(6, 64, dtype=torch.long), rows), dim=-1)
    fused = tempered_softmax_ref(pipeline.ban_eos_in_place(logits.clone(), rows), pipeline.fused_temperature)
    assert torch.equal(fused, expected)
    banned = torch.tensor([True, False, True, True, False, False])
    assert (fused[banned][:, [2, 7]] == 0).all() and (fused[~banned][:, [2, 7]] > 0).all()


def _assert_same_truncation(got, expected):
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 97), (5, 5000), (3, 13000), (70, 4100)])
@pytest.mark.parametrize(
    "temperature, top_k, top_p, keep", [(0.65, 20, 0.8, 1), (1.0, 1, 1.0, 1), (1.7, 50, 1.0, 1), (0.65, 200, 0.95, 1),
                                        (1.0, 7, 0.0, 3), (0.8, 5000, 0.5, 1)]
)  # fmt: skip
def test_truncated_matches_reference(device, rows, vocab, temperature, top_k, top_p, keep):
    """Distinct logits with masked tokens (a whole split of them in the wide vocabulary); top_k from 1 to
    more than the vocabulary, top_p off, ordinary and 0 (min_tokens_to_keep only)."""
    generator = torch.Generator().manual_seed(rows * vocab + top_k)
    logits = torch.randn(rows, vocab, generator=generator) * 4
    logits[:, 1::7] = float("-inf")
    if vocab > 8192:
        logits[1, 4096:8192] = float("-inf")
    for dtype in _dtypes(device):
        x = logits.to(dtype).to(device)
        expected = truncated_softmax_ref(x, temperature, top_k, top_p, keep)
        _assert_same_truncation(truncated_softmax(x, temperature, top_k, top_p, keep), expected)
        if top_k < vocab and dtype == torch.float32:  # at most top_k kept (half precision has ties)
            assert ((expected > 0).sum(-1) <= top_k).all()


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.6])
def test_truncated_ties_at_the_kth_and_on_the_top_p_boundary(device, top_p):
    """Integer logits: every token tied with the k-th is kept (more than k, across splits of the wide
    row), and a tie group straddling top-p's boundary is kept whole, as the reference."""
    vocab = 9000
    logits = torch.full((4, vocab), -6.0)
    logits[:, :3] = torch.tensor([4.0, 3.0, 2.0])
    logits[0, [10, 2000, 4500, 8999]] = 1.0  # with k = 5: the 4th to 7th largest tie with the k-th
    logits[1, [5, 6, 7]] = 2.0  # a group of 4 tied at 2 (the 3rd-6th largest): k = 5 cuts into it
    logits[2, 100:140] = 0.0  # 40 tokens tied at the k-th
    logits[3, 3:9] = 3.0  # seven tied at 3 (on the top-p boundary of 0.6 and 0.9)
    for dtype in _dtypes(device):
        x = logits.to(dtype).to(device)
        expected = truncated_softmax_ref(x, 1.0, 5, top_p, 1)
        got = truncated_softmax(x, 1.0, 5, top_p, 1)
        _assert_same_truncation(got, expected)
        if top_p == 1.0:
            assert (got > 0).sum(-1).tolist() == [7, 6, 43, 8]


def test_truncated_candidates_beyond_the_finite_logits_and_strided_rows(device, monkeypatch):
    """top_k larger than a row's finite logits keeps them all (the k-th is -inf); rows of a larger
    buffer; one program per row; bad arguments."""
    logits = torch.randn(12, 3000, generator=torch.Generator().manual_seed(5)).to(device) * 3
    logits[3, 10:] = float("-inf")  # row 1 of the view: 10 finite logits
    view = logits[::3]
    for top_p in (1.0, 0.7):
        expected = truncated_softmax_ref(view, 0.7, 40, top_p, 1)
        _assert_same_truncation(truncated_softmax(view, 0.7, 40, top_p, 1), expected)
        monkeypatch.setattr(module, "SOFTMAX_PROGRAMS_PER_SM", 0)  # no split
        _assert_same_truncation(truncated_softmax(view, 0.7, 40, top_p, 1), expected)
        monkeypatch.undo()
    assert (truncated_softmax(view, 0.7, 40)[1, :10] > 0).all()
    assert truncated_softmax(view[:0], 0.7, 40).shape == (0, 3000)
    for bad in (dict(temperature=0.0), dict(top_k=0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            truncated_softmax(view, **(dict(temperature=0.7, top_k=40) | bad))


def _counting_topk(monkeypatch) -> list[int]:
    """Patch `torch.topk` to record the row length of every call (the list it returns)."""
    widths, topk = [], torch.topk
    monkeypatch.setattr(torch, "topk", lambda x, k, dim=-1: widths.append(x.shape[-1]) or topk(x, k, dim=dim))
    return widths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, chunk", [(97, 8), (1000, 8), (4100, 64), (13000, 128), (4096, 16)])
@pytest.mark.parametrize("k", [1, 3, 20, 50])
def test_largest_values_equals_topk(monkeypatch, dtype, n, chunk, k):
    """The k largest values of rows ranked by their chunks' maxima equal one `torch.topk`'s, bit for bit:
    distinct values; integer values with many ties (the k-th tied inside and across chunks); masked
    tokens (-inf) including whole chunks and a row with fewer finite values than k; rows of a wider
    buffer (strided); a remainder past the last whole chunk or none; no rows. The chunked path runs
    (a `torch.topk` over fewer values than the row) wherever the candidates are at most half of it."""
    generator = torch.Generator().manual_seed(n * k + chunk)
    distinct = torch.randn(5, n, generator=generator) * 4
    tied = torch.randint(-3, 4, (5, n), generator=generator).float()
    masked = distinct.clone()
    masked[:, 1::3] = float("-inf")
    masked[1, : n // 2] = float("-inf")  # whole chunks masked
    masked[2, 2:] = float("-inf")  # 2 finite values (fewer than k for k > 2)
    wide = torch.randn(10, n + 7, generator=generator)[::2, 3 : n + 3]  # strided rows
    chunked = k < n // chunk and 2 * k * chunk <= n
    for scores in (distinct, tied, masked, wide, distinct[:0]):
        scores = scores.to(dtype)
        expected = torch.topk(scores, k, dim=-1).values
        widths = _counting_topk(monkeypatch)
        got = largest_values(scores, k, chunk)
        monkeypatch.undo()
        assert got.dtype == dtype and torch.equal(got, expected)
        assert (max(widths) < n) == chunked, (widths, n)
    assert torch.equal(largest_values(distinct, k, 0), torch.topk(distinct, k).values)  # 0: one topk


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_truncated_with_candidates_from_the_chunks(device, monkeypatch, top_p):
    """`truncated_softmax` with `TOPK_CHUNK` set keeps the tokens and probabilities of the reference (one
    `torch.topk`): ties at the k-th across chunks, masked tokens, a remainder past the last chunk; its
    candidates come from the chunks (a `torch.topk` over fewer values than the row)."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 5003, generator=generator) * 4
    logits[:, 1::7] = float("-inf")
    logits[1] = torch.randint(-3, 3, (5003,), generator=generator).float()  # ties at the k-th, everywhere
    logits[2, :4000] = float("-inf")
    for dtype in _dtypes(device):
        x = logits.to(dtype).to(device)
        expected = truncated_softmax_ref(x, 0.65, 20, top_p, 1)
        monkeypatch.setattr(module, "TOPK_CHUNK", 32)
        widths = _counting_topk(monkeypatch)
        got = truncated_softmax(x, 0.65, 20, top_p, 1)
        monkeypatch.undo()
        _assert_same_truncation(got, expected)
        assert min(widths) < 5003 and max(widths) < 5003, widths
