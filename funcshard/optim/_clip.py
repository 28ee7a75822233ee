"""The global gradient norm over every shard of every rank, and clipping by it.

[Note: each element once]
The global norm counts every element of every parameter once. A ``Shard`` placement splits a
tensor, but a ``Replicate`` placement (0-d parameters; the replica dim of an HSDP mesh) keeps a
full copy of the local tensor on each rank of that mesh dim, so summing the local squares over
all ranks would count it once per replica; so does a parameter on the data-parallel sub-mesh of
FSDP x TP, on each rank of the other (tensor-parallel) dims. Each leaf's local sum of squares
is therefore weighted by ``1 / (number of replicas)``; then one all-reduce over all ranks sums
every leaf at once. The result is the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .._communication import _hangs, _liveness
from .._communication._consensus import before_collective
from .._runtime._compat import compiling
from .._trees._parallel import sub_mesh_problem
from .._trees._spec import BySpec
from .._trees._tree import Flat, PyTree, flatten
from ._base import GradientTransformation, local, locals_of, without_grad, wrap


class ClipState(NamedTuple):
    """State of :func:`clip_by_global_norm`: ``norm``, the global norm of the last gradients
    it saw, before clipping (a 0-d float32 tensor, for logging)."""

    norm: torch.Tensor


@without_grad
def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all elements of ``tree``, as if every leaf were gathered and concatenated.

    For DTensor leaves, one all-reduce over all ranks (for every leaf together); each element
    counts once, replicated ones included (see [Note: each element once]). For plain tensors,
    this process's tensors only, without communication. ``None`` leaves are skipped. Sums of
    squares are taken in float32.

    Returns:
        A 0-d float32 tensor, the same on every rank.

    Raises:
        ValueError: a leaf is a ``Partial`` DTensor (reduce it first), lives on a mesh that does
            not span all ranks, or the tree mixes DTensors with plain tensors.
    """
    leaves = [x for x in Flat.of(tree).leaves if x is not None]  # see [Note: a dict of ...]

    def paths() -> list[str]:  # for an error only
        return flatten(tree)[0]

    kinds = set(map(type, leaves))
    sharded = any(issubclass(k, DTensor) for k in kinds)
    if sharded and not all(issubclass(k, DTensor) for k in kinds):
        plain = next(p for p, x in zip(paths(), leaves, strict=True) if not isinstance(x, DTensor))
        raise ValueError(
            f"global_norm: {plain!r} is a plain tensor in a tree of DTensors, so it is unclear "
            "whether it is the same on every rank; shard every leaf (fs.shard) or none."
        )
    if sharded:  # see [Note: the optimizer rides the next check] in _updates
        before_collective("global_norm's all-reduce")
    if not leaves:
        return torch.zeros(())
    (locals_,) = locals_of(range(len(leaves)), leaves)
    norms = torch._foreach_norm(locals_, 2, dtype=torch.float32)
    weights = _weights(leaves, paths) if sharded else None
    if weights is None:
        norms = torch.stack(norms)
        total = (norms * norms).sum()
    else:  # Python numbers: no host tensor copied in (capturable)
        total = torch.stack(torch._foreach_mul(torch._foreach_mul(norms, norms), weights)).sum()
    if sharded and dist.get_world_size() > 1:
        _liveness.doing("fs.optim.global_norm (the optimizer's clip): the all_reduce of the norm")
        try:
            if compiling():  # see [Note: the norm's all-reduce under torch.compile]
                ops = torch.ops._c10d_functional
                total = ops.wait_tensor(ops.all_reduce(total, "sum", dist.group.WORLD.group_name))
            else:
                dist.all_reduce(total)
        except RuntimeError as e:  # a peer died, or is not at this collective: say which
            _hangs.explain(e, "the all_reduce of fs.optim.global_norm")
            raise
    return total.sqrt()


# [Note: the norm's all-reduce under torch.compile]
# Dynamo traces c10d's in-place `dist.all_reduce` as an effectful op on the process group
# object, which inductor cannot lower ("'__eq__' is not implemented for ProcessGroup"): a whole
# step with clipping compiled with the default backend failed. While compiling, the norm is
# all-reduced with the functional collective instead, as funcshard's other collectives are.


def _weights(leaves: list[DTensor], paths: Callable[[], list[str]]) -> list[float] | None:
    """``1 / replicas`` per leaf (see [Note: each element once]), or ``None`` when every one is
    1; remembered per DTensorSpec (see [Note: checked DTensor specs] in ``_trees/_spec``)."""
    world, weights = BySpec.world(), []
    for i, x in enumerate(leaves):
        w = _WEIGHTS.get(x._spec, world)
        if w is None:
            w = _WEIGHTS.put(x._spec, world, 1 / _replicas(lambda i=i: paths()[i], x))
        weights.append(w)
    return None if all(w == 1 for w in weights) else weights


_WEIGHTS = BySpec()


def _replicas(path: Callable[[], str], x: DTensor) -> int:
    mesh, world = x.device_mesh, dist.get_world_size()
    if mesh.size() != world and sub_mesh_problem(mesh):
        raise ValueError(
            f"global_norm: {path()!r} lives on a mesh of {mesh.size()} ranks, but the norm is "
            f"summed over all {world} ranks; shard over a mesh of every rank."
        )
    n = world // mesh.size()  # the data-parallel mesh of FSDP x TP: the same on every tp rank
    for i, p in enumerate(x.placements):
        if isinstance(p, Replicate):
            n *= mesh.size(i)
        elif not isinstance(p, Shard | _StridedShard):
            raise ValueError(
                f"global_norm: {path()!r} has placement {p}; reduce partial gradients first "
                "(fs.reduce) so that each element has a value."
            )
    return n


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all gradients by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` their
    :func:`global_norm`, as ``torch.nn.utils.clip_grad_norm_`` does (on DTensor shards, one
    all-reduce). The norm before clipping is kept in the state (``ClipState.norm``) for logging.

    Raises:
        ValueError: ``max_norm`` is not a positive number.
    """
    if not (isinstance(max_norm, int | float) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"clip_by_global_norm: max_norm={max_norm!r}; it must be a number > 0.")

    def init(params):
        devices = [local(x).device for x in flatten(params)[1]]
        return ClipState(torch.zeros((), device=devices[0] if devices else None))

    @without_grad
    def update(grads, state, params=None, inplace=False):
        if not isinstance(state, ClipState):
            raise TypeError(
                f"clip_by_global_norm: the state is a {type(state).__name__}, not the ClipState "
                "that this transformation's init returned."
            )
        norm = global_norm(grads)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        flat = Flat.of(grads)
        gs = flat.leaves
        todo = [i for i, g in enumerate(gs) if g is not None]
        (tensors,) = locals_of(todo, gs)
        if inplace:
            torch._foreach_mul_(tensors, coef)
            return grads, ClipState(norm)
        # in place on copies: a 0-dim low-precision gradient times the float32 coefficient
        # would otherwise promote to float32; clip_grad_norm_ keeps the gradients' dtype
        scaled = [t.clone() for t in tensors]
        if scaled:
            torch._foreach_mul_(scaled, coef)
        out = list(gs)
        for i, s in zip(todo, scaled, strict=True):
            out[i] = wrap(s, gs[i])
        return flat.rebuild(out), ClipState(norm)

    return GradientTransformation(
        init, update, lambda grads, state, params=None: update(grads, state, params, True)
    )
