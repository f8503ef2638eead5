"""A compiled forward's linears through `hf_sparsespec::linear` (`runner.TRITON_LINEARS`): the pre-grad pass
routes every linear of the graph (also the fused sibling projections, after `FuseSiblingLinears`), the
compiled model gives the eager logits and the engine the eager tokens; on the GPU, `TunedLinear` times its
candidates once per shape, outside captures only, and its outputs are the linear's."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from test_step_buffers import _run_engine

from hf_sparsespec import SparseSpecConfig, linear_ops
from hf_sparsespec import packed_projections as pp
from hf_sparsespec import runner as model_runner

PROMPTS = [[5, 17, 3, 8], [9] * 11, [40, 41, 42], [2, 7]]


@pytest.fixture
def routed_calls(monkeypatch):
    """The (tokens, out features) of every call of the op's implementation, in order."""
    calls, tuned = [], linear_ops.TUNED_LINEAR

    class Recording:
        def __call__(self, x, weight, bias):
            calls.append((x.numel() // x.shape[-1], weight.shape[0]))
            return tuned(x, weight, bias)

    monkeypatch.setattr(linear_ops, "TUNED_LINEAR", Recording())
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph skips the passes
        yield calls


def test_the_pass_routes_every_linear_of_a_compiled_model(routed_calls):
    torch._dynamo.reset()
    model = tiny_model("qwen2", num_hidden_layers=2)
    ids = torch.tensor([[3, 9, 27, 4, 8]])
    with torch.no_grad():
        expected = model(ids).logits
        with pp.packed_projections(model), torch._inductor.config.patch(
            pre_grad_custom_pass=linear_ops.PreGradPasses([pp.FuseSiblingLinears(), linear_ops.RouteLinears()])
        ):
            logits = torch.compile(model, dynamic=True)(ids).logits
    torch._dynamo.reset()
    config = model.config
    # per layer: q/k/v fused into one, o, gate/up fused into one, down; then the LM head
    qkv = config.hidden_size + 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    per_layer = [qkv, config.hidden_size, 2 * config.intermediate_size, config.hidden_size]
    assert routed_calls == [(5, n) for n in per_layer * config.num_hidden_layers + [config.vocab_size]]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_the_engine_routes_its_compiled_linears_only_when_asked_and_decodes_the_eager_tokens(routed_calls, monkeypatch):
    torch._dynamo.reset()
    model = tiny_model("qwen2", num_hidden_layers=2)
    runs = []
    for compile_forward, routed in ((False, 0), (True, 1)):
        monkeypatch.setattr(model_runner, "TRITON_LINEARS", routed)
        config = SparseSpecConfig(num_draft_tokens=3, min_budget=2, page_size=4, compile_forward=compile_forward,
                                  selection="induction_diagonal", backend="torch")  # fmt: skip
        calls_before = len(routed_calls)
        _, requests, shapes = _run_engine(model, PROMPTS, config, pad=True, max_new_tokens=16)
        runs.append([(r.generated, r.stats.accepted_histogram) for r in requests])
        assert (len(routed_calls) > calls_before) == bool(routed)
    torch._dynamo.reset()
    assert runs[0] == runs[1]


def test_the_pass_leaves_graphs_without_linears_alone():
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph
    before = [node.target for node in graph.nodes]
    linear_ops.RouteLinears()(graph)
    assert [node.target for node in graph.nodes] == before


def test_pass_identities_follow_their_parts():
    fuse, route = pp.FuseSiblingLinears(), linear_ops.RouteLinears()
    assert linear_ops.PreGradPasses([fuse, route]).uuid() == linear_ops.PreGradPasses([fuse, route]).uuid()
    assert linear_ops.PreGradPasses([fuse, route]).uuid() != linear_ops.PreGradPasses([route]).uuid()


def test_off_the_gpu_the_tuned_linear_is_the_linear():
    tuned = linear_ops.TunedLinear()
    x, weight, bias = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(tuned(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    assert tuned.choices == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_tuned_linear_times_each_shape_once_outside_captures():
    tuned = linear_ops.TunedLinear()
    x = torch.randn(136, 1536, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(8960, 1536, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(8960, device="cuda", dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(tuned(x, weight, bias), expected, rtol=2e-2, atol=2e-2)
    assert len(tuned.choices) == 1
    other = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)
    graph, static_out = torch.cuda.CUDAGraph(), None
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):  # a new shape inside a capture: cuBLAS, nothing timed or kept
        static_out = tuned(other, weight, bias)
        again = tuned(x, weight, bias)  # a known shape: its choice
    graph.replay()
    torch.testing.assert_close(static_out, torch.nn.functional.linear(other, weight, bias), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(again, expected, rtol=2e-2, atol=2e-2)
    assert len(tuned.choices) == 1
