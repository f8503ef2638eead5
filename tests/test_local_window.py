"""`local_window`: every draft also attends the newest `local_window` old keys; the refreshing
verification starts the next cycles' recent window that many keys before its block and selects its
budget among the keys before them. Lossless, so greedy equals plain `generate`."""

from __future__ import annotations

import pytest
import torch
from models import assert_greedy_equal, on_backend_device, ragged_batch, tiny_model

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.cache.page_allocator import PageAllocator
from hf_sparsespec.kernels.backend import TorchBackend
from hf_sparsespec.scheduler import Request, RowKind, Scheduler


def _generate(model, ids, mask, new_tokens, config):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              generation_strategy="sparsespec", sparsespec_config=config,
                              return_dict_in_generate=True)  # fmt: skip


@pytest.mark.parametrize("window", [0, 5, 40])
def test_a_refreshing_verification_opens_the_window_before_its_block(window):
    config = SparseSpecConfig(num_draft_tokens=3, page_size=4, min_budget=4, local_window=window,
                              selection_refresh_interval=2, delayed_verification=False)  # fmt: skip
    scheduler = Scheduler(config, PageAllocator(512, config.page_size), num_slots=1)
    request = Request(0, [1] * 30, 60)
    scheduler.add(request)
    seen = []
    for _ in range(200):
        if request.finished:
            break
        for row in scheduler.schedule():
            if row.kind is not RowKind.VERIFY:
                continue
            first = row.first_position
            if row.refreshes:
                start = max(first - window, 0)
                assert request.pending_recent_start == row.selectable_keys == start
                assert 0 < row.budget <= start or (start == 0 and row.budget == 0)
                seen.append(start)
            else:  # a kept selection keeps the last refresh's window
                assert request.pending_recent_start == request.recent_start <= max(first - window, 0)
            scheduler.commit_verification(request, 1)
            if request.num_committed >= request.max_total_len - 1:
                scheduler.finish(request, "length")
            else:
                scheduler.start_cycle(request, scheduler.iteration)
    assert len(seen) >= 3


@pytest.mark.parametrize(
    "config",
    [
        SparseSpecConfig(num_draft_tokens=4, min_budget=3, page_size=4, selection="pillar", local_window=5),
        SparseSpecConfig(num_draft_tokens=5, min_budget=3, page_size=2, selection="induction_diagonal",
                         num_induction_keys=3, local_window=4, selection_refresh_interval=2),  # fmt: skip
        SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4, selection="diagonal", scheduler="naive",
                         delayed_verification=False, local_window=3),  # fmt: skip
        SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, selection="induction_diagonal",
                         num_induction_keys=3, local_window=4, backend="triton"),  # fmt: skip
    ],
    ids=["k4-pillar-w5", "k5-induction-diagonal-w4-every-2", "k3-diagonal-naive-sync-w3",
         "k4-induction-diagonal-w4-triton"],  # fmt: skip
)
def test_greedy_equals_plain_generate_and_no_selected_key_is_in_the_window(config, monkeypatch):
    """Each refreshing verification selects only keys before its window (`num_old_keys - window`),
    while the moved keys still come from every old key. The Triton backend runs its kernels (the
    interpreter on CPU)."""
    if config.backend == "triton":
        from hf_sparsespec.kernels.triton_backend import TritonBackend as backend_class
    else:
        backend_class = TorchBackend
    original = backend_class.select_verified_keys
    checked = []

    def spy(self, scores, num_old_keys, budgets, selected, slots, *args, num_selectable_keys=None, **kwargs):
        original(self, scores, num_old_keys, budgets, selected, slots, *args,
                 num_selectable_keys=num_selectable_keys, **kwargs)  # fmt: skip
        real = slots < selected.shape[1] - 1  # the last slot is the dummy one
        expected = torch.clamp(num_old_keys - config.local_window, min=0)
        assert torch.equal(num_selectable_keys[real], expected[real])
        for row in torch.nonzero(real).flatten().tolist():
            keys = selected[:, slots[row], :, : int(budgets[row])]
            assert int(budgets[row]) <= int(num_selectable_keys[row])
            assert bool((keys >= 0).all()) and bool((keys < num_selectable_keys[row]).all())
            checked.append(int(budgets[row]))

    monkeypatch.setattr(backend_class, "select_verified_keys", spy)
    model = on_backend_device(tiny_model("qwen2"), config.backend)
    ids, mask = (t.to(model.device) for t in ragged_batch([9, 14, 5, 11]))
    new_tokens = 16 if config.backend == "triton" else 40
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    out = _generate(model, ids, mask, new_tokens, config)
    assert_greedy_equal(model, expected, out.sequences, mask)
    total = out.sparsespec_stats.total
    assert total.cycles > 0 and total.accepted_drafts < total.drafted_tokens  # the sparse drafts are tested
    assert checked and max(checked) > 0  # rows selected something, all of it before the window


def test_a_window_over_the_whole_context_drafts_densely():
    """With a window longer than any context, every draft attends every key (nothing is left to
    select), so under greedy every draft is accepted, as with `selection="dense"`; without the window
    the same small budget rejects some."""
    model = tiny_model("llama")
    ids, mask = ragged_batch([5, 11, 8])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=50, do_sample=False)
    common = dict(num_draft_tokens=6, selection="pillar", page_size=4, min_budget=2, budget_ratio=0.01)
    sparse = _generate(model, ids, mask, 50, SparseSpecConfig(**common)).sparsespec_stats.total
    out = _generate(model, ids, mask, 50, SparseSpecConfig(local_window=1000, **common))
    assert_greedy_equal(model, expected, out.sequences, mask)
    total = out.sparsespec_stats.total
    assert total.accepted_drafts == total.drafted_tokens > 0
    assert sparse.accepted_drafts < sparse.drafted_tokens


def test_the_window_needs_a_scored_selection():
    with pytest.raises(ValueError, match="local_window must be an int"):
        SparseSpecConfig(local_window=2.0)
    with pytest.raises(ValueError, match="local_window must be >= 0"):
        SparseSpecConfig(local_window=-1)
    for selection in ("streaming", "dense"):
        with pytest.raises(ValueError, match="local_window > 0 needs a scored selection"):
            SparseSpecConfig(selection=selection, local_window=16)
    assert SparseSpecConfig(selection="streaming").local_window == 0
