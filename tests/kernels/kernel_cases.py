"""Builders for kernel tests: paged caches with shuffled page tables, draft selections, the
low-precision torch baselines of flash-attn's error rule, and output poisoning.

Test modules import `poison_outputs` (an autouse fixture): inside a kernel test every `torch.empty`
returns NaN (floats) or a sentinel (integers), so an output element a kernel forgets to write
cannot pass as a lucky zero.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import triton
from conftest import TOLERANCES, assert_close_to_reference  # tests/conftest.py


def _fix_triton36_interpreter_index() -> None:
    """Triton <= 3.6's interpreter turns a scalar into a Python int with `int(array_of_one)`, which
    NumPy >= 2.3 refuses, so `range(loaded_bound, ...)` fails there (Triton 3.7+ squeezes first).
    Test-only shim: the same fix, applied when the old interpreter is in use."""
    if os.environ.get("TRITON_INTERPRET") != "1" or tuple(map(int, triton.__version__.split(".")[:2])) > (3, 6):
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


_fix_triton36_interpreter_index()

_empty = torch.empty


def _poisoned_empty(*args, **kwargs) -> torch.Tensor:
    x = _empty(*args, **kwargs)
    if x.is_floating_point():
        x.fill_(float("nan"))
    elif x.dtype in (torch.int32, torch.int64):
        x.fill_(-12345)
    return x


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "empty", _poisoned_empty)


POISON = 100.0  # the contents of the page that padding entries of a page table point to


def i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def make_paged_kv(context_lens, page_size, num_kv_heads, head_dim, dtype, device, spare_pages=3):
    """K/V caches holding every row's context on pages from `torch.randperm` (never contiguous),
    plus a poison page that the page table's unused entries point to.

    Returns `(k_cache, v_cache, page_table [num_rows, max_pages] int32)`."""
    pages_per_row = [max(1, math.ceil(c / page_size)) for c in context_lens]
    num_pages = sum(pages_per_row) + spare_pages + 1
    poison_page = num_pages - 1
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim).to(dtype)
    k_cache[poison_page] = POISON
    v_cache[poison_page] = POISON
    order = torch.randperm(num_pages - 1)
    max_pages = max(pages_per_row) + 1
    page_table = torch.full((len(context_lens), max_pages), poison_page, dtype=torch.int32)
    used = 0
    for row, n in enumerate(pages_per_row):
        page_table[row, :n] = order[used : used + n].to(torch.int32)
        used += n
    return k_cache.to(device), v_cache.to(device), page_table.to(device)


def query_offsets(q_lens) -> list[int]:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return starts


def random_selection(context_lens, recent_start, num_selected, num_kv_heads, max_budget, device, num_slots=None):
    """`selected [num_slots, num_kv_heads, max_budget]` (-1 padded, sorted positions below recent_start)
    and a shuffled `selection_slot [num_rows]`."""
    num_rows = len(context_lens)
    num_slots = num_slots or num_rows + 2
    slots = torch.randperm(num_slots)[:num_rows]
    selected = torch.full((num_slots, num_kv_heads, max_budget), -1, dtype=torch.int32)
    for row in range(num_rows):
        for h in range(num_kv_heads):
            n = num_selected[row]
            selected[slots[row], h, :n] = torch.randperm(recent_start[row])[:n].sort().values.to(torch.int32)
    return selected.to(device), slots.to(torch.int32).to(device)


def _gather(cache, page_row, positions):
    positions = positions.long()
    return cache[page_row.long()[positions // cache.shape[1]], positions % cache.shape[1]]


def _attend_lowp(q, k, v, visible, scale):
    """q [nq, g, d], k/v [n, d], visible [nq, n]: attention with the matmuls in the inputs' dtype
    (flash-attn's `upcast=False` baseline): returns [nq, g, d]."""
    logits = torch.einsum("qgd,nd->qgn", q, k).float() * scale
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(q.dtype)
    return torch.einsum("qgn,nd->qgd", probs, v)


def paged_attention_lowp(query, k_cache, v_cache, page_table, query_start, context_lens, scale):
    """`paged_attention_ref` with the matmuls in query.dtype."""
    num_q_heads, head_dim = query.shape[1:]
    kvh = k_cache.shape[2]
    g = num_q_heads // kvh
    out = torch.zeros_like(query)
    starts = query_start.tolist()
    for row, ctx in enumerate(context_lens.tolist()):
        q0, q1 = starts[row], starts[row + 1]
        if q1 == q0:
            continue
        pos = torch.arange(ctx, device=query.device)
        visible = pos[None, :] <= torch.arange(ctx - (q1 - q0), ctx, device=query.device)[:, None]
        k = _gather(k_cache, page_table[row], pos)
        v = _gather(v_cache, page_table[row], pos)
        for h in range(kvh):
            q = query[q0:q1, h * g : (h + 1) * g]
            out[q0:q1, h * g : (h + 1) * g] = _attend_lowp(q, k[:, h], v[:, h], visible, scale)
    return out


def sparse_attention_lowp(
    query, k_cache, v_cache, page_table, context_lens, recent_start, selected, selection_slot, num_selected, scale
):
    """`sparse_draft_attention_ref` with the matmuls in query.dtype."""
    num_q_heads = query.shape[1]
    kvh = k_cache.shape[2]
    g = num_q_heads // kvh
    out = torch.zeros_like(query)
    rows = zip(context_lens.tolist(), recent_start.tolist(), selection_slot.tolist(), num_selected.tolist())
    for row, (ctx, recent, slot, count) in enumerate(rows):
        for h in range(kvh):
            pos = torch.cat([selected[slot, h, :count].long(), torch.arange(recent, ctx, device=query.device)])
            k = _gather(k_cache, page_table[row], pos)[:, h]
            v = _gather(v_cache, page_table[row], pos)[:, h]
            visible = torch.ones(1, pos.numel(), dtype=torch.bool, device=query.device)
            out[row : row + 1, h * g : (h + 1) * g] = _attend_lowp(
                query[row : row + 1, h * g : (h + 1) * g], k, v, visible, scale
            )
    return out


def assert_attention_close(actual: torch.Tensor, expected: torch.Tensor, lowp: torch.Tensor | None, dtype) -> None:
    """fp32: the tolerance table. Lower precision: flash-attn's rule, the kernel at most 2x as far
    from the fp32 reference as torch in the same dtype, plus a small atol."""
    assert not actual.isnan().any(), "unwritten (NaN-poisoned) or NaN output"
    if dtype == torch.float32 or lowp is None:
        assert_close_to_reference(actual, expected, dtype)
        return
    err = (actual.float() - expected.float()).abs().max().item()
    base = (lowp.float() - expected.float()).abs().max().item()
    atol = TOLERANCES[dtype][1] / 4
    assert err <= 2 * base + atol, f"kernel error {err:.3g} > 2 x torch {dtype} error {base:.3g} + {atol:.1g}"
