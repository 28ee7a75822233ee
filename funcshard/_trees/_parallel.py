"""Data parallelism on top of tensor (or expert) parallelism: FSDP x TP's 2-D layout.

[Note: the 2-D layout]
After ``parallelize_module(block, mesh["tp"], plan)`` a parameter is a DTensor on the TP mesh,
and its *TP-local* tensor is what this rank's module computes with. ``fs.shard(params,
mesh["dp"])`` shards that TP-local tensor over the data-parallel mesh, as FSDP2 does: the result
is a DTensor on the concatenated mesh ``(dp dims..., tp dims...)`` whose placements are the dp
placement (``_StridedShard(d, sf)`` when tp splits the same tensor dim, since DTensor splits mesh
dims left to right) followed by the TP placements -- byte for byte FSDP2's ``(Shard(0) over dp,
TP placement)`` layout, so DCP, ``full_tensor()`` and redistribution read it right.

Which mesh dims are funcshard's (gathered and reduced) is a fact about the concatenated mesh,
recorded here when :func:`~funcshard.shard` builds it (``{mesh: dp dims}``), as FSDP2 records
its ``dp_mesh_dims``; ``ShardSpec.of`` reads it, so every DTensor on that mesh -- optimizer
outputs, loaded checkpoints, gradients -- carries the same spec. Gathers and reduce-scatters run
on the dp sub-mesh over the TP-local tensors (``ShardSpec.gathered``); the result is wrapped into
a DTensor on the TP mesh with the TP placements (``ShardSpec.model``), so the module's own DTensor
ops run TP's collectives, and the gradient coming back is redistributed to the TP placements
(a ``Partial`` gradient of a replicated norm weight is all-reduced over tp there) before its
reduce-scatter over dp.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from . import _dtensor

_DP_DIMS: dict[DeviceMesh, tuple[tuple[int, ...], bool, tuple[int, ...]]] = {}
# data-parallel sub-meshes of 2-D layouts: their other dims are model parallel, so a plain
# parameter sharded on one of them is replicated over those (see [Note: meshes funcshard can
# gather over] in _spec)
_DATA_PARALLEL: set[DeviceMesh] = set()


def record(mesh: DeviceMesh, dp_dims: tuple[int, ...], spmd: bool, path: str, ep_dims=()) -> None:
    """Remember that funcshard gathers ``mesh``'s dims ``dp_dims`` (the others are TP's or EP's),
    whether the module computes on the whole mesh (``spmd``, see [Note: full SPMD]), and which
    model-parallel dims hold different data (``ep_dims``, see [Note: expert parallelism]).

    Raises:
        ValueError: the same mesh was already used with other dp (or ep) dims.
    """
    _DATA_PARALLEL.add(submesh(mesh, dp_dims))
    known = _DP_DIMS.setdefault(mesh, (dp_dims, spmd, tuple(ep_dims)))
    if known != (dp_dims, spmd, tuple(ep_dims)):
        names = mesh.mesh_dim_names
        raise ValueError(
            f"shard: {path!r} would make the dims {[names[i] for i in dp_dims]} of {mesh} its "
            f"data-parallel dims (expert parallel: {[names[i] for i in ep_dims]}), but this "
            f"mesh already has the data-parallel dims {[names[i] for i in known[0]]} (full "
            f"SPMD: {known[1]}; expert parallel: {[names[i] for i in known[2]]}). Use one "
            "data-parallel mesh per model-parallel mesh, and the same mesh for fs.shard's tree "
            "(the ranks holding different data) in every call."
        )


def dp_dims(mesh: DeviceMesh) -> tuple[tuple[int, ...] | None, bool, tuple[int, ...]]:
    """The recorded data-parallel dims of ``mesh`` (``None``: all of them), whether the
    module computes on the whole mesh, and the expert-parallel dims."""
    return _DP_DIMS.get(mesh, (None, False, ())) if _DP_DIMS else (None, False, ())


def expert_dims(path: str, mesh: DeviceMesh, dims: tuple[int, ...], data: DeviceMesh):
    """The model-parallel dims of the layout ``mesh`` (those not in ``dims``) whose ranks hold
    different data: the dims inside ``data``, the mesh of the tree given to ``fs.shard``.

    [Note: expert parallelism]
    ``fs.shard(params, mesh, fn)``'s ``mesh`` is the data-parallel mesh: its ranks hold
    different batches, and every gradient is the mean over them. A model-parallel dim outside
    it (tensor parallel: the tp ranks hold the same batch) needs nothing more. A model-parallel
    dim *inside* it is expert parallel (torchtitan's ep, borrowed from the dp ranks): each ep
    rank holds whole experts of its own and the tokens of every ep rank reach them by
    all-to-all, so its local gradient already *sums* the ep ranks' losses. The mean then divides
    by the ep size too, with the reduction over the dp dims (as torchtitan's
    ``set_gradient_divide_factor(dp world size)`` on FSDP2's expert modules). Sizes of 1 are
    neither.

    Raises:
        ValueError: a model-parallel dim partly inside ``data`` (naming the meshes).
    """
    ranks = set(data.mesh.flatten().tolist())
    out = []
    for j in (j for j in range(mesh.ndim) if j not in dims and mesh.size(j) > 1):
        along = set(submesh(mesh, (j,)).mesh.flatten().tolist())
        if along <= ranks:
            out.append(j)
        elif len(along & ranks) > 1:
            name = mesh.mesh_dim_names[j]
            raise ValueError(
                f"shard: {path!r} is model parallel on {name!r} of {mesh}, whose ranks "
                f"{sorted(along)} are partly inside the data-parallel mesh {data} (ranks "
                f"{sorted(ranks)}): the ranks of {name!r} must either hold the same batch "
                "(tensor parallel: outside it) or different ones (expert parallel: inside "
                "it). Build both from one mesh, e.g. init_device_mesh(device, (dp, tp)) or "
                "(efsdp, ep) with the dense weights on the ranks of every data shard."
            )
    return tuple(out)


def layout_mesh(path: str, x: DTensor, dp_mesh: DeviceMesh):
    """``(mesh, dp dims, spmd)`` of the 2-D layout of ``x`` sharded over ``dp_mesh``.

    [Note: full SPMD]
    A DTensor of the *whole* mesh with ``Replicate()`` on the dims of ``dp_mesh`` (FSDP2's
    ``dp_mesh_dims``: a model written as DTensor ops on the whole mesh, the batch sharded over
    dp) keeps its mesh: the dp dims are ``dp_mesh``'s names in it, and the module computes with
    DTensors of that mesh, ``Replicate()`` on the dp dims. Its gradients arrive ``Partial`` over
    dp (each rank's share of the global-batch loss) and are made whole over dp before the
    reduce-scatter averages them: the same values as FSDP2, one all-reduce per parameter more
    (FSDP2 reduce-scatters the partial sums; see docs/parallelism.md).
    Otherwise ``x`` is a TP DTensor of other dims: the mesh is the concatenation.

    Raises:
        ValueError: see :func:`concatenate`; a full-mesh DTensor not replicated over dp.
    """
    mesh, dp_names = x.device_mesh, dp_mesh.mesh_dim_names or ()
    names = mesh.mesh_dim_names or ()
    if not (dp_names and set(dp_names) < set(names)):
        return concatenate(path, dp_mesh, mesh), tuple(range(dp_mesh.ndim)), False
    dims = tuple(names.index(n) for n in dp_names)
    if any(x.placements[i] != Replicate() for i in dims) or dp_mesh != submesh(mesh, dims):
        raise ValueError(
            f"shard: {path!r} is a DTensor on {mesh} placed as {tuple(x.placements)}; to shard "
            f"it over its dims {list(dp_names)} (full SPMD, FSDP2's dp_mesh_dims) it must be "
            "Replicate() on them, and the data-parallel mesh a slice of its mesh. Distribute "
            "the parameters with Replicate() on the data-parallel dims."
        )
    return mesh, dims, True


@functools.lru_cache(maxsize=256)
def submesh(mesh: DeviceMesh, dims: tuple[int, ...]) -> DeviceMesh:
    """The sub-mesh of ``mesh`` made of ``dims`` (named meshes only; cached)."""
    names = mesh.mesh_dim_names
    return mesh[tuple(names[i] for i in dims)]


def concatenate(path: str, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``(dp dims..., tp dims...)`` of a 2-D layout (FSDP2's ``_spmd_mesh``).

    [Note: private torch APIs of the 2-D layout]
    ``DeviceMesh._concatenate`` joins two slices of one root mesh without new process groups,
    ``DeviceMesh._get_root_mesh`` tells whether two meshes slice the same root, and
    ``_StridedShard`` is DTensor's placement for a dp split of a TP-local tensor; FSDP2 uses all
    three for the same purposes, and they are used here only. ``tests/test_parallel.py`` builds
    2-D layouts and compares them with FSDP2's, so a torch upgrade that changes them fails there.

    Raises:
        ValueError: unnamed meshes, meshes of different roots, or overlapping meshes.
    """
    fix = (
        "Build one mesh, e.g. mesh = init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', "
        "'tp')), parallelize on mesh['tp'] and fs.shard on mesh['dp']."
    )
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError(
            f"shard: {path!r} is a DTensor on {tp_mesh} and is sharded on {dp_mesh}; FSDP x TP "
            f"needs named meshes. {fix}"
        )
    if dp_mesh._get_root_mesh() != tp_mesh._get_root_mesh():
        raise ValueError(
            f"shard: {path!r} is a DTensor on {tp_mesh}, which is not a sub-mesh of the same root "
            f"mesh as the data-parallel mesh {dp_mesh}. {fix}"
        )
    try:
        return DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except RuntimeError as e:
        raise ValueError(
            f"shard: {path!r}: its tensor-parallel mesh {tp_mesh} and the data-parallel mesh "
            f"{dp_mesh} cannot form one mesh ({e}); they must be disjoint dims of one root. {fix}"
        ) from e


def storage_placements(placements: tuple[Placement, ...], dims: tuple[int, ...], sizes):
    """DTensor placements of the 2-D layout: on ``dims`` funcshard's ``Shard`` / ``Replicate``
    of the TP-local tensor, on the other dims the TP placements. A dp ``Shard(d)`` of a dim that
    a TP dim to its right also splits becomes ``_StridedShard(d, split_factor)`` (DTensor
    splits mesh dims left to right; see [Note: the 2-D layout])."""
    out = list(placements)
    for i in dims:
        p, right = placements[i], range(i + 1, len(placements))
        factor = math.prod(sizes[j] for j in right if j not in dims and _splits(placements[j], p))
        out[i] = _StridedShard(p.dim, split_factor=factor) if factor > 1 else p
    return tuple(out)


def check_composable(path: str, shape, placements, dims, mesh: DeviceMesh) -> None:
    """A dp ``Shard(d)`` on top of TP dims that split ``d`` needs ``d`` divisible by them.

    [Note: uneven TP splits under a dp split]
    funcshard (and FSDP2) split the TP-local tensor with ``torch.chunk`` over dp. When tp splits
    the same dim into unequal parts (7 rows over 2 ranks: 4 and 3), DTensor's reading of the
    stored ``_StridedShard`` differs from that for some sizes (7 rows, dp 3: the last rank holds
    row 6 by ``torch.chunk`` but an empty shard by ``_StridedShard``), so ``full_tensor()`` and
    checkpoints would misplace rows. Such a parameter is refused rather than silently misread.

    Raises:
        ValueError: naming the parameter, its shape, the meshes and the fix.
    """
    for i in dims:
        p = placements[i]
        if not isinstance(p, Shard):
            continue
        tp = [j for j in range(len(placements)) if j not in dims and _splits(placements[j], p)]
        factor = math.prod(mesh.size(j) for j in tp)
        if factor > 1 and shape[p.dim] % factor:
            names = mesh.mesh_dim_names
            raise ValueError(
                f"shard: {path!r} of shape {list(shape)}: dim {p.dim} is split by "
                f"{[names[j] for j in tp]} into unequal parts ({shape[p.dim]} over {factor}), "
                f"and a data-parallel {p!r} on top of that cannot be described by DTensor (see "
                "[Note: uneven TP splits under a dp split]). Shard it over "
                f"{[names[j] for j in dims]} along another dim (a placements function "
                "returning e.g. Shard(1) for it, or Replicate() for a 1-d tensor), or make the "
                f"dim divisible by {factor}."
            )


def _splits(q: Placement, p: Placement) -> bool:
    return isinstance(p, Shard) and isinstance(q, Shard | _StridedShard) and q.dim == p.dim


def plain(p: Placement) -> Placement:
    """``_StridedShard(d, ...)`` -> ``Shard(d)``: funcshard's view of a dp placement."""
    return Shard(p.dim) if isinstance(p, _StridedShard) else p


def check_model_placements(path: str, x: DTensor) -> None:
    """A TP DTensor funcshard can shard over dp: ``Shard`` / ``Replicate`` placements.

    Raises:
        ValueError: naming the parameter, its placements and the fix.
    """
    for p in x.placements:
        if type(p) not in (Shard, Replicate):
            raise ValueError(
                f"shard: {path!r} is a DTensor on {x.device_mesh} placed as "
                f"{tuple(x.placements)}; funcshard can shard over data-parallel dims only "
                "tensor-parallel layouts made of Shard(d) and Replicate(). Redistribute it "
                "(x.redistribute(mesh, [Shard(d) or Replicate()])) before fs.shard."
            )


def describe(mesh: DeviceMesh) -> str:
    """The same text on every rank for a mesh and its sub-meshes (for ``_consensus``)."""
    root = mesh._get_root_mesh()
    if root is mesh or root == mesh:
        return str(mesh.mesh.tolist())
    return f"{root.mesh.tolist()}[{', '.join(mesh.mesh_dim_names or ())}]"


def is_model_parallel(x: DTensor, dp_mesh: DeviceMesh) -> bool:
    """Whether ``x`` is a TP (or EP) DTensor to shard over ``dp_mesh`` (a mesh of other dims),
    rather than a DTensor funcshard (or anyone) already sharded over it."""
    mesh = x.device_mesh
    dims, spmd, _ = dp_dims(mesh)
    if dims is not None:  # a 2-D layout's mesh: full SPMD parameters are replicated over dp
        return spmd and all(x.placements[i] == Replicate() for i in dims)
    if mesh == dp_mesh:
        return False
    names, dp_names = set(mesh.mesh_dim_names or ()), set(dp_mesh.mesh_dim_names or ())
    return not names & dp_names or (bool(dp_names) and dp_names < names)  # TP, or full SPMD


def sub_mesh_problem(mesh: DeviceMesh) -> str | None:
    """Why a mesh of fewer ranks than the world cannot be sharded over (``None``: it can --
    it is the data-parallel mesh of a 2-D layout, whose other dims are model parallel)."""
    if mesh in _DATA_PARALLEL:
        return None
    return (
        f"which has {mesh.size()} ranks while the process group has {dist.get_world_size()} "
        "(a mesh of fewer ranks is the data-parallel mesh of FSDP x TP only: fs.shard the "
        "parameters of the module parallelized on its other dims on it, DTensors and all, in "
        "one call)"
    )


def wrap(fulls: list[torch.Tensor], specs) -> list[torch.Tensor]:
    """Gathered TP-local tensors -> DTensors on their TP meshes (differentiably, also inside
    ``torch.func``); tensors of 1-D layouts are returned as they are."""
    where = [i for i, s in enumerate(specs) if s.dp_dims is not None]
    if not where:
        return fulls
    made = _dtensor.dtensors_of([fulls[i] for i in where], [specs[i].model() for i in where])
    out = list(fulls)
    for i, d in zip(where, made, strict=True):
        out[i] = d
    return out


def model_local(path: str, full: torch.Tensor, spec) -> torch.Tensor:
    """What :func:`~funcshard.reduce` scatters over dp for a 2-D layout: the TP-local part of
    ``full`` -- a DTensor on the TP mesh (redistributed to the TP placements if ``Partial``), or
    a plain tensor of the global shape, the same on every tp rank. Differentiable.

    Raises:
        ValueError: a DTensor on another mesh than the parameter's TP mesh.
    """
    model = spec.model()
    if isinstance(full, DTensor):
        if full.device_mesh != model.mesh:
            raise ValueError(
                f"reduce: full_grads at {path!r} is a DTensor on {full.device_mesh}, but the "
                f"parameter is tensor parallel on {model.mesh}; pass its gradient as the module "
                "computed it (a DTensor on the TP mesh), or a plain full tensor."
            )
        if tuple(full.placements) != model.placements:
            full = full.redistribute(model.mesh, model.placements)
        return full.to_local()
    for d, (offset, size) in enumerate(
        zip(model.local_offset(), model.level_shapes()[-1], strict=True)
    ):
        full = full.narrow(d, offset, size) if size != full.shape[d] else full
    return full


def refuse_unsynced(paths, specs, fn: str) -> None:
    """``sync_grads=False`` is not supported on 2-D layouts (yet).

    Raises:
        NotImplementedError: naming the first 2-D parameter and the fix.
    """
    for path, spec in zip(paths, specs, strict=True):
        if spec.dp_dims is not None:
            raise NotImplementedError(
                f"{fn}: {path!r} is tensor parallel (FSDP x TP), and fs.value_and_grad(..., "
                "sync_grads=False) does not support 2-D layouts yet. Use sync_grads=True (the "
                "default) and add the sharded gradients of the micro-batches."
            )


def layout_label(spec) -> str:
    """How a parameter of ``spec`` (a :class:`~funcshard.ShardSpec`) is communicated, in the
    words the printed plan uses: ``"gathered over dp(4)"``, ``"gathered over shard(2),
    all-reduced over replicate(2)"``, ``"gathered over dp(2), tensor parallel over tp(2)"``,
    ``"gathered over efsdp(2), expert parallel over ep(2) (mean over 4)"``. Gathered dims are
    reduce-scattered in backward; all-reduced ones are replicated (never gathered)."""
    mesh, names = spec.mesh, spec.mesh.mesh_dim_names or ()
    dim = lambda i: f"{names[i] if i < len(names) else f'dim{i}'}({mesh.size(i)})"
    ours = range(mesh.ndim) if spec.dp_dims is None else spec.dp_dims
    sharded = [dim(i) for i in ours if not isinstance(plain(spec.placements[i]), Replicate)]
    replicated = [dim(i) for i in ours if isinstance(plain(spec.placements[i]), Replicate)]
    parts = [f"gathered over {', '.join(sharded)}"] if sharded else []
    parts += [f"all-reduced over {', '.join(replicated)}"] if replicated else []
    model = [i for i in range(mesh.ndim) if i not in ours and i not in spec.ep_dims]
    parts += [f"tensor parallel over {', '.join(dim(i) for i in model)}"] if model else []
    if spec.ep_dims:
        mean = math.prod(mesh.size(i) for i in (*ours, *spec.ep_dims))
        experts = ", ".join(dim(i) for i in spec.ep_dims)
        parts.append(f"expert parallel over {experts} (mean over {mean})")
    return ", ".join(parts)
