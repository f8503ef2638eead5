"""What people read off `out.sparsespec_stats`: the printed summary, the notebook HTML, `as_dict()`,
the per-cycle trace and the histogram plot."""

from __future__ import annotations

import json

import pytest
import torch
from models import ragged_batch, tiny_model

from hf_sparsespec import RequestStats, SparseSpecConfig, SparseSpecStats


@pytest.fixture(scope="module")
def stats() -> SparseSpecStats:
    model = tiny_model("llama")
    ids, mask = ragged_batch([5, 9, 3])
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, generation_strategy="sparsespec",
        sparsespec_config=SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4), return_dict_in_generate=True,
    )
    return out.sparsespec_stats


def test_summary_shows_the_numbers_people_look_for(stats):
    total = stats.total
    text = str(stats)
    assert "requests" in text and " 3\n" in text
    assert f"{total.generated_tokens}" in text and f"{total.cycles} (k = 4" in text
    assert f"{total.mean_accepted_per_cycle:.2f} of 4" in text
    assert f"{total.acceptance_rate:.1%}" in text
    assert "tokens/s" in text and stats.tokens_per_second == pytest.approx(90 / stats.elapsed_s)
    engine = stats.engine  # on CPU every iteration runs eagerly (graphs need CUDA)
    assert engine.iterations == engine.eager_iterations > 0 and engine.graph_replays == engine.graphs_captured == 0
    assert f"{engine.iterations} (0 graph replays, {engine.iterations} eager" in text
    line = repr(stats)
    assert "\n" not in line and line.startswith("SparseSpecStats(3 requests, 90 tokens")
    assert f"{total.mean_accepted_per_cycle:.2f} accepted drafts/cycle" in line
    assert repr(stats.per_request[0]).startswith("RequestStats(30 tokens,")


def test_html_view(stats):
    page = stats._repr_html_()
    assert page.startswith("<div>") and page.count("<tr>") == len(stats.summary_rows()) + 1 + 5  # rows, header, 0..k
    assert f"{stats.mean_accepted_per_cycle:.2f} of 4" in page


def test_as_dict_is_json_and_carries_the_trace(stats):
    data = json.loads(json.dumps(stats.as_dict()))
    assert data["num_requests"] == 3 and data["tokens_per_second"] > 0
    assert data["total"]["generated_tokens"] == 90
    assert data["engine"]["iterations"] == stats.engine.iterations
    for request in data["per_request"]:
        trace = request["cycle_accepted"]
        assert len(trace) == request["cycles"] and sum(trace) == request["accepted_drafts"]
        assert [trace.count(a) for a in range(5)] == request["accepted_histogram"]


def test_plot_histogram(stats):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    ax = stats.plot_histogram()
    heights = [bar.get_height() for bar in ax.patches]
    assert len(heights) == 5 and sum(heights) == pytest.approx(1.0)
    assert heights == pytest.approx([c / stats.total.cycles for c in stats.total.accepted_histogram])
    plt.close(ax.figure)


def test_without_timing_there_is_no_throughput():
    stats = SparseSpecStats.from_requests(2, [RequestStats()])
    assert stats.tokens_per_second is None and "tokens/s" not in str(stats) and "0 cycles" in repr(stats)
    assert torch.tensor(stats.total.accepted_histogram).tolist() == [0, 0, 0]
