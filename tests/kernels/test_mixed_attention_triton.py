"""mixed_attention (Triton, one launch + merge) against its float32 reference on unified batches
(prefill chunk, verifications, drafts), and the TritonBackend call pattern (plan once, then per
layer) against TorchBackend."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kernel_cases import (  # noqa: F401
    assert_attention_close,
    i32,
    make_paged_kv,
    paged_attention_lowp,
    poison_outputs,
    query_offsets,
    random_selection,
    sparse_attention_lowp,
)

from hf_sparsespec.kernels import attention_plan
from hf_sparsespec.kernels.attention_plan import (
    AttentionPlan,
    block_sizes,
    plan_attention,
    plan_capacity,
    plan_work_lists,
)
from hf_sparsespec.kernels.backend import TorchBackend
from hf_sparsespec.kernels.mixed_attention import mixed_attention, mixed_attention_ref
from hf_sparsespec.kernels.triton_backend import TritonBackend

# Full rows (context_len, q_len): a prefill chunk and two verifications; then drafts
# (context_len, recent_start, num_selected), one with an empty selection.
FULL_ROWS = [(12, 12), (97, 9), (40, 9)]
DRAFT_ROWS = [(97, 92, 30), (45, 40, 0), (17, 15, 6)]


def _mixed_batch(device, dtype, page_size, group, head_dim, num_kv_heads=2, full_rows=FULL_ROWS, draft_rows=DRAFT_ROWS):
    context_lens = [c for c, _ in full_rows] + [c for c, _, _ in draft_rows]
    q_lens = [q for _, q in full_rows] + [1] * len(draft_rows)
    recent_start = [0] * len(full_rows) + [r for _, r, _ in draft_rows]
    num_selected = [0] * len(full_rows) + [n for _, _, n in draft_rows]
    k_cache, v_cache, page_table = make_paged_kv(context_lens, page_size, num_kv_heads, head_dim, dtype, device)
    selected, selection_slot = random_selection(
        context_lens, [max(r, 1) for r in recent_start], num_selected, num_kv_heads, 32, device
    )
    starts = query_offsets(q_lens)
    query = torch.randn(starts[-1], num_kv_heads * group, head_dim).to(dtype).to(device)
    args = (
        query, k_cache, v_cache, page_table, i32(starts, device), i32(context_lens, device), len(full_rows),
        i32(recent_start, device), selected, selection_slot, i32(num_selected, device), head_dim**-0.5,
    )  # fmt: skip
    host = SimpleNamespace(
        query_start=starts, context_lens=context_lens, num_full_rows=len(full_rows), num_selected=num_selected,
        recent_start=recent_start, device=device,
    )  # fmt: skip
    return args, host


def _lowp(args):
    query, k_cache, v_cache, page_table, query_start, context_lens, num_full = args[:7]
    recent_start, selected, selection_slot, num_selected, scale = args[7:]
    num_full_tokens = int(query_start[num_full])
    full = paged_attention_lowp(
        query[:num_full_tokens], k_cache, v_cache, page_table[:num_full], query_start[: num_full + 1],
        context_lens[:num_full], scale,
    )  # fmt: skip
    draft = sparse_attention_lowp(
        query[num_full_tokens:], k_cache, v_cache, page_table[num_full:], context_lens[num_full:],
        recent_start[num_full:], selected, selection_slot[num_full:], num_selected[num_full:], scale,
    )  # fmt: skip
    return torch.cat([full, draft])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size, group, head_dim", [(1, 1, 16), (16, 3, 32), (16, 6, 64)])
def test_mixed_attention_matches_reference(device, dtype, page_size, group, head_dim):
    args, host = _mixed_batch(device, dtype, page_size, group, head_dim)
    _check_whole_and_split(args, host, dtype, group, device)


def _check_whole_and_split(args, host, dtype, group, device) -> AttentionPlan:
    """The launch with the default plan and with pieces of 16 keys (24 programs) against the reference;
    returns the split plan."""
    ref_out, ref_lse = mixed_attention_ref(*args)
    lowp = _lowp(args) if dtype != torch.float32 else None
    tiny_splits = plan_attention(
        host.query_start, host.context_lens, host.num_full_rows, host.num_selected, host.recent_start,
        group=group, num_kv_heads=2, device=device, min_keys_per_split=16, target_programs=24,
    )  # fmt: skip
    assert tiny_splits.num_merge > 0
    for plan in (None, tiny_splits):
        out, lse = mixed_attention(*args, plan=plan)
        assert_attention_close(out, ref_out, lowp, dtype)
        assert torch.equal(lse.isinf(), ref_lse.isinf())  # draft tokens: -inf
        finite = ref_lse.isfinite()
        assert_attention_close(lse[finite], ref_lse[finite], None, torch.float32 if dtype == torch.float32 else dtype)
    return tiny_splits


@pytest.mark.parametrize("full_rows, draft_rows", [([], DRAFT_ROWS), (FULL_ROWS, [])])
def test_mixed_attention_one_kind_of_row(device, full_rows, draft_rows):
    args, _ = _mixed_batch(device, torch.float32, 16, 3, 32, full_rows=full_rows, draft_rows=draft_rows)
    ref_out, ref_lse = mixed_attention_ref(*args)
    out, lse = mixed_attention(*args)
    assert_attention_close(out, ref_out, None, torch.float32)
    assert torch.equal(lse.isinf(), ref_lse.isinf())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verifications_of_k16_fill_a_128_row_tile(device, dtype):
    """k = 16: 17 queries x a GQA group of 6 (Qwen2.5-1.5B) pack 102 rows into one 128-row tile, beside
    drafts; whole and split into pieces of 16 keys."""
    full_rows, group = [(120, 17), (60, 17)], 6
    assert block_sizes(17, group)[0] == 128
    args, host = _mixed_batch(device, dtype, 16, group, 64, full_rows=full_rows)
    assert _check_whole_and_split(args, host, dtype, group, device).block_m_full == 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verifications_of_k16_in_two_64_row_tiles(device, dtype, monkeypatch):
    """With `MAX_BLOCK_M = 64` (the benchmarks' `_maxtile64`) a 17-query verification takes two tiles of
    10 and 7 queries (60 and 42 rows for a group of 6), beside drafts; whole and split."""
    monkeypatch.setattr(attention_plan, "MAX_BLOCK_M", 64)
    full_rows, group = [(120, 17), (60, 17)], 6
    assert block_sizes(17, group)[0] == 64
    args, host = _mixed_batch(device, dtype, 16, group, 64, full_rows=full_rows)
    plan = _check_whole_and_split(args, host, dtype, group, device)
    assert plan.block_m_full == 64
    q_begins = {int(q) for row, q in plan.work[:, :2].tolist() if row in (0, 1)}
    assert q_begins == {0, 10}


def test_a_rows_query_tiles_read_each_key_range_side_by_side(monkeypatch):
    """The pieces of a row's query tiles that cover one key range are neighbours in the work list
    (longest first still), so the second tile's keys come from L2. (Without the wide verification floor,
    so that the rows split into several pieces at this small grid.)"""
    monkeypatch.setattr(attention_plan, "WIDE_KEYS_PER_VERIFY_SPLIT", 0)
    context_lens, q_lens = [800, 700, 50], [17, 17, 1]
    work, _, _ = plan_work_lists(
        query_offsets(q_lens), context_lens, 2, [0, 0, 10], [0, 0, 40], group=6, block_m_full=64, items=12,
        min_keys_per_split=64,
    )  # fmt: skip
    full = work[work[:, 1] >= 0]
    assert set(full[:, 1].tolist()) == {0, 10}
    sizes = full[:, 3] - full[:, 2]
    assert np.all(np.diff(-(work[:, 3] - work[:, 2])) >= 0)  # longest first
    pairs = 0
    for i in range(0, len(full) - 1):
        row, q_begin, key_begin = full[i, :3]
        if q_begin == 0 and sizes[i] == sizes[i + 1]:  # its tile-10 partner of the same size follows it
            assert full[i + 1].tolist()[:3] == [row, 10, key_begin]
            pairs += 1
    assert pairs >= 4  # both rows split into several equal pieces (5 pairs here)


def test_plain_steps_beside_drafts_in_the_verifications_tile(device):
    """A drafting run's drain bucket: one-query full rows (requests' last tokens, plain steps) beside
    drafts and no verification, planned with the verifications' tile (k = 8, a GQA group of 6: 64 rows
    for 6), as the engine does so that the kernel keeps one variant a run (`BatchBuilder.plain_phases`)."""
    group, k = 6, 8
    args, host = _mixed_batch(device, torch.float32, 16, group, 32, full_rows=[(97, 1), (40, 1), (5, 1)])
    block_m_full = block_sizes(k + 1, group)[0]
    assert block_m_full == 64 > block_sizes(1, group)[0]
    capacity = plan_capacity(6, 6, block_m_full // group, 6)
    work, merge, _ = plan_work_lists(
        host.query_start, host.context_lens, host.num_full_rows, host.num_selected, host.recent_start, group=group,
        block_m_full=block_m_full, items=6, min_keys_per_split=16, capacity=capacity,
    )  # fmt: skip
    assert (merge[:, 3] > 1).any()  # split, and merged
    lists = torch.from_numpy(np.concatenate([work.reshape(-1), merge.reshape(-1)])).to(device)
    plan = AttentionPlan(lists[: work.size].view(-1, 5), lists[work.size :].view(-1, 5), capacity.num_part_rows,
                         block_m_full, block_sizes(1, group)[1], group, 2)  # fmt: skip
    out, lse = TritonBackend().mixed_attention(*args, plan=plan)
    ref_out, ref_lse = TorchBackend().mixed_attention(*args, plan=None)
    assert_attention_close(out, ref_out, None, torch.float32)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_triton_backend_matches_torch_backend(device):
    """The engine's call pattern: a work list padded to a fixed capacity (no-op items and merge
    entries, as a CUDA graph replays it) reused by two layers, then PillarAttn on the verification
    rows writing straight into the selected-index store at the rows' slots."""
    args, host = _mixed_batch(device, torch.float32, 16, 3, 32)
    query, k_cache, v_cache, page_table, query_start = args[:5]
    triton_backend, torch_backend = TritonBackend(), TorchBackend()
    assert triton_backend.needs_plan and not torch_backend.needs_plan
    block_m_full = block_sizes(12, 3)[0]
    capacity = plan_capacity(12, 40, block_m_full // 3, 6)
    work, merge, _ = plan_work_lists(
        host.query_start, host.context_lens, host.num_full_rows, host.num_selected, host.recent_start, group=3,
        block_m_full=block_m_full, items=6, min_keys_per_split=16, capacity=capacity,
    )  # fmt: skip
    assert (work[:, 0] == -1).any() and (merge[:, 3] == 0).any() and (merge[:, 3] > 1).any()  # padded, and split
    lists = torch.from_numpy(np.concatenate([work.reshape(-1), merge.reshape(-1)])).to(device)
    plan = AttentionPlan(lists[: work.size].view(-1, 5), lists[work.size :].view(-1, 5), capacity.num_part_rows,
                         block_m_full, block_sizes(1, 3)[1], 3, 2)  # fmt: skip
    for _layer in range(2):  # the second layer reuses the plan's work list and workspace
        out, lse = triton_backend.mixed_attention(*args, plan=plan)
        ref_out, ref_lse = torch_backend.mixed_attention(*args, plan=None)
        assert_attention_close(out, ref_out, None, torch.float32)

    # PillarAttn on the two verification rows (rows 1, 2; tokens 12..29, absolute offsets), written
    # into slots 3 and 0 of a store; a third, padding row (no queries, budget 0) writes nothing.
    verify_args = (
        query, k_cache, page_table[1:4], i32([12, 21, 30, 30], device), ref_lse, i32([88, 31, 0], device),
        i32([17, 5, 0], device),
    )  # fmt: skip
    slots = torch.tensor([3, 0, 4], device=device)
    stores = [torch.full((5, 2, 24), -7, dtype=torch.int32, device=device) for _ in range(2)]
    for backend, store in ((triton_backend, stores[0]), (torch_backend, stores[1])):  # as the engine: score, then select
        scores = torch.zeros((2, 3, 2, 96), dtype=torch.float32, device=device)  # two layers' planes, the second used
        backend.score_verification(*verify_args[:6], scores[1], args[-1], slots)
        layers = torch.stack([torch.full_like(store, -7), store])
        backend.select_verified_keys(scores, verify_args[5], verify_args[6], layers, slots)
        store.copy_(layers[1])
    for slot, budget in ((3, 17), (0, 5)):
        assert torch.equal(stores[0][slot, :, :budget], stores[1][slot, :, :budget])
    assert (stores[0][[1, 2, 4]] == -7).all()
