"""Graph buckets (`hf_sparsespec/graph_buckets.py`): which bucket an iteration borrows while its own has
no graph, that borrowing cuts the eager iterations of a batch that grows and shrinks, and that an
iteration built for a larger (and shifted) bucket decodes exactly what its own bucket decodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import assert_same_decoding, on_backend_device, tiny_model

from hf_sparsespec.attention import use_attention
from hf_sparsespec.batch import round_up_rows
from hf_sparsespec.config import SparseSpecConfig
from hf_sparsespec.engine import Engine
from hf_sparsespec.graph_buckets import CAPTURE_AFTER_PADDING_TOKENS, GraphBuckets, holds
from hf_sparsespec.results import StopChecker
from hf_sparsespec.sampling import LogitsPipeline
from hf_sparsespec.scheduler import Request, RowKind

SPEC = 9  # k = 8


def test_a_captured_bucket_runs_in_its_own_graph():
    buckets = GraphBuckets(SPEC)
    buckets.add((4, 64, False))
    buckets.add((2, 32, False))
    assert buckets.choose((4, 64, False)) == (4, 64, False)
    assert buckets.choose((2, 32, False)) == (2, 32, False)


def test_a_new_bucket_borrows_the_smallest_holder_until_its_padding_costs_a_capture():
    buckets = GraphBuckets(SPEC)
    for bucket in [(4, 64, True), (2, 48, False), (4, 48, False), (2, 64, False)]:
        buckets.add(bucket)
    need = (2, 40, False)  # 58 tokens
    rent = -(-CAPTURE_AFTER_PADDING_TOKENS // 8)  # each borrowed replay computes 8 padding tokens
    for _ in range(rent):
        assert buckets.choose(need) == (2, 48, False)  # 66 tokens: the fewest of the four holders
    assert buckets.padding[need] >= CAPTURE_AFTER_PADDING_TOKENS
    assert buckets.choose(need) == need  # its padding has cost a capture: runs in its own bucket ...
    assert buckets.ran_eagerly(need)  # ... eagerly once, then captured
    buckets.add(need)
    assert buckets.choose(need) == need


def test_a_bucket_nothing_holds_is_captured_when_seen_twice():
    buckets = GraphBuckets(SPEC)
    buckets.add((2, 16, False))
    need = (4, 16, False)  # more verify rows than any graph
    assert buckets.choose(need) == need
    assert not buckets.ran_eagerly(need)  # a first sighting may be a transient
    assert buckets.choose(need) == need
    assert buckets.ran_eagerly(need)


def test_borrowing_takes_any_holder_and_keeps_to_the_shift():
    buckets = GraphBuckets(SPEC)
    buckets.add((8, 256, False))  # 328 tokens
    # 34 tokens: a replay with 294 padding tokens still costs far less than an eager iteration
    assert buckets.choose((2, 16, False)) == (8, 256, False)
    assert buckets.padding[(2, 16, False)] == 294
    assert buckets.choose((8, 200, False)) == (8, 256, False)
    assert buckets.choose((10, 16, False)) == (10, 16, False)  # more verify rows than any graph: its own
    assert buckets.choose((8, 200, True)) == (8, 200, True)  # speculative rows need the shift fields
    buckets.add((8, 256, True))
    assert buckets.choose((8, 224, False)) == (8, 256, False)  # unshifted prefers the cheaper match
    buckets.captured.remove((8, 256, False))
    assert buckets.choose((8, 192, False)) == (8, 256, True)  # ... but may run in a shifted graph


def _runs_eagerly(buckets: GraphBuckets, need) -> bool:
    """The runner's bookkeeping of one padded iteration that needs `need`: True if it runs eagerly (then
    captured when `ran_eagerly` says so)."""
    bucket = buckets.choose(need)
    assert holds(bucket, need)
    if bucket in buckets.captured:
        return False
    if buckets.ran_eagerly(bucket):
        buckets.add(bucket)
    return True


def _simulate(num_requests: int, k: int, borrow: bool, seed: int = 0) -> tuple[int, int]:
    """(eager iterations, graphs) of a full unified batch that drains (requests finishing at random
    iterations, as forced lengths with different acceptance do), under the runner's policy or the old
    one (capture at the second sighting, no borrowing)."""
    rng = np.random.default_rng(seed)
    spec = k + 1
    buckets = GraphBuckets(spec)
    phases = [int(p) for p in rng.integers(0, spec, num_requests)]  # 0..k-1 draft, k verify
    ends = sorted(rng.integers(800, 2400, num_requests))
    eager, seen, graphs, just_verified = 0, {}, set(), 0
    for iteration in range(ends[-1] + 1):
        finishing = sum(1 for end in ends if end == iteration)
        for _ in range(finishing):
            phases.pop(int(rng.integers(0, len(phases))))
        n_v = sum(1 for p in phases if p == k)
        n_d = len(phases) - n_v
        if not phases:
            continue
        need = (round_up_rows(n_v, num_requests, spec), round_up_rows(n_d, num_requests), just_verified > 0)
        if borrow:
            eager += _runs_eagerly(buckets, need)
        elif need not in graphs:
            eager += 1
            seen[need] = seen.get(need, 0) + 1
            if seen[need] >= 2:
                graphs.add(need)
        just_verified = n_v
        phases = [(p + 1) % spec for p in phases]
    return eager, len(buckets.captured) if borrow else len(graphs)


def test_borrowing_cuts_the_eager_iterations_of_a_growing_and_draining_batch():
    old_eager, old_graphs = _simulate(256, 8, borrow=False)
    new_eager, new_graphs = _simulate(256, 8, borrow=True)
    assert old_eager > 200  # the measured problem: ~2 eager iterations per bucket (211 on the H200)
    assert new_eager <= old_eager // 10, (new_eager, old_eager)  # 245 -> 14 (27 when borrowing stopped at 2x tokens)
    assert new_graphs <= old_graphs


def _simulate_start(num_slots: int, k: int, first_graph: bool, iterations: int = 40) -> tuple[int, list]:
    """(eager iterations, graphs) of a batch's decode start: a (k + 1)-th of the slots join each
    iteration until every slot drafts (the scheduler's phase buckets spread them over one cycle), each
    request then drafting k times and verifying once."""
    spec = k + 1
    buckets = GraphBuckets(spec, num_slots if first_graph else None)
    joined, eager, just_verified = [], 0, 0
    for iteration in range(iterations):
        joined += [iteration] * min(-(-num_slots // spec), num_slots - len(joined))
        n_v = sum(1 for start in joined if (iteration - start) % spec == k)
        need = (round_up_rows(n_v, num_slots, spec), round_up_rows(len(joined) - n_v, num_slots), just_verified > 0)
        eager += _runs_eagerly(buckets, need)
        just_verified = n_v
    return eager, buckets.captured


@pytest.mark.parametrize("num_slots", [64, 256])
def test_the_decode_start_ramps_up_in_one_graph_captured_at_once(num_slots):
    old_eager, _ = _simulate_start(num_slots, 8, first_graph=False)
    eager, graphs = _simulate_start(num_slots, 8, first_graph=True)
    assert old_eager >= 9  # a new bucket each iteration of the ramp, each run eagerly (twice if it stays)
    assert eager == 1 and graphs[0] == GraphBuckets(SPEC, num_slots).first_graph()
    assert graphs[0] == ((10, 64, True) if num_slots == 64 else (36, 256, True))  # 1.25 x slots / 9 verify rows


def test_no_first_graph_for_autoregressive_decoding_or_an_iteration_past_it():
    plain = GraphBuckets(1, 64)  # k = 0: one-token rows only, all present from the start
    assert plain.choose((0, 64, False)) == (0, 64, False) and plain.first is None
    buckets = GraphBuckets(SPEC, 64)
    assert buckets.choose((12, 64, False)) == (12, 64, False)  # more verifications than the first graph holds
    assert not buckets.ran_eagerly((12, 64, False))  # ... runs as any new bucket: captured when seen again


def _run(model, prompts, config, do_sample, bucket=None, max_new_tokens=24):
    torch.manual_seed(7)  # the keyed sampling seed comes from torch's generator
    requests = [Request(i, p, max_new_tokens, batch_row=i) for i, p in enumerate(prompts)]
    engine = Engine(model, requests, config, LogitsPipeline([]), do_sample, StopChecker(set(), [], model.device),
                    pad_to_buckets=True)  # fmt: skip
    batches = []
    if bucket is not None:
        engine.runner.bucket = bucket
    original = engine.runner.run
    engine.runner.run = lambda batch: batches.append(batch) or original(batch)
    with use_attention(model), torch.no_grad():
        engine.run()
    return engine, requests, batches


@pytest.mark.parametrize("backend,do_sample", [("torch", False), ("torch", True), ("triton", False)])
def test_an_iteration_in_a_larger_shifted_bucket_decodes_the_same(backend, do_sample):
    """Every padded iteration built for a bucket with 2 more verify rows, 8 more one-token rows and the
    shift fields (what borrowing a larger graph does): the same tokens, acceptance, KV and token history.
    Requests take plain steps until their context reaches 12 tokens, so one-token rows mix plain steps
    and drafts."""
    model = on_backend_device(tiny_model("qwen2"), backend)
    prompts = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7]]
    config = SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4, backend=backend, min_draft_context=12,
                              cuda_graphs=False)  # the padded iterations themselves, eagerly  # fmt: skip
    tokens = 24 if backend == "torch" else 10  # the CPU interpreter: seconds per engine iteration

    def larger(verify_rows, single_rows, shifted):
        return min(verify_rows + 2, 4), min(single_rows + 8, 12), True

    own, own_requests, own_batches = _run(model, prompts, config, do_sample, max_new_tokens=tokens)
    big, big_requests, big_batches = _run(model, prompts, config, do_sample, bucket=larger, max_new_tokens=tokens)
    own_shapes, big_shapes = [b.shape for b in own_batches], [b.shape for b in big_batches]
    padded = [(a, b) for a, b in zip(own_shapes, big_shapes) if b.padded]
    assert padded and all(b.num_tokens > a.num_tokens and b.shifted for a, b in padded)
    # iterations whose one-token rows were plain steps and drafts
    assert any(b.plain_rows and any(r.kind is RowKind.DRAFT for r in b.rows) for b in own_batches)
    assert any(not a.shifted for a, _ in padded)  # unshifted iterations ran with the shift fields
    assert_same_decoding(own, own_requests, big, big_requests)
