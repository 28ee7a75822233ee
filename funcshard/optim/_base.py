"""Optimizers as data: a pair of pure functions whose state is returned, never kept on an object.

[Note: pure and donated updates]
torch's optimizer kernels (``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``, ...) update the
parameters and the optimizer state in place. The pure ``update`` therefore runs them on copies:
fresh moments (the new state) and a copy of the parameters, from which the updates are taken as
``new - old`` (see [Note: updates as differences]). Besides its inputs, a pure Adam step holds the
new moments and the updates: three parameter-sized buffers that ``torch.optim.AdamW`` does not
need. JAX avoids them with buffer donation; PyTorch cannot know whether the caller still holds the
old state, so donation is explicit here: :func:`step` (and ``update_inplace``) runs the same
kernels directly on the caller's parameters, gradients and state, as ``optimizer.step()`` does,
and costs the same memory. A transformation that has applied its result to the parameters itself
returns ``None`` updates for those leaves: nothing is left to add.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from .._communication._consensus import recorded
from .._runtime._compile import compiling, dynamo_tracing, traced
from .._trees._dtensor import _local as _local_shard
from .._trees._dtensor import placed_like
from .._trees._tree import Flat, PyTree, flatten, nothing_in

InitFn = Callable[[PyTree], Any]
UpdateFn = Callable[..., tuple[PyTree, Any]]


class _Fields(NamedTuple):
    init: InitFn
    update: UpdateFn
    update_inplace: UpdateFn | None = None


class GradientTransformation(_Fields):
    """An optimizer, or one stage of one, as a pair of pure functions (optax's contract).

    - ``init(params) -> state``: a NamedTuple (or tuple of them) of tensors, the tree ones
      ``DTensor``s placed like ``params``.
    - ``update(grads, state, params=None) -> (updates, state)``: does not modify its inputs;
      ``updates`` has the structure of ``grads``, ``None`` where ``grads`` is ``None`` (no update).
    - ``update_inplace``: the donated form of ``update`` used by :func:`step`, or ``None`` (then
      :func:`step` falls back to ``update``). Same results, but it may overwrite ``grads``,
      ``state`` and ``params``, and returns ``None`` for leaves it has already applied to
      ``params``. See [Note: pure and donated updates].

    ``update`` and ``update_inplace`` are stored marked to be traced as a whole by
    ``torch.compile`` (see [Note: funcshard under torch.compile]); outside it they are the same
    calls, which, on sharded gradients of a multi-rank run, also leave a record of the
    transformation and its step for the ranks' next check (see [Note: the optimizer rides the
    next check] in ``_updates``).
    """

    __slots__ = ()

    def __new__(cls, init: InitFn, update: UpdateFn, update_inplace: UpdateFn | None = None):
        inplace = None if update_inplace is None else _recorded(update_inplace, update)
        pure = _recorded(update, update)
        donated = inplace or pure
        donated.funcshard_step = traced(_donated_step(donated), "step")  # type: ignore[attr-defined]
        return super().__new__(cls, init, pure, inplace)


def _recorded(fn: UpdateFn, update: UpdateFn) -> UpdateFn:
    out = traced(recorded(fn, update))
    out.funcshard_update = update  # type: ignore[attr-defined]  # see _updates.describe
    return out


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none."""


def local(x: torch.Tensor) -> torch.Tensor:
    """The tensor the arithmetic runs on: a DTensor's local shard (same storage), or ``x``.

    Eagerly the shard itself (no ``to_local()``: its autograd wrapper is an aten call per leaf
    and per list, most of an optimizer step's host time on a GPU); traced, ``to_local()``."""
    if not isinstance(x, DTensor):
        return x
    return x.to_local() if compiling() else _local_shard(x)


def locals_of(idx: Sequence[int], *lists: list) -> tuple[list[torch.Tensor], ...]:
    """Per list of ``lists``, :func:`local` of ``xs[i]`` for each ``i`` in ``idx`` (ascending),
    with the mode asked once."""
    if compiling():
        return tuple([local(xs[i]) for i in idx] for xs in lists)
    return tuple(_locals(xs if len(idx) == len(xs) else [xs[i] for i in idx]) for xs in lists)


def _locals(xs: list) -> list[torch.Tensor]:
    try:
        return list(map(_LOCAL, xs))  # DTensors: the common case, one call
    except AttributeError:
        return [x._local_tensor if isinstance(x, DTensor) else x for x in xs]


_LOCAL = operator.attrgetter("_local_tensor")


def _spec(x: Any) -> Any:
    """A DTensor's spec (see [Note: one DTensorSpec per layout] in ``_trees/_dtensor``)."""
    return x._spec if type(x) is DTensor else None


