"""Adaptive draft lengths (`adaptive_draft_tokens`): the length rule, and the scheduler driven without a
model by an engine double that reads verifications with made-up accepted counts. The phase buckets
must count exactly where every request's next verification falls, every cycle's length must stay in
[min_draft_tokens, k] (less only at the length limit), and a request's lengths must not depend on
what else is in the batch."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.cache import PageAllocator
from hf_sparsespec.scheduler import Phase, Request, RowKind, Scheduler, adapt_draft_length


@pytest.mark.parametrize(
    "target, drafted, accepted, expected",
    [
        (8, 8, 8, 8),  # all accepted at k: stays at k
        (5, 5, 5, 6),  # all accepted: one more
        (5, 5, 3, 5),  # at least half: unchanged
        (8, 8, 4, 8),
        (8, 8, 3, 4),  # fewer than half: accepted + 1
        (8, 8, 0, 2),  # ... but at least min
        (3, 3, 1, 2),
        (1, 1, 0, 2),  # target below min (not reachable) is lifted to min
        (6, 2, 2, 7),  # a cycle cut by the length limit, all accepted
        (6, 2, 0, 2),
    ],
)
def test_length_rule(target, drafted, accepted, expected):
    assert adapt_draft_length(target, drafted, accepted, low=2, high=8) == expected


def test_config_validation():
    assert SparseSpecConfig(num_draft_tokens=1).min_draft_tokens == 2  # unused while adaptive is off
    SparseSpecConfig(num_draft_tokens=3, adaptive_draft_tokens=True, min_draft_tokens=3)
    with pytest.raises(ValueError, match=r"min_draft_tokens must be in \[1, 3\], got 4"):
        SparseSpecConfig(num_draft_tokens=3, adaptive_draft_tokens=True, min_draft_tokens=4)
    with pytest.raises(ValueError, match=r"min_draft_tokens must be >= 1, got 0"):
        SparseSpecConfig(min_draft_tokens=0)
    with pytest.raises(ValueError, match=r"adaptive_draft_tokens needs num_draft_tokens >= 1, got 0"):
        SparseSpecConfig(num_draft_tokens=0, adaptive_draft_tokens=True)
    with pytest.raises(ValueError, match=r"adaptive_draft_tokens must be a bool, got 1"):
        SparseSpecConfig(adaptive_draft_tokens=1)


def accepted_count(seed: int, request_id: int, cycle: int, drafted: int) -> int:
    """A request's accepted drafts in a cycle: a function of the request and cycle only (as keyed
    sampling makes it), skewed so that both long and short cycles happen."""
    rng = random.Random(f"{seed}-{request_id}-{cycle}")
    return drafted if rng.random() < 0.4 else rng.randint(0, drafted)


def check_buckets(scheduler: Scheduler) -> None:
    residues = scheduler.verify_residues
    assert all(count >= 0 for count in residues.values()), residues
    scheduled = [r for r in scheduler.active if r.verify_iteration >= 0]
    assert +residues == Counter(r.verify_iteration % scheduler.cycle_length for r in scheduled)
    assert sum(residues.values()) == len(scheduled)
    for request in scheduler.active:  # a request in a drafting cycle has its verification in the buckets; a
        # prefill or a plain step (a cycle of 0 drafts: the last token here) none
        if request.phase in (Phase.DRAFT, Phase.VERIFY, Phase.VERIFYING) and request.cycle_drafts:
            assert request.verify_iteration >= 0
        elif request.phase is Phase.PREFILL or request.phase is Phase.VERIFY:
            assert request.verify_iteration < 0


def simulate(config: SparseSpecConfig, specs: dict[int, tuple[int, int]], num_slots: int, seed: int) -> dict[int, list[int]]:
    """Run requests {id: (prompt length, new tokens)} to completion like the engine does (results read
    one iteration late with delayed verification); returns every request's cycle lengths."""
    scheduler = Scheduler(config, PageAllocator(4096, config.page_size), num_slots)
    requests = [Request(rid, [1] * prompt_len, new_tokens) for rid, (prompt_len, new_tokens) in specs.items()]
    for request in requests:
        scheduler.add(request)
    lengths: dict[int, list[int]] = {r.request_id: [] for r in requests}
    low, k = config.min_draft_tokens, config.num_draft_tokens

    def read(rows) -> None:
        for row in rows:
            request = row.request
            if request.finished:
                continue
            if row.kind is RowKind.PREFILL and row.samples:
                request.generated.append(0)
                if request.max_new_tokens <= 1:
                    scheduler.finish(request, "length")
            elif row.kind is RowKind.PLAIN:  # a plain step: its token committed when scheduled
                assert row.num_tokens == 1 and request.num_committed == request.max_total_len  # the last token
                lengths[request.request_id].append(0)
                request.generated.append(0)
                scheduler.finish(request, "length")
            elif row.kind is RowKind.VERIFY:
                drafted = row.num_tokens - 1
                remaining = request.max_total_len - request.num_committed  # num_committed: as at the verification
                assert drafted <= k and (drafted >= low or drafted == remaining - 1), (drafted, remaining)
                lengths[request.request_id].append(drafted)
                kept = accepted_count(seed, request.request_id, len(lengths[request.request_id]), drafted) + 1
                if len(request.generated) + kept >= request.max_new_tokens:
                    request.generated.extend([0] * (request.max_new_tokens - len(request.generated)))
                    scheduler.finish(request, "length")
                else:
                    request.generated.extend([0] * kept)
                    speculated = request.speculated_iteration >= 0
                    scheduler.commit_verification(request, kept)
                    scheduler.start_cycle(request, scheduler.iteration)
                    remaining = request.max_total_len - request.num_committed
                    # the next cycle: within [min, k] but for the length limit; a speculative first draft counted
                    assert min(low, remaining - 1) <= request.cycle_drafts <= min(k, remaining - 1)
                    assert request.drafts_done == (1 if speculated and remaining > 1 else 0)
            check_buckets(scheduler)

    pending: deque = deque()
    keep = 1 if config.delayed_verification else 0
    for _ in range(10_000):
        if not (scheduler.has_work or pending):
            break
        rows = scheduler.schedule()
        check_buckets(scheduler)
        if not rows:
            assert pending, "nothing runs and nothing is in flight"
            while pending:
                read(pending.popleft())
            continue
        for row in rows:  # a speculative first draft runs only where its cycle will have room for it
            if row.speculative:
                assert row.request.max_total_len - row.request.num_committed >= 1
        pending.append(rows)
        while len(pending) > keep:
            read(pending.popleft())
    else:
        raise AssertionError("the scheduler did not finish")
    assert not scheduler.active and +scheduler.verify_residues == Counter()
    assert all(len(r.generated) == r.max_new_tokens for r in requests)
    return lengths


