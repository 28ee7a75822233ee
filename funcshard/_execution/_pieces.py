"""A traced step compiled in pieces: each distinct region once, and the computation between the
collectives in segments; the graph around them runs as traced.

[Note: a step compiled in pieces]
Inductor's work on a graph -- AOTAutograd's functionalizing pass over it, lowering, scheduling
-- grows with the graph's nodes: a step of 16 blocks compiled as one graph takes about four
times as long as one of 4, though the blocks are the same. What changes from block to block is
the scheduler's part -- gathers, copies in and out of the flat buffers, reduce-scatters, the
optimizer's kernels -- which inductor does not fuse anyway (collectives and funcshard's
operators are calls in its code). So ``fs.jit`` compiles what it can fuse, once per distinct
graph:

* each region's body (a block's forward, a block's backward: see [Note: identical groups
  compiled once] in ``_regions``) is compiled once, however many blocks call it;
* each *segment* -- a run of pure ATen operators between collectives, funcshard's operators and
  regions, with some real computation in it (the embedding's backward, the head, the loss, a
  step over ``fs.unshard`` whole) -- is compiled on its own;

and the traced graph calls the compiled pieces in its order. The cost of compiling is then that
of the distinct pieces, the same at any depth, and each piece is found in inductor's caches by
its graph. What stays outside the pieces runs as traced, one call per operation: views,
collectives and their waits, funcshard's copy and optimizer operators, in-place operators and
random ones (which then draw the eager step's numbers).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from torch import fx

# operators that move or view data but compute nothing: a segment of only these is not compiled
_TRIVIAL = frozenset(
    {"view", "_unsafe_view", "detach", "t", "permute", "expand", "alias", "as_strided", "slice",
     "select", "split", "split_with_sizes", "squeeze", "unsqueeze", "reshape", "transpose",
     "clone", "empty", "new_empty", "arange", "cat", "ones_like", "zeros_like", "full"}
)  # fmt: skip
_HEAVY = 8  # a segment is compiled from this many operators that compute
_PROFILER = "profiler"  # record_function nodes: spans, not data; segments pass over them


class Compiled(torch.nn.Module):
    """A compiled piece, called by the graph (``call_module``)."""

    def __init__(self, fn: Callable, what: str) -> None:
        super().__init__()
        self.fn, self.what = fn, what

    def forward(self, *args: torch.Tensor):
        return self.fn(*args)

    def extra_repr(self) -> str:
        return self.what


def compiled_in_pieces(gm: fx.GraphModule, compile: Callable) -> fx.GraphModule:
    """``gm`` with its regions and segments compiled by ``compile(graph, example_tensors)`` (see
    [Note: a step compiled in pieces]); modified in place and returned."""
    bodies: dict[str, str] = {}
    for node in list(gm.graph.find_nodes(op="call_function", target=_invoke_subgraph())):
        body, _, *operands = node.args
        if body.target not in bodies:
            name = f"funcshard_region_{len(bodies)}"
            fn = compile(getattr(gm, body.target), [a.meta["val"] for a in operands])
            gm.add_submodule(name, Compiled(fn, f"region {body.target}"))
            bodies[body.target] = name
        node.op, node.target, node.args = "call_module", bodies[body.target], tuple(operands)
        if not body.users:
            gm.graph.erase_node(body)
    for i, segment in enumerate(_segments(gm.graph)):
        _compile_segment(gm, segment, compile, f"funcshard_segment_{i}")
    gm.graph.lint()
    gm.recompile()
    return gm


def _invoke_subgraph():
    return torch.ops.higher_order.invoke_subgraph


def _pure(node: fx.Node) -> bool:
    """An operation a segment may hold: a pure ATen operator (or an item of a tuple)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def _passed_over(node: fx.Node) -> bool:
    """A node a segment extends over: a profiler span's start or end (no data)."""
    target = node.target
    return node.op == "call_function" and getattr(target, "namespace", None) == _PROFILER


def _heavy(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return False
    return node.target._schema.name.split("::")[-1] not in _TRIVIAL


def _segments(graph: fx.Graph) -> list[list[fx.Node]]:
    """The runs of pure operators worth compiling. A run passes over profiler spans and over
    items taken from a result made before it (a tuple: the item is an input of the run)."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in graph.nodes:
        outside_item = node.target is operator.getitem and node.args[0] not in current
        if _pure(node) and not outside_item:
            current.append(node)
        elif not (_passed_over(node) or outside_item) and current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [run for run in runs if sum(map(_heavy, run)) >= _HEAVY]


def _compile_segment(gm: fx.GraphModule, nodes: Sequence[fx.Node], compile, name: str) -> None:
    """Replace ``nodes`` (a segment, in graph order) with one call of their compiled graph,
    where the last of them was (what lies between them uses none of their results: see
    ``_segments``); a segment whose inputs or outputs are not all tensors stays."""
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    tensor = lambda n: isinstance(n.meta.get("val"), torch.Tensor)
    if not outputs or not all(map(tensor, inputs)) or not all(map(tensor, outputs)):
        return
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    fn = compile(fx.GraphModule(torch.nn.Module(), graph), [a.meta["val"] for a in inputs])
    gm.add_submodule(name, Compiled(fn, f"{len(nodes)} operators"))
    with gm.graph.inserting_before(nodes[-1].next):
        call = gm.graph.call_module(name, tuple(inputs))
        got = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for old, new in zip(outputs, got, strict=True):
        new.meta = dict(old.meta)
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for n in reversed(nodes):
        gm.graph.erase_node(n)
