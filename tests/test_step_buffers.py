"""The graph-free parts of the GPU-bound engine, on CPU: the vectorised batch builder against a
per-row construction, the single logits pipeline against per-row processors, bucket padding, and the
autoregressive mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import VOCAB, assert_greedy_equal, assert_same_decoding, on_backend_device, ragged_batch, tiny_model
from transformers import GenerationConfig
from transformers.generation import logits_process as lp

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.attention import use_attention
from hf_sparsespec.batch import (
    FIELD_ALIGNMENT,
    MAX_PADDING_TOKENS,
    BatchBuilder,
    DevicePageTable,
    aligned,
    round_up_rows,
)
from hf_sparsespec.cache import PageAllocator
from hf_sparsespec.engine import Engine
from hf_sparsespec.kernels.attention_plan import block_sizes
from hf_sparsespec.results import StopChecker
from hf_sparsespec.sampling import (
    ACCEPT_NOISE,
    DRAFT_NOISE,
    TARGET_NOISE,
    LogitsPipeline,
    LogitsRows,
    position_keys,
    sample_keys,
)
from hf_sparsespec.scheduler import Request, RowKind, ScheduledRow

# --- the batch builder ---------------------------------------------------------------------------


def _reference_fields(rows, allocator, width, k, num_slots):
    """The per-row construction the builder vectorises (the engine's packing before graphs); a
    verification that keeps its selection (`refreshes` False) scores no key into the dummy slot."""
    f = {name: [] for name in ("input_index", "position", "kv_slot", "query_start", "context_len", "recent_start",
                               "num_selected", "selection_slot", "logits_token", "logits_prefix_len",
                               "logits_slot", "plain_write", "draft_write", "draft_prob_index", "prefill_write",
                               "draft_row_base", "draft_recent_start",
                               "verify_base", "num_drafts", "num_old_keys", "budget", "verify_slot", "shift_index",
                               "logits_key", "accept_key")}  # fmt: skip
    f["query_start"].append(0)
    for row in rows:
        request = row.request
        base = request.slot * width + request.history_offset
        start = f["query_start"][-1]
        for position in range(row.first_position, row.context_len):
            f["input_index"].append(base + position)
            f["position"].append(position)
            f["kv_slot"].append(allocator.slot(request.request_id, position))
        f["query_start"].append(start + row.num_tokens)
        f["context_len"].append(row.context_len)
        is_draft = row.kind is RowKind.DRAFT
        recent, selected = (request.pending_recent_start, request.pending_budget) if row.speculative else (
            request.recent_start, request.num_selected)
        f["recent_start"].append(recent if is_draft else 0)
        f["num_selected"].append(selected if is_draft else 0)
        f["selection_slot"].append(request.slot if is_draft else 0)
        f["shift_index"].append(request.verify_result_index * (k + 2) if row.speculative else -1)
    logits = {RowKind.VERIFY: [], RowKind.PLAIN: [], RowKind.DRAFT: [], RowKind.PREFILL: []}
    for index, row in enumerate(rows):
        request, start = row.request, f["query_start"][index]
        base = request.slot * width + request.history_offset
        if row.kind is RowKind.VERIFY:
            m = row.num_tokens - 1
            f["verify_base"].append(base + row.first_position + 1)
            f["num_drafts"].append(m)
            f["num_old_keys"].append(row.first_position if row.refreshes else 0)
            f["budget"].append(row.budget)
            f["verify_slot"].append(request.slot if row.refreshes else num_slots)
            for j in range(k + 1):
                jj = min(j, m)
                logits[row.kind].append((start + jj, request.history_offset + row.first_position + jj + 1, request.slot,
                                         (request.request_id, request.history_offset + row.first_position + 1 + jj,
                                          TARGET_NOISE)))  # fmt: skip
            for j in range(k):
                position = request.history_offset + row.first_position + 1 + j
                f["accept_key"].append((request.request_id, position, ACCEPT_NOISE))
        elif row.kind is RowKind.PLAIN:  # one token, sampled from the target's noise and committed
            logits[row.kind].append((start, request.history_offset + row.context_len, request.slot,
                                     (request.request_id, request.history_offset + row.context_len, TARGET_NOISE)))  # fmt: skip
            f["plain_write"].append(base + row.context_len)
        elif row.kind is RowKind.DRAFT:
            logits[row.kind].append((start, request.history_offset + row.context_len, request.slot,
                                     (request.request_id, request.history_offset + row.context_len, DRAFT_NOISE)))  # fmt: skip
            f["draft_write"].append(base + row.context_len)
            f["draft_prob_index"].append(request.slot * k + row.draft_index - 1)
            f["draft_row_base"].append(base)
            f["draft_recent_start"].append(f["recent_start"][index])
        elif row.samples:
            logits[row.kind].append((start + row.num_tokens - 1, request.history_offset + row.context_len, request.slot,
                                     (request.request_id, request.history_offset + row.context_len, TARGET_NOISE)))  # fmt: skip
            f["prefill_write"].append(base + row.context_len)
    for kind in (RowKind.VERIFY, RowKind.PLAIN, RowKind.DRAFT, RowKind.PREFILL):
        for token, prefix, slot, key in logits[kind]:
            f["logits_key"].append(key)
            f["logits_token"].append(token)
            f["logits_prefix_len"].append(prefix)
            f["logits_slot"].append(slot)
    return f


@st.composite
def schedules(draw):
    k = draw(st.integers(1, 6))
    page_size = draw(st.sampled_from([1, 3, 16]))
    num_requests = draw(st.integers(1, 9))
    kinds = sorted(draw(st.lists(st.sampled_from(list(RowKind)), min_size=num_requests, max_size=num_requests)))
    slots = draw(st.permutations(range(num_requests + draw(st.integers(0, 3)))))[:num_requests]
    specs = []
    for kind, slot in zip(kinds, slots):
        offset = draw(st.integers(0, 5))
        if kind is RowKind.PREFILL:
            first, n = draw(st.integers(0, 40)), draw(st.integers(1, 30))
            specs.append((kind, slot, offset, first, n, draw(st.booleans()), 0, 0, 0, 0))
        elif kind is RowKind.PLAIN:
            specs.append((kind, slot, offset, draw(st.integers(1, 60)), 1, True, 0, 0, 0, 0))
        elif kind is RowKind.VERIFY:
            first, m = draw(st.integers(1, 60)), draw(st.integers(1, k))
            specs.append((kind, slot, offset, first, m + 1, True, 0, draw(st.integers(0, first)), 0, 0))
        else:
            position = draw(st.integers(1, 60))
            recent = draw(st.integers(0, position))
            # speculative: (verification row index in the previous iteration, drafts it verified)
            speculative = draw(st.one_of(st.none(), st.tuples(st.integers(0, 7), st.integers(0, k))))
            specs.append((kind, slot, offset, position, 1, True, draw(st.integers(1, k)), 0, recent,
                          draw(st.integers(0, recent)), speculative))  # fmt: skip
    specs = [spec + (None,) * (11 - len(spec)) for spec in specs]
    return k, page_size, specs, draw(st.booleans())


@settings(max_examples=120, deadline=None)
@given(schedules())
def test_builder_equals_the_per_row_construction(schedule):
    k, page_size, specs, pad = schedule
    num_slots, width = 16, 128
    allocator = PageAllocator(4096, page_size)
    rows = []
    for index, (kind, slot, offset, first, n, samples, draft_index, budget, recent, n_sel, spec) in enumerate(specs):
        request = Request(index, list(range(1, 50)), 60, padding=[0] * offset, slot=slot)
        request.recent_start, request.num_selected = recent, n_sel
        allocator.reserve(index, 200)
        row = ScheduledRow(request, kind, first, n, samples, draft_index=draft_index, budget=budget,
                           refreshes=index % 3 != 1)
        if spec is not None:  # the first draft after an unread verification of `spec[1]` drafts
            request.num_committed, request.verify_result_index = first, spec[0]
            request.pending_recent_start, request.pending_budget = max(first - 1, 0), n_sel
            row.draft_index, row.speculative, row.max_shift = 1, True, spec[1]
        allocator.ensure(index, first + n + row.max_shift)
        rows.append(row)
    builder = BatchBuilder(k, num_slots, width, page_size, DevicePageTable(num_slots, width // page_size + 2),
                           group=2, num_kv_heads=2, plan_items=4, num_params=0, pad=pad, sample_seed=99)  # fmt: skip
    batch = builder.build(rows, allocator)
    a, ref = batch.arrays, _reference_fields(rows, allocator, width, k, num_slots)
    n_tokens, n_rows = len(ref["input_index"]), len(rows)
    for name in ("input_index", "position", "kv_slot"):
        assert a[name][:n_tokens].tolist() == ref[name], name
    assert (a["kv_slot"][n_tokens:] == -1).all()  # padding tokens write no KV
    for name in ("query_start", "context_len", "recent_start", "num_selected", "selection_slot"):
        assert a[name][: len(ref[name])].tolist() == ref[name], name
    n_verify = sum(r.kind is RowKind.VERIFY for r in rows)
    for name in ("verify_base", "num_drafts", "num_old_keys", "budget", "verify_slot"):
        assert a[name][:n_verify].tolist() == ref[name], name
    shape = batch.shape
    dummy = num_slots * width
    assert (a["num_drafts"][n_verify:] == 0).all() and (a["verify_base"][n_verify:] == dummy).all()
    # logits rows: [verify x (k + 1)][drafts][prefill samples], padding rows read the dummy slot
    spec = k + 1
    real = [i for i in range(shape.num_logits) if a["logits_slot"][i] != num_slots]
    assert len(real) == len(ref["logits_token"])
    for name in ("logits_token", "logits_prefix_len", "logits_slot"):
        assert a[name][real].tolist() == ref[name], name
    # keyed noise: each draw's (request, position of the drawn token, purpose); nothing where none is drawn
    streams = a["logits_stream"].reshape(-1, 2)
    keys = position_keys(streams[real], a["logits_prefix_len"][real])  # what the device step folds in
    assert keys.tolist() == [sample_keys(99, *key)[0].tolist() for key in ref["logits_key"]]
    assert not streams[[i for i in range(shape.num_logits) if i not in real]].any()
    accept = a["accept_key"].reshape(-1, 2)
    assert accept[: n_verify * k].tolist() == [sample_keys(99, *key)[0].tolist() for key in ref["accept_key"]]
    assert not accept[n_verify * k :].any()
    assert real[: n_verify * spec] == list(range(n_verify * spec))
    # one-token rows: plain steps (no probabilities stored, induction lookups in the dummy slot), then drafts
    n_plain, n_draft = len(ref["plain_write"]), len(ref["draft_write"])
    pad_single = shape.num_single_rows - n_plain - n_draft
    assert a["single_write"].tolist() == ref["plain_write"] + ref["draft_write"] + [dummy] * pad_single
    assert a["single_prob_index"].tolist() == [-1] * n_plain + ref["draft_prob_index"] + [-1] * pad_single
    assert a["single_row_base"].tolist() == [dummy] * n_plain + ref["draft_row_base"] + [dummy] * pad_single
    assert a["single_recent_start"].tolist() == [0] * n_plain + ref["draft_recent_start"] + [0] * pad_single
    assert a["num_full_rows"].tolist() == [sum(r.kind in (RowKind.PREFILL, RowKind.VERIFY, RowKind.PLAIN) for r in rows)]
    assert a["prefill_write"].tolist() == ref["prefill_write"]
    if shape.shifted:  # speculative rows point at their verification's accepted count; maps cover rows
        assert a["shift_index"][:n_rows].tolist() == ref["shift_index"]
        assert a["token_row"][:n_tokens].tolist() == [i for i, r in enumerate(rows) for _ in range(r.num_tokens)]
        assert (a["token_row"][n_tokens:] == shape.num_rows).all()  # padding: the row that never shifts
        single_rows = [i for i, r in enumerate(rows) if r.kind in (RowKind.PLAIN, RowKind.DRAFT)]
        assert a["single_row"].tolist() == single_rows + [shape.num_rows] * (shape.num_single_rows - len(single_rows))
        assert a["logits_row"][real].tolist() == [
            i for i, r in enumerate(rows) if r.kind is RowKind.VERIFY for _ in range(spec)
        ] + [i for i, r in enumerate(rows) if r.kind is RowKind.PLAIN] + [
            i for i, r in enumerate(rows) if r.kind is RowKind.DRAFT] + [
            i for i, r in enumerate(rows) if r.kind is RowKind.PREFILL and r.samples]
    else:
        assert all(index == -1 for index in ref["shift_index"])
    if pad and not any(r.kind is RowKind.PREFILL for r in rows):
        assert shape.padded and shape.num_tokens == shape.num_verify_rows * spec + shape.num_single_rows
    assert shape.num_rows >= n_rows and shape.size == sum(aligned(n) for _, n in shape.fields())
    # the work list covers each (row, key) of the real rows once; padding items are no-ops
    work = a["work"].reshape(-1, 5)
    assert work.shape[0] == shape.plan.num_work
    covered = {}
    for row, q_begin, key_begin, key_end, _ in work[work[:, 0] >= 0].tolist():
        covered.setdefault((row, q_begin), []).append((key_begin, key_end))
    for (row_index, q_begin), ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and all(a1 == b0 for (_, a1), (b0, _) in zip(ranges, ranges[1:]))
        row = rows[row_index]
        if q_begin < 0:  # a draft row: all its keys, and room for the largest shift of a speculative row
            keys = ref["num_selected"][row_index] + row.context_len - ref["recent_start"][row_index]
            assert ranges[-1][1] == keys + row.max_shift
    assert {row for row, _ in covered} == set(range(n_rows))


# --- the logits pipeline ---------------------------------------------------------------------------


def test_repetition_penalty_in_place_equals_transformers_row_by_row():
    """The vectorised repetition penalty writes the scores in place (no padded copy): every row equals
    transformers' processor on its own history `[ignore, prefix_len)`, with tokens repeated in it (a
    16-token vocabulary), rows whose span is empty (prefix at or below the ignored length, prefix 0),
    negative and positive scores."""
    from hf_sparsespec.sampling import LogitsRows

    generator = torch.Generator().manual_seed(3)
    vocab, width, n = 16, 12, 40
    token_buffer = torch.randint(0, vocab, (5, width), generator=generator)
    slot = torch.randint(0, 5, (n,), generator=generator)
    prefix = torch.randint(0, width + 1, (n,), generator=generator)
    ignore = torch.randint(0, 6, (n,), generator=generator)
    prefix[:3], ignore[:3] = torch.tensor([0, 2, 4]), torch.tensor([0, 3, 4])  # empty spans
    scores = torch.randn(n, vocab, generator=generator) * 3
    rows = LogitsRows(slot=slot, prefix_len=prefix, params=ignore[None, :])
    pipeline = LogitsPipeline([lp.RepetitionPenaltyLogitsProcessor(1.4)])
    overwritten = scores.clone()
    processed = pipeline(overwritten, token_buffer, rows)
    assert processed.data_ptr() == overwritten.data_ptr()  # in place
    for i in range(n):
        own = lp.RepetitionPenaltyLogitsProcessor(1.4)
        history = token_buffer[slot[i], int(ignore[i]) : int(prefix[i])][None]
        expected = own(history, scores[i : i + 1].clone()) if history.shape[1] else scores[i : i + 1]
        assert torch.equal(processed[i : i + 1], expected), i
    assert not torch.equal(processed, scores)


@pytest.mark.parametrize("ignore", [None, 2, "per_row"])
def test_single_pipeline_equals_per_row_processors(ignore):
    """Rows of requests with different prompt lengths (and paddings), history-dependent processors:
    one vectorised call equals applying each request's own processors to each row's prefix."""
    torch.manual_seed(0)
    eos = torch.tensor([5, 9])
    prompts = [(0, 7), (3, 2), (1, 12)]  # (padding, prompt length) of three requests
    ignore_of = {None: [0, 0, 0], 2: [2, 2, 2], "per_row": [0, 3, 1]}[ignore]
    prompt_ignore = torch.tensor(ignore_of) if ignore == "per_row" else ignore
    rep = lp.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=prompt_ignore)
    processors = [
        lp.MinLengthLogitsProcessor(11, eos),
        lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=4, min_new_tokens=3, eos_token_id=eos),
        rep,
        lp.TemperatureLogitsWarper(0.7),
        lp.TopKLogitsWarper(20),
    ]
    pipeline = LogitsPipeline(processors)
    assert pipeline.graph_safe and pipeline.num_params == 3 and pipeline.host_synchronising() == []
    ngram = LogitsPipeline([*processors, lp.NoRepeatNGramLogitsProcessor(3)])  # host-side n-gram lookups
    assert not ngram.graph_safe and ngram.host_synchronising() == ["NoRepeatNGramLogitsProcessor"]
    requests = [Request(i, list(range(1, n + 1)), 30, padding=[0] * pad, batch_row=i) for i, (pad, n) in enumerate(prompts)]
    params = [pipeline.request_params(r) for r in requests]
    token_buffer = torch.randint(0, VOCAB, (4, 40))
    row_requests = [0, 1, 2, 1, 0, 2, 2, 1]
    prefix = [7, 6, 14, 9, 13, 25, 15, 5]
    scores = torch.randn(len(row_requests), VOCAB)
    rows = LogitsRows(
        slot=torch.tensor(row_requests), prefix_len=torch.tensor(prefix),
        params=torch.tensor([params[r] for r in row_requests]).T.contiguous(),
    )  # fmt: skip
    actual = pipeline(scores.clone(), token_buffer, rows)
    for i, (r, n) in enumerate(zip(row_requests, prefix)):
        request = requests[r]
        history = token_buffer[r : r + 1, :n]
        expected = scores[i : i + 1].clone()
        own = [
            lp.MinLengthLogitsProcessor(11, eos),
            lp.MinNewTokensLengthLogitsProcessor(request.history_offset + request.prompt_len, 3, eos),
            lp.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=ignore_of[r]),
            lp.TemperatureLogitsWarper(0.7),
            lp.TopKLogitsWarper(20),
        ]
        for processor in own:
            expected = processor(history, expected)
        torch.testing.assert_close(actual[i : i + 1], expected, msg=f"row {i}")


# --- bucket padding and the autoregressive mode through the engine --------------------------------


def _build_engine(model, prompts, config, pad, max_new_tokens=24):
    requests = [Request(i, p, max_new_tokens, batch_row=i) for i, p in enumerate(prompts)]
    engine = Engine(model, requests, config, LogitsPipeline([]), False, StopChecker(set(), [], torch.device("cpu")),
                    pad_to_buckets=pad)  # fmt: skip
    return engine, requests


def _run_engine(model, prompts, config, pad, max_new_tokens=24):
    engine, requests = _build_engine(model, prompts, config, pad, max_new_tokens)
    shapes = []
    original = engine.runner.run

    def run(batch):
        shapes.append(batch.shape)
        return original(batch)

    engine.runner.run = run
    with use_attention(model), torch.no_grad():
        engine.run()
    return engine, requests, shapes


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bucket_padding_writes_no_kv_and_samples_nothing(backend):
    model = tiny_model("qwen2")
    prompts = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7]]
    config = SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4, backend=backend)
    tokens = 24 if backend == "torch" else 12  # the CPU interpreter: ~10 s per engine iteration here
    exact, exact_requests, exact_shapes = _run_engine(model, prompts, config, pad=False, max_new_tokens=tokens)
    padded, padded_requests, padded_shapes = _run_engine(model, prompts, config, pad=True, max_new_tokens=tokens)
    assert any(s.padded and s.num_rows > s.num_verify_rows for s in padded_shapes)
    assert not any(s.padded for s in exact_shapes)
    assert_same_decoding(exact, exact_requests, padded, padded_requests)  # padding writes no KV
    num_slots = exact.layout.num_slots
    assert padded.runner.token_buffer[num_slots].any()  # padding rows sampled into the dummy slot only


@pytest.mark.parametrize(
    "fields, one_tile",
    [({}, True), (dict(min_draft_context=12), False), (dict(plain_tail_rows=2), False)],
    ids=["drafting", "plain-steps-first", "plain-tail"],
)
def test_a_drafting_run_tiles_every_bucket_for_its_verifications(fields, one_tile):
    """A drafting run's buckets without verifications (the drain: drafts and requests' last tokens, which
    are plain steps) keep the verifications' full-row tile, so that the attention kernel compiles one
    variant a run (its `BLOCK_M_FULL`); a run with stretches of plain steps tiles those for one query."""
    model = tiny_model("qwen2")
    prompts = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7], [6] * 6]
    config = SparseSpecConfig(num_draft_tokens=8, min_budget=2, page_size=4, **fields)
    engine, requests, shapes = _run_engine(model, prompts, config, pad=True, max_new_tokens=30)
    padded = [s for s in shapes if s.padded]
    without = [s for s in padded if s.num_verify_rows == 0]
    assert without and len(without) < len(padded)  # both kinds of bucket ran
    verification_tile = block_sizes(config.num_draft_tokens + 1, engine.builder.group)[0]
    one_query_tile = block_sizes(1, engine.builder.group)[0]
    assert verification_tile > one_query_tile
    assert {s.block_m_full for s in padded if s.num_verify_rows} == {verification_tile}
    assert {s.block_m_full for s in without} == {verification_tile if one_tile else one_query_tile}
    assert all(len(r.generated) == 30 for r in requests)


@pytest.mark.parametrize("max_new_tokens", [1, 7, 37])
def test_kernel_argument_strides_keep_their_divisibility_whatever_the_lengths(max_new_tokens):
    # Triton specialises integer arguments on divisibility by 16: the strides that follow the requests'
    # lengths (page table, selected-index store, PillarAttn scores) stay multiples of 16, so another
    # max_new_tokens reuses the compiled kernels. The buffers are sized when the engine is built; the
    # short lengths also decode through them (37 tokens under the interpreter would take ~2 minutes).
    config = SparseSpecConfig(num_draft_tokens=3, min_budget=5, page_size=4, backend="triton")
    model = on_backend_device(tiny_model("qwen2"), config.backend)
    prompts = [[5, 17, 3, 8], [9] * 11]
    if max_new_tokens <= 7:
        engine, requests, _ = _run_engine(model, prompts, config, pad=True, max_new_tokens=max_new_tokens)
        assert all(len(r.generated) == max_new_tokens for r in requests)
    else:
        engine, _ = _build_engine(model, prompts, config, pad=True, max_new_tokens=max_new_tokens)
    runner = engine.runner
    strides = [runner.page_table.stride(0), runner.token_buffer.stride(0), engine.cache.selected.stride(2)]
    strides += [runner.scores.stride(0), runner.scores.stride(1), runner.scores.stride(2)]
    assert all(stride % 16 == 0 for stride in strides), strides


def test_every_metadata_field_starts_16_byte_aligned_whatever_the_rows():
    # Triton specialises pointer arguments on 16-byte alignment: a field that started wherever the row
    # counts put it would compile every kernel again for the odd shapes of a draining batch (3 s
    # iterations at 1-3 rows on the H200, docs/measurements.md 10)
    model = tiny_model("qwen2")
    config = SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4)
    prompts = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7], [3] * 5]
    for pad in (False, True):
        engine, _, shapes = _run_engine(model, prompts, config, pad=pad, max_new_tokens=13)
        runner = engine.runner
        assert len({(s.num_rows, s.num_tokens) for s in shapes}) > 3  # odd shapes: rows join and leave
        for shape in shapes:
            views = runner._views(shape)
            assert views.size == shape.size <= runner.metadata.numel()
            for name, (offset, _) in views.offsets.items():
                assert offset % FIELD_ALIGNMENT == 0, (name, offset, shape)
                assert views.fields[name].data_ptr() % 16 == 0, name


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_autoregressive_mode_equals_plain_generate(arch):
    model = tiny_model(arch)
    ids, mask = ragged_batch([9, 3, 14, 6])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    config = SparseSpecConfig(num_draft_tokens=0, page_size=4)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                         generation_strategy="sparsespec", sparsespec_config=config, return_dict_in_generate=True)  # fmt: skip
    assert_greedy_equal(model, expected, out.sequences, mask)
    total = out.sparsespec_stats.total
    assert total.drafted_tokens == 0 and total.generated_tokens == 4 + total.cycles  # one token per iteration


def test_autoregressive_mode_stops_at_eos_with_iterations_in_flight():
    model = tiny_model("llama")
    prompt = [[5, 17, 3, 8, 1]]
    plain = model.generate(input_ids=torch.tensor(prompt), max_new_tokens=12, do_sample=False)[0, 5:].tolist()
    eos = plain[6]
    expected = plain[: plain.index(eos) + 1]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=eos)
    from hf_sparsespec import generate_batch

    result = generate_batch(model, prompt, config, SparseSpecConfig(num_draft_tokens=0))[0]
    assert result.generated_ids == expected and result.finish_reason == "eos"



@pytest.mark.parametrize(
    ("selection", "backend"),
    [("pillar", "torch"), ("diagonal", "torch"), ("induction_diagonal", "torch"), ("diagonal", "triton")],
)
def test_compiled_forward_equals_eager(selection, backend):
    """`compile_forward`: the padded decode iterations' forward through torch.compile (the attention
    ops as custom ops, the diagonal selection's offsets store among their arguments) gives the same
    tokens and the same acceptance as the eager forward. The Triton case runs `diagonal` only: it
    launches every kernel `pillar` does (scores, top keys, sparse attention) plus the moved keys'
    (a pillar-triton case took ~3 minutes under the CPU interpreter)."""
    model = tiny_model("qwen2")
    prompts = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7]]
    runs = []
    for compile_forward in (False, True):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, compile_forward=compile_forward,
                                  selection=selection, backend=backend)  # fmt: skip
        tokens = 20 if backend == "torch" else 12  # the CPU interpreter: several seconds per iteration
        engine, requests, shapes = _run_engine(model, prompts, config, pad=True, max_new_tokens=tokens)
        runs.append([(r.generated, r.stats.accepted_histogram) for r in requests])
    assert runs[0] == runs[1]
    assert engine.runner.compiled_forward is not None and any(engine.runner._compiles(s) for s in shapes)


def test_the_compiled_forward_pads_no_kind_of_row_to_a_single_one():
    """With `compile_forward` a padded iteration has no single verification and no single one-token
    row (it pads them to two), so no shape falls back to the eager forward for a size dynamo would
    specialise; without it such shapes appear (a batch of 3 requests, the last one alone). Same tokens."""
    model = tiny_model("qwen2")
    prompts = [[5, 17, 3, 8], [9] * 11, [40, 41, 42]]
    runs, single = [], []
    for compiled in (False, True):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, compile_forward=compiled,
                                  backend="torch")  # fmt: skip
        engine, requests, shapes = _run_engine(model, prompts, config, pad=True, max_new_tokens=20)
        runs.append([(r.generated, r.stats.accepted_histogram) for r in requests])
        padded = [s for s in shapes if s.padded]
        single.append(sum(1 in (s.num_verify_rows, s.num_single_rows) for s in padded))
        if compiled:
            assert padded and all(engine.runner._compiles(s) for s in padded if s.num_verify_rows)
    assert runs[0] == runs[1]
    assert single[0] > 0 and single[1] == 0


def test_compiled_forward_scoring_after_it_equals_eager_scoring_inside_it():
    """`score_after_forward` with the compiled forward: the attention op only copies each layer's
    verification queries and LSE aside (a mutated argument of the custom op), the runner scores every
    layer after the forward; the same tokens and acceptance as the eager forward scoring each layer."""
    model = tiny_model("qwen2")
    prompts = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7]]
    runs = []
    for compiled in (False, True):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, compile_forward=compiled,
                                  selection="induction_diagonal", backend="torch", score_after_forward=compiled)  # fmt: skip
        engine, requests, shapes = _run_engine(model, prompts, config, pad=True, max_new_tokens=20)
        runs.append([(r.generated, r.stats.accepted_histogram) for r in requests])
    assert runs[0] == runs[1]
    assert engine.runner.score_after_forward and any(engine.runner._compiles(s) for s in shapes)


def test_compiled_forward_compiles_once_while_the_batch_shrinks():
    """Requests of different lengths leave the batch one by one (the tail of a run): shapes without
    verifications, with one row of a kind, and shifted (speculative) shapes all appear. None of them
    compiles the forward again (on the H200 one such recompilation cost 88 s in the middle of a run):
    a view-or-copy aliasing change and a branch on "any verification" each did before."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 15, (12,), generator=g)]
    lengths = [int(n) for n in torch.randint(6, 40, (12,), generator=g)]
    requests = [Request(i, p, n, batch_row=i) for i, (p, n) in enumerate(zip(prompts, lengths))]
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, compile_forward=True, backend="torch")
    engine = Engine(model, requests, config, LogitsPipeline([]), False, StopChecker(set(), [], torch.device("cpu")),
                    pad_to_buckets=True)  # fmt: skip
    shapes = []
    original = engine.runner.run
    engine.runner.run = lambda batch: shapes.append(batch.shape) or original(batch)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with use_attention(model), torch.no_grad():
        engine.run()
    assert all(len(r.generated) == n for r, n in zip(requests, lengths))
    compiled = [s for s in shapes if engine.runner._compiles(s)]
    assert len({(s.num_verify_rows, s.num_single_rows) for s in compiled}) >= 3  # many shapes ran compiled
    assert any(s.shifted for s in compiled) and any(not s.shifted for s in compiled)
    assert any(s.num_verify_rows == 0 for s in shapes)  # ... and the tail's verification-free ones eagerly
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


