"""An exponential moving average of sharded parameters, with no communication.

[Note: the average of uneven shards]
The average is elementwise, so each rank averages its own shards: no communication, and the
average is placed exactly like the parameters. Rebuilding a DTensor from a local shard with
``DTensor.from_local(t, mesh, placements)`` alone *infers* the global shape as if every rank held
a shard of this rank's size, which is wrong for uneven shards (7 rows over 2 ranks: 4 and 3; rank
1 would infer 6, rank 0 8), a known FSDP2 pitfall. The average's DTensors are made with the
parameters' own global shape and stride (``wrap``), never inferred.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .._trees._tree import PyTree, flatten, unflatten
from ._adam_sgd import _check, _check_state
from ._base import leaves_like, local, without_grad, wrap


class EmaState(NamedTuple):
    """State of :func:`ema`: ``count`` (int64, updates done) and ``average``, a tree like the
    parameters (DTensors placed like them; ``None`` for non-floating-point parameters)."""

    count: torch.Tensor
    average: PyTree


class Ema(NamedTuple):
    """``init(params) -> EmaState`` (a copy of the parameters); ``update(state, params) ->
    state`` (pure); ``update_inplace(state, params) -> state`` (donates ``state``)."""

    init: Callable[[PyTree], EmaState]
    update: Callable[[EmaState, PyTree], EmaState]
    update_inplace: Callable[[EmaState, PyTree], EmaState]


def ema(decay: float, *, dtype: torch.dtype | None = None) -> Ema:
    """An exponential moving average of the parameters: ``average = decay * average + (1 -
    decay) * params`` after each update, starting from the parameters themselves.

    Computed as ``torch.optim.swa_utils.get_ema_multi_avg_fn`` computes it (``average.lerp_(p,
    1 - decay)``), on the local shards, with no communication (see [Note: the average of uneven
    shards]). Evaluate with the average in place of the parameters (``apply(state.average,
    ...)``); checkpoint the state with the rest of the training state.

    Args:
        decay: in ``[0, 1]``; ``0.999`` averages over about the last 1000 updates.
        dtype: the average's dtype (e.g. ``torch.float32`` for bfloat16 parameters); default
            the parameters'.

    Raises:
        ValueError: ``decay`` outside ``[0, 1]``; (from ``update``) a tree that does not pair with
            the state's.
    """
    _check("ema", "decay", decay, isinstance(decay, int | float) and 0 <= decay <= 1, "in [0, 1]")

    @without_grad
    def init(params: PyTree) -> EmaState:
        _, leaves, spec = flatten(params, none_is_leaf=True)
        average = [
            None
            if p is None or not p.is_floating_point()
            else wrap(local(p).to(dtype or p.dtype, copy=True), p)
            for p in leaves
        ]
        return EmaState(torch.zeros((), dtype=torch.int64), unflatten(spec, average))

    @without_grad
    def update(state: EmaState, params: PyTree, inplace: bool = False) -> EmaState:
        _check_state("ema", state, EmaState)
        _, ps, spec = flatten(params, none_is_leaf=True)
        avgs = leaves_like(state.average, params, "ema state.average", "params")
        todo = [i for i, a in enumerate(avgs) if a is not None]
        targets = [local(avgs[i]) if inplace else local(avgs[i]).clone() for i in todo]
        sources = [local(ps[i]).to(t.dtype) for i, t in zip(todo, targets, strict=True)]
        if targets:
            torch._foreach_lerp_(targets, sources, 1 - decay)
        if inplace:
            state.count.add_(1)
            return state
        out = list(avgs)
        for i, t in zip(todo, targets, strict=True):
            out[i] = wrap(t, avgs[i])
        return EmaState(state.count + 1, unflatten(spec, out))

    return Ema(init, update, lambda state, params: update(state, params, True))
