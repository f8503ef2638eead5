"""`min_draft_context`: a request decodes with plain one-token steps (full attention, committed when
scheduled) until its context reaches the threshold, then joins the drafting cycles like a new request.
Plain steps take one token of an iteration's bucket, not k + 1; outputs stay the model's own."""

from __future__ import annotations

import pytest
from test_greedy_exactness import exact_greedy_run
from test_sampling_distribution import SAMPLES, assert_same_distribution, sample_both

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.cache.page_allocator import PageAllocator
from hf_sparsespec.scheduler import Phase, Request, RowKind, Scheduler


def _rows_of(config: SparseSpecConfig, prompt_lengths: list[int], new_tokens: int) -> list[list]:
    """Every iteration's rows while the requests decode (verifications read at once: 1 draft kept)."""
    scheduler = Scheduler(config, PageAllocator(1024, config.page_size), num_slots=len(prompt_lengths))
    requests = [Request(i, [1] * n, new_tokens) for i, n in enumerate(prompt_lengths)]
    for request in requests:
        scheduler.add(request)
    iterations = []
    for _ in range(500):
        rows = scheduler.schedule()
        if not rows:
            break
        iterations.append(rows)
        for row in rows:
            request = row.request
            if row.kind is RowKind.VERIFY:
                scheduler.commit_verification(request, 2)
            if request.num_committed >= request.max_total_len:
                if request.phase in (Phase.AWAIT, Phase.DRAFT, Phase.VERIFY):
                    scheduler.finish(request, "length")
            elif row.kind is RowKind.VERIFY:
                scheduler.start_cycle(request, scheduler.iteration)
    return iterations


def test_requests_step_plainly_until_their_context_reaches_the_threshold():
    config = SparseSpecConfig(num_draft_tokens=3, page_size=4, min_budget=2, min_draft_context=12,
                              delayed_verification=False)  # fmt: skip
    iterations = _rows_of(config, [3, 3, 3, 20], new_tokens=30)
    by_request: dict[int, list] = {}
    for rows in iterations:
        kinds = [row.kind for row in rows]
        assert kinds == sorted(kinds)  # prefill, verify, plain, draft: the attention relies on the order
        for row in rows:
            by_request.setdefault(row.request.request_id, []).append(row)
    for rid in (0, 1, 2):
        decode = [row for row in by_request[rid] if row.kind is not RowKind.PREFILL]
        plain = [row for row in decode if row.kind is RowKind.PLAIN]
        # prompt 3 + the first token: contexts 4 .. 11 step plainly (8 steps), then the cycles begin
        assert [row.context_len for row in plain[:8]] == list(range(4, 12))
        first_draft = next(i for i, row in enumerate(decode) if row.kind is RowKind.DRAFT)
        assert first_draft == 8 and all(row.kind is RowKind.PLAIN for row in decode[:8])
        assert decode[first_draft].context_len == 12  # reads the last committed token (11): 12 keys
    long_prompt = [row for row in by_request[3] if row.kind is not RowKind.PREFILL]
    assert long_prompt[0].kind is RowKind.DRAFT  # its context starts past the threshold
    # the three requests that crossed together joined different phases: their verifications spread out
    verify_iterations = {
        rid: {i for i, rows in enumerate(iterations) for row in rows if row.kind is RowKind.VERIFY and
              row.request.request_id == rid} for rid in (0, 1, 2)
    }  # fmt: skip
    first_verifications = sorted(min(v) for v in verify_iterations.values())
    assert len(set(first_verifications)) == 3, first_verifications


def test_plain_steps_cost_one_token_of_the_bucket():
    """Padded iterations of plain steps only: one token a row (not k + 1), one logits row a row."""
    from hf_sparsespec.batch import BatchBuilder, DevicePageTable

    config = SparseSpecConfig(num_draft_tokens=8, page_size=4, min_draft_context=100)
    allocator = PageAllocator(1024, 4)
    scheduler = Scheduler(config, allocator, num_slots=16)
    for i in range(12):
        scheduler.add(Request(i, [1] * 5, 50))
    scheduler.schedule()  # the prefills
    rows = scheduler.schedule()
    assert len(rows) == 12 and all(row.kind is RowKind.PLAIN for row in rows)
    builder = BatchBuilder(8, 16, 128, 4, DevicePageTable(16, 40), group=2, num_kv_heads=2, plan_items=4,
                           num_params=0, pad=True)  # fmt: skip
    shape = builder.build(rows, allocator).shape
    assert (shape.num_verify_rows, shape.num_single_rows) == (0, 16)
    assert shape.num_tokens == 16 and shape.num_logits == 16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "sync"])
def test_greedy_equals_plain_generate(arch, delayed):
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4, min_draft_context=20,
                              delayed_verification=delayed)  # fmt: skip
    out = exact_greedy_run(arch, [9, 3, 14, 6, 11, 5], 40, config)
    for length, stats in zip([9, 3, 14, 6, 11, 5], out.sparsespec_stats.per_request):
        plain_first = 20 - (length + 1)  # contexts from prompt + 1 up to 19
        assert stats.cycle_drafted[:plain_first] == [0] * plain_first
        assert stats.cycle_drafted[plain_first] > 0 and stats.generated_tokens == 40


def test_greedy_equals_plain_generate_on_triton_kernels():
    """The Triton backend (the interpreter on CPU) with plain steps beside drafts and verifications."""
    config = SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4, min_draft_context=10, backend="triton")
    out = exact_greedy_run("qwen3", [7, 3, 12], 12, config)
    total = out.sparsespec_stats.total
    assert total.plain_steps >= 6 + 2 and total.drafted_tokens > 0


def test_sampling_keeps_the_distribution():
    """3-token prompts, 10 new tokens: plain steps until the context reaches 8 (4 of them), then cycles."""
    config = SparseSpecConfig(num_draft_tokens=2, min_budget=1, budget_ratio=0.01, page_size=2,
                              max_num_requests=SAMPLES, selection="pillar", min_draft_context=8)  # fmt: skip
    plain, ours, total, per_request = sample_both(dict(temperature=1.0, top_k=0), config, 10)
    assert all(stats.cycle_drafted[:4] == [0] * 4 for stats in per_request)
    assert 0.05 < total.acceptance_rate < 0.95, total.as_dict()
    assert_same_distribution(plain, ours)


def test_min_draft_context_must_be_a_count():
    with pytest.raises(ValueError, match="min_draft_context must be >= 0"):
        SparseSpecConfig(min_draft_context=-1)
    with pytest.raises(ValueError, match="min_draft_context must be an int"):
        SparseSpecConfig(min_draft_context=2.5)
