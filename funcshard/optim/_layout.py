"""The optimizer's state laid out apart from the parameters: more sharded than they are.

[Note: state more sharded than the parameters]
A replicated parameter (DDP, the replica dim of an HSDP mesh, a tensor-parallel norm) has its
whole value on every rank, and an optimizer placed like it keeps its whole state on every rank
too. ZeRO-1 keeps each rank's share of the state only: ``shard_state(inner)`` runs ``inner`` on
the parameters and gradients seen through *state placements*, in which every ``Replicate()`` mesh
dim of a parameter becomes ``Shard(d)`` on a tensor dim ``d`` the parameter does not shard (as a
JAX user gives the optimizer state its own partition spec). This rank's block under the state
placements is a sub-block of its block under the parameters' (``d`` is whole there), so the views
cost nothing: ``inner`` updates its share of the parameter in place (or returns updates for it),
and one all-gather per parameter and step (``redistribute`` back to the parameter's placements)
gives every replica the whole result. ``inner`` sees ordinary DTensors: AdamW updates its shard
elementwise, and Muon gives each matrix one owner, as for any sharded matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .._communication._grad_layout import check_refines, view
from .._trees._tree import PyTree, flatten, unflatten
from ._base import GradientTransformation, leaves_like, local

StatePlacements = Callable[[str, DTensor], tuple[Placement, ...] | None]


def shard_state(
    inner: GradientTransformation, placements: StatePlacements | None = None
) -> GradientTransformation:
    """``inner`` with its state (and its arithmetic) sharded over the mesh dims on which the
    parameters are replicated: ZeRO-1 for replicated parameters, and the state more sharded than
    the parameters for HSDP (see [Note: state more sharded than the parameters]).

    The updates (or, in :func:`step`, the parameters) come back placed like the parameters, by
    one all-gather per parameter with a replicated mesh dim. Gradients may come placed like the
    parameters or already in the state placements (ZeRO-2: ``fs.value_and_grad(...,
    grad_placements=...)`` with the same placements; see [Note: gradients in the optimizer
    state's layout] in ``_grad_layout``). Plain tensors, and parameters with
    no ``Replicate()`` dim or no tensor dim left to shard (a bias on an HSDP mesh), are passed
    to ``inner`` as they are.

    Args:
        inner: the optimizer (a chain ending with one, a partition, ...).
        placements: ``fn(path, param) -> placements`` for the state, or ``None`` for the
            default; each must equal the parameter's on its ``Shard`` mesh dims and may shard
            its ``Replicate`` ones on a tensor dim the parameter does not shard.

    Raises:
        ValueError: placements that are not such a refinement of the parameter's, naming it.
    """

    def init(params):
        return inner.init(_views(params, placements, params))

    def run(grads, state, params, inplace: bool):
        ref = grads if params is None else params
        vg = _views(grads, placements, ref)
        vp = None if params is None else _views(params, placements, ref)
        update = (inner.update_inplace or inner.update) if inplace else inner.update
        updates, state = update(vg, state, vp)
        _, ps, spec = flatten(ref, none_is_leaf=True)
        us = leaves_like(updates, ref, "updates", "params")
        gs = leaves_like(grads, ref, "grads", "params")
        vs = [None] * len(ps) if vp is None else flatten(vp, none_is_leaf=True)[1]
        out = []
        for p, g, u, v in zip(ps, gs, us, vs, strict=True):
            moved = isinstance(v, DTensor) and v.placements != p.placements
            if moved and u is not None:
                u = u.redistribute(p.device_mesh, p.placements)
            elif moved and inplace and g is not None:  # applied to this rank's share: gather
                local(p).copy_(v.redistribute(p.device_mesh, p.placements).to_local())
            out.append(u)
        return unflatten(spec, out), state

    return GradientTransformation(
        init,
        lambda grads, state, params=None: run(grads, state, params, False),
        lambda grads, state, params=None: run(grads, state, params, True),
    )


def state_placements(path: str, param: DTensor) -> tuple[Placement, ...]:
    """The default state placements: each ``Replicate()`` mesh dim of ``param`` becomes
    ``Shard(d)``, ``d`` its first tensor dim that no mesh dim shards (unchanged if none)."""
    sharded = {p.dim for p in param.placements if isinstance(p, Shard)}
    free = [d for d in range(param.dim()) if d not in sharded]
    if not free:
        return tuple(param.placements)
    return tuple(Shard(free[0]) if isinstance(p, Replicate) else p for p in param.placements)


def _views(tree: PyTree, placements: StatePlacements | None, params: PyTree) -> PyTree:
    """``tree`` (placed like ``params``) seen through the state placements, without copies."""
    paths, xs, spec = flatten(tree, none_is_leaf=True)
    ps = leaves_like(params, tree, "params", "grads")
    out: list[Any] = []
    for path, x, p in zip(paths, xs, ps, strict=True):
        if not isinstance(x, DTensor) or p is None:
            out.append(x)
            continue
        target = tuple((placements or state_placements)(path, p) or p.placements)
        if target != tuple(x.placements):
            check_refines(path, tuple(x.placements), target, x.dim())
            x = view(x, target)
        out.append(x)
    return unflatten(spec, out)