@st.composite
def scenarios(draw):
    k = draw(st.integers(1, 8))
    config = SparseSpecConfig(
        num_draft_tokens=k,
        adaptive_draft_tokens=True,
        min_draft_tokens=draw(st.integers(1, k)),
        scheduler=draw(st.sampled_from(["unified", "naive"])),
        delayed_verification=draw(st.booleans()),
        page_size=4,
    )
    specs = dict(enumerate(draw(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 60)), min_size=1, max_size=7))))
    return config, specs, draw(st.integers(1, 4)), draw(st.integers(0, 1000))


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_buckets_stay_exact_and_lengths_depend_on_the_request_alone(scenario):
    config, specs, num_slots, seed = scenario
    together = simulate(config, specs, num_slots, seed)
    for rid, spec in specs.items():  # each request alone: the same cycle lengths
        assert simulate(config, {rid: spec}, 1, seed)[rid] == together[rid]


def test_lengths_adapt():
    """With made-up acceptances, cycles shorten and grow back; with adaptation off they stay at k."""
    specs = {0: (5, 200), 1: (3, 150)}
    fixed = simulate(SparseSpecConfig(num_draft_tokens=6, page_size=4), specs, 2, seed=7)
    assert all(set(ms[: len(ms) // 2]) == {6} for ms in fixed.values())  # (the last cycles meet the length limit)
    adaptive = simulate(SparseSpecConfig(num_draft_tokens=6, adaptive_draft_tokens=True, page_size=4), specs, 2, seed=7)
    for ms in adaptive.values():
        assert ms[0] == 6 and set(ms[:-1]) >= {2, 6} and len(set(ms)) >= 4
