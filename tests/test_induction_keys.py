"""The `"induction"` selection: the per-step lookup of the successors of the draft token's earlier
occurrences (against a per-row Python loop), the store writes, and the engine attending them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import assert_greedy_equal, ragged_batch, tiny_model

import hf_sparsespec  # noqa: F401  (registers the strategy)
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.kernels.backend import TorchBackend
from hf_sparsespec.kernels.induction_keys import induction_offsets, write_induction_offsets
from hf_sparsespec.kernels.moved_keys import NO_OFFSET
from hf_sparsespec.kernels.triton_backend import TritonBackend


def loop_reference(tokens, slots, paddings, positions, recent_starts, num_entries):
    """Row by row: the positions j + 1 (latest first) with tokens[j] == the row's token at `position`,
    0 <= j and j + 1 < recent_start, as offsets from the position."""
    out = []
    for slot, padding, q, recent in zip(slots, paddings, positions, recent_starts):
        row = tokens[slot]
        token = row[padding + q]
        found = [j + 1 for j in range(len(row) - padding - 1) if row[padding + j] == token and j + 1 < recent]
        found = sorted(found, reverse=True)[:num_entries]
        out.append([key - q for key in found] + [NO_OFFSET] * (num_entries - len(found)))
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 5),  # slots
    st.integers(3, 40),  # width
    st.integers(1, 6),  # entries
    st.integers(2, 5),  # vocabulary (small: many matches)
    st.data(),
)
def test_offsets_match_the_loop_reference(num_slots, width, num_entries, vocab, data):
    tokens = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=width, max_size=width),
                                             min_size=num_slots, max_size=num_slots)))  # fmt: skip
    num_rows = data.draw(st.integers(1, 6))
    slots, paddings, positions, recents = [], [], [], []
    for _ in range(num_rows):
        slot = data.draw(st.integers(0, num_slots - 1))
        padding = data.draw(st.integers(0, width - 1))
        q = data.draw(st.integers(0, width - 1 - padding))  # the token read sits inside the row
        slots.append(slot), paddings.append(padding), positions.append(q)
        recents.append(data.draw(st.integers(0, q + 1)))
    row_base = torch.tensor([s * width + p for s, p in zip(slots, paddings)])
    input_index = row_base + torch.tensor(positions)
    got = induction_offsets(tokens, input_index, row_base, torch.tensor(recents, dtype=torch.int32), num_entries)
    assert got.dtype == torch.int32 and got.shape == (num_rows, num_entries)
    assert got.tolist() == loop_reference(tokens.tolist(), slots, paddings, positions, recents, num_entries)


def test_offsets_point_at_successors_of_the_latest_matches():
    # slot 1, two columns of left padding; position p holds row[2 + p]
    tokens = torch.tensor([[0] * 12, [5, 5, 7, 1, 7, 2, 3, 7, 4, 9, 7, 6]])
    # the draft reads position 8 (a 7); old keys below 7: 7 occurs at positions 0, 2, 5 (and 8 itself)
    offsets = induction_offsets(tokens, torch.tensor([12 + 2 + 8]), torch.tensor([14]), torch.tensor([7]), 4)
    assert offsets.tolist() == [[6 - 8, 3 - 8, 1 - 8, NO_OFFSET]]  # successors 6, 3, 1, latest first
    # the padding's 5s never match a 5 read at position 0
    offsets = induction_offsets(torch.tensor([[5, 5, 5, 1]]), torch.tensor([2]), torch.tensor([2]), torch.tensor([1]), 2)
    assert offsets.tolist() == [[NO_OFFSET, NO_OFFSET]]


def test_store_writes_every_layer_and_head_of_the_slot():
    store = torch.full((3, 4, 2, 2), -1, dtype=torch.int32)
    write_induction_offsets(store, torch.tensor([2, 0]), torch.tensor([[5, 6], [7, 8]], dtype=torch.int32))
    assert (store[:, 2] == torch.tensor([5, 6], dtype=torch.int32)).all()
    assert (store[:, 0] == torch.tensor([7, 8], dtype=torch.int32)).all()
    assert (store[:, [1, 3]] == -1).all()


def test_store_drops_the_offsets_the_diagonal_entries_hold():
    """Per layer and KV head: an induction offset the slot's diagonal list holds already becomes NO_OFFSET
    (the Triton draft kernels do not look for repeats within a list), the others are written as looked up."""
    store = torch.full((2, 3, 2, 5), -1, dtype=torch.int32)
    diagonal, induction = store[..., :2], store[..., 2:]
    diagonal[0, 1, 0] = torch.tensor([-4, -9], dtype=torch.int32)  # layer 0, slot 1, head 0 holds -4 and -9
    diagonal[1, 1, 1] = torch.tensor([-7, NO_OFFSET], dtype=torch.int32)
    write_induction_offsets(induction, torch.tensor([1]), torch.tensor([[-4, -7, -9]], dtype=torch.int32), diagonal)
    assert induction[0, 1, 0].tolist() == [NO_OFFSET, -7, NO_OFFSET]
    assert induction[0, 1, 1].tolist() == [-4, -7, -9]
    assert induction[1, 1, 0].tolist() == [-4, -7, -9]
    assert induction[1, 1, 1].tolist() == [-4, NO_OFFSET, -9]
    assert (store[:, [0, 2]] == -1).all() and diagonal[0, 1, 0].tolist() == [-4, -9]


def spy_on_induction_writes(monkeypatch, record) -> None:
    """Call `record(moved_offsets, num_taken, token_buffer, input_index, row_base, recent_start)` before
    every backend's `write_induction_keys`."""
    for backend in (TorchBackend, TritonBackend):
        original = backend.write_induction_keys

        def spy(self, *args, original=original):
            record(*args)
            original(self, *args)

        monkeypatch.setattr(backend, "write_induction_keys", spy)


