"""Reshard to a smaller mesh after forward: ``reshard_after_forward=N`` (FSDP2's int form).

[Note: reshard to a smaller mesh]
A group with ``reshard_after_forward=N`` (plan step ``reshard``) keeps, after its last forward
run, a ``1/N`` slice of its gathered parameters instead of nothing, so that backward gathers
them again within a sub-group of ``N`` ranks (a node: fast links) instead of the whole sharded
mesh dim, as FSDP2 does (``_init_post_forward_mesh_info``, ``to_sharded_post_forward``; ZeRO++
calls it hpZ). The forward all-gather and the backward reduce-scatter stay over the whole dim.

Per bucket, the all-gather's buffer is rank-major: ``[W, S]``, row ``r`` the padded shard of
rank ``r`` of the dim's group. The dim's ranks (in group order) are cut into ``W / N``
contiguous sub-groups of ``N`` ranks (FSDP2's post-forward mesh ``(W // N, N)``, inner dim);
the rank at index ``j`` of its sub-group keeps rows ``[j * W/N, (j + 1) * W/N)``, cut from the
full tensors before their storage is freed (one copy of ``1/N`` of the bucket). In backward
the sub-group's all-gather of those slices, in sub-group order, is again the ``[W, S]`` buffer,
copied out into the freed storage exactly as a full re-gather would be (see [Note: refill
after the transfer] in ``_schedule``): the full tensors, and so the gradients, are the same.

Only plain eager autograd (``Mode.EAGER``) keeps slices. Under ``torch.compile`` and while a
CUDA graph is captured, a ``reshard`` step is a ``free`` (a full re-gather in backward: the
values are the same, the backward all-gathers are over the whole dim); inside ``torch.func``
transforms nothing is freed at all (see [Note: reshard after forward without saved-tensor
tricks inside torch.func] in ``_schedule``). ``N`` must divide the size of the group's sharded
mesh dim in every mode (one sharded mesh dim per bucket); ``N`` equal to it is ``True``.

The sub-groups are process groups: every rank of the default group creates all of them for a
mesh dim, in the same order (as ``DeviceMesh`` does), the first time a structure is lowered
with that mesh dim and ``N``; they are kept per (default group, mesh, dim, ``N``) for the
process's life and handed to the lowered gather as data (``Post``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from .._runtime._compile import untraced
from .._runtime._mode import Mode
from . import _collectives as C

# (default group, mesh ranks, mesh shape, mesh dim, N) -> this rank's sub-group and its index
_SUBGROUPS: dict[tuple, tuple[dist.ProcessGroup, int]] = {}


@dataclasses.dataclass(frozen=True)
class Post:
    """A bucket's post-forward sub-group: ``comm`` over ``N`` ranks, this rank at ``index``;
    the bucket's gather is over ``world`` ranks, of which this rank keeps ``world // N`` rows
    (from row ``index * world // N``)."""

    comm: C.Comm
    index: int
    world: int

    @property
    def rows(self) -> int:
        return self.world // self.comm.world


def check(label: str, n: int, sizes: list[int], paths: list[str]) -> None:
    """Raise unless ``n`` divides the size of the one sharded mesh dim of a bucket (``sizes``:
    its sharded mesh dims' sizes; ``paths``: its parameters, for the message)."""
    where = (
        f"group {label or '<root>'!r} (parameters {paths[:3]}{' ...' if len(paths) > 3 else ''})"
    )
    if len(sizes) > 1:
        if n == math.prod(sizes):  # the whole of them: a full reshard
            return
        raise ValueError(
            f"schedule: {where} has reshard_after_forward={n}, but its parameters are sharded "
            f"on {len(sizes)} mesh dims ({sizes}); an int reshards within one sharded mesh dim. "
            "Use True or False for this group (plan.replace(groups=...))."
        )
    if sizes and sizes[0] % n:
        raise ValueError(
            f"schedule: {where} has reshard_after_forward={n}, which does not divide the size "
            f"{sizes[0]} of the mesh dim its parameters are sharded on. Pick a divisor of "
            f"{sizes[0]} (e.g. the ranks per node), or True / False, in fs.plan(..., "
            "reshard_after_forward=) or plan.replace(groups=...)."
        )


def post(comm: C.Comm, mesh, mesh_dim: int, n: int) -> Post | None:
    """The sub-group of ``n`` ranks for a bucket gathered by ``comm`` over ``mesh_dim`` of
    ``mesh``; ``None`` where nothing is kept (``n`` is 1 or the whole dim)."""
    if n <= 1 or n >= comm.world:
        return None
    group, index = subgroup(mesh, mesh_dim, n)
    return Post(C.Comm(group, n, comm.label, mode=Mode.EAGER), index, comm.world)


def subgroup(mesh, mesh_dim: int, n: int) -> tuple[dist.ProcessGroup, int]:
    """This rank's sub-group of ``n`` contiguous ranks of its group along ``mesh_dim``, and its
    index there; every rank creates all sub-groups of the dim, in the same order."""
    with untraced():  # the mesh's rank tensor is host data, also under fs.explain's fake mode
        ranks = mesh.mesh
        flat, shape = tuple(ranks.flatten().tolist()), tuple(ranks.shape)
        rows = ranks.movedim(mesh_dim, -1).reshape(-1, ranks.shape[mesh_dim]).tolist()
    key = (dist.group.WORLD, flat, shape, mesh_dim, n)
    found = _SUBGROUPS.get(key)
    if found is None:
        me = dist.get_rank()
        for row in rows:
            row = sorted(row)  # a dim's group orders its ranks so (new_group sorts them)
            for start in range(0, len(row), n):
                members = row[start : start + n]
                group = dist.new_group(members)
                if me in members:
                    found = (group, members.index(me))
        assert found is not None, "this rank is in no row of its own mesh"
        _SUBGROUPS[key] = found
    return found


def keep(fulls: list[torch.Tensor], layouts, mesh_dim: int, p: Post) -> torch.Tensor:
    """This rank's kept slice of a bucket: rows ``[index * W/N, (index + 1) * W/N)`` of the
    rank-major ``[W, S]`` all-gather buffer, flat, cut from the bucket's full tensors."""
    per, w = p.rows, p.world
    start = p.index * per
    rows = []
    for full, lay in zip(fulls, layouts, strict=True):
        d = lay.dim(mesh_dim)
        size = full.shape[d]
        c = -(-lay.levels[mesh_dim][d] // w)
        lo = min(start * c, size)
        part = full.narrow(d, lo, min((start + per) * c, size) - lo)
        if part.shape[d] != per * c:  # the gather's padding
            zeros = part.new_zeros(*part.shape[:d], per * c - part.shape[d], *part.shape[d + 1 :])
            part = torch.cat([part, zeros], dim=d)
        rows.append(part.unflatten(d, (per, c)).movedim(d, 0).reshape(per, -1))
    return torch.cat(rows, dim=1).reshape(-1)


def padded_shapes(layouts, mesh_dim: int, world: int) -> list[tuple[int, ...]]:
    """The padded local pieces' shapes of a bucket gathered over ``world`` ranks of
    ``mesh_dim`` (those :func:`keep` cuts the rows into)."""
    out = []
    for lay in layouts:
        d, shape = lay.dim(mesh_dim), list(lay.levels[mesh_dim])
        shape[d] = -(-shape[d] // world)
        out.append(tuple(shape))
    return out