def test_compiled_layers_share_one_graph_and_decode_as_the_eager_forward(monkeypatch):
    """`compile_forward="layers"`: every decoder layer runs through one compiled graph (the layer index
    a symbolic integer, the ops given whole stores), compiled for the 4 layers static first, then once
    for the index and once for the iteration's sizes; the modules' other ints and the hidden and head
    sizes stay static; the same tokens and acceptance as the eager forward, and the user's layers are
    left uncompiled afterwards."""
    import torch._dynamo.utils
    from torch._inductor.compile_fx import compile_fx

    from hf_sparsespec.runner import LAYER_GRAPHS_LIMIT, ModelRunner, decoder_layers

    graphs = []  # each compiled graph's symbolic inputs: (name, value) of SymInts, sizes of float tensors

    def recording_backend(gm, example_inputs):
        placeholders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append(([name for name, v in zip(names, placeholders) if isinstance(v, torch.SymInt)],
                       [v.shape for v in placeholders if isinstance(v, torch.Tensor) and v.is_floating_point()]))
        return compile_fx(gm, example_inputs)

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend=recording_backend, **kw))
    torch._dynamo.reset()
    model = tiny_model("qwen2", num_hidden_layers=4)
    prompts = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7]]
    runs, added, limits = [], [], []
    model_logits = ModelRunner._model_logits
    monkeypatch.setattr(ModelRunner, "_model_logits",
                        lambda *args: (limits.append(torch._dynamo.config.recompile_limit), model_logits(*args))[1])
    for mode in (False, "layers"):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, compile_forward=mode,
                                  selection="induction_diagonal", backend="torch")  # fmt: skip
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        engine, requests, shapes = _run_engine(model, prompts, config, pad=True, max_new_tokens=20)
        added.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        runs.append([(r.generated, r.stats.accepted_histogram) for r in requests])
    assert runs[0] == runs[1]
    assert added == [0, 3] and len(graphs) == 3 and sum(engine.runner._compiles(s) for s in shapes) > 5
    # the shared layer call may keep more graphs than dynamo's default 8 (other configs, other models)
    assert LAYER_GRAPHS_LIMIT in limits and LAYER_GRAPHS_LIMIT > 8
    symbols, float_shapes = graphs[-1]
    module_ints = [name for name in symbols if "_modules_" in name or name.startswith("l_self_")]
    assert module_ints and all(name.endswith("layer_idx") for name in module_ints)  # not head_dim & co.
    hidden, head_dim = model.config.hidden_size, model.config.hidden_size // model.config.num_attention_heads
    feature_dims = [shape[-1] for shape in float_shapes if len(shape) == 3]  # hidden states, rotary tables
    assert hidden in feature_dims and head_dim in feature_dims  # static ints, not symbols
    assert all(isinstance(d, int) for d in feature_dims)
    assert [layer for layer, _ in engine.runner.compiled_layers] == list(model.model.layers)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    with pytest.raises(NotImplementedError, match="no list of decoder layers"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="compile_forward must be a bool or 'layers'"):
        SparseSpecConfig(compile_forward="fast")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "qwen3_moe"])
