"""Decoding keeps the heap that existed before it out of the garbage collector's full collections
(`engine.frozen_heap`, entered by `Engine.running()`), and gives it back afterwards."""

from __future__ import annotations

import gc
import weakref

import pytest
from models import tiny_model
from test_step_buffers import _build_engine

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.engine import frozen_heap


class _Node:
    """An object in a reference cycle: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def nothing_frozen():
    assert gc.get_freeze_count() == 0, "an earlier test left objects frozen"
    yield
    assert gc.get_freeze_count() == 0


def _collectable(obj) -> bool:
    """Whether `obj` is in one of the collector's generations (a frozen object is in none of them)."""
    return any(o is obj for o in gc.get_objects())


@pytest.mark.parametrize("k", [0, 3])
def test_every_step_runs_with_the_earlier_heap_frozen_and_it_is_unfrozen_after(nothing_frozen, k):
    model = tiny_model("llama", num_hidden_layers=1)
    config = SparseSpecConfig(num_draft_tokens=k, min_budget=2, page_size=4, backend="torch")
    engine, requests = _build_engine(model, [[1, 2, 3, 4], [5, 6]], config, pad=False, max_new_tokens=7)
    assert _collectable(model)
    seen_at_steps = []
    step = engine.step

    def step_and_look():
        seen_at_steps.append((gc.get_freeze_count() > 0, _collectable(model), _collectable(requests)))
        step()

    engine.step = step_and_look
    engine.run()
    assert seen_at_steps and all(frozen and not model_seen for frozen, model_seen, _ in seen_at_steps)
    assert not any(requests_seen for _, _, requests_seen in seen_at_steps)  # made before the run: frozen too
    assert _collectable(model) and _collectable(requests)  # back in the collector's generations
    assert [len(r.generated) for r in requests] == [7, 7]


def test_garbage_made_while_frozen_is_collected_and_earlier_garbage_after(nothing_frozen):
    earlier = _Node()
    earlier_ref = weakref.ref(earlier)
    with frozen_heap():
        del earlier
        made = _Node()
        made_ref = weakref.ref(made)
        del made
        gc.collect()
        assert made_ref() is None  # the collector works on what the block allocates
        assert earlier_ref() is not None  # frozen: not scanned
    gc.collect()
    assert earlier_ref() is None


def test_a_freeze_the_process_made_itself_is_left_alone(nothing_frozen):
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with frozen_heap():
            assert gc.get_freeze_count() == count
        assert gc.get_freeze_count() == count  # not unfrozen: it was not ours
    finally:
        gc.unfreeze()


def test_an_error_inside_unfreezes(nothing_frozen):
    with pytest.raises(RuntimeError, match="inside"):
        with frozen_heap():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("inside")
