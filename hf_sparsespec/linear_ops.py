"""A compiled forward's linears through `hf_sparsespec::linear`: per shape, the faster of cuBLAS and the
split-K Triton linear (`kernels/linear.py`), timed once.

How: `RouteLinears`, an inductor pre-grad pass (after `FuseSiblingLinears`, `PreGradPasses`), replaces
every `linear` call of the graph with the custom op. The op's implementation runs whenever the compiled
code runs eagerly (a graph's warm-up and capture; replays run no Python): the first time a shape
(tokens, features, inputs, dtype, bias or not) runs outside a capture, `TunedLinear` times cuBLAS and a
few tile configurations with CUDA events and keeps the fastest for that shape; a shape first met
inside a capture uses cuBLAS. Off the GPU, and for float32, the op is `torch.nn.functional.linear`.

The runner routes the linears only when `runner.TRITON_LINEARS` is 1 (off until measured end to end:
`_tritonlinear1` runs). The choices are a tuning cache (like Triton's autotuner's), not step state:
one per process, filled once per shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from hf_sparsespec.kernels.linear import LinearConfig, choose_linear_config
from hf_sparsespec.kernels.linear import linear as triton_linear

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


class TunedLinear:
    """`linear(x, weight, bias)` by the fastest implementation measured for the shape (module docstring)."""

    def __init__(self, repeats: int = 5):
        self.repeats = repeats
        self.choices: dict[tuple, LinearConfig | None] = {}  # shape -> Triton tiles, or None for cuBLAS

    def candidates(self, m: int, n: int, k: int, device: torch.device) -> list[LinearConfig | None]:
        from hf_sparsespec.kernels.attention_plan import num_sms

        chosen = choose_linear_config(m, n, k, num_sms(device))
        variants = [chosen, dataclasses.replace(chosen, split_k=chosen.split_k * 2),
                    dataclasses.replace(chosen, block_n=128)]  # fmt: skip
        if chosen.split_k > 1:
            variants.append(dataclasses.replace(chosen, split_k=chosen.split_k // 2))
        return [None] + list(dict.fromkeys(variants))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type != "cuda" or x.dtype not in (torch.float16, torch.bfloat16):
            return torch.nn.functional.linear(x, weight, bias)
        m, (n, k) = x.numel() // max(x.shape[-1], 1), weight.shape
        key = (m, n, k, x.dtype, bias is not None, x.device.index)
        if key not in self.choices:
            if torch.cuda.is_current_stream_capturing():
                return torch.nn.functional.linear(x, weight, bias)  # nothing can be timed inside a capture
            self.choices[key] = self.fastest(x, weight, bias, self.candidates(m, n, k, x.device))
        config = self.choices[key]
        return torch.nn.functional.linear(x, weight, bias) if config is None else triton_linear(x, weight, bias, config)

    def fastest(self, x, weight, bias, candidates: list[LinearConfig | None]) -> LinearConfig | None:
        """The candidate with the least median time over `repeats` runs (after one warm-up run each)."""
        times = []
        for config in candidates:
            run = (lambda: torch.nn.functional.linear(x, weight, bias)) if config is None else (
                lambda config=config: triton_linear(x, weight, bias, config))  # fmt: skip
            run()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(self.repeats)]  # fmt: skip
            for start, end in events:
                start.record()
                run()
                end.record()
            torch.cuda.synchronize(x.device)
            times.append(sorted(start.elapsed_time(end) for start, end in events)[self.repeats // 2])
        return candidates[min(range(len(candidates)), key=times.__getitem__)]


TUNED_LINEAR = TunedLinear()


@torch.library.custom_op("hf_sparsespec::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`torch.nn.functional.linear` by `TUNED_LINEAR`'s choice for the shape."""
    return TUNED_LINEAR(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class RouteLinears(CustomGraphPass):
    """A pre-grad pass: every plain `linear` call of the graph becomes `hf_sparsespec::linear`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _LINEARS:
                continue
            names = ("input", "weight", "bias")
            args = list(node.args) + [node.kwargs[name] for name in names[len(node.args) :] if name in node.kwargs]
            if len(args) not in (2, 3) or not set(node.kwargs) <= set(names):
                continue
            with graph.inserting_before(node):
                routed = graph.call_function(torch.ops.hf_sparsespec.linear.default, (*args[:2], args[2] if len(args) == 3 else None))
            routed.meta.update(node.meta)
            node.replace_all_uses_with(routed)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()


class PreGradPasses(CustomGraphPass):
    """Several pre-grad passes in order, as the one `pre_grad_custom_pass` inductor takes."""

    def __init__(self, passes: list[CustomGraphPass]):
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> bytes:
        return hashlib.sha256(b"".join(graph_pass.uuid() for graph_pass in self.passes)).digest()
