"""The Triton kernels in bf16 on the GPU at realistic sizes (contexts up to 32K), against the float32
references with flash-attn's rule (at most 2x torch-bf16's error, plus a small atol). Skipped on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close_to_reference
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

from hf_sparsespec.kernels.mixed_attention import mixed_attention, mixed_attention_ref
from hf_sparsespec.kernels.paged_attention import paged_attention, paged_attention_ref
from hf_sparsespec.kernels.pillar_select import pillar_scores, pillar_scores_ref
from hf_sparsespec.kernels.sparse_attention import sparse_draft_attention, sparse_draft_attention_ref
from hf_sparsespec.kernels.store_kv import store_kv, store_kv_ref

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16

# (head_dim, group, num_kv_heads, page_size, context_lens, q_lens)
FULL_CASES = [
    (128, 6, 2, 16, [32768, 97, 15, 9], [9, 9, 9, 9]),
    (64, 3, 3, 1, [4099, 97, 1], [9, 1, 1]),
    (128, 8, 1, 64, [63, 64, 20000], [9, 64, 9]),
    (64, 1, 4, 16, [16, 97, 3000], [1, 97, 300]),
]


@pytest.mark.parametrize("case", FULL_CASES, ids=lambda c: f"d{c[0]}-g{c[1]}-ps{c[3]}")
def test_paged_attention_bf16(case):
    head_dim, group, kvh, page_size, context_lens, q_lens = case
    k_cache, v_cache, page_table = make_paged_kv(context_lens, page_size, kvh, head_dim, BF16, "cuda")
    starts = query_offsets(q_lens)
    query = torch.randn(starts[-1], kvh * group, head_dim, device="cuda").to(BF16)
    args = (query, k_cache, v_cache, page_table, i32(starts, "cuda"), i32(context_lens, "cuda"), head_dim**-0.5)
    ref_out, ref_lse = paged_attention_ref(*args)
    out, lse = paged_attention(*args)
    assert_attention_close(out, ref_out, paged_attention_lowp(*args), BF16)
    assert_close_to_reference(lse, ref_lse, BF16)


# (head_dim, group, num_kv_heads, page_size, context_lens); 5% budgets, recent windows of 1-9.
DRAFT_CASES = [
    (128, 6, 2, 16, [32768, 16384, 97, 15]),
    (64, 3, 3, 1, [4096, 97, 2]),
    (128, 8, 1, 64, [20000, 63, 64]),
]


def _draft_rows(context_lens):
    recent = [max(0, c - 1 - (i % 9)) for i, c in enumerate(context_lens)]
    num_selected = [min(r, math.ceil(0.05 * c)) for r, c in zip(recent, context_lens)]
    num_selected[-1] = 0  # an empty selection
    return recent, num_selected


@pytest.mark.parametrize("case", DRAFT_CASES, ids=lambda c: f"d{c[0]}-g{c[1]}-ps{c[3]}")
def test_sparse_draft_attention_bf16(case):
    head_dim, group, kvh, page_size, context_lens = case
    recent, num_selected = _draft_rows(context_lens)
    k_cache, v_cache, page_table = make_paged_kv(context_lens, page_size, kvh, head_dim, BF16, "cuda")
    selected, slots = random_selection(context_lens, [max(r, 1) for r in recent], num_selected, kvh, 1700, "cuda")
    query = torch.randn(len(context_lens), kvh * group, head_dim, device="cuda").to(BF16)
    args = (
        query, k_cache, v_cache, page_table, i32(context_lens, "cuda"), i32(recent, "cuda"), selected, slots,
        i32(num_selected, "cuda"), head_dim**-0.5,
    )  # fmt: skip
    out = sparse_draft_attention(*args)
    assert_attention_close(out, sparse_draft_attention_ref(*args), sparse_attention_lowp(*args), BF16)


# (dtype, full rows (context, q_len), draft contexts): bf16 at long contexts; float32 at the real models'
# head sizes, where the fp32 ("ieee") tile configs at head_dim 128 run (the interpreter tests use <= 64).
MIXED_CASES = {
    "bf16": (BF16, [(16384, 9), (4096, 9), (97, 97)], [32768, 16384, 4096, 97, 15]),
    "fp32": (torch.float32, [(2048, 9), (300, 9), (150, 150)], [2100, 700, 97, 15]),
}


@pytest.mark.parametrize("case", list(MIXED_CASES))
@pytest.mark.parametrize("head_dim, group, kvh", [(128, 6, 2), (64, 3, 3)])
def test_mixed_attention(case, head_dim, group, kvh):
    dtype, full, drafts = MIXED_CASES[case]
    recent, num_selected = _draft_rows(drafts)
    context_lens = [c for c, _ in full] + drafts
    q_lens = [q for _, q in full] + [1] * len(drafts)
    recent_start = [0] * len(full) + recent
    num_sel = [0] * len(full) + num_selected
    k_cache, v_cache, page_table = make_paged_kv(context_lens, 16, kvh, head_dim, dtype, "cuda")
    selected, slots = random_selection(context_lens, [max(r, 1) for r in recent_start], num_sel, kvh, 1700, "cuda")
    starts = query_offsets(q_lens)
    query = torch.randn(starts[-1], kvh * group, head_dim, device="cuda").to(dtype)
    args = (
        query, k_cache, v_cache, page_table, i32(starts, "cuda"), i32(context_lens, "cuda"), len(full),
        i32(recent_start, "cuda"), selected, slots, i32(num_sel, "cuda"), head_dim**-0.5,
    )  # fmt: skip
    ref_out, ref_lse = mixed_attention_ref(*args)
    out, lse = mixed_attention(*args)
    nf = starts[len(full)]
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    if dtype == torch.float32:
        assert_close_to_reference(out, ref_out, dtype)
        assert_close_to_reference(lse[:nf], ref_lse[:nf], dtype)
        return
    lowp_full = paged_attention_lowp(
        query[:nf], k_cache, v_cache, page_table[:3], i32(starts[:4], "cuda"), i32(context_lens[:3], "cuda"), args[-1]
    )
    lowp_draft = sparse_attention_lowp(
        query[nf:], k_cache, v_cache, page_table[3:], i32(drafts, "cuda"), i32(recent, "cuda"), selected, slots[3:],
        i32(num_selected, "cuda"), args[-1],
    )  # fmt: skip
    assert_attention_close(out, ref_out, torch.cat([lowp_full, lowp_draft]), dtype)
    assert_close_to_reference(lse[:nf], ref_lse[:nf], dtype)


@pytest.mark.parametrize("head_dim, group, kvh, page_size", [(128, 6, 2, 16), (64, 3, 3, 1), (128, 8, 1, 64)])
def test_pillar_scores_bf16(head_dim, group, kvh, page_size):
    context_lens, q_lens = [32768, 4105, 97], [9, 9, 9]
    k_cache, v_cache, page_table = make_paged_kv(context_lens, page_size, kvh, head_dim, BF16, "cuda")
    starts = query_offsets(q_lens)
    query = torch.randn(starts[-1], kvh * group, head_dim, device="cuda").to(BF16)
    qs, cl = i32(starts, "cuda"), i32(context_lens, "cuda")
    _, lse = paged_attention(query, k_cache, v_cache, page_table, qs, cl, head_dim**-0.5)
    num_old = [c - q for c, q in zip(context_lens, q_lens)]
    args = (query, k_cache, page_table, qs, lse, i32(num_old, "cuda"), max(num_old), head_dim**-0.5)
    expected, actual = pillar_scores_ref(*args), pillar_scores(*args)
    assert torch.equal(actual.isinf(), expected.isinf())
    finite = expected.isfinite()
    peak = expected.masked_fill(~finite, 0).amax(dim=-1, keepdim=True)
    assert_close_to_reference(actual.masked_fill(~finite, 0) / peak, expected.masked_fill(~finite, 0) / peak, BF16)


@pytest.mark.parametrize("page_size, kvh, head_dim", [(1, 2, 128), (16, 3, 64), (64, 8, 128)])
def test_store_kv_bf16(page_size, kvh, head_dim):
    k_cache = torch.randn(512, page_size, kvh, head_dim, device="cuda").to(BF16)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(512 * page_size, device="cuda")[:300]
    slots[::7] = -1
    key = torch.randn(300, kvh, head_dim, device="cuda").to(BF16)
    value = torch.randn_like(key)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_a_shrinking_tail_compiles_no_scoring_sampling_or_key_hashing_kernel_again():
    """A batch's ramp and tail launch the scoring pass over other numbers of verifications, and hash,
    draw and normalise over other numbers of rows: after one launch of each, other row counts (a
    single row too, which Triton would specialize) must reuse the compiled kernels (256 x 8192 runs
    compiled them again at iterations 8,752 and 8,642; a 256 x 2048 run the scoring and fold kernels
    mid-run, from 36 verifications to 32: docs/measurements.md 25). The page table and the scores
    are row slices of fixed-width buffers, as the engine's are: Triton also specializes a stride
    divisible by 16, which fresh per-launch buffers would meet (2 rows x 2 heads x 328 keys)."""
    import triton

    from hf_sparsespec.kernels.keyed_sample import (
        accept_drafts,
        keyed_sample,
        keyed_sample_residual,
        keyed_uniform,
        position_keys,
        probabilities_at,
    )
    from hf_sparsespec.kernels.pillar_select import pillar_scores_into
    from hf_sparsespec.kernels.tempered_softmax import softmax_stats, truncation_stats

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        pytest.skip("needs triton.knobs.runtime.jit_cache_hook (Triton >= 3.4)")

    capacity, vocab = 40, 151_936
    all_context_lens = [300 + 37 * r for r in range(capacity)]
    k_cache, v_cache, all_pages = make_paged_kv(all_context_lens, 16, 2, 128, BF16, "cuda")
    all_scores = torch.empty(capacity, 2, 1800, device="cuda")

    def score(num_rows):
        context_lens, q_lens = all_context_lens[:num_rows], [9] * num_rows
        page_table = all_pages[:num_rows]
        starts = query_offsets(q_lens)
        query = torch.randn(starts[-1], 12, 128, device="cuda").to(BF16)
        qs, cl = i32(starts, "cuda"), i32(context_lens, "cuda")
        _, lse = paged_attention(query, k_cache, v_cache, page_table, qs, cl, 128**-0.5)
        num_old = i32([c - q for c, q in zip(context_lens, q_lens)], "cuda")
        pillar_scores_into(query, k_cache, page_table, qs, lse, num_old, all_scores[:num_rows], 128**-0.5, 9,
                           max_rows=capacity)  # fmt: skip

    store = torch.randn(40 * 8, vocab, device="cuda").to(BF16)  # the drafts' logits and stats
    store_stats = [softmax_stats(store, 0.65), truncation_stats(store, 0.65, 20, 0.8)]  # temperature; top-k / top-p

    def sample(num_logits):
        logits = torch.randn(num_logits, vocab, device="cuda").to(BF16)
        for stats, stored in zip([softmax_stats(logits, 0.65), truncation_stats(logits, 0.65, 20, 0.8)], store_stats):
            keyed_sample(logits, torch.randint(0, 2**30, (num_logits, 2), device="cuda"), stats, 0.65)
            draws = num_logits // 9  # the verifications' recovered tokens
            rows, store_rows = torch.arange(draws, device="cuda") * 9, torch.arange(draws, device="cuda") - 1
            keyed_sample_residual(logits, rows, store, store_rows, torch.randint(0, 2**30, (draws, 2), device="cuda"),
                                  stats, stored, 0.65)  # fmt: skip
            probabilities_at(logits, rows, rows, stats, 0.65)  # the drafted tokens' p (and q, from the store)

    def hash_keys(num_rows):
        keyed_uniform(torch.randint(0, 2**30, (num_rows * 9 - 8, 2), device="cuda"))
        position_keys(torch.randint(0, 2**30, (num_rows, 2), device="cuda"), torch.arange(num_rows, device="cuda"))
        p, q = torch.rand(num_rows, 8, device="cuda"), torch.rand(num_rows, 8, device="cuda")  # the acceptance tests
        accept_drafts(p, q, torch.randint(0, 2**30, (num_rows, 8, 2), device="cuda"), torch.full((num_rows,), 8, device="cuda"),
                      torch.arange(num_rows * 8, device="cuda").view(num_rows, 8),
                      torch.randint(0, 2**30, (num_rows, 9, 2), device="cuda"))  # fmt: skip

    score(36)
    sample(36 * 9)  # a few splits a row
    hash_keys(36)
    compiled, previous = [], runtime.jit_cache_hook
    runtime.jit_cache_hook = lambda *args, **kwargs: compiled.append(str(kwargs.get("repr", "?"))[:200])
    try:
        for num_rows in (32, 16, 7, 2, 1):
            score(num_rows)
            sample(num_rows * 9 + 3)  # up to one split per block of the vocabulary
            hash_keys(num_rows)
    finally:
        runtime.jit_cache_hook = previous
    kernels = ("_pillar_scores_kernel", "_keyed_uniform_kernel", "_position_keys_kernel", "_fold_splits_kernel",
               "_keyed_sample_kernel", "_softmax_partials_kernel", "_softmax_write_kernel", "_accept_drafts_kernel")  # fmt: skip
    again = [name for name in compiled if any(kernel in name for kernel in kernels)]
    assert not again, f"compiled again: {again}"
