"""``fs.jit(step)``: the step traced once per signature into one graph, compiled, and run.

[Note: a step traced by fs.jit]
A funcshard step is a pure function of its trees whose work depends only on the plan and the
inputs' structure, shapes and dtypes (see [Note: a step as a graph] in ``_cuda_graph``). So it
is traced as ``jax.jit`` traces: on the first call of each signature (``_signature``: the
arguments' structure, each tensor's shape, dtype and placements, the values of the other leaves
and of the static arguments) ``make_fx`` runs the step's Python once on fake local shards, with
``compiling()`` true (``_compat.tracing_step``): the executor in its traced mode, the backward
of ``value_and_grad`` and the optimizer's update become one graph of ATen operators and
functional collectives, in the plan's order, whose inputs are the local tensors of the
arguments. Inductor compiles that graph, with fake inputs in a tracing context so that its FX
graph cache and AOTAutograd's cache key it by the graph itself (see [Note: a traced graph in the
caches] in ``_compat``): a second process compiling the same step finds it there. Every later
call with that signature runs the compiled graph on the arguments' local tensors; nothing of
the step's Python runs again.

What runs once, at the trace: all of the step's Python -- the ranks' agreement through the store
and every other host check, the plan's bookkeeping, prints and other side effects, the
learning-rate schedule's Python (its value is computed in the graph from the count). What runs
at every call: the key of the arguments (cheap for the trees the last call returned: see
``Keys``), the compiled graph, and the wrapping of its outputs as DTensors.

Results: an output that is one of the arguments' tensors (the parameters and optimizer state
that ``fs.optim.step`` updates in place) is that argument itself, updated in place by the graph
as by the eager step; other outputs are the graph's new tensors, placed as the trace's were.
With ``donate_argnames``, an output that would be new is written into a donated argument's
tensor of the same layout instead (as ``jax.jit``'s donation): the step's memory is then that of
an in-place update.

While tracing, the step may not read a tensor's value on the host (``.item()``, ``bool(t)``,
an ``if`` on a tensor) nor make a shape from one (``nonzero``, boolean indexing): the value is
not known, and it could not change between calls. Both are refused naming the user's line.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .._runtime._compat import compile_graph, trace_graph
from .._trees._subclass import is_subclass
from .._trees._tree import flatten
from ._jit_trace import Made, Out, graph_inputs, results, traced_body
from ._pieces import compiled_in_pieces
from ._signature import Keys, difference, local

_BACKENDS = ("inductor", "eager")


@dataclasses.dataclass(frozen=True)
class _Traced:
    """One signature's compiled graph: ``inputs`` (the argument leaf of each graph input),
    ``outs`` (how each result leaf is made) and the results' structure."""

    run: Callable
    graph: torch.fx.GraphModule
    inputs: tuple[int, ...]
    outs: tuple[Out, ...]
    out_spec: optree.PyTreeSpec
    seconds: dict[str, float]  # the trace's and the compilation's

    def __call__(self, leaves: list) -> Any:
        tensors = [local(leaves[i]) for i in self.inputs]
        with torch.no_grad():
            got = self.run(*tensors)
        return optree.tree_unflatten(self.out_spec, results(self.outs, got, leaves))


