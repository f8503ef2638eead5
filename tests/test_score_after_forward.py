"""`score_after_forward`: every layer's PillarAttn scoring pass in one call after the forward, from
copies of the verification rows' queries and LSE, instead of one pass per layer inside it. The scores
are the same, so the selections, the drafts and even the sampled tokens are too."""

from __future__ import annotations

import pytest
import torch
from models import assert_greedy_equal, on_backend_device, ragged_batch, tiny_model
from transformers import GenerationConfig

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.kernels.pillar_select import (
    gather_queries,
    gather_queries_ref,
    pillar_scores_into,
    pillar_scores_layers_into,
)
from hf_sparsespec.runner import attention_scales


def _paged_layers(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, generator):
    return torch.randn(num_layers, num_pages, page_size, num_kv_heads, head_dim, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("track_best", [False, True])
def test_one_launch_over_the_layers_equals_a_launch_per_layer(dtype, track_best, device):
    """Three layers, verifications of several lengths (one with no old keys: a kept selection, one a
    padding row with no queries), pages shuffled: the layered launch writes every layer's scores and
    best keys exactly as that layer's own launch does."""
    generator = torch.Generator().manual_seed(5)
    num_layers, num_kv_heads, group, head_dim, page_size, q_len = 3, 2, 3, 16, 4, 5
    key_pool = _paged_layers(num_layers, 100, page_size, num_kv_heads, head_dim, dtype, generator).to(device)
    num_old = torch.tensor([37, 0, 12, 58, 0], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 5, 10, 15, 20, 20], dtype=torch.int32, device=device)  # the last row: padding
    page_table = torch.randperm(100, generator=generator)[: 5 * 16].view(5, 16).to(torch.int32).to(device)
    query = torch.randn(num_layers, 20, num_kv_heads * group, head_dim, generator=generator).to(dtype).to(device)
    lse = (torch.rand(num_layers, 20, num_kv_heads * group, generator=generator) * 3 + 2).to(device)
    width, entries = 64, q_len * group
    scores = torch.full((num_layers, 5, num_kv_heads, width), -7.0, device=device)
    best = torch.zeros(num_layers, 5, num_kv_heads, entries, dtype=torch.int64, device=device) if track_best else None
    pillar_scores_layers_into(query, key_pool, page_table, starts, lse, num_old, scores, 0.3, q_len, best=best,
                              max_rows=8)  # fmt: skip
    for layer in range(num_layers):
        own = torch.full((5, num_kv_heads, width), -7.0, device=device)
        own_best = torch.zeros(5, num_kv_heads, entries, dtype=torch.int64, device=device) if track_best else None
        pillar_scores_into(query[layer], key_pool[layer], page_table, starts, lse[layer], num_old, own, 0.3, q_len,
                           best=own_best, max_rows=8)  # fmt: skip
        assert torch.equal(scores[layer], own), layer
        if track_best:
            assert torch.equal(best[layer], own_best) and bool((best[layer][0] != 0).any()), layer
    assert bool((scores[:, 1] == -7.0).all()) and bool((scores[:, 0, :, 37:] == -7.0).all())  # nothing else written
    assert bool((scores[:, 3, :, :58] > 0).all())