K4 = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, selection="induction", num_induction_keys=4)
# every verification refreshes, so that the recent window follows the drafts and the repeated prompt tokens'
# matches fall before it (with the default 4, the 12 tokens of the Triton case stay in the first window)
NAIVE_SYNC = SparseSpecConfig(num_draft_tokens=6, min_budget=2, page_size=2, selection="induction", scheduler="naive",
                              delayed_verification=False, selection_refresh_interval=1)  # fmt: skip
ADAPTIVE = SparseSpecConfig(num_draft_tokens=5, min_budget=3, page_size=8, selection="induction_diagonal",
                            adaptive_draft_tokens=True)  # fmt: skip  # adaptive cycles with both kinds of extra keys


@pytest.mark.parametrize(
    ("config", "backend"),
    [(K4, "torch"), (NAIVE_SYNC, "torch"), (ADAPTIVE, "torch"), (K4, "triton"), (NAIVE_SYNC, "triton")],
    ids=["k4-torch", "k6-naive-sync-torch", "k5-adaptive-diagonal-torch", "k4-triton", "k6-naive-sync-triton"],
)
def test_greedy_equals_plain_generate_and_the_lookups_find_keys(config, backend, monkeypatch):
    """Lossless (greedy = plain `generate`) while the drafts really attend induction keys: a repetitive
    prompt gives every lookup matches (some old, so attended). The Triton backend (the interpreter on
    CPU, ~25 s a case) runs the delayed and the synchronous schedule."""
    found = []

    def looked_up(moved_offsets, num_taken, token_buffer, input_index, row_base, recent_start):
        offsets = induction_offsets(token_buffer, input_index, row_base, recent_start, moved_offsets.shape[-1] - num_taken)
        found.append(int((offsets != NO_OFFSET).sum()))

    spy_on_induction_writes(monkeypatch, looked_up)
    model = tiny_model("qwen2")
    ids, mask = ragged_batch([9, 14, 5])
    ids[:, -6:] = torch.tensor([3, 4, 5, 3, 4, 5])  # repeated tokens: matches from the start
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24 if backend == "torch" else 12,
                              do_sample=False)  # fmt: skip
    config = dataclasses.replace(config, backend=backend)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=expected.shape[1] - ids.shape[1],
                             do_sample=False, generation_strategy="sparsespec", sparsespec_config=config,
                             return_dict_in_generate=True)  # fmt: skip
    assert_greedy_equal(model, expected, out.sequences, mask)
    assert out.sparsespec_stats.total.cycles > 0
    assert found and sum(found) > 0


COMBINED = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, selection="induction_diagonal",
                            num_induction_keys=3)  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_induction_diagonal_fills_both_parts_of_the_store_and_equals_plain_generate(backend, monkeypatch):
    """`"induction_diagonal"`: the verifications write the store's first (k + 1) x group entries (the
    diagonal's moved keys) and the lookups the last `num_induction_keys`, neither clobbering the other,
    and greedy still equals plain `generate`."""
    from hf_sparsespec.attention import use_attention
    from hf_sparsespec.engine import Engine
    from hf_sparsespec.results import StopChecker
    from hf_sparsespec.sampling import LogitsPipeline
    from hf_sparsespec.scheduler import Request

    widths = []  # of the store parts the lookups write: the induction part alone
    spy_on_induction_writes(monkeypatch, lambda store, num_taken, *rest: widths.append(store.shape[-1] - num_taken))
    model = tiny_model("qwen2")
    ids, mask = ragged_batch([9, 14, 5])
    ids[:, -6:] = torch.tensor([3, 4, 5, 3, 4, 5])
    new_tokens = 20 if backend == "torch" else 10
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    config = dataclasses.replace(COMBINED, backend=backend)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             generation_strategy="sparsespec", sparsespec_config=config)  # fmt: skip
    assert_greedy_equal(model, expected, out, mask)

    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    requests = [Request(i, p, new_tokens, batch_row=i) for i, p in enumerate(prompts)]
    engine = Engine(model, requests, config, LogitsPipeline([]), False, StopChecker(set(), [], torch.device("cpu")))
    diagonal = (config.num_draft_tokens + 1) * (model.config.num_attention_heads // model.config.num_key_value_heads)
    store = engine.cache.moved_offsets
    assert store.shape[-1] == diagonal + config.num_induction_keys
    seen = {"diagonal": 0, "induction": 0}
    step = engine.step

    def step_and_look():
        step()
        slots = store[:, : engine.layout.num_slots]
        seen["diagonal"] = max(seen["diagonal"], int((slots[..., :diagonal] != NO_OFFSET).sum()))
        seen["induction"] = max(seen["induction"], int((slots[..., diagonal:] != NO_OFFSET).sum()))

    engine.step = step_and_look
    with use_attention(model), torch.no_grad():
        engine.run()
    assert seen["diagonal"] > 0 and seen["induction"] > 0
    assert widths and set(widths) == {config.num_induction_keys}
    assert [r.generated for r in requests] == [out[i, ids.shape[1] :].tolist() for i in range(len(prompts))]