class Jitted:
    """``step`` traced and compiled per signature: see :func:`jit`. ``traces``: how many
    signatures were traced; ``graphs()``: their graphs (as they run); ``seconds()``:
    what tracing and compiling each took."""

    def __init__(
        self, step, static_argnames, donate_argnames, max_traces, backend, regions
    ) -> None:
        if not callable(step):
            raise TypeError(f"jit: step is a {type(step).__name__}, not a callable.")
        if not (isinstance(max_traces, int) and max_traces >= 1):
            raise ValueError(f"jit: max_traces={max_traces!r}; it must be an int >= 1.")
        if not (callable(backend) or backend in _BACKENDS):
            raise ValueError(
                f"jit: backend={backend!r}; it must be one of {_BACKENDS} or a callable "
                "(graph, example tensors) -> compiled callable."
            )
        self.step, self.max_traces, self.backend = step, max_traces, backend
        self.regions = regions
        inner = getattr(step, "func", step)  # a functools.partial: its function's name
        self.name = getattr(step, "__name__", None) or getattr(inner, "__name__", "step")
        self.static = _names(static_argnames, "static_argnames")
        self.donate = _names(donate_argnames, "donate_argnames")
        both = set(self.static) & set(self.donate)
        if both:
            raise ValueError(f"jit: {sorted(both)} cannot be both static and donated.")
        self.positions = _positions(step, self.static + self.donate)
        self.entries: dict[Any, _Traced] = {}
        self.keys = Keys()
        self.last: Any = None
        functools.update_wrapper(self, step)

    @property
    def traces(self) -> int:
        return len(self.entries)

    def graphs(self) -> list[torch.fx.GraphModule]:
        """The traced graph of each signature, in the order they were traced (with its compiled
        pieces as submodules: see [Note: a step compiled in pieces] in ``_pieces``)."""
        return [e.graph for e in self.entries.values()]

    def seconds(self) -> list[dict[str, float]]:
        """Per signature, in the order traced: ``{"trace": s, "compile": s}``, the seconds of
        the trace (the step's Python on fake tensors) and of the compilation (inductor, or its
        caches)."""
        return [dict(e.seconds) for e in self.entries.values()]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs, static = self._split(args, kwargs)
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        key = ((spec, static), self.keys(leaves))
        entry = self.entries.get(key)
        if entry is None:
            entry = self._trace(key, args, kwargs, static, leaves, spec)
        self.last = key
        return entry(leaves)

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        """The arguments without the static ones (``None`` in their place), and the static
        ones as ``(name, value)`` pairs."""
        if not self.static:
            return args, kwargs, ()
        args, kwargs, static = list(args), dict(kwargs), []
        for name in self.static:
            at = self.positions.get(name)
            if at is not None and at < len(args):
                static.append((name, args[at]))
                args[at] = None
            elif name in kwargs:
                static.append((name, kwargs.pop(name)))
        for name, value in static:
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"jit: the static argument {name!r} of {self.name} is a "
                    f"{type(value).__name__}, which is not hashable: a static argument is part "
                    "of the key of the traced graph. Pass a tuple, a frozen dataclass or a "
                    "number."
                ) from None
        return tuple(args), kwargs, tuple(static)

    def _trace(self, key, args, kwargs, static, leaves, spec) -> _Traced:
        if len(self.entries) >= self.max_traces:
            paths = flatten((args, kwargs), none_is_leaf=True)[0]
            what = (
                difference(self.last, paths, key)
                if self.last is None or self.last[0][1] == static
                else f"the static arguments are {dict(static)}, were {dict(self.last[0][1])}"
            )
            raise ValueError(
                f"jit: {self.name} needs a new trace ({what}), but it was traced "
                f"{len(self.entries)} times already (max_traces={self.max_traces}); each new "
                "structure, shape, dtype or placement of the arguments, Python value among "
                "them or static argument is traced and compiled anew. Pad the batches to a few "
                "shapes, pass changing numbers as tensors, or raise max_traces."
            )
        self._refuse_subclasses(args, kwargs, leaves)
        inputs, slots = graph_inputs(leaves)
        donated = self._donated(args, kwargs)
        made = Made()
        body = traced_body(self.step, self.name, leaves, slots, spec, static, self.positions,
                           donated, made)  # fmt: skip
        tensors = [local(leaves[i]) for i in inputs]
        started = time.perf_counter()
        graph = trace_graph(body, tensors)
        traced = time.perf_counter()
        if self.backend == "eager":
            run = graph
        else:
            compile = compile_graph if self.backend == "inductor" else self.backend
            run = compiled_in_pieces(graph, compile) if self.regions else compile(graph, tensors)
        seconds = {"trace": traced - started, "compile": time.perf_counter() - traced}
        entry = _Traced(run, graph, tuple(inputs), made.outs, made.spec, seconds)
        self.entries[key] = entry
        return entry

    def _refuse_subclasses(self, args: tuple, kwargs: dict, leaves: list) -> None:
        """Refuses tensor subclasses among the arguments (low-precision weights: torchao's NF4
        and float8), which fs.jit does not trace yet (``torch.compile`` does)."""
        at = [i for i, x in enumerate(leaves)
              if isinstance(x, torch.Tensor) and is_subclass(local(x))]  # fmt: skip
        if at:
            paths = flatten((args, kwargs), none_is_leaf=True)[0]
            raise NotImplementedError(
                f"jit: {self.name}'s argument {paths[at[0]]!r} is a "
                f"{type(local(leaves[at[0]])).__name__} (a tensor subclass: a low-precision "
                "weight), which fs.jit does not trace yet. Compile the step with "
                "torch.compile(step, fullgraph=True), which takes them (docs/low_precision.md)."
            )

    def _donated(self, args: tuple, kwargs: dict) -> set[int]:
        """The storages of the donated arguments' tensors (their local tensors')."""
        out = set()
        for name in self.donate:
            at = self.positions.get(name)
            tree = args[at] if at is not None and at < len(args) else kwargs.get(name)
            for x in optree.tree_leaves(tree):
                if isinstance(x, torch.Tensor):
                    out.add(id(local(x)))
        return out


