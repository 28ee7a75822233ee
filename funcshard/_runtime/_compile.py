"""funcshard under ``torch.compile``: traced like ``jax.jit`` traces, not by Dynamo.

[Note: funcshard under torch.compile]
Dynamo rewrites Python bytecode; funcshard's Python (optree trees, the agreement check through
the c10d store, the scheduler's cursor over a plan, ``Deferred`` parameters, autograd Functions
with ``jvp`` rules) is a poor fit for it: each of those is a graph break or a guard on per-call
state. But none of it depends on tensor *values*: it decides which collectives run, in which
order, on which shapes. So every public transform is marked ``nonstrict_trace``
(:func:`traced`): Dynamo does not look inside, and AOTAutograd runs the transform's ordinary
Python once per compilation, on fake tensors, recording the torch ops it issues -- the way
``jax.jit`` traces a function. The compiled graph takes the shards as inputs and is
straight-line code: functional collectives (``_c10d_functional`` ops + ``wait_tensor``) and
compute, with no Python left at run time, and Dynamo guards only on the arguments' structure,
shapes, dtypes and placements (no recompilation while they stay the same).

While tracing (``torch.compiler.is_compiling()``), the eager machinery that cannot be recorded
steps aside: collectives are the functional ops, waited where their result is first used (see
``_collectives.wait``), never pending across autograd; no storage is freed or refilled (the
compiler frees a tensor after its last use); the agreement of the ranks (``_consensus``) is
checked once per structure at trace time, as in eager. The scheduler follows its plan at trace
time, so the graph issues the gathers in the plan's order (see [Note: a plan under
torch.compile] in ``_schedule``).

Consequences, as for ``jax.jit``: tensors a traced function reads from its closure (a
``buffers`` dict captured by a loss) become constants of the graph, so pass tensors that change
as arguments; Python side effects of the loss run at compile time only.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.utils._pytree as torch_pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

# ``compiling``: whether funcshard's code runs as part of a ``torch.compile`` trace (see [Note:
# a compile session on torch 2.11 and 2.12]); the rest of the package asks it through here.
from ._compat import compiling, keep_mesh_hash_out_of_pickles

keep_mesh_hash_out_of_pickles()  # compiled steps' graphs take meshes: [Note: a mesh in a cache key]

F = TypeVar("F", bound=Callable)
_NUMBERS = itertools.count()
_CREATED_INSIDE = (
    "funcshard: {name} was created inside a function that torch.compile is compiling. Create "
    "funcshard's transforms once, outside it -- `vg = fs.value_and_grad(loss)`, "
    "`apply = fs.schedule(...)`, `opt = fs.optim.adamw(...)` -- and call them inside; pass "
    "what changes from step to step (batches) as arguments, not through a closure."
)


def dynamo_tracing() -> bool:
    """Dynamo itself is interpreting the running code: the first pass of ``torch.compile``,
    where a call of :func:`traced` becomes one operation of the graph (``compiling()`` is true
    in AOTAutograd's passes too)."""
    return torch.compiler.is_dynamo_compiling()


def traced(fn: F, name: str | None = None) -> F:
    """``fn``, traced by AOTAutograd rather than Dynamo when called under ``torch.compile``.

    See [Note: funcshard under torch.compile]. Outside ``torch.compile`` this is a plain call.
    ``fn``'s arguments and results must be pytrees (tensors, DTensors, LocalShards, Python
    scalars, dtypes, ``None``, containers of them). ``name``: the name errors give it
    (default: ``fn``'s; pass the user's function's for a wrapper of it: Dynamo of torch 2.11
    and 2.12 does not see the name ``functools.wraps`` copies).
    """
    name = name or getattr(fn, "__name__", "fn")
    if dynamo_tracing():
        refuse_while_tracing(_CREATED_INSIDE.format(name=name))

    def body(*args, **kwargs):
        _WAITED.clear()  # a trace of its own: see after_waits
        try:
            decoded = _decoded(args)
            return _graphable(_returned_arguments(fn(*decoded, **_decoded(kwargs)), decoded))
        except Exception as e:
            if not compiling():
                raise
            # Dynamo reports an exception raised here as "Unsupported output type for
            # nonstrict_trace-ed function", without it (torch 2.13): say what it was.
            warnings.warn(
                f"funcshard: {name} raised {type(e).__name__} while torch.compile traced it: {e}",
                stacklevel=2,
            )
            raise

    body.__name__ = body.__qualname__ = name  # names in graphs
    opaque = torch._dynamo.nonstrict_trace(body)

    def call(*args, **kwargs):
        if not dynamo_tracing():
            return fn(*args, **kwargs)
        return _ungraphed(opaque(*_encoded(args), **_encoded(kwargs)), args)

    return functools.wraps(fn)(_own_code(call, name))  # type: ignore[return-value]


@torch._dynamo.assume_constant_result
def refuse_while_tracing(message: str) -> None:
    """Raise ``RuntimeError(message)`` from code that Dynamo is tracing, as the user's error.

    [Note: an error Dynamo does not swallow]
    An exception raised by code Dynamo *traces* is simulated: with ``fullgraph=True`` the user
    gets Dynamo's ``Unsupported: Observed exception`` with our text deep inside it; with the
    default ``fullgraph=False`` Dynamo breaks the graph and runs the code eagerly, where the
    check does not fire, and the compiled rest fails later with an unrelated error (inductor:
    ``InductorError: ... convert all Tensors to FakeTensors``). A function marked
    ``assume_constant_result`` is *called* at trace time instead, so its exception is real: it
    reaches the user in both modes, as ``InternalTorchDynamoError`` (a ``RuntimeError``) whose
    message starts with ``RuntimeError: <our message>`` (torch 2.11 to 2.13;
    tests/test_compile.py checks it).
    """
    raise RuntimeError(message)


def _own_code(f: Callable, name: str) -> Callable:
    """``f`` with a code object of its own.

    Dynamo keeps its compiled graphs, their guards, the recompilation limit and the history
    behind automatic dynamic shapes per code object, and it guards on a nonstrict_trace function
    by its code only (which they all share). Were every transform's wrapper the same code, each
    ``torch.compile(fs.value_and_grad(...))`` would add to one shared cache -- reaching the
    recompilation limit, and so eager, after a few -- and could even reuse another transform's
    graph (torch 2.13).
    """
    # numbered: automatic dynamic shapes also remember sizes by (file, line, name) of the code
    name = f"{name}<{next(_NUMBERS)}>"
    code = f.__code__.replace(co_name=name, co_qualname=f"funcshard.{name}")
    return types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__)


