"""The torch references (the CPU backend and every Triton kernel's oracle) against independent
dense computations: sdpa with explicit masks over K/V gathered from randomly permuted pages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_sparsespec.kernels import (
    paged_attention_ref,
    pillar_scores_ref,
    select_top_keys,
    sparse_draft_attention_ref,
    store_kv_ref,
)
from hf_sparsespec.kernels.top_keys import rank_key


def paged_setup(context_lens, page_size, num_kv_heads, head_dim, seed=0):
    """Random contiguous K/V per request, scattered into pages from torch.randperm."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-n // page_size) for n in context_lens]
    num_pages = sum(pages_per_row) + 3
    order = torch.randperm(num_pages, generator=generator)
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=generator)
    tables, used = [], 0
    for n in pages_per_row:
        tables.append(order[used : used + n].tolist())
        used += n
    width = max(pages_per_row)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    dense_k = [k_cache[torch.tensor(t)].flatten(0, 1)[:n] for t, n in zip(tables, context_lens)]
    dense_v = [v_cache[torch.tensor(t)].flatten(0, 1)[:n] for t, n in zip(tables, context_lens)]
    return k_cache, v_cache, page_table, dense_k, dense_v


def sdpa(q, k, v, mask, scale):
    """q [q_len, H, D], k/v [n, KVH, D], mask [q_len, n] bool -> [q_len, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_ref_matches_sdpa(page_size, group):
    context_lens, q_lens = [1, 15, 97, 20], [1, 5, 9, 20]
    k_cache, v_cache, page_table, dense_k, dense_v = paged_setup(context_lens, page_size, 2, 16)
    query = torch.randn(sum(q_lens), 2 * group, 16)
    query_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = paged_attention_ref(
        query, k_cache, v_cache, page_table, query_start, torch.tensor(context_lens, dtype=torch.int32), 0.3
    )
    for row, (n, q_len) in enumerate(zip(context_lens, q_lens)):
        q = query[query_start[row] : query_start[row + 1]]
        mask = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        torch.testing.assert_close(out[query_start[row] : query_start[row + 1]], sdpa(q, dense_k[row], dense_v[row], mask, 0.3))
        k = dense_k[row].repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->qhk", q, k) * 0.3
        expected_lse = torch.logsumexp(logits.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
        torch.testing.assert_close(lse[query_start[row] : query_start[row + 1]], expected_lse)


@pytest.mark.parametrize("page_size", [1, 8])
def test_sparse_draft_attention_ref_is_masked_dense_attention(page_size):
    context_lens = [40, 97, 9]
    recent = [30, 90, 0]
    k_cache, v_cache, page_table, dense_k, dense_v = paged_setup(context_lens, page_size, 2, 16, seed=1)
    generator = torch.Generator().manual_seed(3)
    budget = 6
    selected = torch.full((5, 2, budget), -1, dtype=torch.int32)
    num_selected = [5, 6, 0]
    slots = [4, 0, 2]
    for row, (slot, count) in enumerate(zip(slots, num_selected)):
        for head in range(2):
            picks = torch.randperm(max(recent[row], 1), generator=generator)[:count].sort().values
            selected[slot, head, :count] = picks.to(torch.int32)
    query = torch.randn(3, 6, 16)
    out = sparse_draft_attention_ref(
        query, k_cache, v_cache, page_table, torch.tensor(context_lens, dtype=torch.int32),
        torch.tensor(recent, dtype=torch.int32), selected, torch.tensor(slots, dtype=torch.int32),
        torch.tensor(num_selected, dtype=torch.int32), 0.25,
    )
    for row, n in enumerate(context_lens):
        for head in range(2):
            mask = torch.zeros(n, dtype=torch.bool)
            mask[recent[row] :] = True
            mask[selected[slots[row], head, : num_selected[row]].long()] = True
            q = query[row : row + 1, head * 3 : head * 3 + 3]
            expected = sdpa(q, dense_k[row][:, head : head + 1], dense_v[row][:, head : head + 1], mask[None], 0.25)
            torch.testing.assert_close(out[row, head * 3 : head * 3 + 3], expected[0])


def test_pillar_scores_ref_is_the_mean_softmax_probability():
    context_lens, q_lens = [50, 23], [9, 4]
    k_cache, v_cache, page_table, dense_k, dense_v = paged_setup(context_lens, 4, 2, 16, seed=2)
    query = torch.randn(sum(q_lens), 6, 16)
    query_start = torch.tensor([0, 9, 13], dtype=torch.int32)
    _, lse = paged_attention_ref(query, k_cache, v_cache, page_table, query_start, torch.tensor(context_lens, dtype=torch.int32), 0.25)
    num_old = torch.tensor([41, 19], dtype=torch.int32)
    scores = pillar_scores_ref(query, k_cache, page_table, query_start, lse, num_old, 45, 0.25)
    assert scores.shape == (2, 2, 45)
    for row, (n, q_len) in enumerate(zip(context_lens, q_lens)):
        q = query[query_start[row] : query_start[row + 1]]
        mask = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        logits = torch.einsum("qhd,khd->qhk", q, dense_k[row].repeat_interleave(3, dim=1)) * 0.25
        probs = logits.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)  # [q, H, n]
        expected = probs.view(q_len, 2, 3, n).mean(dim=(0, 2))[:, : num_old[row]]
        torch.testing.assert_close(scores[row, :, : num_old[row]], expected)
        assert torch.isinf(scores[row, :, num_old[row] :]).all()


def test_select_top_keys_sorted_and_padded():
    # scores far apart at bfloat16 precision (ratios of 1.1, both signs): the ranking is the exact one
    magnitudes = 1.1 ** torch.randperm(180).float().view(3, 2, 30)
    scores = magnitudes * torch.where(torch.rand(3, 2, 30) < 0.3, -1.0, 1.0)
    scores[2, :, 10:] = float("-inf")
    budgets = torch.tensor([5, 8, 10], dtype=torch.int32)
    selected = select_top_keys(scores, budgets, 12)
    assert selected.dtype == torch.int32 and selected.shape == (3, 2, 12)
    for row in range(3):
        for head in range(2):
            b = int(budgets[row])
            expected = scores[row, head].topk(b).indices.sort().values
            assert torch.equal(selected[row, head, :b].long(), expected)
            assert (selected[row, head, b:] == -1).all()


def test_select_top_keys_ranks_at_bfloat16_precision_with_ties_to_the_lowest_positions():
    """Scores within bfloat16's resolution of each other tie (their float32 patterns share the top
    16 bits) and the lowest positions win; coarser differences rank as usual."""
    base = torch.tensor(1.25 * 2.0**-7)  # a bfloat16 value: the run below stays inside its bucket
    step = 2.0**-10 * base  # 6 steps span 0.5 %, under bfloat16's 2^-7 relative resolution
    scores = torch.full((1, 1, 12), 0.001)
    # a run of 6 near-equal scores rising with the position (the last ones are the largest in float32)
    scores[0, 0, 4:10] = base + step * torch.arange(6)
    scores[0, 0, 1] = 0.5  # clearly the best
    assert torch.equal(rank_key(scores)[0, 0, 4:10], rank_key(scores)[0, 0, 4:5].expand(6))
    selected = select_top_keys(scores, torch.tensor([4], dtype=torch.int32), 4)
    assert selected[0, 0].tolist() == [1, 4, 5, 6]  # float32's top 4 would be [1, 7, 8, 9]
    # rank_key keeps the order (toward zero on both signs) and -inf
    values = torch.tensor([-float("inf"), -3.0, -1e-3, 0.0, 1e-30, 0.2, 0.2001, 7.0, float("inf")])
    ranked = rank_key(values)
    assert (ranked[1:] >= ranked[:-1]).all() and ranked[0] == -float("inf") and ranked[-1] == float("inf")
    finite = values.isfinite()
    assert ((ranked - values)[finite].abs() <= values[finite].abs() * 2.0**-7).all()


def test_store_kv_ref_writes_slots_and_skips_padding():
    k_cache = torch.zeros(4, 3, 2, 8)
    v_cache = torch.zeros(4, 3, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([7, -1, 0, 11, 5])
    store_kv_ref(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[token]) and torch.equal(flat_v[slot], value[token])
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == 4
