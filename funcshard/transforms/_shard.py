"""``shard``: full tensors every rank holds -> DTensor shards, without communication."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .._communication import _liveness
from .._communication._values import checked
from .._trees._parallel import (
    check_composable,
    check_model_placements,
    expert_dims,
    is_model_parallel,
    layout_mesh,
    record,
    storage_placements,
    sub_mesh_problem,
)
from .._trees._spec import ShardSpec, check_mesh, check_storage_placements
from .._trees._subclass import cut, is_subclass
from .._trees._tree import PyTree, map_with_path

Placements = Placement | Sequence[Placement]
PlacementFn = Callable[[str, torch.Tensor], "Placements | None"]


@checked  # in debug mode, the ranks' values compared: see [Note: the same initial values]
def shard(
    params: PyTree,
    mesh: DeviceMesh,
    placements: Placements | PlacementFn | None = None,
) -> PyTree:
    """Split every tensor of ``params`` across ``mesh``; return the same tree of DTensor shards.

    Every rank must pass the same values (same seed or loaded checkpoint): each keeps its own
    chunk, so no communication happens. Local shards are fresh contiguous tensors, so the full
    tensors can be freed afterwards. ``requires_grad`` is kept.

    Args:
        params: a pytree of tensors, e.g. the ``params`` of :func:`~funcshard.extract`. DTensor
            leaves of a module parallelized on other dims of the same mesh
            (``parallelize_module(block, mesh["tp"], plan)``) are sharded over ``mesh`` on top of
            their TP placement: FSDP2's 2-D layout (docs/parallelism.md).
        mesh: a 1-D mesh (FSDP) or a 2-D ``(replicate, shard)`` mesh (HSDP), whose size is the
            world size of the default process group; or, for FSDP x TP, the data-parallel dims
            of a named mesh of the whole world (``mesh["dp"]``, ``mesh["dp_replicate",
            "dp_shard"]``).
        placements: one placement per mesh dim; or a single placement, meaning that placement on
            the last mesh dim and ``Replicate()`` on the others; or ``fn(path, tensor)`` returning
            either (or ``None`` for the default), like FSDP2's ``shard_placement_fn``; or, from
            ``fn``, a pair ``(own_mesh, placements)`` giving that parameter a mesh of its own
            (MoE experts on an ``(ep, dp)`` mesh, dense weights on ``mesh``). Default:
            ``Shard(0)`` on the last mesh dim (``Replicate()`` for 0-d tensors). Sizes need not
            divide: chunks follow ``torch.chunk``, and trailing ranks may hold empty shards.

    Returns:
        The same structure with ``DTensor`` leaves; ``None`` entries stay ``None``.

    Raises:
        RuntimeError: no default process group.
        ValueError: the mesh size is not the world size (without TP DTensors in the tree); a
            leaf is already sharded over ``mesh``; a TP DTensor's mesh is not a sub-mesh of the
            same root as ``mesh``, or its placements are not ``Shard``/``Replicate``; a placement
            is not ``Shard``/``Replicate``, is out of range, or shards a 0-d tensor; a tensor is
            on another device type than the mesh; in debug mode (``FUNCSHARD_DEBUG=1``), on
            every rank, the ranks passed different values (see [Note: the same initial values]).
        TypeError: a leaf is not a tensor.
    """
    _liveness.doing("fs.shard")
    _check_group(mesh)
    made: set[int] = set()

    def parallel(path: str, x):
        if isinstance(x, DTensor):
            target, pl = _resolve(path, x, mesh, placements)
            if is_model_parallel(x, target):
                x = _shard_model_parallel(path, x, target, pl, mesh)
                made.add(id(x))
        return x

    params = map_with_path(parallel, params)  # first: makes mesh a data-parallel mesh
    _check_mesh(mesh)

    def one(path: str, x) -> DTensor:
        if id(x) in made:
            return x
        if isinstance(x, DTensor):
            raise ValueError(
                f"shard: {path!r} is already a DTensor with placements {tuple(x.placements)}; "
                "pass full tensors (fs.extract(module)[0]), not an already sharded tree (the "
                "DTensors of a module parallelized on other dims of the same mesh are sharded "
                "on top of their placements: docs/parallelism.md)."
            )
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"shard: {path!r} is a {type(x).__name__}; every leaf must be a tensor (use None "
                "for an absent entry)."
            )
        mesh_, pl = _resolve(path, x, mesh, placements)
        if mesh_ is not mesh:
            _check_own_mesh(path, mesh_, mesh)
        if x.device.type not in (mesh.device_type, "meta"):
            raise ValueError(
                f"shard: {path!r} is on {x.device}, but the mesh is a {mesh.device_type!r} mesh; "
                f"move the parameters to {mesh.device_type!r} (or build the mesh for "
                f"{x.device.type!r}) first."
            )
        check_storage_placements(path, pl, mesh_, x.dim())
        stride = torch.empty(x.shape, device="meta").stride()
        spec = ShardSpec(mesh_, pl, tuple(x.shape), tuple(stride))
        local = _cut(path, x.detach(), spec)
        out = DTensor.from_local(local, mesh_, pl, run_check=False, shape=x.shape, stride=stride)
        return out.requires_grad_(x.requires_grad)

    return map_with_path(one, params)


def _resolve(path: str, x: torch.Tensor, mesh: DeviceMesh, placements):
    """``(mesh, placements)`` of one leaf: ``placements`` (or what its function returns) may
    name a mesh of the leaf's own, as ``(mesh, placements)``."""
    p = placements
    if callable(p) and not isinstance(p, Placement):
        p = p(path, x)
    if isinstance(p, tuple) and p and isinstance(p[0], DeviceMesh):
        if len(p) != 2:
            raise ValueError(
                f"shard: the placements of {path!r} are {p!r}; a parameter's own mesh is given "
                "as a pair (mesh, placements), e.g. (expert_mesh, (Shard(0), Shard(1)))."
            )
        mesh, p = p
    if p is None:
        p = Replicate() if x.dim() == 0 else Shard(0)
    if isinstance(p, Placement):
        p = (Replicate(),) * (mesh.ndim - 1) + (p,)
    return mesh, tuple(p)


