"""tempered_softmax (Triton) against `softmax(logits.float() / T)` (float32): rows fewer and more than
the device's programs (split and unsplit vocabularies), vocabularies across block edges, masked
tokens (-inf) including a whole split of them, half-precision logits, strided rows; the pipeline's
test of when the engine may use it, and the fused path against the processors then softmax."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import poison_outputs  # noqa: F401
from transformers.generation import logits_process as lp

from hf_sparsespec.kernels import tempered_softmax as module
from hf_sparsespec.kernels.tempered_softmax import tempered_softmax, tempered_softmax_ref
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
    expected = torch.softmax(pipeline(logits.float(), torch.zeros(6, 64, dtype=torch.long), rows), dim=-1)
    fused = tempered_softmax_ref(pipeline.ban_eos_in_place(logits.clone(), rows), pipeline.fused_temperature)
    assert torch.equal(fused, expected)
    banned = torch.tensor([True, False, True, True, False, False])
    assert (fused[banned][:, [2, 7]] == 0).all() and (fused[~banned][:, [2, 7]] > 0).all()
