"""Greedy SparseSpec decoding equals plain `generate(do_sample=False)` token for token."""

from __future__ import annotations

import pytest
import torch
from models import assert_greedy_equal, on_backend_device, ragged_batch, shortened_cycles, tiny_model

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.runner import ModelRunner

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"]


def sparsespec(model, ids, mask, max_new_tokens, config, **kwargs):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        generation_strategy="sparsespec",
        sparsespec_config=config,
        return_dict_in_generate=True,
        **kwargs,
    )


def exact_greedy_run(arch: str, lengths: list[int], max_new_tokens: int, config: SparseSpecConfig):
    """SparseSpec's greedy output (with its statistics) for a ragged batch of prompts of `lengths` on a
    tiny `arch` model, checked token for token against plain `generate`."""
    model = on_backend_device(tiny_model(arch), config.backend)
    ids, mask = (t.to(model.device) for t in ragged_batch(lengths))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    out = sparsespec(model, ids, mask, max_new_tokens, config)
    assert_greedy_equal(model, expected, out.sequences, mask)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "config",
    [
        SparseSpecConfig(num_draft_tokens=4, min_budget=4, budget_ratio=0.05, page_size=4),
        # every verification refreshes: with the default 4, this budget and the recent window since the
        # last refresh cover every key of these short contexts, and no draft is ever rejected
        SparseSpecConfig(num_draft_tokens=8, min_budget=16, budget_ratio=0.2, page_size=16, selection_refresh_interval=1),
        SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=1, selection="streaming", num_sink_tokens=1),
        SparseSpecConfig(num_draft_tokens=5, min_budget=8, page_size=8, scheduler="naive", delayed_verification=False),
        SparseSpecConfig(num_draft_tokens=4, min_budget=4, budget_ratio=0.05, page_size=4, selection="diagonal"),
        SparseSpecConfig(num_draft_tokens=7, min_budget=3, page_size=1, selection="diagonal", scheduler="naive"),
        SparseSpecConfig(num_draft_tokens=8, min_budget=4, budget_ratio=0.05, page_size=4, adaptive_draft_tokens=True),
        SparseSpecConfig(num_draft_tokens=6, min_budget=4, page_size=8, scheduler="naive", delayed_verification=False,
                         adaptive_draft_tokens=True, min_draft_tokens=1),  # fmt: skip
        SparseSpecConfig(num_draft_tokens=5, min_budget=3, page_size=2, selection="diagonal", adaptive_draft_tokens=True),
        SparseSpecConfig(num_draft_tokens=16, min_budget=4, budget_ratio=0.05, page_size=4),
    ],
    ids=["k4-pillar", "k8-pillar", "k3-streaming", "k5-naive-sync", "k4-diagonal", "k7-diagonal-naive",
         "k8-adaptive", "k6-adaptive-naive-sync", "k5-diagonal-adaptive", "k16-induction-diagonal"],  # fmt: skip
)
def test_ragged_batch_matches_plain_generate(arch, config):
    model = tiny_model(arch)
    ids, mask = ragged_batch([9, 3, 14, 6])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    out = sparsespec(model, ids, mask, 40, config)
    assert_greedy_equal(model, expected, out.sequences, mask)
    total = out.sparsespec_stats.total
    assert total.cycles > 0 and total.accepted_drafts < total.drafted_tokens  # sparse drafts were rejected
    shortened = [shortened_cycles(s, config.num_draft_tokens, 40) for s in out.sparsespec_stats.per_request]
    assert any(shortened) if config.adaptive_draft_tokens else not any(shortened)  # rejections shortened cycles


def test_dense_drafting_accepts_every_draft():
    model = tiny_model("llama")
    ids, mask = ragged_batch([5, 11, 8])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=50, do_sample=False)
    out = sparsespec(model, ids, mask, 50, SparseSpecConfig(num_draft_tokens=6, selection="dense", page_size=4))
    assert_greedy_equal(model, expected, out.sequences, mask)
    total = out.sparsespec_stats.total
    assert total.accepted_drafts == total.drafted_tokens > 0


def test_rejecting_every_draft_rolls_back_exactly(monkeypatch):
    """Corrupt every draft: each cycle commits only the target's token, and the KV the drafts wrote
    must be overwritten/rolled back for the output to stay exact."""
    vocab = 96
    original = ModelRunner._store_drafts

    def wrong_drafts(self, write_index, prob_index, tokens, probs):
        original(self, write_index, prob_index, (tokens + 1) % vocab, probs)

    monkeypatch.setattr(ModelRunner, "_store_drafts", wrong_drafts)
    model = tiny_model("qwen2")
    ids, mask = ragged_batch([7, 4])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = sparsespec(model, ids, mask, 30, SparseSpecConfig(num_draft_tokens=4, selection="dense", page_size=4))
    assert_greedy_equal(model, expected, out.sequences, mask)
    total = out.sparsespec_stats.total
    assert total.accepted_drafts == 0 and total.cycles > 0
    assert total.accepted_histogram[0] == total.cycles