def _check_own_mesh(path: str, own: DeviceMesh, mesh: DeviceMesh) -> None:
    """A parameter's own mesh must cover the ranks as ``mesh`` does (see ``_check_mesh``)."""
    if not isinstance(own, DeviceMesh) or own.device_type != mesh.device_type:
        raise ValueError(
            f"shard: {path!r} is given its own mesh {own}, which is not a {mesh.device_type!r} "
            "DeviceMesh like the tree's mesh; build it with init_device_mesh on the same device."
        )
    if own.size() != dist.get_world_size() and sub_mesh_problem(own):
        raise ValueError(
            f"shard: {path!r} is given its own mesh {own} of {own.size()} ranks, which does not "
            f"cover the {dist.get_world_size()} ranks (the tree's mesh is {mesh}): its "
            "gradients would be averaged over part of the data. Give it a mesh of every rank, "
            "e.g. init_device_mesh(device, (ep, world // ep), mesh_dim_names=('ep', 'dp')) for "
            "experts, or the data-parallel dims of a mesh whose other dims parallelize it."
        )
    check_mesh(path, own, "shard")


def _check_group(mesh: DeviceMesh) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            "shard: no default process group; call torch.distributed.init_process_group (or "
            "init_device_mesh, which does it) on every rank first."
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"shard: mesh must be a DeviceMesh, got {type(mesh).__name__}.")


def _check_mesh(mesh: DeviceMesh) -> None:
    world = dist.get_world_size()
    if mesh.size() != world and sub_mesh_problem(mesh):
        raise ValueError(
            f"shard: the mesh has {mesh.size()} ranks (shape {tuple(mesh.shape)}), but the process "
            f"group has {world}; funcshard shards over every rank. Build the mesh with "
            f"init_device_mesh({mesh.device_type!r}, ({world},)) for FSDP, or "
            f"(replicas, {world} // replicas) for HSDP; a mesh of fewer ranks is the "
            "data-parallel mesh of FSDP x TP, for a tree holding the DTensors of a module "
            "parallelized on the other dims (docs/parallelism.md)."
        )
    check_mesh("<mesh>", mesh, "shard")


def _shard_model_parallel(path: str, x: DTensor, mesh: DeviceMesh, pl, data: DeviceMesh):
    """A tensor-parallel, expert-parallel (or full-SPMD) DTensor -> the 2-D layout: its
    TP-local tensor sharded over ``mesh`` (see [Note: the 2-D layout] in ``_parallel``);
    ``data`` is the tree's mesh (see [Note: expert parallelism])."""
    check_model_placements(path, x)
    spmd, dims, full = layout_mesh(path, x, mesh)
    experts = expert_dims(path, spmd, dims, data)
    _check_layout_covers(path, spmd, mesh, x.device_mesh)  # before the layout is recorded
    check_mesh(path, spmd, "shard")
    record(spmd, dims, full, path, experts)
    check_storage_placements(path, pl, mesh, x.dim())
    merged = list(x.placements) if full else [*pl, *x.placements]
    for i, p in zip(dims, pl, strict=True):
        merged[i] = p
    check_composable(path, tuple(x.shape), merged, dims, spmd)
    placements = storage_placements(tuple(merged), dims, tuple(spmd.shape))
    spec = ShardSpec(spmd, placements, tuple(x.shape), tuple(x.stride()), dims, full, experts)
    local = _cut(path, x._local_tensor.detach(), spec.gathered())
    out = DTensor.from_local(
        local, spmd, placements, run_check=False, shape=spec.shape, stride=spec.stride
    )
    return out.requires_grad_(x.requires_grad)


def _check_layout_covers(path: str, layout: DeviceMesh, dp: DeviceMesh, model: DeviceMesh):
    """A 2-D layout must span every rank (a pipeline-parallel dim is not supported).

    Raises:
        ValueError: naming the parameter, both meshes and the fix.
    """
    world = dist.get_world_size()
    if layout.size() != world:
        raise ValueError(
            f"shard: {path!r} is model parallel on {model} and sharded over {dp}: together "
            f"{layout.size()} ranks, which do not cover the {world} ranks, so its gradients "
            "would be averaged over part of the data. Shard it over the data-parallel dims "
            "that, with its model-parallel ones, make a mesh of every rank: mesh['dp'] of a "
            "(dp, tp) mesh, mesh['efsdp'] of an (efsdp, ep) mesh."
        )


def _cut(path: str, x: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's shard of ``x`` (of ``spec``'s global shape), as a fresh contiguous tensor
    (a tensor subclass's: see [Note: sharding a tensor subclass])."""
    if is_subclass(x):
        return cut(path, x, spec.local_offset(), spec.level_shapes()[-1])
    for d, (offset, size) in enumerate(
        zip(spec.local_offset(), spec.level_shapes()[-1], strict=True)
    ):
        if size != x.shape[d]:
            x = x.narrow(d, offset, size)
    return x.clone(memory_format=torch.contiguous_format)
