"""`selection_refresh_interval`: only every n-th verification of a request scores its keys and selects
the next cycle's; the cycles in between draft from the last refresh's selection over a recent window
that starts at that refresh's block, and the output stays the model's own."""

from __future__ import annotations

import pytest
import torch
from models import assert_greedy_equal, on_backend_device, ragged_batch, tiny_model

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.cache.page_allocator import PageAllocator
from hf_sparsespec.kernels.backend import TorchBackend
from hf_sparsespec.scheduler import Phase, Request, RowKind, Scheduler


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("interval, period", [(3, 3), (None, 4)], ids=["every-3", "default-every-4"])
def test_every_nth_verification_refreshes_and_the_others_keep_the_window(delayed, interval, period):
    config = SparseSpecConfig(num_draft_tokens=3, page_size=4, min_budget=2, selection_refresh_interval=interval,
                              delayed_verification=delayed)  # fmt: skip
    scheduler = Scheduler(config, PageAllocator(512, config.page_size), num_slots=2)
    request = Request(0, [1] * 20, 200)
    scheduler.add(request)
    refreshes, windows = [], []
    pending = []
    for _ in range(400):
        if request.finished:
            break
        rows = scheduler.schedule()
        for row in rows:
            if row.kind is RowKind.VERIFY:
                refreshes.append(row.refreshes)
                if row.refreshes:  # the next cycle's window starts at this block, its keys scored up to it
                    assert request.pending_recent_start == row.first_position and row.budget > 0
                else:  # ... or stays where the last refresh put it, with that refresh's selection
                    assert request.pending_recent_start == request.recent_start < row.first_position
                    assert request.pending_budget == request.num_selected > 0
            if row.kind is RowKind.DRAFT:
                windows.append(request.pending_recent_start if row.speculative else request.recent_start)
        pending.append(rows)
        while len(pending) > (1 if delayed else 0):
            for row in pending.pop(0):
                if row.kind is RowKind.VERIFY:
                    scheduler.commit_verification(request, 2)  # one draft accepted of each cycle
                    if request.num_committed >= request.max_total_len - 1:
                        scheduler.finish(request, "length")
                    else:
                        scheduler.start_cycle(request, scheduler.iteration)
        if request.phase is Phase.AWAIT and not pending:
            break
    assert len(refreshes) >= 3 * period
    assert refreshes[: 3 * period] == ([True] + [False] * (period - 1)) * 3
    # the draft windows start at positions of refreshing blocks only, and never move back
    assert windows == sorted(windows) and len(set(windows)) >= 3


@pytest.mark.parametrize(
    "config",
    [
        SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4, selection="pillar", selection_refresh_interval=2),
        SparseSpecConfig(num_draft_tokens=5, min_budget=3, page_size=2, selection="induction_diagonal",
                         num_induction_keys=3, selection_refresh_interval=3),  # fmt: skip
        SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4, selection="diagonal", scheduler="naive",
                         delayed_verification=False, selection_refresh_interval=2),  # fmt: skip
        SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, selection="induction_diagonal",
                         num_induction_keys=3, selection_refresh_interval=2, backend="triton"),  # fmt: skip
        SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4, num_induction_keys=3),
    ],
    ids=["k4-pillar-every-2", "k5-induction-diagonal-every-3", "k3-diagonal-naive-sync-every-2",
         "k4-induction-diagonal-every-2-triton", "k3-default-every-4"],  # fmt: skip
)
def test_greedy_equals_plain_generate_and_fewer_verifications_select(config, monkeypatch):
    """Lossless, while only about 1 in n verifications writes a selection: the others select into the
    dummy slot (the padding's), past the last real slot. The Triton backend runs its kernels (the
    interpreter on CPU)."""
    selecting, verifying = [], []
    if config.backend == "triton":
        from hf_sparsespec.kernels.triton_backend import TritonBackend as backend_class
    else:
        backend_class = TorchBackend
    original = backend_class.select_verified_keys

    def spy(self, scores, num_old_keys, budgets, selected, slots, *args, **kwargs):
        real = slots < selected.shape[1] - 1  # the last slot is the dummy one
        selecting.append(int(real.sum()))
        verifying.append(len(slots))  # on the CPU nothing is padded: every row is a verification
        assert (num_old_keys[~real] == 0).all()  # nothing scored for a verification that keeps its selection
        return original(self, scores, num_old_keys, budgets, selected, slots, *args, **kwargs)

    monkeypatch.setattr(backend_class, "select_verified_keys", spy)
    model = on_backend_device(tiny_model("qwen2"), config.backend)
    ids, mask = (t.to(model.device) for t in ragged_batch([9, 14, 5, 11]))
    new_tokens = 16 if config.backend == "triton" else 40
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             generation_strategy="sparsespec", sparsespec_config=config,
                             return_dict_in_generate=True)  # fmt: skip
    assert_greedy_equal(model, expected, out.sequences, mask)
    total = out.sparsespec_stats.total
    assert total.cycles > 0 and total.accepted_drafts < total.drafted_tokens  # the sparse drafts are tested
    interval = config.refresh_interval
    assert 0 < sum(selecting) < sum(verifying)
    assert sum(selecting) <= total.cycles / interval + len(ids) + 1  # one refresh per n cycles, per request


def test_the_interval_needs_a_scored_selection():
    with pytest.raises(ValueError, match="selection_refresh_interval must be an int"):
        SparseSpecConfig(selection_refresh_interval=1.5)
    with pytest.raises(ValueError, match="selection_refresh_interval must be in"):
        SparseSpecConfig(selection_refresh_interval=0)
    with pytest.raises(ValueError, match="needs a scored selection"):
        SparseSpecConfig(selection="streaming", selection_refresh_interval=2)


@pytest.mark.parametrize(
    "selection, default",
    [("pillar", 4), ("diagonal", 4), ("induction", 4), ("induction_diagonal", 4), ("streaming", 1), ("dense", 1)],
)
def test_the_default_interval_is_4_for_scored_selections_and_1_for_the_others(selection, default):
    assert SparseSpecConfig(selection=selection).refresh_interval == default
    assert SparseSpecConfig(selection=selection, selection_refresh_interval=1).refresh_interval == 1
    if default > 1:
        assert SparseSpecConfig(selection=selection, selection_refresh_interval=2).refresh_interval == 2
