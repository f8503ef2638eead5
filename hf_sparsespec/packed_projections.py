"""Sibling projections packed into one weight, so that a compiled forward runs one GEMM where the
modeling code runs two or three on the same input (`q_proj`, `k_proj`, `v_proj`; `gate_proj`,
`up_proj`).

Why: at 64 rows an iteration reads all the weights for ~120 tokens, and the small projections are
latency-bound launches (on the H100 the k and v projections of Qwen2.5-1.5B take ~5 us each for
0.8 MB, the q projection ~6 us; docs/measurements.md 31). One GEMM over the three reads the same bytes
in one launch. The modeling code is not forked: it keeps calling its three `nn.Linear`s.

How, in two parts that only work together:
- `packed_projections(model)` (for one `generate`): each group's weights (and biases) are copied into
  one buffer, rows one after another, and each parameter's `.data` becomes its view of it (the
  `Parameter` objects stay the same). On exit every parameter gets a storage of its own again, so the
  model is left as it was found.
- `FuseSiblingLinears`, an inductor pre-grad pass: linears of one input whose weights the compiled
  graph's example tensors show to be such adjacent views of one storage (and whose biases are, or are
  all None) become one `linear` over a strided view that spans the group from its first weight, and a
  split. It fuses nothing it cannot prove adjacent, so it is inert on unpacked weights.

Invariant: a graph compiled with fused groups reads past each group's first weight, so it must only run
while the weights are packed. Dynamo does not guard on storage adjacency, so the runner compiles
through `call_packed` when it packs: those graphs are cached under that code object, apart from the
forward's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
from collections import defaultdict
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.multiprocessing.reductions import StorageWeakRef

SIBLING_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


def sibling_groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """The groups of plain `nn.Linear` projections of one module that `packed_projections` packs:
    same input features, dtype and device, all with a bias or none, dense contiguous weights."""
    groups = []
    for module in model.modules():
        for names in SIBLING_PROJECTIONS:
            linears = [getattr(module, name, None) for name in names]
            if all(type(linear) is torch.nn.Linear for linear in linears) and _packable(linears):
                groups.append(linears)
    return groups


def _packable(linears: list[torch.nn.Linear]) -> bool:
    first = linears[0]
    for linear in linears:
        params = [linear.weight] + ([linear.bias] if linear.bias is not None else [])
        if (linear.bias is None) != (first.bias is None) or linear.in_features != first.in_features:
            return False
        if any(type(p) is not torch.nn.Parameter or not p.is_contiguous() or p.device.type == "meta"
               or p.dtype != first.weight.dtype or p.device != first.weight.device for p in params):  # fmt: skip
            return False
    return True


@contextlib.contextmanager
def packed_projections(model: torch.nn.Module):
    """Pack every sibling group's weights and biases into one buffer each (see the module docstring);
    yields the number of groups packed, and gives every packed parameter its own storage again on exit,
    also when packing itself fails part-way (out of memory for a group's buffer: the error propagates
    and the model is left as it was found)."""
    groups = sibling_groups(model)
    params = [[getattr(linear, name) for linear in group] for group in groups for name in ("weight", "bias")]
    params = [group for group in params if group[0] is not None]
    packed_groups = []
    try:
        with torch.no_grad():
            for group in params:
                packed = torch.cat([p.data for p in group])  # rows of the first, then the next, ...
                start = 0
                for p in group:
                    p.data = packed[start : start + p.shape[0]]
                    start += p.shape[0]
                packed_groups.append(group)
        yield len(groups)
    finally:
        with torch.no_grad():
            for group in packed_groups:
                for p in group:
                    p.data = p.data.clone()


def call_packed(function, *args, **kwargs):
    """`function(*args, **kwargs)`. The runner compiles its forward through this frame while the
    projections are packed: dynamo keeps a code object's compiled graphs together and does not guard on
    storage adjacency, so the graphs with fused projections live under this code object and never run on
    unpacked weights (those compile under the forward's own code)."""
    return function(*args, **kwargs)


class FuseSiblingLinears(CustomGraphPass):
    """The pre-grad pass (see the module docstring): `torch._inductor.config.pre_grad_custom_pass`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        by_input = defaultdict(list)  # input node -> its linears, in graph order
        for node in graph.nodes:
            args = _linear_args(node) if node.op == "call_function" and node.target in _LINEARS else None
            if args is not None:
                by_input[args[0]].append(node)
        for nodes in by_input.values():
            for run in _adjacent_runs(nodes):
                _fuse(graph, run, earliest=next(node for node in nodes if node in run))

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()


def _linear_args(node: torch.fx.Node):
    """`(input, weight, bias)` of a linear node, or None for an unusual call."""
    names = ("input", "weight", "bias")
    args = list(node.args) + [node.kwargs[name] for name in names[len(node.args) :] if name in node.kwargs]
    if len(args) == 2:
        args.append(None)
    return tuple(args) if len(args) == 3 and set(node.kwargs) <= set(names) else None


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _adjacent_runs(nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Runs of >= 2 linears (of one input) whose weights follow each other in one storage, rows after
    rows, with biases that do too or are all None."""
    by_storage = defaultdict(list)  # weight storage -> its linears' keys, in graph order
    for node in nodes:
        _, weight, bias = _linear_args(node)
        w, b = _example(weight), _example(bias)
        if w is None or w.ndim != 2 or not w.is_contiguous() or (bias is not None and (b is None or b.ndim != 1)):
            continue
        storage = StorageWeakRef(w.untyped_storage())
        by_storage[storage].append((storage, w.storage_offset(), node, w, b))
    runs = []
    for keyed in by_storage.values():
        members = sorted(keyed, key=lambda k: k[1])
        run = [members[0]]
        for previous, current in zip(members, members[1:]):
            if _follows(previous, current):
                run.append(current)
            else:
                runs.append(run)
                run = [current]
        runs.append(run)
    return [[key[2] for key in run] for run in runs if len(run) >= 2]


def _follows(previous, current) -> bool:
    _, offset, _, w, b = previous
    _, next_offset, _, next_w, next_b = current
    if next_offset != offset + w.numel() or next_w.shape[1] != w.shape[1] or next_w.dtype != w.dtype:
        return False
    if (b is None) != (next_b is None):
        return False
    return b is None or (
        StorageWeakRef(b.untyped_storage()) == StorageWeakRef(next_b.untyped_storage())
        and b.is_contiguous() and next_b.storage_offset() == b.storage_offset() + b.numel()
    )  # fmt: skip


def _fuse(graph: torch.fx.Graph, run: list[torch.fx.Node], earliest: torch.fx.Node) -> None:
    """One linear over the run's strided span (`run` in storage order) and a split, in place of the
    run's linears, inserted before the first of them in the graph (`earliest`)."""
    x, first_weight, first_bias = _linear_args(run[0])
    sizes = [_example(_linear_args(node)[1]).shape[0] for node in run]
    rows, features = sum(sizes), _example(first_weight).shape[1]
    with graph.inserting_before(earliest):
        weight = graph.call_function(torch.as_strided, (first_weight, (rows, features), (features, 1)))
        bias = graph.call_function(torch.as_strided, (first_bias, (rows,), (1,))) if first_bias is not None else None
        fused = graph.call_function(torch._C._nn.linear, (x, weight, bias))
        parts = graph.call_function(torch.split, (fused, sizes), {"dim": -1})
        outputs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(run))]
    _set_examples(x, first_weight, first_bias, weight, bias, fused, parts, outputs, rows, features, sizes)
    for node, output in zip(run, outputs):
        node.replace_all_uses_with(output)
        graph.erase_node(node)


def _set_examples(x, first_weight, first_bias, weight, bias, fused, parts, outputs, rows, features, sizes) -> None:
    """The new nodes' example values (later pre-grad passes read them), under the graph's fake mode."""
    examples = [_example(x), _example(first_weight)] + ([_example(first_bias)] if first_bias is not None else [])
    mode = getattr(examples[1], "fake_mode", None)  # the graph's own (not whichever mode is active)
    with mode if mode is not None else contextlib.nullcontext():
        weight.meta["example_value"] = torch.as_strided(examples[1], (rows, features), (features, 1))
        if bias is not None:
            bias.meta["example_value"] = torch.as_strided(examples[2], (rows,), (1,))
        bias_value = bias.meta["example_value"] if bias is not None else None
        fused.meta["example_value"] = torch.nn.functional.linear(examples[0], weight.meta["example_value"], bias_value)
        split = torch.split(fused.meta["example_value"], sizes, dim=-1)
        parts.meta["example_value"] = split
        for output, value in zip(outputs, split):
            output.meta["example_value"] = value
