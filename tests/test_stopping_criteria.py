"""Stopping criteria are called exactly as plain `generate` calls them: once per generated position,
with the whole batch in row order (finished rows padded), returning a BoolTensor or a bool; stateful,
batch-aware criteria behave as in plain decoding, and requests that ran ahead are cut back."""

from __future__ import annotations

import pytest
import torch
from models import ragged_batch, tiny_model, tiny_tokenizer
from transformers import MaxTimeCriteria, StoppingCriteria, StoppingCriteriaList, StopStringCriteria

import hf_sparsespec.results
from hf_sparsespec import SparseSpecConfig

LENGTHS = [9, 3, 14, 6]
WIDTH = max(LENGTHS)
CONFIGS = {
    "k4": SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4),
    "k3-queued": SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4, max_num_requests=2),
    "k6-sync": SparseSpecConfig(num_draft_tokens=6, min_budget=4, page_size=8, delayed_verification=False),
}


class Recorder(StoppingCriteria):
    """Records every call (the whole `input_ids`) and stops row r once it has `stop_after[r]` new tokens,
    or at a token divisible by `modulus`. Answers a BoolTensor, or with `all_or_nothing` the bool
    "every row is done" that lm-eval's stop-sequence criterion answers (done rows tracked across calls)."""

    def __init__(self, stop_after: list[int], modulus: int = 0, all_or_nothing: bool = False, width: int = WIDTH) -> None:
        self.stop_after = torch.tensor(stop_after)
        self.width = width
        self.modulus = modulus
        self.all_or_nothing = all_or_nothing
        self.done = [False] * len(stop_after)
        self.calls: list[list[list[int]]] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.tolist())
        flags = input_ids.shape[1] - self.width >= self.stop_after
        if self.modulus:
            flags |= input_ids[:, -1] % self.modulus == 0
        if not self.all_or_nothing:
            return flags
        self.done = [d or bool(f) for d, f in zip(self.done, flags)]
        return all(self.done)


def run_both(model, make_criteria, config, lengths=LENGTHS, **kwargs):
    ids, mask = ragged_batch(lengths)
    plain_criteria, sparse_criteria = make_criteria(), make_criteria()
    expected = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, stopping_criteria=StoppingCriteriaList(plain_criteria),
        **kwargs,
    )
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, stopping_criteria=StoppingCriteriaList(sparse_criteria),
        generation_strategy="sparsespec", sparsespec_config=config, return_dict_in_generate=True, **kwargs,
    )
    return expected, out, plain_criteria, sparse_criteria


def assert_stats_consistent(out, width):
    for row, stats in enumerate(out.sparsespec_stats.per_request):
        assert stats.generated_tokens == 1 + stats.accepted_drafts + stats.cycles
        assert sum(stats.accepted_histogram) == stats.cycles
        tokens = out.sequences[row, width:].tolist()
        assert stats.generated_tokens <= len(tokens)