# [Note: results through a nonstrict_trace boundary]
# A graph carries neither ``None`` arguments nor ``None`` results of a nonstrict_trace function
# (frozen parameters' gradients, a donated step's updates), and Dynamo cannot rebuild a
# NamedTuple result (an optimizer state) from its flattened form (torch 2.13). Arguments: this
# constant string stands for ``None`` on the way in (an argument equal to it would be mistaken
# for None). Results: nodes of our own, ``_Absent`` (no leaves) and ``_Named``, stand for them
# on the way out. A result that is one of the arguments itself (the same tensors in the same
# structure: a donated step's parameters and state, updated in place) crosses as ``_Same``, its
# index, and is that argument again outside: Dynamo then neither flattens nor wraps its tensors
# a second time.
_NONE = "<funcshard: None>"


def _encoded(tree):
    return torch_pytree.tree_map(lambda x: _NONE if x is None else x, tree)


def _decoded(tree):
    return torch_pytree.tree_map(lambda x: None if isinstance(x, str) and x == _NONE else x, tree)


class _Absent:
    """``None`` in a result."""


class _Named:
    """A NamedTuple in a result: its class and its fields."""

    def __init__(self, cls: type, fields: list) -> None:
        self.cls, self.fields = cls, fields


class _Same:
    """A result that is the argument ``index`` itself."""

    def __init__(self, index: int) -> None:
        self.index = index


torch_pytree.register_pytree_node(_Absent, lambda _: ([], None), lambda _, __: _Absent())
torch_pytree.register_pytree_node(_Same, lambda s: ([], s.index), lambda _, i: _Same(i))
torch_pytree.register_pytree_node(
    _Named, lambda n: (list(n.fields), n.cls), lambda fields, cls: _Named(cls, list(fields))
)


def _graphable(tree):
    named = torch_pytree.is_namedtuple_instance

    def one(x):
        if x is None:
            return _Absent()
        return _Named(type(x), [_graphable(v) for v in x]) if named(x) else x

    return torch_pytree.tree_map(one, tree, is_leaf=lambda x: x is None or named(x))


def _returned_arguments(out, args: tuple):
    """``out``, a result or a tuple of results, with ``_Same`` for each that is one of
    ``args``."""

    def same(x):
        leaves, spec = torch_pytree.tree_flatten(x)
        for i, a in enumerate(args):
            theirs, their_spec = torch_pytree.tree_flatten(a)
            if leaves and spec == their_spec and all(map(operator.is_, leaves, theirs)):
                return _Same(i)
        return x

    return tuple(same(x) for x in out) if type(out) is tuple else same(out)


def _ungraphed(tree, args: tuple):
    """The result of a call with ``args``, rebuilt (see [Note: results through a
    nonstrict_trace boundary])."""
    if isinstance(tree, _Same):
        return args[tree.index]
    if type(tree) is tuple:
        return tuple(args[x.index] if isinstance(x, _Same) else _rebuilt(x) for x in tree)
    return _rebuilt(tree)


def _rebuilt(tree):
    def one(x):
        if isinstance(x, _Absent):
            return None
        return x.cls(*(_rebuilt(v) for v in x.fields)) if isinstance(x, _Named) else x

    return torch_pytree.tree_map(one, tree, is_leaf=lambda x: isinstance(x, _Absent | _Named))


