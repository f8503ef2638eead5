"""The engine on the Triton backend (interpreter on CPU): greedy SparseSpec decoding equals plain
`generate` token for token on a tiny random model, through every kernel (store_kv, mixed attention with
drafts and verifications, PillarAttn selection, the diagonal selection's moved keys)."""

from __future__ import annotations

import kernel_cases  # noqa: F401  (the Triton 3.6 interpreter fix)
import pytest
import torch
from models import assert_greedy_equal, ragged_batch, tiny_model  # tests/models.py

import hf_sparsespec  # noqa: F401  (registers the strategy)
from hf_sparsespec import SparseSpecConfig


def greedy_on_triton_equals_generate(device, prompt_lengths, max_new_tokens, config):
    """SparseSpec's greedy output on the tiny qwen2 model (float32) for a ragged batch, checked token for
    token against plain `generate`."""
    model = tiny_model("qwen2").float().to(device)
    ids, mask = (x.to(device) for x in ragged_batch(prompt_lengths))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            generation_strategy="sparsespec", sparsespec_config=config, return_dict_in_generate=True,
        )  # fmt: skip
    assert_greedy_equal(model, expected, out.sequences, mask)
    return out


@pytest.mark.parametrize("selection", ["pillar", "diagonal", "dense"])
def test_greedy_sparsespec_on_triton_backend_matches_generate(device, selection):
    """Dense drafts are the target's own tokens: every draft is accepted, also the speculative first
    draft of each cycle, whose position the device shifts by the accepted count (plan room, clamp)."""
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, budget_ratio=0.05, page_size=4, backend="triton",
                              selection=selection)  # fmt: skip
    total = greedy_on_triton_equals_generate(device, [9, 14], 14, config).sparsespec_stats.total
    assert total.cycles > 0
    if selection == "dense":
        assert total.accepted_drafts == total.drafted_tokens > 0


def test_greedy_k16_with_verifications_in_several_query_tiles_matches_generate(device, monkeypatch):
    """k = 16 with the full rows' tile capped (`attention_plan.MAX_BLOCK_M`, the benchmarks' `_maxtile<n>`):
    each 17-query verification takes three query tiles (8 + 8 + 1 queries x a group of 2) in the
    attention and in the scoring pass, and the decode still equals plain `generate`."""
    from hf_sparsespec.kernels import attention_plan

    monkeypatch.setattr(attention_plan, "MAX_BLOCK_M", 16)
    assert attention_plan.block_sizes(17, 2)[0] == 16
    config = SparseSpecConfig(num_draft_tokens=16, min_budget=4, budget_ratio=0.05, page_size=4, backend="triton")
    assert greedy_on_triton_equals_generate(device, [9, 20], 30, config).sparsespec_stats.total.cycles > 0


# (sampling settings, the fused path's backend method, the pipeline property that enables it, stats columns)
LOGITS_SAMPLING = {
    "temperature": (dict(top_k=0, top_p=1.0), "softmax_stats", "fused_temperature", 2),
    "top-k-top-p": (dict(top_k=20, top_p=0.8), "truncation_stats", "fused_truncation", 3),
}


@pytest.mark.parametrize("sampling", list(LOGITS_SAMPLING))
@pytest.mark.parametrize("num_draft_tokens", [4, 0], ids=["sparsespec", "autoregressive"])
def test_sampling_on_triton_backend_reads_the_logits(num_draft_tokens, sampling, device, monkeypatch):
    """Temperature alone, or a model card's top-k / top-p, after a min-length ban: the Triton backend
    draws, accepts and recovers from the logits (the ban in place on them) and each row's stats
    (`softmax_stats`, or `truncation_stats` with a third column); the drafts' store keeps logits in the
    model's dtype. The tokens are exactly those of the processors-then-softmax path, and of the written
    probabilities (`runner.SAMPLE_FROM_LOGITS = 0`, the path before: the same bits of every probability
    the two paths read)."""
    from models import assert_fused_draws_the_unfused_tokens

    from hf_sparsespec import runner as runner_module
    from hf_sparsespec.kernels.triton_backend import TritonBackend
    from hf_sparsespec.runner import ModelRunner

    truncation, fused, enabled_by, columns = LOGITS_SAMPLING[sampling]
    stores = []
    original = ModelRunner._store_drafts

    def record_stores():
        monkeypatch.setattr(ModelRunner, "_store_drafts", lambda self, *args: stores.append(self.draft_store)
                            or original(self, *args))  # fmt: skip

    record_stores()
    model = tiny_model("qwen2").to(torch.float16 if device.type == "cpu" else torch.bfloat16).to(device)
    ids, mask = (x.to(device) for x in ragged_batch([9, 14]))
    config = SparseSpecConfig(num_draft_tokens=num_draft_tokens, min_budget=4, page_size=4, backend="triton")
    sample = dict(do_sample=True, temperature=0.7, **truncation, min_new_tokens=12, eos_token_id=7,
                  max_new_tokens=16, generation_strategy="sparsespec", sparsespec_config=config,
                  return_dict_in_generate=True)  # fmt: skip
    out = assert_fused_draws_the_unfused_tokens(
        monkeypatch, TritonBackend, fused, enabled_by,
        lambda: model.generate(input_ids=ids, attention_mask=mask, **sample),
    )  # fmt: skip
    assert (out.sequences[:, 14:26] != 7).all()
    if num_draft_tokens:
        store = stores[0]
        assert store.from_logits and store.values.dtype == model.dtype and store.stats.shape[1] == columns
        total = out.sparsespec_stats.total
        assert 0 < total.accepted_drafts < total.drafted_tokens  # both acceptance and recovery ran
    monkeypatch.undo()
    stores.clear()
    record_stores()
    monkeypatch.setattr(runner_module, "SAMPLE_FROM_LOGITS", 0)
    torch.manual_seed(7)
    written = model.generate(input_ids=ids, attention_mask=mask, **sample)
    assert torch.equal(written.sequences, out.sequences)
    if num_draft_tokens:
        assert not stores[0].from_logits and stores[0].values.dtype == torch.float32


@pytest.mark.parametrize("after_forward", [False, True], ids=["per-layer", "after-forward"])
def test_every_scoring_launch_pads_its_rows_to_the_workspace(after_forward, device, monkeypatch):
    """The engine passes its scores workspace's rows as `max_rows` to every scoring launch, whatever
    the iteration's verifications (eager and, on a GPU, compiled: one compiled kernel for them all):
    one launch a layer, or one for all layers after the forward (the default)."""
    from hf_sparsespec.kernels import triton_backend

    name = "pillar_scores_layers_into" if after_forward else "pillar_scores_into"
    launches, score = [], getattr(triton_backend, name)

    def recording(query, k_cache, page_table, *args, max_rows=None, **kwargs):
        launches.append((page_table.shape[0], max_rows))
        return score(query, k_cache, page_table, *args, max_rows=max_rows, **kwargs)

    monkeypatch.setattr(triton_backend, name, recording)
    model = tiny_model("qwen2").float().to(device)
    ids, mask = (x.to(device) for x in ragged_batch([9, 14, 6]))
    # every verification scores (the default, every 4th, leaves too few scoring launches to differ)
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4, backend="triton",
                              score_after_forward=after_forward, selection_refresh_interval=1)  # fmt: skip
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False,
                       generation_strategy="sparsespec", sparsespec_config=config)  # fmt: skip
    capacities = {max_rows for _, max_rows in launches}
    assert len(capacities) == 1 and None not in capacities
    assert all(rows <= max_rows for rows, max_rows in launches)
    assert len({rows for rows, _ in launches}) > 1  # the iterations did differ in verifications
