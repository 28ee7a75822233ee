"""JAX-style ``value_and_grad`` / ``grad`` over sharded trees, on plain autograd."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._spec import LocalShard
from ._tree import flatten, unflatten


def value_and_grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``fn(sharded, *args) -> scalar`` becomes ``f(sharded, *args) -> (value, grads)``.

    Gradients have the structure of the differentiated arguments and the same leaf types:
    DTensors with the inputs' placements (or LocalShards for LocalShard inputs), reduced as the
    ``unshard`` / ``schedule`` calls inside ``fn`` say (``grad_reduce="mean"`` by default). An
    input that does not influence the value gets zero gradients. Plain autograd underneath:
    ``fn`` runs once with fresh leaves, then one ``torch.autograd.grad``.

    Args:
        fn: returns a scalar tensor, or ``(scalar, aux)`` with ``has_aux=True``.
        argnums: which positional arguments to differentiate (an int or a sequence of ints).
        has_aux: return ``((value, aux), grads)``.

    Raises:
        TypeError: the value is not a scalar tensor, or a differentiated leaf is not a tensor.
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args = list(args)
        rebuild, inputs = [], []
        for n in nums:
            paths, leaves, spec = flatten(args[n])
            fresh = [_fresh_leaf(p, x) for p, x in zip(paths, leaves, strict=True)]
            args[n] = unflatten(spec, fresh)
            rebuild.append((spec, fresh, len(inputs)))
            inputs.extend(_tensor(x) for x in fresh)
        with torch.enable_grad():
            out = fn(*args, **kwargs)
        value, aux = out if has_aux else (out, None)
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(
                f"value_and_grad: {getattr(fn, '__name__', 'fn')} must return a scalar tensor"
                f"{' (as the first element of (value, aux))' if has_aux else ''}, got {got}."
            )
        grads = torch.autograd.grad(value, inputs, allow_unused=True) if inputs else ()
        grads = [
            torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True)
        ]
        trees = [
            unflatten(
                spec,
                [
                    _like(g, x)
                    for g, x in zip(grads[start : start + len(fresh)], fresh, strict=True)
                ],
            )
            for spec, fresh, start in rebuild
        ]
        result = trees[0] if isinstance(argnums, int) else tuple(trees)
        value = value.detach()
        return ((value, aux) if has_aux else value), result

    return wrapped


def grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """Like :func:`value_and_grad` but returns only the gradients (``(grads, aux)`` with aux)."""
    vg = value_and_grad(fn, argnums, has_aux)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        (value_aux, grads) = vg(*args, **kwargs)
        return (grads, value_aux[1]) if has_aux else grads

    return wrapped


def _fresh_leaf(path: str, x):
    if isinstance(x, LocalShard):
        return LocalShard(x.tensor.detach().requires_grad_(), x.spec)
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_()
    raise TypeError(
        f"value_and_grad: differentiated argument has a {type(x).__name__} at {path!r}; only "
        "tensors (DTensors, LocalShards) can be differentiated -- pass other values as "
        "non-differentiated arguments."
    )


def _tensor(x) -> torch.Tensor:
    return x.tensor if isinstance(x, LocalShard) else x


def _like(g: torch.Tensor, x):
    return LocalShard(g, x.spec) if isinstance(x, LocalShard) else g