@pytest.fixture
def truncations(monkeypatch):
    """Counts the requests that ran ahead of their stop and were cut back."""
    count = [0]
    original = hf_sparsespec.results._truncated

    def counting(commits, length):
        count[0] += 1
        return original(commits, length)

    monkeypatch.setattr(hf_sparsespec.results, "_truncated", counting)
    return count


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("eos", [None, 5], ids=["no-eos", "eos"])
@pytest.mark.parametrize("all_or_nothing", [False, True], ids=["tensor", "bool"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_batch_criteria_see_what_plain_generate_shows_them(arch, eos, all_or_nothing, config, truncations):
    model = tiny_model(arch)

    def criteria():
        return [Recorder([7, 19, 2, 40], modulus=17, all_or_nothing=all_or_nothing), Recorder([25, 25, 11, 40])]

    expected, out, plain, sparse = run_both(model, criteria, config, max_new_tokens=32, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    for a, b in zip(plain, sparse):
        assert [torch.tensor(call).shape for call in b.calls] == [torch.tensor(call).shape for call in a.calls]
        assert b.calls == a.calls  # same calls, same rows in the same order, same padding of finished rows
    assert len(plain[0].calls) < 32  # the criteria did stop the batch early
    assert truncations[0] > 0  # and requests that had run ahead were cut back
    assert_stats_consistent(out, WIDTH)
    lengths = {request.generated_tokens for request in out.sparsespec_stats.per_request}
    if eos is not None and not all_or_nothing:
        assert len(lengths) > 1  # rows stopped at different lengths; the finished ones were padded


def test_batch_of_one_and_stats_after_a_cut(truncations):
    model = tiny_model("llama")
    config = SparseSpecConfig(num_draft_tokens=8, selection="dense", page_size=4)  # dense: whole blocks accepted

    def criteria():
        return [Recorder([13], width=5)]

    expected, out, plain, sparse = run_both(model, criteria, config, lengths=[5], max_new_tokens=40)
    assert torch.equal(out.sequences, expected) and out.sequences.shape[1] == 5 + 13
    assert sparse[0].calls == plain[0].calls and len(plain[0].calls) == 13
    stats = out.sparsespec_stats.per_request[0]
    # 13 tokens: 1 after prefill, then cycles of up to 8 accepted drafts + 1; the last cycle is cut
    assert stats.generated_tokens == 13 == 1 + stats.accepted_drafts + stats.cycles
    assert stats.accepted_drafts <= stats.drafted_tokens


def test_max_time_stops_every_row_at_the_first_position():
    model = tiny_model("qwen2")
    ids, mask = ragged_batch(LENGTHS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, max_time=1e-9)
    expected = model.generate(**kwargs)
    out = model.generate(**kwargs, generation_strategy="sparsespec", sparsespec_config=CONFIGS["k4"])
    assert expected.shape[1] == WIDTH + 1 and torch.equal(out, expected)


def test_max_time_as_a_criterion_with_others():
    model = tiny_model("llama")

    def criteria():
        return [Recorder([3, 30, 30, 30]), MaxTimeCriteria(max_time=60.0)]

    expected, out, plain, sparse = run_both(model, criteria, CONFIGS["k4"], max_new_tokens=20, eos_token_id=9)
    assert torch.equal(out.sequences, expected) and sparse[0].calls == plain[0].calls


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_stop_strings_on_a_ragged_batch(config):
    model, tokenizer = tiny_model("llama", seed=3), tiny_tokenizer()
    ids, mask = ragged_batch(LENGTHS, seed=1)
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    texts = tokenizer.batch_decode(reference[:, WIDTH:])
    stops = [texts[0][4:6], texts[2][11:13]]  # two strings the plain run produces, in two rows, mid-way
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=1, pad_token_id=0)
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, stops)])
    expected = model.generate(**kwargs, stopping_criteria=criteria)
    out = model.generate(**kwargs, stopping_criteria=criteria, generation_strategy="sparsespec", sparsespec_config=config)
    assert torch.equal(out, expected)
    assert (expected[:, WIDTH:] == 0).any()  # some rows stopped early and were padded


def test_sampling_with_criteria_keeps_stats_consistent(truncations):
    model = tiny_model("llama")
    ids, mask = ragged_batch(LENGTHS)
    torch.manual_seed(0)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=True, temperature=0.9, eos_token_id=4,
        stopping_criteria=StoppingCriteriaList([Recorder([3, 33, 17, 40])]), generation_strategy="sparsespec",
        sparsespec_config=CONFIGS["k4"], return_dict_in_generate=True,
    )
    assert truncations[0] > 0  # row 0 stops inside its first cycle (dense drafts, all accepted) and is cut back
    for row, stats in enumerate(out.sparsespec_stats.per_request):
        generated = out.sequences[row, WIDTH:].tolist()
        length = generated.index(4) + 1 if 4 in generated else 0
        length = min(length or 40, [3, 33, 17, 40][row])
        assert stats.generated_tokens == length == 1 + stats.accepted_drafts + stats.cycles