def test_the_layered_launch_checks_its_layers(device):
    key_pool = torch.zeros(2, 4, 4, 1, 8, device=device)
    query, lse = torch.zeros(2, 3, 2, 8, device=device), torch.zeros(2, 3, 2, device=device)
    page_table, starts = torch.zeros(1, 4, dtype=torch.int32, device=device), torch.tensor([0, 3], device=device)
    num_old, scores = torch.tensor([5], dtype=torch.int32, device=device), torch.zeros(2, 1, 1, 16, device=device)
    args = (page_table, starts.int(), lse, num_old, scores, 0.5)
    with pytest.raises(ValueError, match="expected a leading layer dimension"):
        pillar_scores_layers_into(query[0], key_pool, *args)
    with pytest.raises(ValueError, match="query: expected 2 layers"):
        pillar_scores_layers_into(torch.zeros(3, 3, 2, 8, device=device), key_pool, *args)
    with pytest.raises(ValueError, match="scores: expected 2 layers"):
        pillar_scores_layers_into(query, key_pool, page_table, starts.int(), lse, num_old, scores[:1], 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_q_heads", "head_dim"), [(12, 24), (3, 16), (1, 8)])
def test_one_launch_gathers_the_queries_and_lse_as_the_reference(dtype, num_q_heads, head_dim, device):
    """Heads and head dims that are not powers of 2, the query a transposed view (as the attention's),
    tokens repeated and out of order, copies into a layer's slice of a larger store."""
    generator = torch.Generator().manual_seed(num_q_heads)
    query = torch.randn(1, num_q_heads, 30, head_dim, generator=generator).to(dtype).to(device)[0].transpose(0, 1)
    lse = torch.randn(30, num_q_heads, generator=generator).to(device)
    tokens = torch.tensor([7, 8, 9, 29, 0, 9], device=device)
    store_q = torch.zeros(3, 10, num_q_heads, head_dim, dtype=dtype, device=device)
    store_lse = torch.zeros(3, 10, num_q_heads, device=device)
    gather_queries(query, lse, tokens, store_q[1, :6], store_lse[1, :6])
    expected_q, expected_lse = torch.empty_like(store_q[1, :6]), torch.empty_like(store_lse[1, :6])
    gather_queries_ref(query, lse, tokens, expected_q, expected_lse)
    assert torch.equal(store_q[1, :6], expected_q) and torch.equal(store_lse[1, :6], expected_lse)
    assert torch.equal(expected_q[3], query[29]) and torch.equal(expected_lse[5], lse[9])
    assert not store_q[[0, 2]].any() and not store_q[1, 6:].any() and not store_lse[1, 6:].any()
    with pytest.raises(TypeError, match="tokens: expected dtype"):
        gather_queries(query, lse, tokens.int(), store_q[1, :6], store_lse[1, :6])
    with pytest.raises(ValueError, match="out_lse: expected shape"):
        gather_queries(query, lse, tokens, store_q[1, :6], store_lse[1, :5])


CONFIGS = [
    dict(num_draft_tokens=4, min_budget=3, page_size=4, selection="pillar"),
    dict(num_draft_tokens=5, min_budget=3, page_size=2, selection="induction_diagonal", num_induction_keys=3,
         selection_refresh_interval=2),
    dict(num_draft_tokens=3, min_budget=2, page_size=4, selection="diagonal", scheduler="naive",
         delayed_verification=False),
    dict(num_draft_tokens=4, min_budget=2, page_size=4, selection="induction_diagonal", num_induction_keys=3,
         backend="triton"),
]  # fmt: skip
IDS = ["k4-pillar", "k5-induction-diagonal-every-2", "k3-diagonal-naive-sync", "k4-induction-diagonal-triton"]


@pytest.mark.parametrize("fields", CONFIGS, ids=IDS)
def test_greedy_equals_plain_generate_and_sampling_draws_the_same_tokens(fields, monkeypatch):
    """By default (None) every layer is scored after the forward and none inside it, and greedy equals
    plain `generate`; sampled with one seed, the tokens and the acceptance equal those of the per-layer
    passes (`False`): the same scores, so the same selections and drafts (a draft's keys change its
    distribution, and with it the keyed draws)."""
    if fields.get("backend") == "triton":
        from hf_sparsespec.kernels.triton_backend import TritonBackend as backend_class
    else:
        from hf_sparsespec.kernels.backend import TorchBackend as backend_class
    calls = []
    score_layers = backend_class.score_layers

    def counted(self, query, key_pool, *args, **kwargs):
        calls.append(key_pool.shape[0])
        return score_layers(self, query, key_pool, *args, **kwargs)

    def refused(self, *args, **kwargs):
        raise AssertionError("a layer scored inside the forward")

    model = on_backend_device(tiny_model("qwen2"), fields.get("backend"))
    ids, mask = (t.to(model.device) for t in ragged_batch([9, 14, 5, 11]))
    new_tokens = 14 if fields.get("backend") == "triton" else 36
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(backend_class, "score_layers", counted)
        patch.setattr(backend_class, "score_verification", refused)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             generation_strategy="sparsespec", return_dict_in_generate=True,
                             sparsespec_config=SparseSpecConfig(**fields))  # fmt: skip
    assert_greedy_equal(model, expected, out.sequences, mask)
    assert calls and set(calls) == {model.config.num_hidden_layers}
    total = out.sparsespec_stats.total
    assert total.cycles > 0 and total.accepted_drafts < total.drafted_tokens  # sparse drafts were tested
    prompts = [[5, 17, 3, 9, 9, 2, 40], [9] * 11, [40, 41, 42, 43, 44, 45, 46, 47, 48], [8, 9, 30, 31, 32]]
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=0.9, eos_token_id=None)

    def sampled(**overrides):
        torch.manual_seed(11)
        results = hf_sparsespec.generate_batch(model, prompts, gc, SparseSpecConfig(**fields, **overrides))
        return [r.generated_ids for r in results]

    assert sampled() == sampled(score_after_forward=False)


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="score_after_forward must be a bool or None"):
        SparseSpecConfig(score_after_forward=1)
    with pytest.raises(ValueError, match="choose one"):
        SparseSpecConfig(score_after_forward=True, overlap_scoring=True)
    assert SparseSpecConfig().score_after_forward is None  # automatic
    assert SparseSpecConfig(selection="streaming", score_after_forward=True).score_after_forward  # nothing to score