def test_eos_inside_a_draft_block_stops_there():
    model = tiny_model("llama")
    ids, mask = ragged_batch([6, 10, 4], seed=3)
    free_run = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    generated = free_run[0, ids.shape[1] :].tolist()
    eos = next(t for i, t in enumerate(generated) if i >= 5 and t not in generated[:i])  # a token first seen mid-run
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=eos)
    config = SparseSpecConfig(num_draft_tokens=8, selection="dense", page_size=4)
    out = sparsespec(model, ids, mask, 40, config, eos_token_id=eos)
    assert_greedy_equal(model, expected, out.sequences, mask)
    assert out.sequences.shape == expected.shape
    row0 = out.sequences[0, ids.shape[1] :].tolist()
    assert eos in row0 and all(t == model.generation_config.pad_token_id for t in row0[row0.index(eos) + 1 :])


def test_custom_generate_without_the_wrapper():
    model = tiny_model("llama")
    ids, mask = ragged_batch([5, 8])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, custom_generate=hf_sparsespec.generate
    )
    assert isinstance(out, torch.Tensor)
    assert_greedy_equal(model, expected, out, mask)


def test_no_attention_mask_and_max_length():
    model = tiny_model("qwen3")
    ids = torch.randint(1, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    expected = model.generate(input_ids=ids, max_length=40, do_sample=False)
    out = model.generate(input_ids=ids, max_length=40, do_sample=False, generation_strategy="sparsespec")
    assert out.shape == expected.shape == (1, 40)
    assert_greedy_equal(model, expected, out)


def test_history_dependent_processors_see_the_right_prefix():
    """Repetition penalty and no-repeat-ngram read each row's history at every draft/verify position."""
    model = tiny_model("llama")
    ids, mask = ragged_batch([6, 9], seed=5)
    kwargs = dict(max_new_tokens=40, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=5)
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4)
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_strategy="sparsespec", sparsespec_config=config, **kwargs
    )
    assert_greedy_equal(model, expected, out, mask)


def test_model_attention_is_restored():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    model.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=5, generation_strategy="sparsespec")
    assert model.config._attn_implementation == before


def test_admission_queue_chunked_prefill_and_a_small_page_pool():
    """More requests than slots, prompts prefilled in chunks, a pool that fits two requests at once."""
    model = tiny_model("qwen3")
    ids, mask = ragged_batch([17, 5, 23, 9, 12], seed=4)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    config = SparseSpecConfig(
        num_draft_tokens=4, min_budget=4, page_size=4, max_num_requests=2, prefill_chunk_size=6, num_pages=2 * 17
    )
    out = sparsespec(model, ids, mask, 30, config)
    assert_greedy_equal(model, expected, out.sequences, mask)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 9])
def test_tiny_generation_lengths(max_new_tokens):
    model = tiny_model("llama")
    ids, mask = ragged_batch([4, 7])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    out = sparsespec(model, ids, mask, max_new_tokens, SparseSpecConfig(num_draft_tokens=4, page_size=2))
    assert torch.equal(out.sequences, expected)


def test_eos_as_the_first_token_finishes_while_drafts_are_in_flight():
    model = tiny_model("llama")
    ids, mask = ragged_batch([6, 10, 4], seed=3)
    free_run = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    eos = int(free_run[1, ids.shape[1]])  # row 1 stops right after prefill
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    out = sparsespec(model, ids, mask, 20, SparseSpecConfig(num_draft_tokens=4, page_size=4), eos_token_id=eos)
    assert_greedy_equal(model, expected, out.sequences, mask)
    assert out.sparsespec_stats.per_request[1].generated_tokens == 1


@pytest.mark.parametrize("do_sample", [False, True])
def test_iterations_that_only_prefill_a_chunk(do_sample):
    """A single long prompt in chunks: the first iterations sample nothing."""
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    config = SparseSpecConfig(num_draft_tokens=4, prefill_chunk_size=6, page_size=4)
    kwargs = dict(input_ids=ids, max_new_tokens=12, do_sample=do_sample)
    out = model.generate(**kwargs, generation_strategy="sparsespec", sparsespec_config=config)
    assert out.shape == (1, 32)
    if not do_sample:
        assert_greedy_equal(model, model.generate(**kwargs), out)


@pytest.mark.parametrize("min_new_tokens", [None, 12], ids=["no-processors", "min-new-tokens"])
def test_greedy_takes_the_argmax_of_half_precision_logits_without_a_float_copy(min_new_tokens, monkeypatch):
    """Greedy with min-length bans at most reads the argmax straight from the model's fp16 logits (the
    bans in place on them): the tokens of the argmax over their float32 copy, the processors' path,
    which a repetition penalty still takes."""
    model = tiny_model("qwen2").half()
    ids, mask = ragged_batch([9, 14, 5])
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4)
    flags, original = [], ModelRunner.__init__

    def runner_reading(logits: bool):
        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            flags.append(self.greedy_on_logits)
            self.greedy_on_logits = self.greedy_on_logits and logits

        monkeypatch.setattr(ModelRunner, "__init__", init)

    extra = dict(min_new_tokens=min_new_tokens, eos_token_id=7) if min_new_tokens else {}
    runner_reading(logits=True)
    out = sparsespec(model, ids, mask, 16, config, **extra)
    runner_reading(logits=False)
    copied = sparsespec(model, ids, mask, 16, config, **extra)
    assert flags == [True, True] and torch.equal(out.sequences, copied.sequences)
    if min_new_tokens:
        assert (out.sequences[:, 14:26] != 7).all()
    sparsespec(model, ids, mask, 4, config, repetition_penalty=1.2)
    assert flags[-1] is False
