"""sparse_draft_attention (Triton) against its float32 reference, and two properties: selecting
every older key equals dense attention, and an empty selection attends the recent window alone."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (  # noqa: F401
    assert_attention_close,
    i32,
    make_paged_kv,
    poison_outputs,
    random_selection,
    sparse_attention_lowp,
)

from hf_sparsespec.kernels.attention_plan import plan_attention
from hf_sparsespec.kernels.paged_attention import paged_attention
from hf_sparsespec.kernels.sparse_attention import sparse_draft_attention, sparse_draft_attention_ref

# Rows (context_len, recent_start, num_selected): a long row, a row whose selection is empty, a dense
# row (recent window = everything), a one-key row, a row ending at a page edge.
ROWS = [(97, 90, 20), (40, 33, 0), (9, 0, 0), (1, 0, 0), (32, 30, 17)]


def _draft_inputs(device, dtype, page_size, group, head_dim, num_kv_heads=2, rows=ROWS, max_budget=24):
    context_lens, recent_start, num_selected = (list(col) for col in zip(*rows))
    k_cache, v_cache, page_table = make_paged_kv(context_lens, page_size, num_kv_heads, head_dim, dtype, device)
    selected, selection_slot = random_selection(
        context_lens, recent_start, num_selected, num_kv_heads, max_budget, device
    )
    query = torch.randn(len(rows), num_kv_heads * group, head_dim).to(dtype).to(device)
    args = (
        query, k_cache, v_cache, page_table, i32(context_lens, device), i32(recent_start, device),
        selected, selection_slot, i32(num_selected, device), head_dim**-0.5,
    )  # fmt: skip
    return args, (context_lens, recent_start, num_selected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group, head_dim", [(1, 16), (3, 32), (6, 64)])
def test_sparse_draft_attention_matches_reference(device, dtype, page_size, group, head_dim):
    args, (context_lens, recent_start, num_selected) = _draft_inputs(device, dtype, page_size, group, head_dim)
    ref = sparse_draft_attention_ref(*args)
    lowp = sparse_attention_lowp(*args) if dtype != torch.float32 else None
    num_rows = len(context_lens)
    tiny_splits = plan_attention(
        list(range(num_rows + 1)), context_lens, 0, num_selected, recent_start,
        group=group, num_kv_heads=2, device=device, min_keys_per_split=8, target_programs=16,
    )  # fmt: skip
    assert tiny_splits.num_merge > 0
    for plan in (None, tiny_splits):
        assert_attention_close(sparse_draft_attention(*args, plan=plan), ref, lowp, dtype)


def test_selecting_every_older_key_equals_dense_attention(device):
    context_lens = [97, 21]
    recent_start = [92, 16]
    num_selected = [92, 16]
    num_kv_heads, group, head_dim = 2, 3, 32
    k_cache, v_cache, page_table = make_paged_kv(context_lens, 16, num_kv_heads, head_dim, torch.float32, device)
    selected = torch.full((2, num_kv_heads, 96), -1, dtype=torch.int32)
    for row in range(2):
        selected[row, :, : num_selected[row]] = torch.arange(num_selected[row], dtype=torch.int32)
    query = torch.randn(2, num_kv_heads * group, head_dim, device=device)
    out = sparse_draft_attention(
        query, k_cache, v_cache, page_table, i32(context_lens, device), i32(recent_start, device),
        selected.to(device), i32([0, 1], device), i32(num_selected, device), 0.2,
    )  # fmt: skip
    dense, _ = paged_attention(
        query, k_cache, v_cache, page_table, i32([0, 1, 2], device), i32(context_lens, device), 0.2
    )
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_empty_selection_attends_the_recent_window(device):
    args, _ = _draft_inputs(device, torch.float32, 16, 2, 16, rows=[(50, 45, 0)])
    query, k_cache, v_cache, page_table = args[:4]
    out = sparse_draft_attention(*args)
    # The same keys as a one-row dense problem over positions 45..49: softmax over 5 keys.
    keys = torch.stack([k_cache[page_table[0, p // 16], p % 16] for p in range(45, 50)])  # [5, kvh, d]
    values = torch.stack([v_cache[page_table[0, p // 16], p % 16] for p in range(45, 50)])
    q = query[0].view(2, 2, 16)
    probs = torch.softmax(torch.einsum("hgd,nhd->hgn", q, keys) * args[-1], dim=-1)
    expected = torch.einsum("hgn,nhd->hgd", probs, values).reshape(4, 16)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
