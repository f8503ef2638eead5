"""`plain_tail_rows`: once the batch has shrunk to a few requests (nobody waiting), they finish with plain
one-token steps (cycles of 0 drafts: plain rows, committed when scheduled). Outputs stay exact: greedy equals plain
`generate`, sampling keeps the model's distribution, and the switch survives offloads."""

from __future__ import annotations

import pytest
from models import assert_greedy_equal, ragged_batch, tiny_model
from test_greedy_exactness import exact_greedy_run
from test_greedy_exactness import sparsespec as greedy
from test_kv_manager import NEW_TOKENS, POOL, run
from test_kv_manager import config as pressured_config
from test_sampling_distribution import SAMPLES, assert_same_distribution, sample_both

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.cache.page_allocator import PageAllocator
from hf_sparsespec.scheduler import Request, RowKind, Scheduler


def trailing_plain_steps(stats) -> int:
    """Plain steps at the end of a request's cycles (the tail; a cycle with one token to go is one too)."""
    count = 0
    for drafted in reversed(stats.cycle_drafted):
        if drafted:
            break
        count += 1
    return count


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "sync"])
def test_the_tail_decodes_plainly_and_exactly(arch, delayed):
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4, plain_tail_rows=3,
                              delayed_verification=delayed)  # fmt: skip
    out = exact_greedy_run(arch, [9, 3, 14, 6, 11, 5], 40, config)
    per_request = out.sparsespec_stats.per_request
    assert all(stats.generated_tokens == 40 for stats in per_request)
    tails = [trailing_plain_steps(stats) for stats in per_request]
    assert sum(tail > 1 for tail in tails) >= 2, tails  # the last requests finished plainly, for several steps
    assert all(any(stats.cycle_drafted) for stats in per_request), tails  # after drafting while the batch was full
    total = out.sparsespec_stats.total
    assert total.plain_steps > len(per_request)  # more than the last-token cycles
    assert total.mean_accepted_per_drafting_cycle > total.mean_accepted_per_cycle


def test_a_batch_smaller_than_the_tail_never_drafts():
    config = SparseSpecConfig(num_draft_tokens=6, min_budget=4, page_size=4, plain_tail_rows=2)
    out = exact_greedy_run("qwen3", [5, 12], 30, config)
    total = out.sparsespec_stats.total
    assert total.drafted_tokens == 0 and total.plain_steps == total.cycles == 2 * 29


def test_without_the_tail_option_requests_keep_drafting():
    model = tiny_model("llama")
    ids, mask = ragged_batch([9, 3, 14, 6, 11, 5])
    out = greedy(model, ids, mask, 40, SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4))
    assert all(trailing_plain_steps(stats) <= 1 for stats in out.sparsespec_stats.per_request)


def test_plain_steps_commit_when_scheduled():
    """In the tail a request runs a one-token plain step every iteration, without waiting for its result."""
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4, plain_tail_rows=1)
    scheduler = Scheduler(config, PageAllocator(64, 4), num_slots=2)
    request = Request(request_id=0, prompt=[1, 2, 3], max_new_tokens=5)
    scheduler.add(request)
    (prefill,) = scheduler.schedule()
    assert prefill.kind is RowKind.PREFILL and request.num_committed == 4
    for expected_committed in (5, 6, 7, 8):
        (row,) = scheduler.schedule()
        assert row.kind is RowKind.PLAIN and row.num_tokens == 1
        assert request.num_committed == expected_committed
    assert not scheduler.schedule()  # the last token is committed: the request awaits its read


def test_the_tail_under_kv_pressure_stays_exact():
    """Offloaded requests switch to plain steps when they come back; nothing is lost."""
    model = tiny_model("qwen2")
    lengths = [3, 11, 7, 5, 9, 4, 10, 6, 8, 3, 11, 5]
    ids, mask = ragged_batch(lengths, seed=4)
    out = run(model, ids, mask, pressured_config(num_pages=POOL, plain_tail_rows=4), do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert_greedy_equal(model, expected, out.sequences, mask)
    stats = out.sparsespec_stats
    assert stats.kv.offloads > 0 and stats.kv.restores == stats.kv.offloads
    assert sum(trailing_plain_steps(s) > 1 for s in stats.per_request) >= 2


def test_the_tail_keeps_the_sampled_distribution():
    """Half the requests finish plainly, from wherever they were when the batch halved. PillarAttn
    alone, refreshed at every verification: its lower acceptance on this tiny model leaves the most
    requests to switch (with the default `"induction_diagonal"`, 356 of 4,000 did, and with PillarAttn
    refreshed every 4th verification, the default interval, 341; the check below wants over 400)."""
    config = SparseSpecConfig(num_draft_tokens=3, min_budget=1, budget_ratio=0.01, page_size=2, selection="pillar",
                              max_num_requests=SAMPLES, plain_tail_rows=SAMPLES // 2,
                              selection_refresh_interval=1)  # fmt: skip
    plain, ours, total, per_request = sample_both(dict(temperature=1.0, top_k=0), config, 10)
    assert 0.05 < total.acceptance_rate < 0.95, total.as_dict()
    switched = sum(trailing_plain_steps(stats) > 1 for stats in per_request)
    assert SAMPLES // 10 < switched, switched
    assert_same_distribution(plain, ours)


def test_plain_tail_rows_must_be_a_count():
    with pytest.raises(ValueError, match="plain_tail_rows must be >= 0"):
        SparseSpecConfig(plain_tail_rows=-1)