def _names(names: str | Sequence[str], what: str) -> tuple[str, ...]:
    names = (names,) if isinstance(names, str) else tuple(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"jit: {what} must be names of the step's arguments, got {bad!r}.")
    return names


def _positions(step: Callable, names: Sequence[str]) -> dict[str, int]:
    """The positional index of each named argument that may be passed positionally."""
    if not names:
        return {}
    try:
        params = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):
        return {}
    known = {p.name for p in params}
    variadic = any(p.kind is p.VAR_KEYWORD for p in params)
    missing = [n for n in names if n not in known]
    if missing and not variadic:
        raise ValueError(
            f"jit: {missing} name no argument of {getattr(step, '__name__', step)} "
            f"(its arguments: {[p.name for p in params]})."
        )
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name: i for i, p in enumerate(params) if p.kind in positional and p.name in names}


def jit(
    step: Callable,
    *,
    static_argnames: str | Sequence[str] = (),
    donate_argnames: str | Sequence[str] = (),
    max_traces: int = 8,
    backend: str | Callable = "inductor",
    regions: bool = True,
) -> Jitted:
    """``step`` traced once per input signature into one graph, compiled, and run as that graph
    (see [Note: a step traced by fs.jit]).

    Typical use::

        vg = fs.value_and_grad(loss_fn)
        opt = fs.optim.adamw(3e-4)

        @fs.jit
        def train_step(params, state, batch):
            loss, grads = vg(params, batch)
            params, state = fs.optim.step(opt, params, grads, state)
            return loss, params, state

        for batch in batches:
            loss, params, state = train_step(params, state, batch)

    The first call of a signature -- the arguments' tree structure, each tensor's shape, dtype,
    device and placements (with the mesh), the values of the other leaves and of the static
    arguments -- traces ``step`` (its Python runs once: prints and other side effects happen
    then, not at every call; the ranks' agreement and every other host check too) and compiles
    the graph; every later call of that signature runs the compiled graph. Tensors the step
    updates in place (``fs.optim.step``'s parameters and state) are updated in place by the
    graph and returned as the same tensors. Tensors the step reads from its closure are
    constants of the graph: pass what changes as arguments. The results carry no autograd
    graph (differentiate inside the step, with ``fs.value_and_grad``).

    Args:
        step: a function of trees of tensors (DTensors or plain tensors, on any device) and
            Python values, whose work does not depend on tensor values.
        static_argnames: arguments passed as Python values (hashable), part of the signature:
            a new value traces again.
        donate_argnames: arguments whose tensors the step may overwrite: a new result of the
            same layout as one of their tensors is written into it and returned as it (the
            tensors a step updates in place are donated anyway).
        max_traces: signatures traced at most; a call with another one after that raises.
        backend: ``"inductor"`` (compiled C++/Triton kernels, cached on disk by the graph),
            ``"eager"`` (the traced graph run as it is: quick to make, for debugging), or a
            callable ``(graph, example_tensors) -> callable``.
        regions: ``True``: the graph compiled in pieces -- each distinct block's forward and
            backward once, the computation between collectives in segments (see [Note: a step
            compiled in pieces]) --, so that compiling does not grow with depth; ``False``: the
            whole graph compiled as one (fusion across blocks; compiling grows with depth).

    Returns:
        A callable with ``step``'s signature and results; ``.traces`` counts the signatures
        traced, ``.graphs()`` returns their graphs and ``.seconds()`` what tracing and
        compiling each took.

    Raises (from a call):
        RuntimeError: the step reads a tensor's value on the host (``.item()``, ``bool(t)`` --
            an ``if`` on a tensor --, ``.tolist()``) or makes a shape from one (``nonzero``),
            naming the line; on a GPU, it mixes CPU and GPU tensors (a host copy).
        ValueError: a new signature after ``max_traces``, naming what changed.
        TypeError: a static argument is not hashable.
        NotImplementedError: an argument is a tensor subclass (torchao's NF4 or float8
            weights): not traced yet; ``torch.compile(step, fullgraph=True)`` takes them.
    """
    return Jitted(step, static_argnames, donate_argnames, max_traces, backend, regions)
