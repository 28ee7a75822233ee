"""Regions: under ``torch.compile``, identical groups are compiled once.

[Note: identical groups compiled once]
A traced step is one graph (see [Note: funcshard under torch.compile] in ``_compile``), and the
compiler generates code for every group's forward and backward anew: eight identical blocks
cost eight times the compilation of one. While the step is traced (``Mode.TRACED``), in the
pass that records the graph (see [Note: the passes of a trace] in ``_compile``), each
group's module (a submodule holding only its group's parameters and no buffers, not
recomputed) therefore runs as one *region*: its forward and backward are each one call of the
``invoke_subgraph`` higher-order operator, which the compiler lowers once per distinct
subgraph, however many times it is called.

A region's joint forward-backward graph is traced on the call's tensors (its arguments, then
its module's full parameters) and split here by the min-cut partitioner, as AOTAutograd splits a
whole model: the forward graph returns what the backward needs (activations), the backward
graph takes it, so nothing is recomputed. Two groups share the graphs when their joint graphs'
code and their tensors' metadata are equal: blocks of other widths, or whose attributes change
the computation, get graphs of their own.

Two things are kept out of the graphs' boundary, both for the scheduler's reshard after forward
and for correctness:

* a saved tensor that is one of the region's inputs (a full parameter, the block's input), or a
  view of one, is saved by the region's autograd Function with ``save_for_backward``, not
  returned by the forward graph: the scheduler's saved-tensor hooks see the full parameters and
  gather them again for backward (see [Note: a plan under torch.compile] in ``_schedule``),
  and the backward graph replays the view on what the hook returns;
* no forward output is one of its inputs (it is copied): the compiler's buffer reuse does not
  follow an alias through ``invoke_subgraph`` and would overwrite the input while the output
  is still read.

A region falls back to an ordinary call (inlined in the step's graph) when its graphs cannot be
made: DTensor parameters (FSDP x TP) or other tensor subclasses (low-precision weights), an
output that is not a floating-point tensor requiring grad, a tensor constant, an integer saved
for backward; or when it draws random numbers
(dropout): the compiler seeds a subgraph's random ops once, so every call of a shared subgraph
would draw the same numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# the torch._ imports (and torch._C._AutoDispatchBelowAutograd) are private APIs, used here only:
# see tests/test_compile.py::test_private_torch_apis_of_regions
from torch._dispatch.python import suspend_functionalization
from torch._functorch._aot_autograd.graph_compile import prepare_for_partitioner
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph, trace_joint_graph_as_bwd
from torch._higher_order_ops.utils import _from_fun
from torch._subclasses.functional_tensor import disable_functional_mode
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from .._plans._plan import Plan
from .._trees._deferred import release_all
from .._trees._extract import aliases
from .._trees._subclass import is_subclass
from ._recompute import prepared
from ._region_key import known


def modules(module: nn.Module, plan: Plan) -> dict[str, nn.Module]:
    """``{group name: its module}`` for the groups that may run as regions."""
    out = {}
    group_of, tied = plan.group_of(), aliases(module)
    for g in plan.groups:
        if g.recompute or not g.name:
            continue
        try:
            sub = module.get_submodule(g.name)
        except AttributeError:  # a merged group
            continue
        fqns = [f"{g.name}.{n}" for n, _ in sub.named_parameters(remove_duplicate=False)]
        owners = {group_of.get(tied.get(f, f)) for f in fqns}
        if fqns and owners == {g.name} and next(sub.buffers(), None) is None:
            out[g.name] = sub
    return out


def regioned(cache: dict) -> Callable:
    """``wrap(sub, forward, name)`` for ``_recompute.recomputing``: ``sub``'s forward as a
    region; ``cache`` holds the graphs of one traced call."""

    def wrap(sub: nn.Module, forward: Callable, name: str) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            call, real, resolvers = prepared(sub, forward, args, kwargs)
            try:
                graphs = _graphs(call, real, cache)
                if graphs is None:
                    with call.bound(real):
                        return call.outputs(call.run(real))
                return call.outputs(_Region.apply(graphs, *real))
            finally:
                release_all(resolvers)

        return run

    return wrap


@dataclasses.dataclass(frozen=True)
class _Graphs:
    """One region's partitioned graphs. ``saved``: what the backward graph takes before the
    gradients of the outputs, in order: ``("input", i)`` (the region's input ``i``, saved by
    the Function) or ``("output", j)`` (the forward graph's extra output ``j``)."""

    name: str
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    outputs: tuple[tuple[torch.Size, torch.dtype, torch.device], ...]
    saved: tuple[tuple[str, int], ...]


def _graphs(call, real: list, cache: dict) -> _Graphs | None:
    """The region's graphs, or ``None`` to run it inline. A group whose key is known before
    tracing (see [Note: identical groups known before tracing] in ``_region_key``) takes the
    graphs of the first group with that key, untraced."""
    if any(isinstance(t, DTensor) or is_subclass(t) for t in real):  # FSDP x TP's DTensor
        return None  # parameters, low-precision weights: invoke_subgraph takes plain tensors
    early = known(call, real)
    if early is not None and early in cache:
        graphs, outputs = cache[early]
        if graphs is not None:
            call.out_spec, call.out_at, call.out_leaves, call.differentiable = outputs
        return graphs
    graphs = _traced(call, real, cache)
    if early is not None:
        cache[early] = (graphs, (call.out_spec, call.out_at, call.out_leaves, call.differentiable))
    return graphs


def _traced(call, real: list, cache: dict) -> _Graphs | None:
    def fn(*tensors):
        with call.bound(tensors):
            return call.run(tensors)

    with suspend_functionalization(), disable_functional_mode(), disable_proxy_modes_tracing():
        primals = [_from_fun(t) for t in real]
        with torch.enable_grad():
            outs = fn(*primals)
        if not outs or not all(o.requires_grad and o.is_floating_point() for o in outs):
            return None
        tangents = [_from_fun(o).contiguous() for o in outs]
    keys = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
    joint = trace_joint_graph_as_bwd(fn, len(primals), primals + tangents, *keys)
    if joint.graph.find_nodes(op="get_attr") or any(map(_random, joint.graph.nodes)):
        return None
    meta = tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in real)
    key = (joint.code, meta)
    if key not in cache:
        outputs = tuple((o.shape, o.dtype, o.device) for o in outs)
        cache[key] = _partition(joint, len(primals), outputs, f"funcshard_region{len(cache)}")
    return cache[key]


