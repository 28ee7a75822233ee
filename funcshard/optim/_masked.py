"""Masks: which parameters a transformation (or weight decay) applies to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._trees._tree import PyTree, flatten, unflatten
from ._base import GradientTransformation, leaves_like

Mask = Callable[[str, torch.Tensor], bool] | PyTree  # a predicate, or a tree of bools


def at_least_2d(path: str, param: torch.Tensor) -> bool:
    """The usual weight-decay mask: ``True`` for parameters with 2 or more dims (weights of
    linear, convolution and embedding layers), ``False`` for biases, norm scales and scalars."""
    return param.dim() >= 2


def resolve(mask: Mask, tree: PyTree, fn: str) -> list[bool]:
    """One bool per leaf of ``tree`` (``None`` leaves included, always ``False``).

    ``mask`` is a predicate ``mask(path, leaf) -> bool`` (``path``: the key path, ``"layers[0].w"``
    or a dict key such as ``"0.weight"``), or a tree of bools with ``tree``'s structure.

    Raises:
        ValueError: a mask tree with other keys; TypeError: an entry that is not a bool.
    """
    paths, leaves, _ = flatten(tree, none_is_leaf=True)
    if callable(mask):
        picked = [x is not None and mask(p, x) for p, x in zip(paths, leaves, strict=True)]
    else:
        picked = leaves_like(mask, tree, "mask", "params")
    out = []
    for path, x, m in zip(paths, leaves, picked, strict=True):
        if not isinstance(m, bool | None) and not (
            isinstance(m, torch.Tensor) and m.dtype == torch.bool and m.numel() == 1
        ):
            raise TypeError(
                f"{fn}: the mask's entry for {path!r} is a {type(m).__name__}; a mask gives one "
                "bool per parameter (True: apply), as a tree of bools or fn(path, param) -> bool."
            )
        out.append(x is not None and bool(m))
    return out


def keep(tree: PyTree, picked: list[bool]) -> PyTree:
    """``tree`` with the leaves not ``picked`` replaced by ``None``."""
    _, leaves, spec = flatten(tree, none_is_leaf=True)
    return unflatten(spec, [x if k else None for x, k in zip(leaves, picked, strict=True)])


class MaskedState(NamedTuple):
    """The state of :func:`masked`: the inner transformation's state (``None`` where masked)."""

    inner: Any


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Apply ``inner`` only to the leaves that ``mask`` selects, as ``optax.masked`` does.

    ``inner`` sees ``None`` in place of the other leaves (so it keeps no state for them), and
    their updates pass through unchanged. Typical use:
    ``chain(masked(add_decayed_weights(wd), fs.optim.at_least_2d), sgd(lr))``.

    Args:
        inner: the transformation to restrict.
        mask: ``fn(path, param) -> bool``, or a tree of bools with the parameters' structure.
    """

    def init(params):
        return MaskedState(inner.init(keep(params, resolve(mask, params, "masked"))))

    def run(grads, state, params, inplace: bool):
        if not isinstance(state, MaskedState):
            raise TypeError(
                f"masked: the state is a {type(state).__name__}, not the MaskedState that this "
                "transformation's init returned."
            )
        picked = resolve(mask, grads if params is None else params, "masked")
        sub_params = None if params is None else keep(params, picked)
        update = (inner.update_inplace or inner.update) if inplace else inner.update
        sub, inner_state = update(keep(grads, picked), state.inner, sub_params)
        _, gs, spec = flatten(grads, none_is_leaf=True)
        us = leaves_like(sub, grads, "updates", "grads")
        merged = [u if k else g for g, u, k in zip(gs, us, picked, strict=True)]
        return unflatten(spec, merged), MaskedState(inner_state)

    return GradientTransformation(
        init,
        lambda grads, state, params=None: run(grads, state, params, False),
        lambda grads, state, params=None: run(grads, state, params, True),
    )
