"""JAX-style ``value_and_grad`` / ``grad`` over sharded trees, on plain autograd."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._communication import _counts, _grad_layout
from .._communication._grad_layout import GradPlacements
from .._runtime import _sink
from .._runtime._compile import traced
from .._runtime._mode import Mode
from .._trees import _spec
from .._trees._spec import LocalShard
from .._trees._tree import flatten, unflatten
from ..transforms._unshard import unshard


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    sync_grads: bool = True,
    grad_placements: GradPlacements | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """``fn(sharded, *args) -> scalar`` becomes ``f(sharded, *args) -> (value, grads)``.

    Gradients have the structure of the differentiated arguments and the same leaf types:
    DTensors with the inputs' placements (or LocalShards for LocalShard inputs), reduced as the
    ``unshard`` / ``schedule`` calls inside ``fn`` say (``grad_reduce="mean"`` by default). An
    input that does not influence the value gets zero gradients; a value without autograd
    history raises (see [Note: a value without autograd history]). Frozen leaves
    (``requires_grad=False``) and integer leaves get ``None``, with no communication for them
    (see [Note: frozen leaves] for trees where no leaf requires grad). Plain autograd underneath:
    ``fn`` runs once with fresh leaves, then one ``torch.autograd.grad``. A tensor with a
    leading dim of 0 among the non-differentiated arguments is an empty batch: with
    ``grad_reduce="mean"`` the ``unshard`` / ``schedule`` calls inside raise on every rank (see
    docs/failures.md).

    Args:
        fn: returns a scalar tensor, or ``(scalar, aux)`` with ``has_aux=True``.
        argnums: which positional arguments to differentiate (an int or a sequence of ints).
        has_aux: return ``((value, aux), grads)``.
        sync_grads: ``False`` skips gradient communication: the gradients of sharded leaves
            are this rank's *unreduced full* gradients (plain tensors of the global shape, in
            the shard's dtype), to accumulate over micro-batches and reduce once with
            :func:`~funcshard.reduce`. See [Note: gradient accumulation without communication].
        grad_placements: ``fn(path, param) -> placements | None`` for the gradients of
            replicated DTensor parameters (a ``Replicate()`` mesh dim), e.g.
            ``fs.optim.state_placements``: their gradients are reduce-scattered straight into
            these placements (ZeRO-2, for ``fs.optim.shard_state`` with the same placements)
            instead of all-reduced whole. See [Note: gradients in the optimizer state's layout].

    Raises:
        TypeError: the value is not a scalar tensor, or a differentiated leaf is not a tensor.
        ValueError: the value has no autograd history (``fn`` ran under ``torch.no_grad()``, or
            detached it) while there are leaves to differentiate; ``grad_placements`` that do
            not refine a parameter's placements.
        NotImplementedError: ``grad_placements`` with ``sync_grads=False``, inside a
            ``torch.func`` transform or ``torch.compile``, or for a 2-D (FSDP x TP) layout.
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        _check_argnums(fn, nums, len(args))
        args = list(args)
        rebuild, inputs, inputs_leaves = [], [], []
        direct: dict[int, tuple[DTensor, torch.Tensor]] = {}
        plain = Mode.now().plain
        moved: dict = {}  # see [Note: gradients in the optimizer state's layout]
        if grad_placements is not None:
            _refuse_grad_placements(fn, plain, sync_grads)
        for n in nums:
            paths, leaves, spec = flatten(args[n])
            wanted = _differentiated(paths, leaves)
            fresh = [
                _fresh_leaf(x, w, direct if plain else None)
                for x, w in zip(leaves, wanted, strict=True)
            ]
            if grad_placements is not None:
                moved.update(_grad_layout.targets(paths, fresh, wanted, grad_placements))
            args[n] = unflatten(spec, fresh)
            rebuild.append((spec, len(fresh), len(inputs)))
            inputs.extend(_tensor(x) if w else None for x, w in zip(fresh, wanted, strict=True))
            inputs_leaves.extend(fresh)
        collect = _sink.collecting() if not sync_grads else nullcontext()
        into = _grad_layout.Into(moved) if moved else None
        outer = bool(_spec.DIRECT)  # see [Note: a value without autograd history]
        _spec.DIRECT.append(direct)
        try:
            batch = [a for i, a in enumerate(args) if i not in nums and i - len(args) not in nums]
            with (
                torch.enable_grad(),
                collect as sink,
                _counts.batch(batch, kwargs),
                _grad_layout.collecting(into),
            ):
                out = fn(*args, **kwargs)
                value, aux = out if has_aux else (out, None)
                _check_value(fn, value, has_aux)
                if outer:
                    _NESTED.add(id(_spec.DIRECT[-2]))
                if not value.requires_grad and any(t is not None for t in inputs):
                    raise _nested_error(fn) if id(direct) in _NESTED else _no_history_error(fn)
                if sink is None:
                    grads = _grads(value, inputs, inputs_leaves, direct, into)
                else:
                    grads = _unreduced(value, sink, inputs, inputs_leaves)
        finally:
            _spec.DIRECT.pop()
            _NESTED.discard(id(direct))
        trees = [unflatten(spec, grads[start : start + n]) for spec, n, start in rebuild]
        result = trees[0] if isinstance(argnums, int) else tuple(trees)
        value = value.detach()
        return ((value, aux) if has_aux else value), result

    # see [Note: funcshard under torch.compile]
    return traced(wrapped, getattr(fn, "__name__", "value_and_grad"))


def grad(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    sync_grads: bool = True,
    grad_placements: GradPlacements | None = None,
) -> Callable[..., Any]:
    """Like :func:`value_and_grad` but returns only the gradients (``(grads, aux)`` with aux)."""
    vg = value_and_grad(
        fn, argnums, has_aux, sync_grads=sync_grads, grad_placements=grad_placements
    )

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        (value_aux, grads) = vg(*args, **kwargs)
        return (grads, value_aux[1]) if has_aux else grads

    return wrapped


# [Note: a value without autograd history]
# A value that does not depend on some differentiated leaves gives them zero gradients (a frozen
# branch, an unused head: ``autograd.grad(..., allow_unused=True)``, then zeros). A value with no
# autograd history at all -- the forward ran under ``torch.no_grad()`` or
# ``torch.inference_mode()``, or the loss was detached (``.detach()``, ``.item()``,
# ``torch.tensor(...)``) -- depends on none of them, and zeros would train nothing, silently:
# that raises, as ``torch.autograd.grad`` refuses such a value. The check is local and costs
# nothing; the ranks cannot silently disagree about it where it matters: a forward under
# ``no_grad`` on some ranks only is refused by the per-call check of its first ``unshard`` /
# ``schedule`` call, whose status says whether the call computes gradients (``_counts.agree``),
# before any collective. A value detached on some ranks only, after a forward with gradients,
# raises there, while the others wait in their backward's collectives until that rank exits
# and its error is quoted (``_liveness``), or, if it catches it, until the wait's limit. A
# value computed by a nested ``fs.value_and_grad`` is detached too (a value, not a graph): that
# gets its own message. ``_NESTED`` holds the outer calls (by the id of their entry on
# ``_spec.DIRECT``) inside which an inner one ran.
_NESTED: set[int] = set()


def _nested_error(fn) -> TypeError:
    return TypeError(
        f"value_and_grad: {getattr(fn, '__name__', 'fn')} calls fs.value_and_grad (or fs.grad) "
        "inside another fs.value_and_grad, and its value depends on the inner one's value, which "
        "is detached: the outer gradients would be zeros. Differentiate once (return what you "
        "need as aux with has_aux=True), or use torch.func.grad for higher-order derivatives."
    )


def _no_history_error(fn) -> ValueError:
    return ValueError(
        f"value_and_grad: {getattr(fn, '__name__', 'fn')} returned a value without autograd "
        "history (requires_grad=False), so it depends on none of the differentiated leaves and "
        "every gradient would be zero. Likely cause: the forward ran under torch.no_grad() or "
        "torch.inference_mode() (inside the loss, or in a module's forward), or the loss was "
        "detached (.detach(), .item(), torch.tensor(...)); torch.autograd.grad refuses such a "
        "value too. Compute the loss with grad mode on; to evaluate it without gradients, call "
        "the loss directly under torch.no_grad()."
    )


def _refuse_grad_placements(fn, plain: bool, sync_grads: bool) -> None:
    if not sync_grads or not plain:
        where = "with sync_grads=False" if not sync_grads else "inside torch.func or compile"
        raise NotImplementedError(
            f"value_and_grad: grad_placements {where} is not supported: the gradients are "
            "reduce-scattered in the backward of plain autograd. Drop grad_placements (the "
            "gradients come back placed like the parameters; fs.optim.shard_state takes its "
            "share of them)."
        )


def _check_argnums(fn, nums: tuple, given: int) -> None:
    bad = [n for n in nums if not isinstance(n, int) or not -given <= n < given]
    if bad:
        raise ValueError(
            f"value_and_grad: argnums {bad} out of range: {getattr(fn, '__name__', 'fn')} was "
            f"called with {given} positional argument(s); argnums index the positional "
            "arguments (keyword arguments are never differentiated)."
        )


def _check_value(fn, value, has_aux: bool) -> None:
    if not (isinstance(value, torch.Tensor) and value.numel() == 1):
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(
            f"value_and_grad: {getattr(fn, '__name__', 'fn')} must return a one-element tensor"
            f"{' (as the first element of (value, aux))' if has_aux else ''}, got {got}."
        )


def _unreduced(value, sink: _sink.GradSink, inputs, leaves) -> list[torch.Tensor | None]:
    """Gradients without sync: for sharded leaves, the sum of the full gradients of every
    tensor gathered from them (see [Note: gradient accumulation without communication])."""
    shard = [isinstance(x, LocalShard | DTensor) for x in leaves]
    plain = [t for t, s in zip(inputs, shard, strict=True) if t is not None and not s]
    targets = [t for _, t in sink.targets]
    wanted = plain + targets
    grads = _autograd(value, wanted)
    full: dict[int, torch.Tensor] = {}
    for (leaf, t), g in zip(sink.targets, grads[len(plain) :], strict=True):
        g = torch.zeros_like(t) if g is None else g
        full[id(leaf)] = g if id(leaf) not in full else full[id(leaf)] + g
    out, plain_grads = [], iter(grads[: len(plain)])
    for t, x, s in zip(inputs, leaves, shard, strict=True):
        if t is None:
            out.append(None)
        elif not s:
            g = next(plain_grads)
            out.append(torch.zeros_like(t) if g is None else g)
        else:
            shape = x.spec.shape if isinstance(x, LocalShard) else x.shape
            g = full.get(id(x))
            out.append(t.new_zeros(shape) if g is None else g.detach().to(t.dtype))
    return out


def _differentiated(paths: list[str], leaves: list[Any]) -> list[bool]:
    """Which leaves of one differentiated argument get gradients.

    [Note: frozen leaves]
    As ``torch.autograd``: a floating-point (or complex) tensor that requires grad. A frozen
    parameter (``requires_grad=False``) and an integer tensor get ``None`` and take no part in
    the backward communication. One exception keeps JAX-style code working: if *no* leaf of the
    argument requires grad -- a tree built without autograd, e.g. by an out-of-place update under
    ``torch.no_grad()`` -- every floating-point leaf is differentiated, as ``jax.grad`` does.
    """
    for path, x in zip(paths, leaves, strict=True):
        if not isinstance(_tensor(x), torch.Tensor):
            raise TypeError(
                f"value_and_grad: differentiated argument has a {type(x).__name__} at {path!r}; "
                "only tensors (DTensors, LocalShards) can be differentiated -- pass other values "
                "as non-differentiated arguments."
            )
    floating = [_tensor(x).is_floating_point() or _tensor(x).is_complex() for x in leaves]
    asked = [f and _tensor(x).requires_grad for x, f in zip(leaves, floating, strict=True)]
    return asked if any(asked) else floating


def _fresh_leaf(x, differentiated: bool, direct: dict | None = None):
    """A detached alias of ``x`` (a new autograd leaf if ``differentiated``).

    With ``direct`` (plain autograd), a DTensor's local shard gets a leaf of its own too,
    recorded in ``direct``: see [Note: differentiating the local shards]."""
    if direct is not None and type(x) is DTensor:
        local = x._local_tensor
        local = local.detach() if local.requires_grad else local  # a wrapper, not a view
        dt = DTensor(local, x._spec, requires_grad=differentiated)
        direct[id(dt)] = (dt, local.detach().requires_grad_(differentiated))
        return dt
    t = _tensor(x).detach()
    t = t.requires_grad_() if differentiated else t
    return LocalShard(t, x.spec) if isinstance(x, LocalShard) else t


def _grads(value, inputs, leaves, direct, into=None) -> list[Any]:
    """Gradients of ``value`` w.r.t. ``inputs`` (``None`` entries: not differentiated).

    [Note: differentiating the local shards]
    Differentiating a DTensor leaf costs two autograd Functions per call (``ToLocal`` where
    ``schedule`` / ``unshard`` take its local shard, ``FromLocal`` in their backward) and one
    DTensor construction per parameter per step for the gradient, paid inside autograd. Under
    plain autograd, each differentiated DTensor ``x`` is therefore given two leaves: the DTensor
    ``fn`` sees (``x``'s spec object around a detached alias of its shard) and a plain tensor
    leaf for its local shard, recorded in ``_spec.DIRECT`` while ``fn`` runs. ``as_locals``
    hands the recorded local leaf straight to the collectives (no Function, no wrapping),
    and its gradient is wrapped into a DTensor once, here, outside autograd, with the same spec
    object. DTensor code in ``fn`` (``p.to_local()``, DTensor arithmetic, a DTensor inside a
    ``torch.func`` transform) still differentiates the DTensor leaf, and the two gradients are
    added. ``_spec.DIRECT`` holds the leaves only during the call: nothing of it is reachable
    from the graph. Under ``torch.func`` transforms and ``torch.compile`` the old route stays.
    """
    moved = into.targets if into is not None else {}  # see [Note: gradients in the ... layout]
    extra = [x for x, t in zip(leaves, inputs, strict=True) if t is not None and id(x) in direct]
    wanted = [
        direct[id(x)][1] if id(x) in direct else t
        for t, x in zip(inputs, leaves, strict=True)
        if t is not None and id(x) not in moved
    ]
    found = _autograd(value, wanted + extra + ([into.anchor] if moved else []))
    found, also = iter(found[: len(wanted)]), iter(found[len(wanted) :])
    out = []
    for t, x in zip(inputs, leaves, strict=True):
        if t is None:
            out.append(None)
            continue
        if id(x) in moved:
            g, via_dtensor = into.gradient(x), next(also)
            if via_dtensor is not None:  # fn used the DTensor itself too
                g = g + _grad_layout.view(via_dtensor, g.placements)
            out.append(g)
            continue
        g = next(found)
        if id(x) in direct:
            local = direct[id(x)][1]
            g = torch.zeros_like(local) if g is None else g
            g = DTensor(g.detach() if g.requires_grad else g, x._spec, requires_grad=False)
            via_dtensor = next(also)
            if via_dtensor is not None:  # fn used the DTensor itself too
                g = g + via_dtensor
            out.append(g)
            continue
        out.append(_like(torch.zeros_like(t) if g is None else g, x))
    return out


def _autograd(value: torch.Tensor, wanted: list) -> tuple:
    """``autograd.grad`` with ``None`` for unused inputs; all ``None`` for a value without
    history (refused before where a leaf is differentiated: see [Note: a value without
    autograd history])."""
    if not wanted:
        return ()
    if not value.requires_grad:
        return (None,) * len(wanted)
    return torch.autograd.grad(value, wanted, allow_unused=True)


def _tensor(x) -> torch.Tensor:
    return x.tensor if isinstance(x, LocalShard) else x


def _like(g: torch.Tensor, x):
    return LocalShard(g, x.spec) if isinstance(x, LocalShard) else g


def per_sample_grad(
    fn: Callable[..., Any],
    *,
    in_dims: int | Sequence[int | None] | None = 0,
    param_dtype: torch.dtype | None = None,
) -> Callable[..., Any]:
    """``fn(full_params, *sample) -> scalar`` (one sample, no batch dim) becomes
    ``f(sharded, *batch) -> per-sample gradients``: the gradients of *this rank's own* samples
    with respect to the full parameters.

    The parameters are gathered once per call, without autograd (one all-gather per bucket); the
    per-sample gradients are then ``vmap(grad(fn))`` on the full tensors, with no communication.
    Each result leaf has the full parameter's shape with the batch dim in front:
    ``{fqn: [B, *global shape]}``, a plain tensor. Clip or otherwise combine them, then
    :func:`~funcshard.reduce` into shards.

    [Note: per-sample gradients through unshard]
    ``torch.func.vmap(torch.func.grad(loss))`` over a loss that calls :func:`~funcshard.unshard`
    runs the backward reduce-scatter once per sample index: sample ``i``'s gradient is then the
    mean over ranks of every rank's sample ``i`` -- the gradient convention of ``unshard``, not
    what DP-SGD wants. Gathering first and differentiating with respect to the full tensors gives
    each rank its own samples' gradients, at one all-gather per step.

    Args:
        fn: the loss of one sample; its first argument is the ``{fqn: full tensor}`` tree.
        in_dims: ``vmap``'s in_dims for the batch arguments (an int, ``None`` for an argument
            shared by all samples, or one per argument).
        param_dtype: gather (and differentiate) the parameters in this dtype.
    """

    @functools.wraps(fn)
    def wrapped(sharded, *batch):
        with torch.no_grad():
            full = unshard(sharded, param_dtype=param_dtype)
        dims = (in_dims,) * len(batch) if not isinstance(in_dims, Sequence) else tuple(in_dims)
        return torch.func.vmap(torch.func.grad(fn), in_dims=(None, *dims))(full, *batch)

    return wrapped
