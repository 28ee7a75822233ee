"""Static sharding metadata, and the local-shard view of a sharded tree.

A sharded parameter is stored as a DTensor. Inside ``torch.func`` transforms a DTensor argument
loses its type (functorch wraps it into a plain tensor), so transforms work on the *local shard*
plus the *static* :class:`ShardSpec` beside it -- the equinox ``partition`` move, done per leaf.

[Note: LocalShard is a torch pytree node]
``LocalShard`` is registered with ``torch.utils._pytree``: ``torch.func.grad(f)(to_local(tree))``
flattens it into its tensor, wraps that tensor, and rebuilds the node with the same static spec,
so ``f`` sees ``LocalShard(wrapped_tensor, spec)`` and the returned gradient tree has the same
nodes, ready for :func:`from_local`. It is *not* registered with optree, so funcshard's own tree
code sees it as a leaf, like a DTensor.

[Note: leading dims stripped by vmap]
``vmap`` over a stacked tree (an ensemble from ``stack_module_state``) strips leading dims from
the local tensors while the spec still describes the stacked storage. Specs are therefore read
from the *trailing* dims: a logical local tensor with ``k`` fewer dims than the spec is the spec
with its first ``k`` dims removed. Sharding a stripped dim is an error (each rank would hold
different members); stack along dim 0 and shard a later dim, e.g. ``placements=Shard(1)``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as torch_pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .._runtime._compile import traced, untraced
from .._runtime._mode import transformed
from . import _dtensor, _parallel
from ._tree import PyTree, map_with_path


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Where a sharded tensor lives: mesh, placements, global shape and stride.

    ``placements[i]`` is ``Shard(d)`` or ``Replicate()`` for mesh dim ``i`` (DTensor semantics,
    uneven sizes split as ``torch.chunk`` does).

    ``dp_dims``: for FSDP x TP's 2-D layout (see [Note: the 2-D layout] in ``_parallel``), the
    mesh dims funcshard gathers over; the other mesh dims are tensor parallel: they split the
    tensor first, and the dp dims split the TP-local tensor (DTensor writes such a dp placement
    as ``_StridedShard``). ``None``: every mesh dim is funcshard's. ``spmd``: the module
    computes on the whole mesh, ``Replicate()`` on the dp dims (see [Note: full SPMD]), rather
    than on the TP sub-mesh. ``ep_dims``: the model-parallel dims that are expert parallel
    (their ranks hold different data, see [Note: expert parallelism] in ``_parallel``): the
    gradient mean divides by their size too.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dp_dims: tuple[int, ...] | None = None
    spmd: bool = False
    ep_dims: tuple[int, ...] = ()

    def __hash__(self) -> int:
        # computed once: a call's per-structure cache key hashes every leaf's spec
        h = self.__dict__.get("_hash")
        if h is None:
            fields = (self.mesh, self.placements, self.shape, self.stride, self.dp_dims)
            h = hash((*fields, self.spmd))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # the hash is this process's (a mesh hashes by identity)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @staticmethod
    def of(dtensor: DTensor) -> ShardSpec:
        mesh = dtensor.device_mesh
        return ShardSpec(
            mesh,
            tuple(dtensor.placements),
            tuple(dtensor.shape),
            tuple(dtensor.stride()),
            *_parallel.dp_dims(mesh),
        )

    def order(self) -> tuple[int, ...]:
        """Mesh dims in the order they split the tensor: tensor-parallel dims, then dp dims."""
        if self.dp_dims is None:
            return tuple(range(self.mesh.ndim))
        return (*(i for i in range(self.mesh.ndim) if i not in self.dp_dims), *self.dp_dims)

    def level_shapes(self) -> tuple[tuple[int, ...], ...]:
        """This rank's shape after sharding the first ``i`` mesh dims of :meth:`order` (mesh dims
        ``0..i-1`` of a 1-D layout), for ``i = 0..mesh.ndim``.

        ``[0]`` is the global shape and ``[-1]`` the local shard's shape.
        """
        order, coord = self.order(), self.mesh.get_coordinate()
        return _level_shapes(
            self.shape,
            tuple(self.mesh.size(i) for i in order),
            tuple(_parallel.plain(self.placements[i]) for i in order),
            tuple(coord[i] for i in order),
        )

    def local_offset(self) -> tuple[int, ...]:
        """Offset of this rank's local shard in the global tensor."""
        offset = [0] * len(self.shape)
        coord = self.mesh.get_coordinate()
        shapes = self.level_shapes()
        for level, i in enumerate(self.order()):
            p = _parallel.plain(self.placements[i])
            if isinstance(p, Shard):
                offset[p.dim] += chunk(shapes[level][p.dim], self.mesh.size(i), coord[i])[1]
        return tuple(offset)

    def gathered(self) -> ShardSpec:
        """What funcshard gathers: a 1-D layout spec on the dp sub-mesh whose global shape is
        the TP-local shape (``self`` for a 1-D layout)."""
        return self if self.dp_dims is None else _gathered(self)

    def model(self) -> ShardSpec:
        """The DTensor the module computes with (2-D layouts only): the TP sub-mesh and
        placements, the global shape (full SPMD: the whole mesh, ``Replicate()`` over dp)."""
        if self.spmd:
            whole = tuple(Replicate() if i in self.dp_dims else p
                          for i, p in enumerate(self.placements))  # fmt: skip
            return ShardSpec(self.mesh, whole, self.shape, self.stride)
        kept = self.order()[: self.mesh.ndim - len(self.dp_dims or ())]
        return ShardSpec(
            _parallel.submesh(self.mesh, kept),
            tuple(self.placements[i] for i in kept),
            self.shape,
            self.stride,
        )