def wrap(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (a local tensor) as a tensor placed like ``like``: a DTensor if ``like`` is one."""
    return placed_like(t, like) if isinstance(like, DTensor) else t


def leaves_like(tree: PyTree, like: PyTree, what: str, like_what: str) -> list[Any]:
    """Leaves of ``tree`` in ``like``'s order, ``None`` entries kept as leaves (a frozen
    parameter's missing gradient pairs with its tensor). Raises ``ValueError`` naming the keys."""
    return Flat.of(like).paired(tree, what=what, like_what=like_what)


def check_like(
    fn: str, path: str, x: torch.Tensor, like: torch.Tensor, what: str, dtype: bool = False
) -> None:
    """``x`` (an entry of ``what``) has ``like``'s type, global shape and placements (and with
    ``dtype``, its dtype: torch's kernels and ``param.grad`` need it).

    Raises:
        TypeError / ValueError: naming ``path`` and both layouts.
    """
    if type(x) is DTensor and type(like) is DTensor and x._spec is like._spec:
        # placed around the parameter's own spec (gradients, states): the same layout
        if dtype and x.dtype != like.dtype:
            _wrong_dtype(fn, path, x, like, what)
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {what}[{path!r}] is a {type(x).__name__}, not a tensor.")
    if isinstance(x, DTensor) != isinstance(like, DTensor):
        kind = lambda t: "a DTensor" if isinstance(t, DTensor) else "a plain tensor"
        raise TypeError(
            f"{fn}: {what}[{path!r}] is {kind(x)} but the parameter is {kind(like)}; pass "
            "gradients from fs.value_and_grad on the same sharded tree (or plain tensors for "
            "plain parameters)."
        )
    placed = lambda t: f"{list(t.shape)} {tuple(getattr(t, 'placements', ()))}"
    if x.shape != like.shape or getattr(x, "placements", None) != getattr(like, "placements", None):
        raise ValueError(
            f"{fn}: {what}[{path!r}] has shape and placements {placed(x)}, but the parameter has "
            f"{placed(like)}; {what} must be placed like the parameters."
        )
    if dtype and x.dtype != like.dtype:
        _wrong_dtype(fn, path, x, like, what)


def _wrong_dtype(fn: str, path: str, x: torch.Tensor, like: torch.Tensor, what: str):
    raise TypeError(
        f"{fn}: {what}[{path!r}] is {x.dtype} but the parameter is {like.dtype}; cast it "
        f"(e.g. {what}[{path!r}].to({like.dtype})), or keep the parameter in {x.dtype}."
    )


def without_grad(fn: Callable) -> Callable:
    """``fn``, run under ``torch.no_grad()``, which is entered only where gradients are on: a
    donated step would enter it three times, a fixed cost of every step."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run


@traced  # see [Note: funcshard under torch.compile]
@without_grad
def apply_updates(params: PyTree, updates: PyTree, *, inplace: bool = False) -> PyTree:
    """``params + updates``, leaf by leaf; a ``None`` update leaves the parameter as it is.

    Each sum is cast to the parameter's dtype and keeps its type (DTensor with the same
    placements, or plain tensor) and ``requires_grad``. No communication.

    Args:
        params: a tree of tensors (DTensors from :func:`~funcshard.shard`, or plain tensors).
        updates: the same structure, e.g. from ``opt.update``; ``None`` for no update.
        inplace: add into ``params``' storage and return ``params`` itself (donating them: the
            old values are gone, and nothing new is allocated). Default: a new tree; ``params``
            is not modified.

    Raises:
        ValueError: the trees' keys differ, or an update's shape/placements differ from its
            parameter's; TypeError: an update for a ``None`` parameter, or a DTensor update for
            a plain parameter (or the reverse).
    """
    if inplace and nothing_in(updates, params):  # a donated update that applied itself
        return params
    flat = Flat.of(params)  # see [Note: a dict of tensors is flattened without optree]
    ps, us = flat.leaves, flat.paired(updates, what="updates", like_what="params")
    todo = [i for i, u in enumerate(us) if u is not None]
    odd = [i for i in todo if type(us[i]) is not DTensor or us[i]._spec is not _spec(ps[i])]
    paths = flatten(params, none_is_leaf=True)[0] if odd else []  # for the errors only
    for i in odd:
        if ps[i] is None:
            raise TypeError(f"apply_updates: updates[{paths[i]!r}] has no parameter (it is None).")
        check_like("apply_updates", paths[i], us[i], ps[i], "updates")
    targets = [local(ps[i]) for i in todo]
    adds = [local(us[i]).to(t.dtype) for i, t in zip(todo, targets, strict=True)]
    if inplace:
        if todo:
            torch._foreach_add_(targets, adds)
        return params
    sums = torch._foreach_add(targets, adds) if todo else []
    out = list(ps)
    for i, s in zip(todo, sums, strict=True):
        out[i] = wrap(s, ps[i]).requires_grad_(ps[i].requires_grad)
    return flat.rebuild(out)


def step(
    opt: GradientTransformation, params: PyTree, grads: PyTree, state: Any
) -> tuple[PyTree, Any]:
    """One donated optimizer step: ``opt``'s update applied to ``params`` in place.

    Equal to ``updates, state = opt.update(grads, state, params)`` followed by
    ``apply_updates(params, updates)``, with the memory of ``torch.optim``'s ``optimizer.step()``:
    torch's kernels run directly on the parameters and the state (see
    [Note: pure and donated updates]). ``params``, ``grads`` and ``state`` are *donated*: they are
    overwritten in place and must not be used afterwards except through the returned values.

    Returns:
        ``(params, state)``: the same parameter tensors, updated, and the new state.
    """
    update = opt.update_inplace or opt.update
    one_call = getattr(update, "funcshard_step", None)  # see [Note: a donated step is one call]
    if one_call is not None and dynamo_tracing():
        return one_call(params, grads, state)
    return _donated_step(update)(params, grads, state)


def _donated_step(update: UpdateFn) -> Callable:
    """:func:`step` with ``update`` (a transformation's donated update).

    [Note: a donated step is one call]
    Under ``torch.compile`` each transform is one call of the graph (see [Note: funcshard under
    torch.compile] in ``_runtime/_compile``), and Dynamo interprets the pytrees of its arguments
    and results bytecode by bytecode, several times each: for a step, the parameters, the
    gradients and the optimizer state, hundreds of leaves. :func:`step` is therefore one call,
    ``update`` and :func:`apply_updates` inside it: the updates (``None`` where the update
    applied itself) never cross into the graph, and the parameters cross once.
    """

    def step(params: PyTree, grads: PyTree, state: Any) -> tuple[PyTree, Any]:
        with torch.no_grad():
            updates, state = update(grads, state, params)
            return apply_updates(params, updates, inplace=True), state

    return step


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after the other: each one's updates are the next one's grads.

    The state is a tuple with one state per transformation, in order. In the donated form
    (:func:`step`), a transformation that applies its result to the parameters itself (``adam``,
    ``adamw``, ``sgd``) must come last.

    Raises (from ``update``):
        ValueError: the state is not a tuple of ``len(transforms)`` states.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is a {type(t).__name__}, not a GradientTransformation "
                "(did you pass a schedule or a torch.optim optimizer?)."
            )

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def run(grads, state, params, inplace: bool):
        _check_chain_state(state, len(transforms))
        new_state = []
        for i, (t, s) in enumerate(zip(transforms, state, strict=True)):
            update = (t.update_inplace or t.update) if inplace else t.update
            before = grads
            grads, s = update(grads, s, params)
            if inplace and i < len(transforms) - 1:
                _check_not_applied(before, grads, i, len(transforms))
            new_state.append(s)
        return grads, tuple(new_state)

    return GradientTransformation(
        init,
        lambda grads, state, params=None: run(grads, state, params, False),
        lambda grads, state, params=None: run(grads, state, params, True),
    )


def _check_chain_state(state, n: int) -> None:
    if not isinstance(state, tuple) or len(state) != n or hasattr(state, "_fields"):
        got = f"a tuple of {len(state)}" if isinstance(state, tuple) else type(state).__name__
        raise ValueError(
            f"chain: the state must be the tuple of {n} states that this chain's init returned, "
            f"got {got}; was it made by another optimizer, or a chain of other transformations?"
        )


def _check_not_applied(before: PyTree, after: PyTree, i: int, n: int) -> None:
    if after is before:  # scaled in place (a clip): nothing was applied
        return
    flat = Flat.of(before)
    b, a = flat.leaves, flat.paired(after, what="updates", like_what="grads")
    gone = [x is not None and y is None for x, y in zip(b, a, strict=True)]
    if any(gone):
        path = flatten(before, none_is_leaf=True)[0][gone.index(True)]
        raise ValueError(
            f"chain: transformation {i} of {n} applied its update to the parameters in place "
            f"(at {path!r}), leaving nothing for the transformations after it. Kernel "
            "transformations (adam, adamw, sgd) must come last to be used with "
            "fs.optim.step; or use the pure opt.update."
        )


def set_grads(params: PyTree, grads: PyTree) -> None:
    """Set ``param.grad = grad`` for every leaf, for ``torch.optim`` optimizers and
    ``torch.nn.utils.clip_grad_norm_`` on the shards (``None`` clears a gradient).

    The parameters must be the tensors the ``torch.optim`` optimizer was built with (update
    them in place only: ``optimizer.step()``, or ``apply_updates(..., inplace=True)``).

    Raises:
        ValueError: the keys differ, or a gradient's shape/placements differ from its
            parameter's; TypeError: a gradient for a ``None`` parameter.
    """
    paths, ps, _ = flatten(params, none_is_leaf=True)
    gs = leaves_like(grads, params, "grads", "params")
    for path, p, g in zip(paths, ps, gs, strict=True):
        if p is None:
            if g is not None:
                raise TypeError(f"set_grads: grads[{path!r}] has no parameter (it is None).")
            continue
        if g is not None:
            check_like("set_grads", path, g, p, "grads", dtype=True)
        p.grad = g
