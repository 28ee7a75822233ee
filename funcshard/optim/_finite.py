"""``apply_if_finite``: skip the updates of a step whose gradients are not finite, on every rank.

[Note: one verdict for every rank]
A NaN or inf in one rank's batch reaches every parameter through the gradient reduction, and a
clipped step then makes every parameter NaN (the global norm is NaN). Whether a step is skipped
must be decided the same way on every rank, or the replicas of a parameter diverge: each rank
tests its own shards (``isfinite`` on every gradient it holds), and for sharded (DTensor)
gradients one all-reduce of that one flag (MIN over all ranks) gives every rank the same answer.
Plain-tensor trees (one process, or gradients already equal on every rank) are not
communicated. The decision is read on the host (one synchronisation per step on a GPU), so this
transformation runs eagerly, not inside ``torch.compile``. As optax's ``apply_if_finite``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._communication import _hangs, _liveness
from .._communication._consensus import before_collective
from .._trees._tree import PyTree, flatten, unflatten
from ._base import GradientTransformation, local, without_grad


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite` (optax's fields): ``notfinite_count`` (int64, the
    non-finite steps in a row), ``last_finite`` (bool, the last step's verdict),
    ``total_notfinite`` (int64, all skipped steps) and ``inner_state``."""

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformation:
    """``inner``, except that a step whose gradients hold a NaN or inf on any rank is skipped on
    every rank: no update (``None`` updates), ``inner``'s state kept, the counts in the state
    advanced. After more than ``max_consecutive_errors`` such steps in a row the update is
    applied anyway (as optax does), so that a run does not silently stop training.

    Cost: an ``isfinite`` pass over the local gradients and, for DTensor gradients, one
    all-reduce of one element per step (see [Note: one verdict for every rank]).

    Raises:
        ValueError: ``max_consecutive_errors`` is not an int >= 0.
        TypeError: (from ``update``) the state is not the ``ApplyIfFiniteState`` of ``init``.
    """
    if not isinstance(max_consecutive_errors, int) or max_consecutive_errors < 0:
        raise ValueError(
            f"apply_if_finite: max_consecutive_errors={max_consecutive_errors!r}; it must be an "
            "int >= 0."
        )

    def init(params):
        zero = torch.zeros((), dtype=torch.int64)
        return ApplyIfFiniteState(zero, torch.ones((), dtype=torch.bool), zero.clone(),
                                  inner.init(params))  # fmt: skip

    def run(grads, state, params, inplace: bool):
        if not isinstance(state, ApplyIfFiniteState):
            raise TypeError(
                f"apply_if_finite: the state is a {type(state).__name__}, not the "
                "ApplyIfFiniteState that this transformation's init returned."
            )
        finite = all_finite(grads)
        count = 0 if finite else int(state.notfinite_count) + 1
        total = state.total_notfinite + (0 if finite else 1)
        if finite or count > max_consecutive_errors:
            update = (inner.update_inplace or inner.update) if inplace else inner.update
            updates, inner_state = update(grads, state.inner_state, params)
        else:
            _, leaves, spec = flatten(grads, none_is_leaf=True)
            updates, inner_state = unflatten(spec, [None] * len(leaves)), state.inner_state
        counts = (torch.tensor(count), torch.tensor(finite), total)
        return updates, ApplyIfFiniteState(*counts, inner_state)

    return GradientTransformation(
        init,
        lambda grads, state, params=None: run(grads, state, params, False),
        lambda grads, state, params=None: run(grads, state, params, True),
    )


@without_grad
def all_finite(tree: PyTree) -> bool:
    """Whether every element of every leaf of ``tree`` is finite, on every rank (the same answer
    on every rank; one all-reduce when ``tree`` holds DTensors). ``None`` leaves are skipped."""
    _, leaves, _ = flatten(tree)
    if not leaves:
        return True
    # the optimizer's records first: see [Note: the optimizer rides the next check] in _updates
    if dist.is_initialized() and any(isinstance(x, DTensor) for x in leaves):
        before_collective("all_finite's all-reduce")
    flags = torch.stack([local(x).isfinite().all() for x in leaves]).all()
    flag = flags.to(torch.int32)
    if any(isinstance(x, DTensor) for x in leaves) and dist.is_initialized():
        _liveness.doing("fs.optim.all_finite: the all_reduce of the flags")
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        except RuntimeError as e:  # a peer died, or is not at this collective: say which
            _hangs.explain(e, "the all_reduce of fs.optim.all_finite")
            raise
    return bool(flag)
