"""paged_attention (Triton) against its float32 reference: ragged rows, awkward lengths, shuffled
pages, GQA packing, and split-KV plans that cut rows into many pieces."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (  # noqa: F401
    assert_attention_close,
    i32,
    make_paged_kv,
    paged_attention_lowp,
    poison_outputs,
    query_offsets,
)

from hf_sparsespec.kernels.attention_plan import plan_attention, plan_work_lists
from hf_sparsespec.kernels.paged_attention import paged_attention, paged_attention_ref

# (context_lens, q_lens); "PS" stands for the page size.
CASES = {
    "decode_kv1": ([1], [1]),
    "verify": ([97, 40], [9, 9]),
    "ragged_page_edges": (["PS-1", "PS", 97], [1, 5, 9]),
    "prefill": ([33, 3], [33, 2]),
}


def _lens(values, page_size):
    return [max(1, page_size + int(v[2:] or 0)) if isinstance(v, str) else v for v in values]


def _run_case(device, dtype, case, page_size, group, head_dim, num_kv_heads=2):
    context_lens, q_lens = CASES[case]
    context_lens = _lens(context_lens, page_size)
    q_lens = [min(q, c) for q, c in zip(q_lens, context_lens)]
    k_cache, v_cache, page_table = make_paged_kv(context_lens, page_size, num_kv_heads, head_dim, dtype, device)
    starts = query_offsets(q_lens)
    query = torch.randn(starts[-1], num_kv_heads * group, head_dim).to(dtype).to(device)
    args = (query, k_cache, v_cache, page_table, i32(starts, device), i32(context_lens, device), head_dim**-0.5)
    ref_out, ref_lse = paged_attention_ref(*args)
    lowp = paged_attention_lowp(*args) if dtype != torch.float32 else None
    tiny_splits = plan_attention(
        starts, context_lens, len(q_lens), [0] * len(q_lens), [0] * len(q_lens),
        group=group, num_kv_heads=num_kv_heads, device=device, min_keys_per_split=24, target_programs=32,
    )  # fmt: skip
    for plan in (None, tiny_splits):
        out, lse = paged_attention(*args, plan=plan)
        assert_attention_close(out, ref_out, lowp, dtype)
        assert_attention_close(lse, ref_lse, None, torch.float32 if dtype == torch.float32 else dtype)
    return tiny_splits


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group, head_dim", [(1, 16), (3, 32)])
def test_paged_attention_fp32(device, case, page_size, group, head_dim):
    _run_case(device, torch.float32, case, page_size, group, head_dim)


@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_fp16(device, case):
    _run_case(device, torch.float16, case, 16, 4, 64, num_kv_heads=1)


def test_split_plan_really_splits(device):
    plan = _run_case(device, torch.float32, "verify", 16, 3, 32)
    assert plan.num_merge > 0 and plan.num_work > 4


def test_each_kind_of_tile_splits_down_to_its_own_floor():
    """A plain step (one-query full row), a verification (9 queries) and a draft, 4,096 keys each, with
    items enough for any split: each is cut into pieces of its own floor's keys."""
    work, _, _ = plan_work_lists(
        [0, 1, 10, 11], [4096, 4096, 64], 2, [0, 0, 4032], [0, 0, 0], group=3, block_m_full=32, items=10_000,
        min_keys_per_split=512, min_keys_per_full_split=1024, min_keys_per_verify_split=256,
    )  # fmt: skip
    pieces = [int((work[:, 0] == row).sum()) for row in range(3)]
    assert pieces == [4, 16, 8]


def test_paged_attention_rejects_bad_arguments(device):
    k_cache, v_cache, page_table = make_paged_kv([5], 16, 2, 32, torch.float32, device)
    query = torch.randn(1, 3, 32, device=device)
    args = [query, k_cache, v_cache, page_table, i32([0, 1], device), i32([5], device), 1.0]
    with pytest.raises(ValueError, match="query: expected a multiple of 2 heads"):
        paged_attention(*args)
    args[0] = torch.randn(1, 4, 32, device=device)
    args[5] = torch.tensor([5], device=device)
    with pytest.raises(TypeError, match="context_lens: expected dtype"):
        paged_attention(*args)