def recording() -> bool:
    """Whether the running trace records a graph (AOTAutograd's last pass; a proxy mode is
    active), not only the results' metadata (Dynamo's run on fake tensors, AOTAutograd's
    metadata passes).

    [Note: the passes of a trace]
    While ``torch.compile`` compiles a step, a transform's Python runs four times on fake
    tensors: once for Dynamo (the results' shapes), twice while AOTAutograd collects metadata
    (of the arguments, then of their DTensors' local tensors) and once while it records the
    graph; only the last one's operations become the graph. The other three need only the same
    results: work that changes the graph's form but not its results (the region graphs of
    ``_regions``) is left to the one that records.
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def untraced() -> contextlib.AbstractContextManager:
    """Leave the trace's fake and functional tensor modes, for metadata computed from real
    tensors that are not part of the program (a mesh's rank tensor, a placeholder)."""
    return _disable_current_modes()


@contextlib.contextmanager
def recorded_saved_tensor_hooks() -> Iterator[None]:
    """Let saved-tensor hooks pushed inside run while AOTAutograd traces.

    AOTAutograd ignores saved-tensor hooks while it traces (they belong to the eager caller and
    run around the compiled graph instead). The scheduler's hooks are part of the program being
    traced: what they do on unpack -- gather a group again -- must be recorded in the graph's
    backward. See [Note: a plan under torch.compile] in ``_schedule``.
    """
    set_tracing = getattr(torch._C._autograd, "_saved_tensors_hooks_set_tracing", None)
    if set_tracing is None:  # an older torch: hooks always run
        yield
        return
    prior = set_tracing(False)
    try:
        yield
    finally:
        set_tracing(prior)


# Collective outputs issued in the running trace and not yet waited for, by id (tensors compare
# elementwise, so they cannot be keys). See [Note: collectives under torch.compile].
_ISSUED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def issued(t: torch.Tensor) -> torch.Tensor:
    """Remember ``t``, a functional collective's output, as needing a ``wait_tensor`` (while
    tracing; a no-op otherwise). Returns ``t``."""
    if compiling():
        _ISSUED[id(t)] = t
    return t


def waits_for(t: torch.Tensor) -> bool:
    """Whether ``t`` is a collective output issued in this trace and not yet waited (and forget
    it: it is waited now). Cheap outside a trace, where nothing is issued: every wait asks."""
    return bool(_ISSUED) and _ISSUED.pop(id(t), None) is t


_WAITED: list[weakref.ref] = []  # wait_tensor outputs of the running trace since the last token


def waited(t: torch.Tensor) -> torch.Tensor:
    """Remember ``t``, a ``wait_tensor``'s output, for the next :func:`after_waits`; returns
    ``t``."""
    _WAITED.append(weakref.ref(t))
    return t


def after_waits() -> torch.Tensor | None:
    """A token computed from the collective outputs waited since the last token in the running
    trace: one element of each, copied (``None`` if there are none).

    [Note: a gather's copy-in follows the waits before it]
    A group's copy-in (``_opaque.copy_in``) reads only the shards, graph inputs: nothing in the
    graph ties it to the point of the trace where the plan issues its gather, and inductor's
    peak-memory ordering placed copy-ins, and the reduce-scatters whose results only the
    optimizer reads, far from there (a re-gather's copy-in computed in forward and held until
    backward; reduce-scatters a group late), holding their buffers. So each copy-in takes this
    token as an input it does not read: it runs after every collective waited before it in
    the plan's order. One element copied from each, not views: a view would keep the whole
    buffer alive until the copy-in runs.
    """
    outs = [t for t in (r() for r in _WAITED) if t is not None]
    _WAITED.clear()
    return torch.cat([t.reshape(-1)[:1].to(torch.float32) for t in outs]) if outs else None


def root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (``t`` itself if it is no view)."""
    return t._base if t._is_view() else t


def regathered(saved: torch.Tensor, old: list[torch.Tensor], new: list[torch.Tensor]):
    """``saved`` -- one of the tensors ``old`` or a view of one -- re-expressed on ``new``, the
    same tensors gathered again: the same view of the corresponding new storage.

    Raises:
        LookupError: ``saved`` views none of ``old`` (a bug: the scheduler's hooks only pass
            tensors they recognised).
    """
    base = root(saved)
    for o, n in zip(old, new, strict=True):
        if root(o) is base:
            if not saved._is_view():
                return root(n)
            if isinstance(saved, DTensor):
                return saved._view_func(root(n))
            # the new storage has the old one's layout: one view, not a replay of the chain
            # (a group's tensors view one buffer, see ``_opaque``)
            return root(n).as_strided(saved.shape, saved.stride(), saved.storage_offset())
    raise LookupError("funcshard: a saved tensor that views no gathered parameter")


def with_recorded_hooks(hooks: contextlib.AbstractContextManager):
    """``hooks`` (saved-tensor hooks), made to run while AOTAutograd traces: see
    :func:`recorded_saved_tensor_hooks`."""
    stack = contextlib.ExitStack()
    stack.enter_context(recorded_saved_tensor_hooks())
    stack.enter_context(hooks)
    return stack