def _random(node) -> bool:
    """A random op: one subgraph called by every block would draw the same numbers in each.
    Attention with ``dropout_p=0`` (the seeded tag is on the op for its dropout) draws none."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            given = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return (arg.default_value if given is None else given) != 0
    return True


def _partition(joint, n_inputs: int, outputs, name: str) -> _Graphs | None:
    n_out = len(outputs)
    joint = prepare_for_partitioner(joint, n_inputs, n_out)
    for node in list(joint.graph.nodes):  # autograd's detaches: saved views of the inputs
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            joint.graph.erase_node(node)
    joint.recompile()
    fw, bw = min_cut_rematerialization_partition(joint, [], num_fwd_outputs=n_out)
    out_node = fw.graph.find_nodes(op="output")[0]
    returned = list(out_node.args[0])
    inputs = fw.graph.find_nodes(op="placeholder")
    bw_inputs = bw.graph.find_nodes(op="placeholder")
    kept, saved = returned[:n_out], []
    for k, node in enumerate(returned[n_out:]):
        if not isinstance(node.meta.get("val"), torch.Tensor):
            return None  # an integer saved for backward
        base, views = _viewed_input(node)
        if base is None:
            saved.append(("output", len(kept) - n_out))
            kept.append(node)
        else:
            saved.append(("input", inputs.index(base)))
            _replay(bw, bw_inputs[k], views, after=bw_inputs[-1])
    for i, node in enumerate(kept):  # an output that is an input: copied (see the Note)
        if node.op == "placeholder":
            with fw.graph.inserting_before(out_node):
                kept[i] = fw.graph.call_function(torch.ops.aten.clone.default, (node,))
    out_node.args = (tuple(kept),)
    fw.recompile()
    bw.recompile()
    return _Graphs(name, fw, bw, outputs, tuple(saved))


def _viewed_input(node):
    """``(input, views)`` when ``node`` is an input or views of one, else ``(None, None)``."""
    views = []
    while node.op == "call_function" and getattr(node.target, "is_view", False):
        views.append(node)
        node = node.args[0]
    return (node, views[::-1]) if node.op == "placeholder" else (None, None)


def _replay(graph_module, placeholder, views, after) -> None:
    """In ``graph_module``, ``placeholder`` (now the input itself) viewed by ``views`` again."""
    if not views:
        return
    users, current = list(placeholder.users), placeholder
    for view in views:
        with graph_module.graph.inserting_after(after):
            current = after = graph_module.graph.call_function(
                view.target, (current, *view.args[1:]), view.kwargs
            )
    for user in users:
        user.replace_input_with(placeholder, current)


class _Region(torch.autograd.Function):
    """``forward(graphs, *tensors)``: the region's outputs; ``backward``: the gradients of its
    inputs. See [Note: identical groups compiled once]."""

    @staticmethod
    def forward(ctx, graphs: _Graphs, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(graphs.outputs)
        with torch._C._AutoDispatchBelowAutograd():
            results = invoke_subgraph(graphs.forward, graphs.name + "_forward", *tensors)
        inputs = [tensors[i] for kind, i in graphs.saved if kind == "input"]
        ctx.graphs = graphs
        ctx.save_for_backward(*inputs, *results[n:])  # with reshard: gathered again
        return tuple(results[:n])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        graphs: _Graphs = ctx.graphs
        saved = ctx.saved_tensors
        inputs = iter(saved)
        extra = saved[sum(kind == "input" for kind, _ in graphs.saved) :]
        args = [next(inputs) if kind == "input" else extra[i] for kind, i in graphs.saved]
        grads = tuple(
            torch.zeros(s, dtype=d, device=v) if g is None else g.contiguous()
            for g, (s, d, v) in zip(grads, graphs.outputs, strict=True)
        )
        with torch._C._AutoDispatchBelowAutograd():
            found = invoke_subgraph(graphs.backward, graphs.name + "_backward", *args, *grads)
        return (None, *found)
