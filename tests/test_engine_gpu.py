"""The engine on a GPU with CUDA graphs: captured and replayed decode iterations give exactly what
eager iterations and plain `generate` give. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from models import assert_fused_draws_the_unfused_tokens, assert_greedy_equal, ragged_batch, tiny_model

import hf_sparsespec  # noqa: F401  (registers the strategy)
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.runner import ModelRunner

pytestmark = pytest.mark.gpu


@pytest.fixture
def runners(monkeypatch):
    """Every ModelRunner made during the test (to read its counters)."""
    made = []
    original = ModelRunner.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ModelRunner, "__init__", init)
    return made


def assert_graphs_equal_eager_and_plain_generate_and_the_option_matters(model, expected, mask, outs, runners):
    """`outs`: an option with graphs, the same eagerly, graphs without the option (the first two
    runners'). The first equals plain `generate` and the eager run, outputs and statistics, and the
    option changed the acceptance."""
    assert_greedy_equal(model, expected, outs[0].sequences, mask)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].sparsespec_stats.total.as_dict() == outs[1].sparsespec_stats.total.as_dict()
    assert outs[0].sparsespec_stats.total.as_dict() != outs[2].sparsespec_stats.total.as_dict()
    assert runners[0].counters.graph_replays > 0 and runners[1].counters.graph_replays == 0


def _generate(model, ids, mask, config, max_new_tokens=48, **kwargs):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, generation_strategy="sparsespec",
        sparsespec_config=config, return_dict_in_generate=True, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("k", [0, 4, 16])
def test_graphs_equal_eager_and_plain_generate(arch, k, runners):
    model = tiny_model(arch).cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6, 11, 2]))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    config = SparseSpecConfig(num_draft_tokens=k, min_budget=4, page_size=4)
    graphs = _generate(model, ids, mask, config, do_sample=False)
    eager = _generate(model, ids, mask, SparseSpecConfig(num_draft_tokens=k, min_budget=4, page_size=4,
                                                         cuda_graphs=False), do_sample=False)  # fmt: skip
    assert_greedy_equal(model, expected, graphs.sequences, mask)
    assert torch.equal(graphs.sequences, eager.sequences)
    assert graphs.sparsespec_stats.total.as_dict() == eager.sparsespec_stats.total.as_dict()
    with_graphs, without = runners
    assert with_graphs.counters.graph_replays > with_graphs.counters.eager_iterations > 0
    assert with_graphs.counters.graphs_captured > 0
    assert without.counters.graph_replays == 0


@pytest.mark.parametrize("selection", ["pillar", "diagonal"])
def test_selection_with_graphs_equals_eager_and_plain_generate(selection, runners):
    """The other selections than the default (`"induction_diagonal"`, above). The diagonal's moved-key
    offsets are written and read inside captured iterations (workspace zeroed by the graph itself):
    replays give what eager iterations and plain `generate` give."""
    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6, 11, 2]))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    outs = [_generate(model, ids, mask, SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4,
                                                         selection=selection, cuda_graphs=graphs), do_sample=False)
            for graphs in (True, False)]  # fmt: skip
    assert_greedy_equal(model, expected, outs[0].sequences, mask)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].sparsespec_stats.total.as_dict() == outs[1].sparsespec_stats.total.as_dict()
    assert runners[0].counters.graph_replays > 0 and runners[1].counters.graph_replays == 0


@pytest.mark.parametrize("selection", ["induction_diagonal", "pillar", "diagonal", "streaming"])
def test_sampling_with_graphs_is_seeded_and_accepts_drafts(selection, runners):
    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6]))
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4, selection=selection, num_sink_tokens=1)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(_generate(model, ids, mask, config, do_sample=True, temperature=0.8, top_k=20))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    total = outs[0].sparsespec_stats.total
    assert 0 < total.accepted_drafts < total.drafted_tokens
    assert all(r.counters.graph_replays > 0 for r in runners)


@pytest.mark.parametrize("min_new_tokens", [None, 30])
@pytest.mark.parametrize("k", [0, 4])
def test_temperature_only_sampling_fuses_the_softmax(k, min_new_tokens, runners, monkeypatch):
    """Temperature alone (and the min-length ban of eos): the distributions are read from the logits and
    each row's stats (`softmax_stats`), and the keyed draws give the tokens of the unfused pipeline
    (processors, then torch.softmax)."""
    from hf_sparsespec.kernels.triton_backend import TritonBackend

    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6]))
    config = SparseSpecConfig(num_draft_tokens=k, min_budget=4, page_size=4)
    sample = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, min_new_tokens=min_new_tokens)
    out = assert_fused_draws_the_unfused_tokens(monkeypatch, TritonBackend, "softmax_stats", "fused_temperature",
                                                lambda: _generate(model, ids, mask, config, **sample))  # fmt: skip
    if k:
        total = out.sparsespec_stats.total
        assert 0 < total.accepted_drafts < total.drafted_tokens
    assert all(r.counters.graph_replays > 0 for r in runners)


@pytest.mark.parametrize("pack_projections", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("compile_forward", [True, "layers"], ids=["whole", "layers"])
@pytest.mark.parametrize("k", [0, 4, 16])
def test_compiled_forward_with_graphs_equals_plain_generate(k, compile_forward, pack_projections, runners):
    """`compile_forward` on the GPU (the whole forward, or one graph shared by the decoder layers; the
    sibling projections packed into one GEMM or not): inductor's kernels inside the captured iterations;
    float32, so greedy must match plain `generate` token for token (ties aside)."""
    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6, 11, 2]))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    config = SparseSpecConfig(num_draft_tokens=k, min_budget=4, page_size=4, compile_forward=compile_forward,
                              pack_projections=pack_projections)  # fmt: skip
    compiled = _generate(model, ids, mask, config, do_sample=False)
    assert_greedy_equal(model, expected, compiled.sequences, mask)
    (runner,) = runners
    assert runner.counters.graph_replays > 0


@pytest.mark.parametrize("history", ["repetition-penalty", "min-new-tokens"])
@pytest.mark.parametrize("k", [0, 4])
def test_top_k_top_p_sampling_skips_the_sort_with_graphs(k, history, runners, monkeypatch):
    """A model card's sampling (temperature, top-k, top-p after a repetition penalty, or after the
    min-length ban on the bf16 logits) in captured iterations: the distributions are read from the scores
    and each row's Triton `truncation_stats` (no sort of the vocabulary, no probabilities written), and
    the keyed draws give the tokens of the processors-then-softmax path."""
    from hf_sparsespec.kernels.triton_backend import TritonBackend

    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6]))
    config = SparseSpecConfig(num_draft_tokens=k, min_budget=4, page_size=4)
    extra = dict(repetition_penalty=1.05) if history == "repetition-penalty" else dict(min_new_tokens=20, eos_token_id=7)
    sample = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, **extra)
    assert_fused_draws_the_unfused_tokens(monkeypatch, TritonBackend, "truncation_stats", "fused_truncation",
                                          lambda: _generate(model, ids, mask, config, **sample))  # fmt: skip
    assert all(r.counters.graph_replays > 0 for r in runners)


@pytest.mark.parametrize("compile_forward", [False, True], ids=["eager-forward", "compiled-forward"])
@pytest.mark.parametrize("selection", ["induction_diagonal", "pillar", "diagonal"])
def test_scoring_on_a_second_stream_changes_nothing(selection, compile_forward, runners):
    """`overlap_scoring`: the scoring passes run beside the forward on their own stream, from copies of
    the verification rows' queries and LSE, inside captured iterations. Greedy output, acceptance and
    every selection equal the in-line scoring's, and plain `generate`'s."""
    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6, 11, 2]))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    outs = []
    for overlap in (True, False):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4, selection=selection,
                                  compile_forward=compile_forward, overlap_scoring=overlap)  # fmt: skip
        outs.append(_generate(model, ids, mask, config, do_sample=False))
    assert_greedy_equal(model, expected, outs[0].sequences, mask)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].sparsespec_stats.total.as_dict() == outs[1].sparsespec_stats.total.as_dict()
    overlapped, in_line = runners
    assert overlapped.scoring_stream is not None and in_line.scoring_stream is None
    assert overlapped.counters.graph_replays > 0


@pytest.mark.parametrize("compile_forward", [False, True], ids=["eager-forward", "compiled-forward"])
@pytest.mark.parametrize("selection", ["induction_diagonal", "pillar"])
@pytest.mark.parametrize("every", [2, None], ids=["every-2", "default-every-4"])
def test_refreshing_every_nth_verification_with_graphs_equals_eager_and_plain_generate(every, selection,
                                                                                        compile_forward, runners):  # fmt: skip
    """`selection_refresh_interval=2`, and the default (every 4th): the verifications that keep their
    selection score and select nothing inside the captured iterations (their rows point at the dummy
    slot); graphs = eager = plain `generate`, and the acceptance differs from refreshing at every
    verification."""
    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6, 11, 2]))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    outs = []
    for graphs, interval in ((True, every), (False, every), (True, 1)):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4, selection=selection,
                                  cuda_graphs=graphs, compile_forward=compile_forward and graphs,
                                  selection_refresh_interval=interval)  # fmt: skip
        outs.append(_generate(model, ids, mask, config, do_sample=False))
    assert_graphs_equal_eager_and_plain_generate_and_the_option_matters(model, expected, mask, outs, runners)


@pytest.mark.parametrize("compile_forward", [False, True], ids=["eager-forward", "compiled-forward"])
def test_plain_steps_below_the_draft_context_with_graphs_equal_eager_and_plain_generate(compile_forward, runners):
    """`min_draft_context=18`: plain one-token steps until a request's context reaches 18, alone and
    beside drafts and verifications, inside captured iterations; with the compiled forward the
    plain-only shapes compile too. Graphs = eager = plain `generate`."""
    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6, 11, 2]))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    outs = []
    for graphs in (True, False):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4, min_draft_context=18,
                                  cuda_graphs=graphs, compile_forward=compile_forward and graphs)  # fmt: skip
        outs.append(_generate(model, ids, mask, config, do_sample=False))
    assert_greedy_equal(model, expected, outs[0].sequences, mask)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].sparsespec_stats.total.as_dict() == outs[1].sparsespec_stats.total.as_dict()
    total = outs[0].sparsespec_stats.total
    assert total.plain_steps >= sum(18 - (n + 1) for n in [9, 3, 14, 6, 11, 2]) and total.drafted_tokens > 0
    with_graphs, without = runners
    # plain-only iterations replayed a graph: their own, or one that holds them (the first graph)
    replayed = [*with_graphs.buckets.captured, *with_graphs.buckets.borrowed]
    plain_only = [bucket for bucket in replayed if bucket[0] == 0 and bucket[1] > 0]
    assert plain_only and with_graphs.counters.graph_replays > 0 and without.counters.graph_replays == 0


@pytest.mark.parametrize("compile_forward", [False, True], ids=["eager-forward", "compiled-forward"])
@pytest.mark.parametrize("selection", ["induction_diagonal", "pillar"])
def test_a_local_window_with_graphs_equals_eager_and_plain_generate(selection, compile_forward, runners):
    """`local_window=5`: the drafts' recent windows start five keys before the refreshing
    verification's block, inside captured iterations (and with `selection_refresh_interval=2`);
    graphs = eager = plain `generate`, and the acceptance differs from no window."""
    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6, 11, 2]))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    outs = []
    for graphs, window in ((True, 5), (False, 5), (True, 0)):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, budget_ratio=0.01, page_size=4,
                                  selection=selection, cuda_graphs=graphs, selection_refresh_interval=2,
                                  compile_forward=compile_forward and graphs, local_window=window)  # fmt: skip
        outs.append(_generate(model, ids, mask, config, do_sample=False))
    assert_graphs_equal_eager_and_plain_generate_and_the_option_matters(model, expected, mask, outs, runners)


@pytest.mark.parametrize("compile_forward", [False, True], ids=["eager-forward", "compiled-forward"])
@pytest.mark.parametrize("selection", ["induction_diagonal", "pillar"])
def test_scoring_after_the_forward_with_graphs_equals_eager_and_the_per_layer_passes(selection, compile_forward,
                                                                                     runners):  # fmt: skip
    """`score_after_forward=True`: the layers copy their verification queries and LSE, one launch scores
    every layer after the forward, inside captured iterations (compiled forward too); graphs = eager =
    plain `generate`, and the acceptance equals the per-layer passes' (the same scores)."""
    model = tiny_model("qwen2").cuda()
    ids, mask = (x.cuda() for x in ragged_batch([9, 3, 14, 6, 11, 2]))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    outs = []
    for graphs, after in ((True, True), (False, True), (True, False)):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, budget_ratio=0.01, page_size=4,
                                  selection=selection, cuda_graphs=graphs, selection_refresh_interval=2,
                                  compile_forward=compile_forward and graphs, score_after_forward=after)  # fmt: skip
        outs.append(_generate(model, ids, mask, config, do_sample=False))
    assert_greedy_equal(model, expected, outs[0].sequences, mask)
    assert torch.equal(outs[0].sequences, outs[1].sequences) and torch.equal(outs[0].sequences, outs[2].sequences)
    stats = [out.sparsespec_stats.total.as_dict() for out in outs]
    assert stats[0] == stats[1] == stats[2] and outs[0].sparsespec_stats.total.cycles > 0
    assert runners[0].counters.graph_replays > 0 and runners[1].counters.graph_replays == 0