@functools.lru_cache(maxsize=4096)
def _gathered(spec: ShardSpec) -> ShardSpec:
    local = spec.level_shapes()[spec.mesh.ndim - len(spec.dp_dims)]
    return ShardSpec(
        _parallel.submesh(spec.mesh, spec.dp_dims),
        tuple(_parallel.plain(spec.placements[i]) for i in spec.dp_dims),
        local,
        tuple(torch.empty(local, device="meta").stride()),
    )


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(length, offset)`` of chunk ``index`` when ``size`` is split as ``torch.chunk`` does.

    Chunks have ``ceil(size / parts)`` elements; trailing chunks may be short or empty.
    """
    full = -(-size // parts)
    start = min(full * index, size)
    return min(size, start + full) - start, start


@functools.lru_cache(maxsize=4096)
def _level_shapes(shape, mesh_shape, placements, coord) -> tuple[tuple[int, ...], ...]:
    current = list(shape)
    out = [tuple(current)]
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            current[p.dim] = chunk(current[p.dim], mesh_shape[i], coord[i])[0]
        out.append(tuple(current))
    return tuple(out)


class LocalShard:
    """A local shard and its static :class:`ShardSpec`: the form sharded trees take inside
    ``torch.func`` transforms. Build trees of them with :func:`to_local`; turn them back into
    DTensors with :func:`from_local`. ``tensor`` is this rank's shard (shape ``spec``'s local shape,
    possibly with leading dims removed by ``vmap``)."""

    __slots__ = ("spec", "tensor")

    def __init__(self, tensor: torch.Tensor, spec: ShardSpec) -> None:
        self.tensor = tensor
        self.spec = spec

    def __repr__(self) -> str:
        t = self.tensor
        shape = list(t.shape) if isinstance(t, torch.Tensor) else t
        pl = ", ".join(str(p) for p in self.spec.placements)
        return f"LocalShard({shape} of {list(self.spec.shape)}, ({pl}), {getattr(t, 'dtype', '')})"


# The pytree context of a LocalShard is a number standing for its spec, not the spec itself:
# torch.compile must carry the context through its graphs as a constant, which it can do for a
# number and not for a ShardSpec (see [Note: funcshard under torch.compile]).
# Bounded: the least recently numbered specs are forgotten past ``_SPECS_SIZE`` (numbers are
# never reused, so a forgotten number fails loudly instead of decoding to another spec).
_SPECS: collections.OrderedDict[int, ShardSpec] = collections.OrderedDict()
_SPEC_NUMBERS: dict[ShardSpec, int] = {}
_SPECS_SIZE = 4096
_NEXT_SPEC = itertools.count()


def _spec_number(spec: ShardSpec) -> int:
    number = _SPEC_NUMBERS.get(spec)
    if number is None:
        number = _SPEC_NUMBERS[spec] = next(_NEXT_SPEC)
        _SPECS[number] = spec
        while len(_SPECS) > _SPECS_SIZE:
            _, old = _SPECS.popitem(last=False)
            del _SPEC_NUMBERS[old]
    else:
        _SPECS.move_to_end(number)
    return number


torch_pytree.register_pytree_node(
    LocalShard,
    lambda node: ([node.tensor], _spec_number(node.spec)),
    lambda children, number: LocalShard(children[0], _SPECS[number]),
    serialized_type_name="funcshard.LocalShard",
    flatten_with_keys_fn=lambda node: (
        [(torch_pytree.GetAttrKey("tensor"), node.tensor)],
        _spec_number(node.spec),
    ),
)


@traced  # see [Note: funcshard under torch.compile]
def to_local(sharded: PyTree) -> PyTree:
    """DTensor leaves -> :class:`LocalShard` leaves (same tree structure), for ``torch.func``.

    Call it once before a ``torch.func`` transform: ``torch.func.grad(f)(fs.to_local(sharded), x)``
    where ``f`` calls :func:`~funcshard.unshard`; turn the returned gradients back with
    :func:`from_local`. Leaves that are not DTensors are returned unchanged.
    """
    return map_with_path(
        lambda _, x: LocalShard(x.to_local(), ShardSpec.of(x)) if isinstance(x, DTensor) else x,
        sharded,
    )


@traced  # see [Note: funcshard under torch.compile]
def from_local(tree: PyTree) -> PyTree:
    """:class:`LocalShard` leaves -> DTensors with their spec's placements (no communication).

    Raises:
        ValueError: a leaf's tensor does not have its spec's local shape (for instance the
            gradient of a single ensemble member, with the stacked dims stripped).
    """

    def convert(path: str, x):
        if not isinstance(x, LocalShard):
            return x
        spec, t = x.spec, x.tensor
        local = spec.level_shapes()[-1]
        if tuple(t.shape) != local:
            raise ValueError(
                f"from_local: {path!r} has shape {list(t.shape)}, but its spec ({spec.placements} "
                f"of {list(spec.shape)}) has local shape {list(local)} on this rank. Convert whole "
                "results, e.g. the output of vmap over every stacked member, not slices of them."
            )
        return DTensor.from_local(
            t, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )

    return map_with_path(convert, tree)


def check_storage_placements(
    path: str, placements, mesh: DeviceMesh, ndim: int, fn: str = "shard", dp_dims=None
) -> None:
    """Placements funcshard can store: ``Shard(d)`` with ``0 <= d < ndim`` or ``Replicate()``
    (and, on the ``dp_dims`` of a 2-D layout, the ``_StridedShard`` DTensor writes there).

    Raises:
        ValueError: with the parameter's path, the offending placement and the fix.
    """
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{fn}: {path!r}: {len(placements)} placements {tuple(placements)} for a "
            f"{mesh.ndim}-D mesh; give one placement per mesh dim, e.g. (Replicate(), Shard(0)) "
            "for HSDP on a 2-D mesh."
        )
    for i, p in enumerate(placements):
        p = _parallel.plain(p) if dp_dims is not None and i in dp_dims else p
        if type(p) is Replicate:
            continue
        if type(p) is not Shard:
            raise ValueError(
                f"{fn}: {path!r}: placement {p} cannot store a parameter; funcshard stores "
                "parameters as Shard(dim) or Replicate(). Reduce Partial tensors first "
                "(fs.reduce) and use plain Shard instead of strided sharding."
            )
        if ndim == 0:
            raise ValueError(
                f"{fn}: {path!r} is a 0-d tensor and cannot be split with {p}; use Replicate() "
                "for it (the default for 0-d tensors)."
            )
        if not 0 <= p.dim < ndim:
            raise ValueError(
                f"{fn}: {path!r}: {p} is out of range for a {ndim}-d tensor; use Shard(d) with "
                f"0 <= d < {ndim} (negative dims are not normalised in DTensor placements)."
            )


def check_materialized(paths, locals_, fn: str) -> None:
    """Raises ``RuntimeError`` naming the shards still on the meta device."""
    on_meta = [p for p, x in zip(paths, locals_, strict=True) if x.device.type == "meta"]
    if on_meta:
        raise RuntimeError(
            f"{fn}: parameters are still on the meta device: {on_meta}. Initialise a module "
            "built on meta with fs.materialize(module, mesh), which makes the shards directly "
            "(module.to_empty(device=...) + reset_parameters() puts the whole model on every rank)."
        )


def as_locals(paths, leaves, fn: str) -> tuple[list[torch.Tensor], list[ShardSpec]]:
    """``(local tensors, specs)`` of sharded leaves: DTensors or :class:`LocalShard`s.

    A DTensor may be under ``torch.func`` wrappers (passed to a transform, or a tangent) or
    closed over: the local shards of a tree's DTensors come through one
    :class:`~funcshard._trees._dtensor.ToLocal` call (see [Note: DTensor trees inside torch.func]).

    Raises:
        TypeError: for a non-tensor leaf or a plain tensor -- each message names the path and
            the fix.
        ValueError: a placement funcshard cannot store (``Partial``, strided), or a mesh that is
            not the whole process group in rank order (see :func:`check_mesh`).
    """
    specs = [spec_of(path, leaf, fn) for path, leaf in zip(paths, leaves, strict=True)]
    locals_ = [leaf.tensor if isinstance(leaf, LocalShard) else None for leaf in leaves]
    if DIRECT and not transformed():
        for i, leaf in enumerate(leaves):  # see [Note: differentiating the local shards]
            found = DIRECT[-1].get(id(leaf))
            if found is not None and found[0] is leaf:
                locals_[i] = found[1]
    dtensors = [i for i, x in enumerate(locals_) if x is None]
    shards = _dtensor.locals_of([leaves[i] for i in dtensors], [specs[i] for i in dtensors])
    for i, local in zip(dtensors, shards, strict=True):
        locals_[i] = local
    return locals_, specs


# The DTensors value_and_grad is differentiating, {id: (dtensor, local autograd leaf)}, per
# call being run (innermost last); see [Note: differentiating the local shards] in _autodiff.
DIRECT: list[dict[int, tuple[DTensor, torch.Tensor]]] = []


def spec_of(path: str, leaf, fn: str) -> ShardSpec:
    """The checked spec of a sharded leaf (errors: see :func:`as_locals`)."""
    if isinstance(leaf, LocalShard):
        spec = leaf.spec
    elif isinstance(leaf, torch.Tensor) and isinstance(dt := _dtensor.unwrap(leaf), DTensor):
        world = BySpec.world()
        found = _CHECKED.get(dt._spec, world)
        if found is not None:
            return found
        return _CHECKED.put(dt._spec, world, _checked(path, ShardSpec.of(dt), fn))
    else:
        _not_a_shard(path, leaf, fn)
    return _checked(path, spec, fn)


def _checked(path: str, spec: ShardSpec, fn: str) -> ShardSpec:
    check_storage_placements(path, spec.placements, spec.mesh, len(spec.shape), fn, spec.dp_dims)
    check_mesh(path, spec.mesh, fn)
    return spec


class BySpec:
    """Values computed from a DTensor's ``DTensorSpec`` (and the default process group),
    remembered by the spec's identity.

    [Note: checked DTensor specs]
    A parameter's DTensors share one DTensorSpec object from step to step (value_and_grad's
    fresh leaves, the optimizer's results and the gradients are made around the same spec), so
    what is computed from a DTensor's layout alone -- its checked ShardSpec, the replicas the
    global norm divides by -- is remembered by the identity of its DTensorSpec (kept alive by
    the entry, so the identity cannot be reused) and of the default process group the mesh was
    checked against. Bounded: least recently used entries are dropped.
    """

    def __init__(self, size: int = 1 << 14) -> None:
        self._table: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._size = size

    @staticmethod
    def world() -> Any:
        """The default process group (``None`` before one exists): part of every key."""
        return dist.group.WORLD if dist.is_initialized() else None

    def get(self, spec: Any, world: Any) -> Any:
        """The value remembered for ``spec`` under ``world``, or ``None``."""
        found = self._table.get(id(spec))
        if found is None or found[0] is not spec or found[1] is not world:
            return None
        self._table.move_to_end(id(spec))
        return found[2]

    def put(self, spec: Any, world: Any, value: Any) -> Any:
        """Remember ``value`` (not ``None``) for ``spec`` under ``world``; returns it."""
        self._table[id(spec)] = (spec, world, value)
        while len(self._table) > self._size:
            self._table.popitem(last=False)
        return value


_CHECKED = BySpec()


def check_mesh(path: str, mesh: DeviceMesh, fn: str) -> None:
    """The mesh of a shard must span the whole default process group, and each of its dims'
    process groups must list the ranks in mesh order.

    [Note: meshes funcshard can gather over]
    funcshard's collectives run over ``mesh.get_group(d)`` and put rank ``i`` of that group's
    chunk at position ``i``. That is the DTensor chunk order only if the group's ranks, in group
    order, are the mesh's ranks along ``d`` in coordinate order -- true for ``init_device_mesh``,
    false for a permuted ``DeviceMesh("cpu", [1, 0])`` (c10d sorts a new group's ranks). And a
    sub-mesh (fewer ranks than the world) would average gradients over part of the data only,
    unless it slices a root mesh of the whole world whose other dims are model parallel
    (``mesh["dp"]`` of a ``(dp, tp)`` mesh: the tp ranks see the same batch).

    Raises:
        ValueError: naming ``path``, what is wrong with the mesh, and the fix.
    """
    problem = _mesh_problem(mesh)
    if mesh.size() != dist.get_world_size():  # not cached: a 2-D layout may come later
        problem = _parallel.sub_mesh_problem(mesh) or problem
    if problem is not None:
        raise ValueError(
            f"{fn}: {path!r} is sharded on {mesh}, {problem}. funcshard shards over every rank "
            "of the default process group: build the mesh with init_device_mesh(device, (world,))"
            " (FSDP) or (replicas, world // replicas) (HSDP), or slice the data-parallel dims of "
            "one mesh of every rank (mesh['dp'] for FSDP x TP), and fs.shard the tensors on it."
        )


@functools.lru_cache(maxsize=256)
def _mesh_problem(mesh: DeviceMesh) -> str | None:
    coord = mesh.get_coordinate()
    if coord is None:
        return f"which does not include this rank ({dist.get_rank()})"
    for d in range(mesh.ndim):
        index = tuple(slice(None) if i == d else c for i, c in enumerate(coord))
        with untraced():  # a real tensor, also while torch.compile traces
            along = mesh.mesh[index].tolist()
        ranks = dist.get_process_group_ranks(mesh.get_group(d))
        if along != ranks:
            return (
                f"whose dim {d} lists ranks {along} but whose process group for that dim orders "
                f"them {ranks} (a permuted mesh)"
            )
    return None


def _not_a_shard(path: str, leaf, fn: str):
    """Raises the TypeError for a leaf that is neither a DTensor nor a LocalShard."""
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(
            f"{fn}: {path!r} is a {type(leaf).__name__}, not a sharded tensor. Trees passed to "
            f"{fn} hold only DTensors from fs.shard (or LocalShards from fs.to_local); keep "
            "other values outside the tree, or use None for an absent entry."
        )
    raise TypeError(
        f"{fn}: {path!r} is a plain torch.Tensor of shape {list(leaf.shape)}, not a shard. "
        "Shard the tree first with fs.shard(params, mesh)."
    )


def tree_map(fn, tree: PyTree, *rest: PyTree) -> PyTree:
    """``fn`` over corresponding tensors of trees of the same structure, looking inside
    :class:`LocalShard` leaves (the result keeps the first tree's spec).

    For arithmetic on sharded trees inside ``torch.func`` transforms, e.g. an inner SGD step
    ``fs.tree_map(lambda p, g: p - lr * g, params, grads)``. ``None`` entries stay ``None``.
    """
    import optree

    def apply(x, *ys):
        if isinstance(x, LocalShard):
            return LocalShard(
                fn(x.tensor, *(y.tensor if isinstance(y, LocalShard) else y for y in ys)), x.spec
            )
        return fn(x, *ys)

    return optree.tree_map(apply, tree, *rest, none_is_leaf=False)
