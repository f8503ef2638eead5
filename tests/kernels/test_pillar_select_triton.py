"""PillarAttn scoring (Triton) against its float32 reference, and the selection it feeds: exact set
equality with the reference on tie-free scores."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close_to_reference
from kernel_cases import i32, make_paged_kv, poison_outputs, query_offsets  # noqa: F401

from hf_sparsespec.kernels import attention_plan
from hf_sparsespec.kernels.paged_attention import paged_attention_ref
from hf_sparsespec.kernels.pillar_select import pillar_scores, pillar_scores_ref, pillar_select, pillar_select_ref


def _verify_batch(device, dtype, page_size, group, head_dim, context_lens, q_lens, num_kv_heads=2):
    k_cache, v_cache, page_table = make_paged_kv(context_lens, page_size, num_kv_heads, head_dim, dtype, device)
    starts = query_offsets(q_lens)
    query = torch.randn(starts[-1], num_kv_heads * group, head_dim).to(dtype).to(device)
    query_start = i32(starts, device)
    scale = head_dim**-0.5
    _, lse = paged_attention_ref(query, k_cache, v_cache, page_table, query_start, i32(context_lens, device), scale)
    num_old = [c - q for c, q in zip(context_lens, q_lens)]
    return query, k_cache, page_table, query_start, lse, num_old, scale


# (context_lens, q_lens): verification blocks of 9, a row with no old keys, a row whose packed block
# (30 queries x group) needs two query tiles, a page-edge row.
CASES = {
    "verify": ([97, 40], [9, 9]),
    "no_old_keys": ([9, 30], [9, 9]),
    "two_query_tiles": ([60, 20], [30, 2]),
    "page_edge": ([25, 16], [9, 9]),
    # 3,913 old keys over 8 programs per KV head on the interpreter: chunks of 512 keys, 10 of them,
    # so a program scores chunks of two rows, and the rows without old keys take none
    "rows_without_keys": ([9, 2600, 9, 1300, 40], [9, 9, 9, 9, 9]),
    # 2,582 old keys over 8 programs: chunks of 384 keys (3 blocks of 128), each row's last one partial
    "uneven_chunks": ([1500, 1100], [9, 9]),
    # k = 16: verification blocks of 17 (17 x 6 = 102 rows of a 128-row tile with Qwen2.5-1.5B's group)
    "verify_k16": ([120, 60], [17, 17]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size, group, head_dim", [(1, 1, 16), (16, 3, 32), (16, 6, 64)])
def test_pillar_scores_match_reference(device, dtype, case, page_size, group, head_dim):
    context_lens, q_lens = CASES[case]
    query, k_cache, page_table, query_start, lse, num_old, scale = _verify_batch(
        device, dtype, page_size, group, head_dim, context_lens, q_lens
    )
    width = max(num_old) + 5  # padding past every row's old keys must be -inf too
    args = (query, k_cache, page_table, query_start, lse, i32(num_old, device), width, scale)
    expected = pillar_scores_ref(*args)
    actual = pillar_scores(*args)
    assert not actual.isnan().any()
    assert torch.equal(actual.isinf(), expected.isinf())
    finite = expected.isfinite()
    # Scores are means of probabilities: compare relative to the largest score of the row.
    scale_ref = expected.masked_fill(~finite, 0).amax(dim=-1, keepdim=True).clamp_min(1e-6)
    assert_close_to_reference(
        (actual.masked_fill(~finite, 0) / scale_ref), (expected.masked_fill(~finite, 0) / scale_ref), dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pillar_scores_of_k16_in_64_row_tiles_match_reference(device, dtype, monkeypatch):
    """With `attention_plan.MAX_BLOCK_M = 64` (`_maxtile64` runs) the scoring kernel takes k = 16's
    17-query verifications (102 rows with a group of 6) in two query tiles of a 64-row tile."""
    monkeypatch.setattr(attention_plan, "MAX_BLOCK_M", 64)
    test_pillar_scores_match_reference(device, dtype, "verify_k16", 16, 6, 64)


@pytest.mark.parametrize("page_size, group", [(1, 3), (16, 6)])
def test_pillar_select_matches_reference_sets(device, page_size, group):
    context_lens, q_lens = [97, 60, 12], [9, 9, 9]
    query, k_cache, page_table, query_start, lse, num_old, scale = _verify_batch(
        device, torch.float32, page_size, group, 32, context_lens, q_lens
    )
    budgets = [20, 51, 3]
    max_budget = 64
    args = (
        query,
        k_cache,
        page_table,
        query_start,
        lse,
        i32(num_old, device),
        i32(budgets, device),
        max(num_old),
        max_budget,
        scale,
    )
    # Tie-free: the kept and the dropped keys are well apart (so fp32 rounding cannot swap them).
    scores = pillar_scores_ref(*args[:6], max(num_old), scale)
    for row, budget in enumerate(budgets):
        if budget == num_old[row]:
            continue  # everything is kept
        ranked = scores[row, :, : num_old[row]].sort(dim=-1, descending=True).values
        assert (ranked[:, budget - 1] - ranked[:, budget]).min() > 1e-6
    expected = pillar_select_ref(*args)
    actual = pillar_select(*args)
    assert torch.equal(actual, expected)
    assert (actual[2, :, 3:] == -1).all() and (actual[0, :, :20] >= 0).all()


def test_the_scoring_kernel_pads_a_shrinking_tail_to_one_variant():
    """`ROWS_PAD` is a compile-time constant: every launch of up to `SCORE_MIN_ROWS_PAD` verifications
    (a batch's tail) shares one compiled kernel; above it, one per power of 2."""
    from hf_sparsespec.kernels.pillar_select import SCORE_MIN_ROWS_PAD, score_rows_pad

    assert {score_rows_pad(n) for n in range(1, SCORE_MIN_ROWS_PAD + 1)} == {SCORE_MIN_ROWS_PAD}
    assert score_rows_pad(SCORE_MIN_ROWS_PAD + 1) == 2 * SCORE_MIN_ROWS_PAD and score_rows_pad(100) == 128
