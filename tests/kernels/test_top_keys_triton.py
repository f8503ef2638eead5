"""select_top_keys_into (Triton, both threshold searches) against the reference selection: the same sets on continuous scores
(ranked at bfloat16 precision, so with many ties: both give the lowest positions), a valid top set
(and the lowest positions) on exact ties, budgets of 0 / all keys / more than the keys, rows
of no keys, widths across block edges, and writes confined to each row's slot and budget."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import i32, poison_outputs  # noqa: F401

from hf_sparsespec.kernels import top_keys
from hf_sparsespec.kernels.top_keys import select_top_keys, select_top_keys_into

# (num_old_keys, budget) per row: block edges (256, 1024 and 2048, the launch configs; 512), all keys, more than
# all, none, one.
ROWS = [(700, 35), (256, 17), (257, 257), (90, 200), (0, 5), (1, 1), (513, 0), (40, 39), (512, 259), (1025, 240),
        (2049, 255)]  # fmt: skip


def _store(num_slots, num_kv_heads, max_budget, device):
    return torch.full((num_slots, num_kv_heads, max_budget), -7, dtype=torch.int32, device=device)


@pytest.fixture(
    params=[(256, "histogram"), (2048, "histogram"), (256, "thresholds"), (1024, "thresholds")],
    ids=["block256-histogram", "block2048-histogram", "block256-thresholds", "block1024-thresholds"],
)
def launch(request, device, monkeypatch):
    """Both the interpreter's and the GPU's launch config, and both threshold searches, on any device."""
    block, search = request.param
    config = dict(BLOCK=block, num_warps={256: 4, 1024: 8, 2048: 16}[block])
    monkeypatch.setitem(top_keys.LAUNCH, device.type, config)
    monkeypatch.setitem(top_keys.SEARCH, device.type, search)
    return config


@pytest.mark.parametrize("spread", ["uniform", "lognormal"])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_matches_reference_on_continuous_scores(device, num_kv_heads, spread, launch):
    """Uniform scores share a few exponents (the histogram's high digit); log-normal ones, like
    attention probabilities, span dozens of them."""
    num_old = [n for n, _ in ROWS]
    budgets = [b for _, b in ROWS]
    width, max_budget = max(num_old) + 3, 260
    scores = torch.rand(len(ROWS), num_kv_heads, width, device=device)  # >= 0; ties at bf16 precision
    if spread == "lognormal":
        scores = torch.exp(torch.randn(len(ROWS), num_kv_heads, width, device=device) * 8 - 10)
    slots = torch.randperm(len(ROWS) + 3, device=device)[: len(ROWS)]
    store = _store(len(ROWS) + 3, num_kv_heads, max_budget, device)
    select_top_keys_into(scores, i32(num_old, device), i32(budgets, device), store, slots)
    masked = scores.clone()
    for row, n in enumerate(num_old):
        masked[row, :, n:] = float("-inf")
    expected = select_top_keys(masked, i32([min(b, n) for n, b in ROWS], device), max_budget)
    for row, (n, b) in enumerate(ROWS):
        kept = min(b, n)
        assert torch.equal(store[slots[row], :, :kept], expected[row, :, :kept]), row
        assert (store[slots[row], :, kept:] == -7).all()  # nothing written past the budget
    untouched = sorted(set(range(len(ROWS) + 3)) - set(slots.tolist()))
    assert (store[untouched] == -7).all()


def test_ties_give_a_valid_top_set_with_the_lowest_positions(device, launch):
    """Scores quantized to a few values: the kept set is a top-B set and, at the threshold value,
    takes the lowest positions."""
    num_old, budget = 600, 50
    scores = (torch.randint(0, 6, (2, 2, num_old), device=device).float() / 8).contiguous()
    store = _store(2, 2, 64, device)
    select_top_keys_into(scores, i32([num_old, num_old], device), i32([budget, budget], device), store,
                         torch.tensor([0, 1], device=device))  # fmt: skip
    for row in range(2):
        for head in range(2):
            kept = store[row, head, :budget].long()
            assert torch.equal(kept, kept.sort().values) and kept.unique().numel() == budget
            values = scores[row, head]
            threshold = values[kept].min()
            mask = torch.ones(num_old, dtype=torch.bool, device=device)
            mask[kept] = False
            assert (values[mask] <= threshold).all()  # nothing better was left out
            ties = torch.nonzero(values == threshold).flatten()
            taken = kept[values[kept] == threshold]
            assert torch.equal(taken, ties[: taken.numel()])  # the lowest positions among the ties


def test_every_layer_in_one_launch_equals_one_launch_per_layer(device):
    """The engine's form: scores and store with a leading layer dimension (a slice of the workspace's
    rows, so the layers are not contiguous with each other), each layer selected as its own launch
    would, and nothing written to other slots or past the budget in any layer."""
    num_layers, num_kv_heads, max_budget = 3, 2, 64
    rows = [(700, 35), (90, 60), (0, 5), (300, 64)]
    num_old, budgets = i32([n for n, _ in rows], device), i32([b for _, b in rows], device)
    workspace = torch.exp(torch.randn(num_layers, len(rows) + 2, num_kv_heads, 720, device=device) * 6 - 8)
    scores = workspace[:, : len(rows)]  # as the runner slices its verification rows
    slots = torch.tensor([5, 0, 2, 3], device=device)
    together = torch.full((num_layers, 7, num_kv_heads, max_budget), -7, dtype=torch.int32, device=device)
    select_top_keys_into(scores, num_old, budgets, together, slots)
    apart = torch.full_like(together, -7)
    for layer in range(num_layers):
        select_top_keys_into(scores[layer], num_old, budgets, apart[layer], slots)
    assert torch.equal(together, apart)
    for layer in range(num_layers):  # and each layer is its own scores' top keys, not another layer's
        masked = scores[layer].clone()
        for row, (n, _) in enumerate(rows):
            masked[row, :, n:] = float("-inf")
        expected = select_top_keys(masked, torch.minimum(budgets, num_old), max_budget)
        for row, (n, b) in enumerate(rows):
            kept = min(n, b)
            assert torch.equal(together[layer, slots[row], :, :kept], expected[row, :, :kept]), (layer, row)
    assert (together[:, [1, 4, 6]] == -7).all()


def test_layer_dimensions_must_agree(device):
    scores = torch.rand(2, 1, 1, 8, device=device)
    store = torch.zeros((3, 1, 1, 4), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="selected"):
        select_top_keys_into(scores, i32([8], device), i32([2], device), store, torch.tensor([0], device=device))
