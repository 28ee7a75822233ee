"""What ``fs.jit`` traces: the step over its arguments' local tensors, and how the step's
results are made from the graph's at every call (see [Note: a step traced by fs.jit] in
``_jit``)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from .._runtime._compat import storage_key
from ._host import HostReads, where
from ._signature import local


class _Kind(enum.Enum):
    GRAPH = "graph"  # the compiled graph's output ``index``, wrapped as ``spec`` says
    INPUT = "input"  # the argument leaf ``index`` itself
    WRAPPED = "wrapped"  # the argument leaf ``index``'s local tensor, placed as ``spec`` says
    VALUE = "value"  # a constant (not a tensor), returned as traced


@dataclasses.dataclass(frozen=True)
class Out:
    """How one result leaf is made at a call: ``index`` is the graph's output (``GRAPH``) or
    the argument leaf (``INPUT``, ``WRAPPED``) it comes from."""

    kind: _Kind
    index: int = -1
    spec: Any = None  # a DTensor's DTensorSpec, or None for a plain tensor
    value: Any = None


@dataclasses.dataclass
class Made:
    """What the trace found about the step's results."""

    outs: tuple[Out, ...] = ()
    spec: Any = None


def graph_inputs(leaves: list) -> tuple[list[int], list[int | None]]:
    """The graph's inputs, one per distinct local tensor (as leaf indices), and each leaf's
    input (``None`` for a leaf that is no tensor)."""
    inputs: list[int] = []
    slots: list[int | None] = []
    seen: dict[int, int] = {}
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            slots.append(None)
            continue
        slot = seen.setdefault(id(local(x)), len(inputs))
        if slot == len(inputs):
            inputs.append(i)
        slots.append(slot)
    return inputs, slots


def traced_body(step, name, leaves, slots, spec, static, positions, donated, made) -> Callable:
    """The function ``make_fx`` traces: the step, over the arguments' local tensors."""
    device = next((local(x).device for x in leaves if isinstance(x, torch.Tensor)), None)
    donated_slots = [s for x, s in zip(leaves, slots, strict=True)
                     if s is not None and id(local(x)) in donated]  # fmt: skip

    def body(*tensors: torch.Tensor) -> list[torch.Tensor]:
        rebuilt = [_rebuilt(x, tensors[s]) if s is not None else x
                   for x, s in zip(leaves, slots, strict=True)]  # fmt: skip
        args, kwargs = optree.tree_unflatten(spec, rebuilt)
        args, kwargs = _with_static(args, kwargs, static, positions)
        checker = HostReads(device, f"jit: {name} cannot be traced", traced=True)
        try:
            with checker:
                out = step(*args, **kwargs)
        except Exception as e:
            if checker.found is not None:
                raise
            refused = _data_dependent(e)
            if refused is None:
                raise
            at = where(e.__traceback__)
            raise RuntimeError(f"jit: {name} cannot be traced: {refused}, at {at}.") from e
        out_leaves, made.spec = optree.tree_flatten(out, none_is_leaf=True)
        made.outs, returned = _results(out_leaves, rebuilt, tensors, slots, donated_slots)
        return returned

    return body


def _rebuilt(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The argument leaf ``x`` in the trace, over ``t``, the graph input of its local tensor."""
    if isinstance(x, DTensor):
        return DTensor(t, x._spec, requires_grad=x.requires_grad)
    return t


def _with_static(args: tuple, kwargs: dict, static: tuple, positions: dict) -> tuple:
    args, kwargs = list(args), dict(kwargs)
    for name, value in static:
        at = positions.get(name)
        if at is not None and at < len(args) and name not in kwargs:
            args[at] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def _results(out_leaves, rebuilt, tensors, slots, donated_slots) -> tuple[tuple[Out, ...], list]:
    """How each result leaf is made at a call, and the graph's outputs."""
    leaf_at = {id(x): i for i, x in enumerate(rebuilt) if isinstance(x, torch.Tensor)}
    slot_at = {id(t): s for s, t in enumerate(tensors)}
    first_leaf = {s: i for i, s in reversed(list(enumerate(slots))) if s is not None}
    outs, returned, fresh = [], [], []
    for x in out_leaves:
        if not isinstance(x, torch.Tensor):
            outs.append(Out(_Kind.VALUE, value=x))
            continue
        if id(x) in leaf_at:
            outs.append(Out(_Kind.INPUT, leaf_at[id(x)]))
            continue
        loc = x._local_tensor if isinstance(x, DTensor) else x
        spec = x._spec if isinstance(x, DTensor) else None
        if id(loc) in slot_at:  # a new DTensor around an argument's local tensor
            outs.append(Out(_Kind.WRAPPED, first_leaf[slot_at[id(loc)]], spec))
            continue
        fresh.append(len(outs))
        outs.append(Out(_Kind.GRAPH, len(returned), spec))
        returned.append(loc.detach())
    done = _donate(outs, returned, fresh, tensors, slots, donated_slots, first_leaf)
    return done, returned


def _donate(outs, returned, fresh, tensors, slots, donated_slots, first_leaf) -> tuple[Out, ...]:
    """``outs``, with each new result written into a donated argument's tensor of its layout
    that no result holds or views (the copy is recorded in the trace)."""
    if not donated_slots:
        return tuple(outs)
    held = {storage_key(t) for t in returned}
    held |= {storage_key(tensors[slots[o.index]]) for o in outs
             if o.kind in (_Kind.INPUT, _Kind.WRAPPED)}  # fmt: skip
    free = [s for s in dict.fromkeys(donated_slots) if storage_key(tensors[s]) not in held]
    for at in fresh:
        o = outs[at]
        t = returned[o.index]
        for s in free:
            d = tensors[s]
            if (d.shape, d.stride(), d.dtype, d.device) == (t.shape, t.stride(), t.dtype, t.device):
                d.copy_(t)
                free.remove(s)
                outs[at] = Out(_Kind.WRAPPED, first_leaf[s], o.spec)
                break
    return tuple(outs)


def _data_dependent(e: BaseException) -> str | None:
    """What a tracing error means when a value or a shape depended on a tensor's contents."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(e, DynamicOutputShapeException):
        return (
            f"{e.func if hasattr(e, 'func') else 'an operation'} makes a shape from a tensor's "
            "values (nonzero, boolean indexing, unique), which a graph compiled once cannot "
            "follow; use fixed shapes (torch.where, masks)"
        )
    if isinstance(e, DataDependentOutputException | GuardOnDataDependentSymNode):
        return (
            "a Python value read from a tensor (.item(), float(t), bool(t) -- an `if` on a "
            "tensor --, .tolist()), which is not known while tracing and would be frozen; "
            "compute with tensors (torch.where) or read it from the results"
        )
    return None


def results(outs: tuple[Out, ...], got: list[torch.Tensor], leaves: list) -> list:
    """The step's result leaves at a call: from the graph's outputs ``got`` and the call's
    argument ``leaves``, as ``outs`` says."""
    out = []
    for o in outs:
        if o.kind is _Kind.GRAPH:
            t = got[o.index]
            out.append(t if o.spec is None else DTensor(t, o.spec, requires_grad=False))
        elif o.kind is _Kind.INPUT:
            out.append(leaves[o.index])
        elif o.kind is _Kind.WRAPPED:
            t = local(leaves[o.index])
            out.append(t if o.spec is None else DTensor(t, o.spec, requires_grad=False))
        else:
            out.append(o.value)
    return out
