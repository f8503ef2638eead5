"""Sibling projections packed into one weight (`pack_projections`): the packing leaves values and
`Parameter` objects alone and is undone on exit; the pre-grad pass fuses exactly the packed groups (one
GEMM for q, k and v, one for gate and up) and nothing on unpacked weights; the engine's compiled
forward with packed projections decodes the eager tokens, and an unpacked compiled run after a packed one
in the same process compiles graphs of its own."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils
from models import tiny_model
from test_step_buffers import _build_engine, _run_engine

from hf_sparsespec import SparseSpecConfig
from hf_sparsespec import packed_projections as pp

PROMPTS = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7]]


@pytest.fixture
def fused_runs(monkeypatch):
    """The sizes of the runs of linears the pass fuses, in order (no compiled graph from a cache: a hit
    skips the pre-grad passes)."""
    runs, fuse = [], pp._fuse
    monkeypatch.setattr(pp, "_fuse", lambda graph, run, **kw: (runs.append(len(run)), fuse(graph, run, **kw))[1])
    with torch._inductor.config.patch(force_disable_caches=True):
        yield runs


def _storage(param: torch.Tensor) -> int:
    return param.untyped_storage().data_ptr()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # q, k, v with biases; without
def test_packing_makes_adjacent_views_and_restores_own_storages(arch):
    model = tiny_model(arch)
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    siblings = [attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj]
    params = [p for linear in siblings for p in (linear.weight, linear.bias) if p is not None]
    values = [p.detach().clone() for p in params]
    with pp.packed_projections(model) as groups:
        assert groups == 2 * len(model.model.layers)
        q, k, v = (linear.weight for linear in siblings[:3])
        assert _storage(q) == _storage(k) == _storage(v) != _storage(siblings[3].weight)
        assert k.storage_offset() == q.numel() and v.storage_offset() == q.numel() + k.numel()
        assert siblings[4].weight.storage_offset() == siblings[3].weight.numel()
        if arch == "qwen2":
            assert _storage(attention.q_proj.bias) == _storage(attention.v_proj.bias) != _storage(q)
        assert all(torch.equal(p, value) for p, value in zip(params, values))
    assert [p for linear in siblings for p in (linear.weight, linear.bias) if p is not None] == params  # same objects
    assert len({_storage(p) for p in params}) == len(params)  # each its own storage again
    assert all(torch.equal(p, value) for p, value in zip(params, values))


def test_a_packing_that_fails_part_way_leaves_the_model_as_it_was(monkeypatch):
    """Out of memory for the third group's buffer: the error reaches the caller, and the two groups
    packed before it get their own storages back, with their values."""
    model = tiny_model("qwen2")
    params = [p for group in pp.sibling_groups(model) for linear in group for p in (linear.weight, linear.bias)
              if p is not None]  # fmt: skip
    values = [p.detach().clone() for p in params]
    cat, calls = torch.cat, []

    def failing_cat(tensors, *args, **kwargs):
        calls.append(len(tensors))
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", failing_cat)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"), pp.packed_projections(model):
        pytest.fail("the body must not run when packing failed")
    monkeypatch.setattr(torch, "cat", cat)
    assert len(calls) == 3
    assert len({_storage(p) for p in params}) == len(params)  # each its own storage again
    assert all(torch.equal(p, value) for p, value in zip(params, values))


def test_only_matching_siblings_are_packed():
    model = tiny_model("llama")
    model.model.layers[0].self_attn.v_proj.to(torch.float64)  # another dtype: not that layer's q, k, v
    model.model.layers[1].mlp.up_proj = torch.nn.Identity()  # not a linear: not that layer's gate and up
    groups = pp.sibling_groups(model)
    assert len(groups) == 2
    assert [len(group) for group in groups] == [2, 3]  # layer 0's gate and up, layer 1's q, k, v


def test_the_pass_fuses_packed_siblings_only(fused_runs):
    model = tiny_model("qwen2")
    ids = torch.randint(1, 90, (1, 9))
    with torch.no_grad():
        expected = model(ids).logits
        torch._dynamo.reset()
        with torch._inductor.config.patch(pre_grad_custom_pass=pp.FuseSiblingLinears()):
            unpacked = torch.compile(model, dynamic=True)(ids).logits
            assert fused_runs == []
            torch._dynamo.reset()
            with pp.packed_projections(model):
                packed = torch.compile(model, dynamic=True)(ids).logits
    # per layer and compilation one run of q, k, v and one of gate, up
    assert set(fused_runs) == {2, 3} and fused_runs.count(3) == fused_runs.count(2)
    assert fused_runs.count(3) % len(model.model.layers) == 0
    torch.testing.assert_close(packed, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(unpacked, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("compile_forward", [True, "layers"], ids=["whole", "layers"])
def test_compiled_forward_with_packed_projections_decodes_the_eager_tokens(compile_forward, fused_runs):
    """Greedy: eager, then compiled with packed projections, then compiled without, then packed again
    (in that order, one process): the same tokens and acceptance; the packed run fused every layer's
    groups, the unpacked one nothing, and it compiled graphs of its own rather than replaying the fused
    ones; the second packed run, on new buffers of the same layout, replays the first's graphs."""
    torch._dynamo.reset()
    model = tiny_model("qwen2", num_hidden_layers=3)
    runs, graphs, fused = [], [], []
    # the default (None) packs exactly when the forward is compiled
    for mode, pack in ((False, None), (compile_forward, None), (compile_forward, False), (compile_forward, True)):
        config = SparseSpecConfig(num_draft_tokens=4, min_budget=2, page_size=4, compile_forward=mode,
                                  pack_projections=pack, selection="induction_diagonal", backend="torch")  # fmt: skip
        before, runs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"], len(fused_runs)
        engine, requests, shapes = _run_engine(model, PROMPTS, config, pad=True, max_new_tokens=20)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        fused.append(fused_runs[runs_before:])
        runs.append([(r.generated, r.stats.accepted_histogram) for r in requests])
    assert runs[0] == runs[1] == runs[2] == runs[3]
    assert fused[0] == [] and fused[2] == [] and fused[3] == [] and graphs[3] == 0
    assert set(fused[1]) == {2, 3} and fused[1].count(2) == fused[1].count(3)  # each graph: every q, k, v; gate, up
    assert graphs[1] > 0 and graphs[2] > 0
    q, k = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj
    assert _storage(q.weight) != _storage(k.weight)  # unpacked after each run