def test_overlap_scoring_keeps_each_layer_scoring_itself(monkeypatch):
    """`overlap_scoring=True` with the default: the layers score themselves (beside the forward on a
    GPU, in line here), never in one launch after it; greedy still equals plain `generate`."""
    from hf_sparsespec.kernels.backend import TorchBackend

    def refused(self, *args, **kwargs):
        raise AssertionError("scored after the forward although overlap_scoring was chosen")

    model = tiny_model("qwen2")
    ids, mask = ragged_batch([9, 5])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(TorchBackend, "score_layers", refused)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                             generation_strategy="sparsespec", return_dict_in_generate=True,
                             sparsespec_config=SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4,
                                                                overlap_scoring=True))  # fmt: skip
    assert_greedy_equal(model, expected, out.sequences, mask)
    assert out.sparsespec_stats.total.cycles > 0


def test_layers_with_different_scales_score_themselves_or_fail_clearly(monkeypatch):
    """Scoring every layer in one launch needs one scale: by default a model whose layers differ scores
    each layer inside the forward (greedy still equals plain `generate`); `True` says why it cannot."""
    from hf_sparsespec.kernels.backend import TorchBackend

    model = tiny_model("llama")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    (scale,) = attention_scales(model, head_dim)
    assert scale == pytest.approx(head_dim**-0.5)
    model.model.layers[1].self_attn.scaling = 0.125
    assert len(attention_scales(model, head_dim)) == 2
    ids, mask = ragged_batch([6, 4])
    config = dict(num_draft_tokens=2, min_budget=2, page_size=4)
    with pytest.raises(NotImplementedError, match="one attention scale for every layer"), torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, generation_strategy="sparsespec",
                       sparsespec_config=SparseSpecConfig(**config, score_after_forward=True))  # fmt: skip

    def refused(self, *args, **kwargs):
        raise AssertionError("layers with different scales scored in one launch")

    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(TorchBackend, "score_layers", refused)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                             generation_strategy="sparsespec", return_dict_in_generate=True,
                             sparsespec_config=SparseSpecConfig(**config))  # fmt: skip
    assert_greedy_equal(model, expected, out.sequences, mask)
    assert out.sparsespec_stats.total.cycles > 0


def test_a_layer_attending_with_another_scale_fails_clearly(monkeypatch):
    """A model whose modules' `scaling` is not what they pass the attention (the runner's scale would
    score every layer wrongly): the first scoring layer says so."""
    import hf_sparsespec.runner as runner

    monkeypatch.setattr(runner, "attention_scales", lambda model, head_dim: {0.5})
    model = tiny_model("qwen2")
    ids, mask = ragged_batch([6, 9])
    with pytest.raises(NotImplementedError, match="scores every layer with the scale 0.5"), torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, generation_strategy="sparsespec",
                       sparsespec_config=SparseSpecConfig(num_draft_tokens=2, min_budget=2, page_size=4,
                                                          score_after_forward=True))  # fmt: skip
