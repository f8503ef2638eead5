"""The `"diagonal"` selection's kernels against their float32 references: the moved-key offsets the
verification's scoring pass keeps (exact integers where the best key is tie-free), and draft attention
over selected + moved + recent keys (out-of-range entries, NO_OFFSET, duplicates of each other and of
the selection), alone and inside `mixed_attention` with split work lists."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (  # noqa: F401
    assert_attention_close,
    i32,
    make_paged_kv,
    poison_outputs,
    query_offsets,
    random_selection,
    sparse_attention_lowp,
)

from hf_sparsespec.kernels.attention_plan import plan_attention
from hf_sparsespec.kernels.backend import TorchBackend
from hf_sparsespec.kernels.mixed_attention import mixed_attention, mixed_attention_ref
from hf_sparsespec.kernels.moved_keys import NO_OFFSET, moved_offsets_ref, moved_positions_ref, unique_offsets
from hf_sparsespec.kernels.paged_attention import paged_attention_ref
from hf_sparsespec.kernels.sparse_attention import sparse_draft_attention, sparse_draft_attention_ref
from hf_sparsespec.kernels.triton_backend import TritonBackend

# (context_lens, q_lens) of verification rows, as the PillarAttn scoring tests: blocks of 9, a row with no
# old keys, a row whose packed block needs two query tiles (and a short one), a page-edge row, and rows
# long enough that a program scans several key blocks and chunks and two programs share a row (the
# best key is folded across blocks, then across programs).
VERIFY_CASES = {
    "verify": ([97, 40], [9, 9]),
    "several_chunks": ([1300, 700], [9, 9]),
    "no_old_keys": ([9, 30], [9, 9]),
    "two_query_tiles": ([60, 20], [30, 2]),
    "page_edge": ([25, 16], [9, 9]),
    "rows_without_keys": ([9, 2600, 9, 1300, 40], [9, 9, 9, 9, 9]),  # a program's chunks span two rows
}


def _verify_rows(device, dtype, page_size, group, head_dim, context_lens, q_lens, num_kv_heads=2):
    k_cache, v_cache, page_table = make_paged_kv(context_lens, page_size, num_kv_heads, head_dim, dtype, device)
    starts = query_offsets(q_lens)
    query = torch.randn(starts[-1], num_kv_heads * group, head_dim).to(dtype).to(device)
    scale = head_dim**-0.5
    _, lse = paged_attention_ref(query, k_cache, v_cache, page_table, i32(starts, device), i32(context_lens, device),
                                 scale)  # fmt: skip
    num_old = [c - q for c, q in zip(context_lens, q_lens)]
    return query, k_cache, page_table, i32(starts, device), lse, i32(num_old, device), scale


def _clear_best(query, k_cache, page_table, query_start, num_old, num_entries, scale) -> torch.Tensor:
    """[rows, kvh, entries] bool: the reference's best key beats the runner-up by a margin no rounding
    of the kernel's products can bridge (the kernel must match exactly there)."""
    num_q_heads, head_dim = query.shape[1:]
    kvh = k_cache.shape[2]
    group = num_q_heads // kvh
    clear = torch.zeros(page_table.shape[0], kvh, num_entries, dtype=torch.bool)
    starts = query_start.tolist()
    for row, n_old in enumerate(num_old.tolist()):
        num_q = min(starts[row + 1] - starts[row], num_entries // group)
        if n_old < 2 or num_q == 0:
            clear[row, :, : num_q * group] = True  # one key (or none): nothing to tie
            continue
        q = query[starts[row] : starts[row] + num_q].float().view(num_q, kvh, group, head_dim)
        positions = torch.arange(n_old)
        keys = k_cache[page_table[row].long()[positions // k_cache.shape[1]], positions % k_cache.shape[1]].float()
        logits = torch.einsum("qhgd,khd->hqgk", q, keys) * scale
        top2 = logits.topk(2, dim=-1).values
        clear[row, :, : num_q * group] = (top2[..., 0] - top2[..., 1] > 1e-2).reshape(kvh, -1).cpu()
    return clear.to(query.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(VERIFY_CASES))
@pytest.mark.parametrize("page_size, group, head_dim", [(1, 1, 16), (16, 3, 32), (16, 6, 64)])
def test_moved_offsets_match_reference(device, dtype, case, page_size, group, head_dim):
    """The engine's refresh with an offsets store (`score_verification` per layer, then
    `select_verified_keys` for all layers): each row's offsets land at its slot in its layer, rows of
    other slots are untouched, the workspace is left zeroed, and a padding row (no queries) writes
    NO_OFFSET."""
    context_lens, q_lens = VERIFY_CASES[case]
    query, k_cache, page_table, query_start, lse, num_old, scale = _verify_rows(
        device, dtype, page_size, group, head_dim, context_lens, q_lens
    )
    num_entries = max(q_lens) * group
    # a last, padding row: no queries, no old keys (as the engine pads its verification rows)
    page_table = torch.cat([page_table, page_table[:1]])
    query_start = torch.cat([query_start, query_start[-1:]])
    num_old = torch.cat([num_old, i32([0], device)])
    budgets = torch.clamp(num_old, max=4)
    num_rows = len(context_lens) + 1
    num_slots = num_rows + 2
    slots = torch.tensor([3, 0, 4] if num_rows == 3 else [num_slots - 1 - r for r in range(num_rows)], device=device)
    unused = [s for s in range(num_slots) if s not in slots.tolist()]
    expected = moved_offsets_ref(query, k_cache, page_table, query_start, num_old, num_entries, scale)
    assert (expected[-1] == NO_OFFSET).all()
    stores = []
    for backend in (TritonBackend(), TorchBackend()):
        layers = 2  # the scored layer is the second; the first layer's stores must stay untouched
        selected = torch.full((layers, num_slots, 2, 8), -1, dtype=torch.int32, device=device)
        offsets = torch.full((layers, num_slots, 2, num_entries), -7, dtype=torch.int32, device=device)
        best = torch.zeros((layers, num_rows, 2, num_entries), dtype=torch.int64, device=device) if backend.needs_plan else None
        scores = torch.zeros((layers, num_rows, 2, int(num_old.max())), dtype=torch.float32, device=device)
        backend.score_verification(query, k_cache, page_table, query_start, lse, num_old, scores[1], scale, slots,
                                   max(q_lens), offsets=offsets[1], best=best[1] if best is not None else None)  # fmt: skip
        backend.select_verified_keys(scores, num_old, budgets, selected, slots, offsets if best is not None else None,
                                     best, group)  # fmt: skip
        if best is not None:
            assert (best == 0).all()
        assert (offsets[0] == NO_OFFSET)[slots.long()].all() if best is not None else (offsets[0] == -7).all()
        stores.append(offsets[1])
    triton_store, torch_store = stores
    assert torch.equal(torch_store[slots.long()], expected)
    assert (triton_store[unused] == -7).all() and (torch_store[unused] == -7).all()
    clear = _clear_best(query, k_cache, page_table, query_start, num_old, num_entries, scale)
    assert clear[expected != NO_OFFSET].float().mean() > 0.5
    actual = triton_store[slots.long()]
    assert torch.equal(actual[clear], expected[clear])
    assert torch.equal(actual == NO_OFFSET, expected == NO_OFFSET)


def test_moved_offsets_point_at_the_diagonal(device):
    """A copy head: every verification query's key equals the key `period` positions earlier, so its
    best old key is p - period and the offset is -period for every (query, head): the list's first entry
    holds it, its repeats move no key (`unique_offsets`)."""
    period, context, q_len, head_dim = 20, 35, 5, 16
    k_cache, _, page_table = make_paged_kv([context], 4, 1, head_dim, torch.float32, device)
    positions = torch.arange(context)
    keys = k_cache[page_table[0].long()[positions // 4], positions % 4]  # [context, 1, d]
    keys[period:] = keys[:-period].clone()
    for p in range(context):
        k_cache[page_table[0, p // 4], p % 4] = keys[p]
    query = (keys[context - q_len :].repeat(1, 2, 1) * 8.0).contiguous()  # q = 8 k: attends its own copy
    args = (query, k_cache, page_table, i32([0, q_len], device), i32([context - q_len], device), q_len * 2, 0.25)
    offsets = moved_offsets_ref(*args)
    assert (offsets[..., 0] == -period).all() and (offsets[..., 1:] == NO_OFFSET).all()


# Draft rows (context_len, recent_start, num_selected) and their offset lists: in-range keys, keys in
# the recent window or before position 0 (masked), NO_OFFSET, duplicates of each other and of the
# selection; a row with an empty selection; a dense row (recent_start 0: every moved key masked).
DRAFT_ROWS = [(97, 90, 20), (40, 33, 0), (9, 0, 0), (32, 30, 17)]


def _moved_offsets(rows, selected, selection_slot, num_entries, num_slots, num_kv_heads, device):
    offsets = torch.full((num_slots, num_kv_heads, num_entries), NO_OFFSET, dtype=torch.int32)
    for row, (context, recent, count) in enumerate(rows):
        slot = int(selection_slot[row])
        q = context - 1
        for h in range(num_kv_heads):
            targets = torch.randint(-5, context + 3, (num_entries,))  # some before 0, some in the window
            targets[0] = targets[1] = max(recent - 1, 0)  # a duplicate pair
            if count:
                targets[2] = int(selected[slot, h, count // 2])  # a duplicate of a selected key
            targets[3] = q + NO_OFFSET  # an unused entry
            offsets[slot, h] = (targets - q).to(torch.int32)
            offsets[slot, h, 3] = NO_OFFSET
    return offsets.to(device)


def _draft_case(device, dtype, page_size, group, head_dim, num_entries, num_kv_heads=2, rows=DRAFT_ROWS,
                max_budget=24):  # fmt: skip
    context_lens, recent_start, num_selected = (list(col) for col in zip(*rows))
    k_cache, v_cache, page_table = make_paged_kv(context_lens, page_size, num_kv_heads, head_dim, dtype, device)
    selected, selection_slot = random_selection(context_lens, recent_start, num_selected, num_kv_heads, max_budget,
                                                device)  # fmt: skip
    offsets = _moved_offsets(rows, selected.cpu(), selection_slot.cpu(), num_entries, selected.shape[0], num_kv_heads,
                             device)  # fmt: skip
    query = torch.randn(len(rows), num_kv_heads * group, head_dim).to(dtype).to(device)
    args = (
        query, k_cache, v_cache, page_table, i32(context_lens, device), i32(recent_start, device),
        selected, selection_slot, i32(num_selected, device), head_dim**-0.5,
    )  # fmt: skip
    return args, offsets


def _with_moved_keys(args, offsets):
    """The same rows with the moved keys appended to the selection (sorted, deduplicated): the lowp
    baseline and the independent check of the reference's key set."""
    query, k_cache, v_cache, page_table, context_lens, recent_start, selected, selection_slot, num_selected, _ = args
    num_kv_heads = k_cache.shape[2]
    merged = torch.full((selected.shape[0], num_kv_heads, selected.shape[2] + offsets.shape[2]), -1, dtype=torch.int32)
    counts = []
    for row, slot in enumerate(selection_slot.tolist()):
        count, context, recent = int(num_selected[row]), int(context_lens[row]), int(recent_start[row])
        per_head = []
        for h in range(num_kv_heads):
            moved = (context - 1 + offsets[slot, h].long()).cpu()
            moved = moved[(moved >= 0) & (moved < recent)]
            per_head.append(torch.unique(torch.cat([selected[slot, h, :count].long().cpu(), moved])))
        for h, positions in enumerate(per_head):
            merged[slot, h, : len(positions)] = positions.to(torch.int32)
        counts.append([len(p) for p in per_head])
    return merged.to(query.device), counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group, head_dim", [(1, 16), (3, 32), (6, 64)])
def test_draft_attention_with_moved_keys_matches_reference(device, dtype, page_size, group, head_dim):
    num_entries = 9 * group
    args, offsets = _draft_case(device, dtype, page_size, group, head_dim, num_entries)
    ref = sparse_draft_attention_ref(*args, offsets=offsets)
    lowp = None
    if dtype != torch.float32:
        lowp = torch.zeros_like(ref)
        merged, counts = _with_moved_keys(args, offsets)
        for row in range(ref.shape[0]):  # per head: the heads' merged sets differ in size
            for h in range(2):
                one = list(args)
                one[6], one[8] = merged, i32([counts[row][h]] * ref.shape[0], args[0].device)
                heads = slice(h * group, (h + 1) * group)
                lowp[row, heads] = sparse_attention_lowp(*one)[row, heads]
    context_lens, recent_start, num_selected = (list(col) for col in zip(*DRAFT_ROWS))
    tiny_splits = plan_attention(
        list(range(len(DRAFT_ROWS) + 1)), context_lens, 0, num_selected, recent_start, group=group,
        num_kv_heads=2, device=device, min_keys_per_split=8, target_programs=16, num_moved=num_entries,
    )  # fmt: skip
    assert tiny_splits.num_merge > 0
    for plan in (None, tiny_splits):  # the kernel's lists hold each offset once, as the store's writers leave them
        assert_attention_close(sparse_draft_attention(*args, plan=plan, offsets=unique_offsets(offsets)), ref, lowp,
                               dtype)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("group, head_dim, page_size", [(6, 128, 16), (3, 64, 1)])
def test_draft_attention_with_moved_keys_bf16(group, head_dim, page_size):
    """bf16 on the GPU at long contexts and 5 % budgets: flash-attn's rule against the fp32 reference
    (the torch-bf16 baseline attends the reference's own key set)."""
    rows = [(4099, 4091, 205), (20000, 19992, 1000), (97, 90, 20)]
    num_entries = 9 * group
    args, offsets = _draft_case("cuda", torch.bfloat16, page_size, group, head_dim, num_entries, rows=rows,
                                max_budget=1024)  # fmt: skip
    ref = sparse_draft_attention_ref(*args, offsets=offsets)
    merged, counts = _with_moved_keys(args, offsets)
    lowp = torch.zeros_like(ref)
    for row in range(ref.shape[0]):
        for h in range(2):
            one = list(args)
            one[6], one[8] = merged, i32([counts[row][h]] * ref.shape[0], "cuda")
            heads = slice(h * group, (h + 1) * group)
            lowp[row, heads] = sparse_attention_lowp(*one)[row, heads]
    assert_attention_close(sparse_draft_attention(*args, offsets=unique_offsets(offsets)), ref, lowp, torch.bfloat16)


def test_reference_attends_the_deduplicated_union(device):
    """The reference's moved keys are exactly the union of the selection and the in-range moved keys:
    the same as a plain selection holding that union (one head's set per call)."""
    args, offsets = _draft_case(device, torch.float32, 16, 3, 32, 27)
    ref = sparse_draft_attention_ref(*args, offsets=offsets)
    merged, counts = _with_moved_keys(args, offsets)
    for row in range(ref.shape[0]):
        for h in range(2):
            one = list(args)
            one[6], one[8] = merged, i32([counts[row][h]] * ref.shape[0], device)
            heads = slice(h * 3, (h + 1) * 3)
            torch.testing.assert_close(sparse_draft_attention_ref(*one)[row, heads], ref[row, heads])


def test_unique_offsets_drop_repeats_and_the_taken_ones():
    offsets = torch.tensor([[[3, -2, 3, NO_OFFSET, NO_OFFSET, -2, 7]]], dtype=torch.int32)
    assert unique_offsets(offsets).tolist() == [[[3, -2, NO_OFFSET, NO_OFFSET, NO_OFFSET, NO_OFFSET, 7]]]
    taken = torch.tensor([[[7, 5]]], dtype=torch.int32)
    assert unique_offsets(offsets, taken).tolist() == [[[3, -2, NO_OFFSET, NO_OFFSET, NO_OFFSET, NO_OFFSET, NO_OFFSET]]]


def test_stored_offsets_hold_each_offset_once(device):
    """`store_moved_offsets` drops an entry whose offset an earlier entry of its list holds (queries i and
    i + 1 whose best keys are j and j + 1: the diagonal), as `unique_offsets` does to the reference's."""
    from hf_sparsespec.kernels.moved_keys import store_moved_offsets

    group, num_entries, num_old = 2, 8, 50
    keys = torch.tensor([[10, 30, 11, 31, 12, 20, 40, 40], [5, 5, 6, 6, 7, 7, 49, 0]])  # [KV heads, entries]
    best = ((torch.ones_like(keys) << 32) | (2**31 - 1 - keys))[None].to(device)  # [rows 1, KV heads, entries]
    best[0, 1, 7] = 0  # no best key: NO_OFFSET
    offsets = torch.full((3, 2, num_entries), -1, dtype=torch.int32, device=device)
    store_moved_offsets(best, torch.tensor([num_old], dtype=torch.int32, device=device), offsets,
                        torch.tensor([2], device=device), group)  # fmt: skip
    raw = keys - (num_old + torch.arange(num_entries) // group)  # key - the query's position
    raw[1, 7] = NO_OFFSET
    assert offsets[2].cpu().tolist() == unique_offsets(raw.to(torch.int32)).tolist()
    assert offsets[2, 0].cpu().tolist() == [-40, -20, NO_OFFSET, NO_OFFSET, NO_OFFSET, -32, -13, NO_OFFSET]
    assert (offsets[:2] == -1).all() and (best == 0).all()


def test_moved_positions_mask_duplicates_and_out_of_range():
    offsets = torch.tensor([[-5, -5, -3, -20, NO_OFFSET, -1, -4]], dtype=torch.int32)
    positions, attend = moved_positions_ref(offsets, 10, 8, torch.tensor([[2, 7]]))
    # keys 5, 5 (dup), 7 (selected), -10 (before 0), NO_OFFSET, 9 (recent window), 6
    assert positions[0].tolist()[:3] == [5, 5, 7] and positions[0, 6] == 6
    assert attend[0].tolist() == [True, False, False, False, False, False, True]


def test_invalid_and_duplicate_moved_keys_change_nothing(device):
    """Offsets that only repeat selected keys, fall into the recent window or before 0: the same output
    as without moved keys (Triton; masked keys get no weight, duplicates are not counted twice)."""
    args, _ = _draft_case(device, torch.float32, 16, 3, 32, 27)
    _, _, _, _, context_lens, recent_start, selected, selection_slot, num_selected, _ = args
    offsets = torch.full((selected.shape[0], 2, 27), NO_OFFSET, dtype=torch.int32, device=device)
    for row, slot in enumerate(selection_slot.tolist()):
        q, count, recent = int(context_lens[row]) - 1, int(num_selected[row]), int(recent_start[row])
        for h in range(2):
            offsets[slot, h, 0] = -q - 3  # before position 0
            offsets[slot, h, 1] = recent - q  # the recent window's first key
            if count:
                offsets[slot, h, 2:4] = selected[slot, h, :2] - q  # selected keys
    plain = sparse_draft_attention(*args)
    torch.testing.assert_close(sparse_draft_attention(*args, offsets=offsets), plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_attention_with_moved_keys_matches_reference(device, dtype):
    """Full rows (a prefill chunk, two verifications) and draft rows with moved keys in one launch."""
    full = [(12, 12), (97, 9), (40, 9)]
    group, head_dim, num_entries = 3, 32, 27
    draft_args, offsets = _draft_case(device, dtype, 16, group, head_dim, num_entries)
    query_d, k_d, v_d, pt_d, ctx_d, recent_d, selected, selection_slot, num_sel_d, scale = draft_args
    k_cache, v_cache, page_table = make_paged_kv([c for c, _ in full], 16, 2, head_dim, dtype, device)
    # one cache for both kinds of rows: the draft rows' pages follow the full rows'
    pt_d = pt_d + k_cache.shape[0]
    k_cache, v_cache = torch.cat([k_cache, k_d]), torch.cat([v_cache, v_d])
    width = max(page_table.shape[1], pt_d.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=0)  # noqa: E731
    page_table = torch.cat([pad(page_table), pad(pt_d)])
    q_lens = [q for _, q in full] + [1] * len(DRAFT_ROWS)
    query_full = torch.randn(sum(q for _, q in full), 2 * group, head_dim).to(dtype).to(device)
    n_full = len(full)
    zeros = i32([0] * n_full, device)
    args = (
        torch.cat([query_full, query_d]), k_cache, v_cache, page_table, i32(query_offsets(q_lens), device),
        torch.cat([i32([c for c, _ in full], device), ctx_d]), n_full, torch.cat([zeros, recent_d]), selected,
        torch.cat([zeros, selection_slot]), torch.cat([zeros, num_sel_d]), scale,
    )  # fmt: skip
    ref_out, ref_lse = mixed_attention_ref(*args, offsets=offsets)
    host = [x.tolist() for x in (args[4], args[5], args[10], args[7])]
    tiny_splits = plan_attention(host[0], host[1], n_full, host[2], host[3], group=group, num_kv_heads=2,
                                 device=device, min_keys_per_split=16, target_programs=24, num_moved=num_entries)  # fmt: skip
    tol = torch.float32 if dtype == torch.float32 else torch.float16
    for plan in (None, tiny_splits):
        out, lse = mixed_attention(*args, plan=plan, offsets=unique_offsets(offsets))
        assert not out.isnan().any()
        # fp16: the reference's own fp16 rounding bound is not built for mixed batches; the table's atol
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-3 if tol == torch.float32 else 1e-2,
                                   atol=1e-3 if tol == torch.float32 else 1e-2)  # fmt: skip
        assert torch.equal(lse.isinf(), ref_lse.isinf())


def test_the_draft_kernels_compile_once_whatever_the_selection_width():
    """The selection store's width follows max_new_tokens (the budget of the longest context); the moved-key
    search's step count, a compile-time constant, must not, or each `generate` with another length
    compiled both draft kernels again in the middle of decoding."""
    from hf_sparsespec.kernels.sparse_attention import moved_key_args

    offsets = torch.zeros(3, 2, 70, dtype=torch.int32)
    constants = {
        width: {key: value for key, value in moved_key_args(offsets, torch.zeros(3, 2, width, dtype=torch.int32), 2).items()
                if key.isupper()}
        for width in (1, 16, 128, 432, 4096, 65535)
    }  # fmt: skip
    assert len({tuple(sorted(c.items())) for c in constants.values()}) == 1, constants


@pytest.mark.parametrize("backend", [TritonBackend(), TorchBackend()], ids=["triton", "torch"])
def test_scoring_from_the_aside_copies_equals_scoring_in_line(device, backend):
    """`overlap_scoring`'s data path (`ops.ScoringAside`, `ops.score_layer`), here on the current
    stream: the step's tokens are prefill, then verification rows (3 of up to k + 1 = 4 tokens: 10 of
    the 12 copied), then a draft; the copies' rows and starts give the same scores (and best keys) as
    the originals' absolute offsets."""
    from hf_sparsespec.ops import ScoringAside, score_layer

    group, spec, prefill, drafts = 3, 4, 5, 1  # 5 + 10 + 1 tokens: the 12th copy is clamped to the last token
    context_lens, q_lens = [37, 20, 53], [4, 4, 2]
    query, k_cache, page_table, starts, lse, num_old, scale = _verify_rows(device, torch.float32, 4, group, 16,
                                                                           context_lens, q_lens)  # fmt: skip
    # the step: 5 prefill tokens before the verification rows, a draft token after them
    step_query = torch.cat([torch.randn(prefill, *query.shape[1:]).to(device), query,
                            torch.randn(drafts, *query.shape[1:]).to(device)])  # fmt: skip
    step_lse = torch.cat([torch.rand(prefill, lse.shape[1]).to(device), lse, torch.rand(drafts, lse.shape[1]).to(device)])
    step_starts = starts + prefill
    slots = torch.tensor([2, 0, 1], device=device)
    entries = spec * group
    results = []
    for aside in (False, True):
        scores = torch.zeros((3, 2, 64), dtype=torch.float32, device=device)
        offsets = torch.full((3, 2, entries), -7, dtype=torch.int32, device=device)
        best = torch.zeros((3, 2, entries), dtype=torch.int64, device=device) if backend.needs_plan else None
        copies = None
        if aside:
            stores = (torch.full((2, 3 * spec, *query.shape[1:]), float("nan"), device=device),
                      torch.full((2, 3 * spec, lse.shape[1]), float("nan"), device=device))  # fmt: skip
            copies = ScoringAside.for_step(None, *stores, step_starts, 3 * spec, step_query.shape[0]).for_layer(1)
        score_layer(backend, step_query, k_cache, page_table, step_starts, step_lse, num_old, scores, scale, slots,
                    spec, offsets=offsets if best is None else None, best=best, aside=copies)  # fmt: skip
        results.append((scores, offsets, best))
    for row, n in enumerate(num_old.tolist()):
        assert torch.equal(results[0][0][row, :, :n], results[1][0][row, :, :n])
    assert torch.equal(results[0][1], results[1][1])
    if backend.needs_plan:
        assert torch.equal(results[0][2], results[1][2]) and (results[0][2] != 0).any()
    else:
        assert (results[0][1] != -7).any()