def test_stepping_by_hand_inside_running_packs_as_run_does():
    """`Engine.running()` (what `run` holds, and benchmarks that call `step` themselves enter) packs the
    projections when the config does, and unpacks them on exit; without packing it leaves them alone."""
    model = tiny_model("qwen2", num_hidden_layers=2)
    q, k = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj
    for pack in (None, False):
        config = SparseSpecConfig(num_draft_tokens=2, min_budget=2, page_size=4, compile_forward=True,
                                  pack_projections=pack, backend="torch")  # fmt: skip
        engine, _ = _build_engine(model, PROMPTS, config, pad=True, max_new_tokens=4)
        with engine.running():
            assert (_storage(q.weight) == _storage(k.weight)) is config.packs_projections
            assert not torch.is_grad_enabled()
        assert _storage(q.weight) != _storage(k.weight)


def test_pack_projections_needs_the_compiled_forward():
    with pytest.raises(ValueError, match="compile_forward=True"):
        SparseSpecConfig(pack_projections=True)
    with pytest.raises(ValueError, match="pack_projections must be a bool or None"):
        SparseSpecConfig(pack_projections="yes", compile_forward=True)


@pytest.mark.parametrize(("compile_forward", "pack", "packs"), [
    (False, None, False), (True, None, True), ("layers", None, True), (True, False, False), (True, True, True),
    ("layers", False, False), (False, False, False),
])  # fmt: skip
def test_the_default_packs_whenever_the_forward_is_compiled(compile_forward, pack, packs):
    config = SparseSpecConfig(compile_forward=compile_forward, pack_projections=pack)
    assert config.packs_projections is packs


@pytest.mark.parametrize(("autotune", "pdl"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_the_compiled_forward_autotunes_its_gemms_and_launches_dependent_only_when_asked(autotune, pdl, monkeypatch):
    """`runner.AUTOTUNE_GEMMS` and `runner.INDUCTOR_PDL` reach inductor's config around every compiled call
    (read when it compiles), beside the sibling-projection pass, and inductor's config is as it was after
    the run."""
    from hf_sparsespec import runner as model_runner

    monkeypatch.setattr(model_runner, "AUTOTUNE_GEMMS", autotune)
    monkeypatch.setattr(model_runner, "INDUCTOR_PDL", pdl)
    model = tiny_model("qwen2", num_hidden_layers=2)
    config = SparseSpecConfig(num_draft_tokens=2, min_budget=2, page_size=4, compile_forward=True,
                              selection="induction_diagonal", backend="torch")  # fmt: skip
    seen = []
    inductor = torch._inductor.config

    def build_engine(*args, **kwargs):  # the compiled call replaced by the eager one, which records the config
        engine, requests = original(*args, **kwargs)
        eager = engine.runner._model_logits

        def recording(*call_args):
            seen.append((inductor.max_autotune_gemm, inductor.triton.enable_pdl, inductor.pre_grad_custom_pass))
            return eager(*call_args)

        engine.runner.compiled_forward = recording
        return engine, requests

    import test_step_buffers

    original = test_step_buffers._build_engine
    monkeypatch.setattr(test_step_buffers, "_build_engine", build_engine)
    _run_engine(model, PROMPTS, config, pad=True, max_new_tokens=8)
    assert seen and {(autotune_gemm, launch_pdl) for autotune_gemm, launch_pdl, _ in seen} == {(bool(autotune), bool(pdl))}
    assert all(isinstance(fusing, pp.FuseSiblingLinears) for _, _, fusing in seen)
    assert inductor.max_autotune_gemm is False and inductor.triton.enable_pdl is False
    assert inductor.pre_grad_custom_pass is None


def test_dependent_launches_without_inductor_support_fail_clearly(monkeypatch):
    """A torch whose inductor has no `triton.enable_pdl` (before 2.10) is told so, not silently run without."""
    from hf_sparsespec import runner as model_runner

    monkeypatch.setattr(model_runner, "INDUCTOR_PDL", 1)
    monkeypatch.delattr(torch._inductor.config.triton, "enable_pdl")
    model = tiny_model("qwen2", num_hidden_layers=2)
    config = SparseSpecConfig(num_draft_tokens=2, min_budget=2, page_size=4, compile_forward=True,
                              selection="induction_diagonal", backend="torch")  # fmt: skip
    with pytest.raises(NotImplementedError, match="triton.enable_pdl"):
        _run_engine(model, PROMPTS, config, pad=True, max_new_tokens=8)