def test_compiled_layers_decode_as_the_eager_forward_on_every_architecture(arch):
    """`compile_forward="layers"` on the other tiny architectures (the MoE one's routing splits its layer
    into two graphs): the eager forward's tokens."""
    prompts = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7]]
    runs = []
    for mode in (False, "layers"):
        model = tiny_model(arch, num_hidden_layers=3)
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, compile_forward=mode, backend="torch")
        engine, requests, shapes = _run_engine(model, prompts, config, pad=True, max_new_tokens=14)
        runs.append([r.generated for r in requests])
    assert runs[0] == runs[1] and any(engine.runner._compiles(s) for s in shapes)


def test_compiled_forward_compiles_twice_with_plain_steps_first():
    """`min_draft_context`: iterations of plain steps only (no verifications), requests crossing the
    threshold (plain steps beside drafts, no verification yet), then the cycles: two variants of the
    forward (with and without verifications), compiled once each, however the rows mix."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 15, (10,), generator=g)]
    requests = [Request(i, p, 36, batch_row=i) for i, p in enumerate(prompts)]
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, compile_forward=True, backend="torch",
                              min_draft_context=18)  # fmt: skip
    engine = Engine(model, requests, config, LogitsPipeline([]), False, StopChecker(set(), [], torch.device("cpu")),
                    pad_to_buckets=True)  # fmt: skip
    batches = []
    original = engine.runner.run
    engine.runner.run = lambda batch: batches.append(batch) or original(batch)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with use_attention(model), torch.no_grad():
        engine.run()
    assert all(len(r.generated) == 36 for r in requests)
    compiled = [b for b in batches if engine.runner._compiles(b.shape)]
    kinds = [{r.kind for r in b.rows} for b in compiled]
    assert {RowKind.PLAIN} in kinds and {RowKind.PLAIN, RowKind.DRAFT} in kinds  # plain only; crossing
    assert any(RowKind.VERIFY in k and RowKind.PLAIN in k for k in kinds)  # the cycles beside plain steps
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2


@given(st.integers(0, 600), st.integers(1, 512), st.sampled_from([1, 3, 5, 9, 17]))
def test_row_buckets_bound_the_padded_tokens(n, limit, row_tokens):
    """A bucket holds its rows, stays within the row capacity (unless the rows exceed it), grows with
    the rows, and past 8 rows pads at most MAX_PADDING_TOKENS tokens: verification rows of k + 1
    tokens get finer buckets than one-token draft rows."""
    padded = round_up_rows(n, limit, row_tokens)
    assert padded >= n and padded <= max(limit, n)
    assert round_up_rows(n + 1, limit, row_tokens) >= padded
    if n > 8:
        assert (padded - n) * row_tokens <= MAX_PADDING_TOKENS
    elif n > 0:
        assert padded == min(1 << (n - 1).bit_length(), max(limit, n))
