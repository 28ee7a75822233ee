"""Bucketed all-gather and reduce-scatter of many shards: one collective per bucket and mesh dim.

Leaves that share a mesh, the kind of placement on each mesh dim (Shard/Replicate) and a dtype
form a *bucket*. A bucket's local shards are padded to equal chunks, concatenated into one flat
buffer ("copy-in"), gathered with a single all-gather per sharded mesh dim, and split back
("copy-out"), as FSDP2's ``foreach_all_gather`` does. Shard dims may differ inside a bucket.
All of this is plain differentiable tensor code around the Functions of ``_collectives``, so
autograd and ``torch.func`` derive the reduce-scatter side (and its batching) themselves.

[Note: order of mesh dims]
A bucket gathers its sharded mesh dims from the last to the first (DTensor splits mesh dim 0
first). Its replicated mesh dims (HSDP's replicate dim) cost nothing in forward; in backward,
the gradient is reduce-scattered first and only the small reduced shard is all-reduced over
them, as FSDP2 does (``AllGather``'s ``replicas``; both orders are the same linear map).

[Note: flat dtype]
Shards are cast to the all-gather dtype (``param_dtype``) before gathering when gradients are
reduced in that same dtype, otherwise kept in their own dtype (``AllGather`` then casts). Either
way the backward reduce-scatter's output dtype equals the pieces', so it can stay pending
until the wait node.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Shard

from .._runtime._compat import storage_key
from .._runtime._compile import after_waits
from .._runtime._mode import Mode
from .._trees import _subclass
from .._trees._spec import ShardSpec
from . import _collectives as C
from . import _counts, _opaque, _packed, _post_forward
from ._rows import _from_rank_major, _pad, _refill, _to_rank_major


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one leaf's *logical* local tensor relates to its spec.

    ``lead`` is the number of leading spec dims stripped by ``vmap`` (see [Note: leading dims
    stripped by vmap] in ``_spec``); ``levels[i]`` is the logical shape after sharding mesh dims
    ``0..i-1``. ``over``: the size of the parameter's expert-parallel dims, by which the mean
    also divides (see [Note: expert parallelism] in ``_parallel``).
    """

    path: str
    spec: ShardSpec
    lead: int
    levels: tuple[tuple[int, ...], ...]
    over: int = 1

    @staticmethod
    def of(path: str, spec: ShardSpec, local: torch.Tensor) -> Layout:
        """The layout of a logical local shard; checks its shape against ``spec``.

        A 2-D layout's (FSDP x TP) is that of what funcshard gathers: ``spec.gathered()``."""
        gathered = spec.gathered()
        lead = len(gathered.shape) - local.dim()
        levels = gathered.level_shapes()
        if lead < 0 or tuple(local.shape) != levels[-1][lead:]:
            raise ValueError(
                f"{path!r}: local tensor has shape {list(local.shape)}, but its spec "
                f"({gathered.placements} of {list(gathered.shape)}) gives local shape "
                f"{list(levels[-1])} on this rank. Pass the shards made by fs.shard / "
                "fs.to_local unchanged (under vmap, map over leading dims only)."
            )
        return Layout.stripped(path, spec, lead)

    @staticmethod
    def stripped(path: str, spec: ShardSpec, lead: int) -> Layout:
        """The layout of ``spec`` with its first ``lead`` dims mapped over by ``vmap``."""
        over = math.prod(spec.mesh.size(i) for i in spec.ep_dims)
        spec = spec.gathered()
        for p in spec.placements:
            if isinstance(p, Shard) and p.dim < lead:
                raise ValueError(
                    f"{path!r} is sharded along dim {p.dim}, which vmap maps over. Stack ensemble "
                    "members along dim 0 and shard a later dim (e.g. placements=Shard(1))."
                )
        return Layout(path, spec, lead, tuple(s[lead:] for s in spec.level_shapes()), over)

    def dim(self, mesh_dim: int) -> int:
        return self.spec.placements[mesh_dim].dim - self.lead


@dataclasses.dataclass(frozen=True)
class Options:
    """Options of a gather: dtypes, gradient reduction and the profiler label; with
    ``grad_reduce="weighted"``, the call's ``counts`` (every rank's, from the exchange: see
    [Note: ranks that average over different counts] in ``_counts``)."""

    label: str
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    grad_reduce: str = "mean"
    counts: tuple[float | None, ...] | None = None

    def key(self) -> tuple:
        """What ranks must agree on (see ``_consensus``)."""
        return (
            ("param_dtype", self.param_dtype),
            ("reduce_dtype", self.reduce_dtype),
            ("grad_reduce", self.grad_reduce),
        )

    def counted(self, counts: Sequence[float | None]) -> Options:
        """These options for one call with the ranks' ``counts`` (only ``"weighted"`` uses them)."""
        if self.grad_reduce != "weighted" or all(c is None for c in counts):
            return self
        return dataclasses.replace(self, counts=tuple(counts))


@dataclasses.dataclass(frozen=True)
class _Level:
    """A gather of one mesh dim: padded (and, under plain autograd, issued), not finished."""

    pieces: list[torch.Tensor]  # padded local pieces, connected to the shards by autograd
    comm: C.Comm
    replicas: tuple[C.Comm, ...]  # replicated mesh dims (HSDP), reduced in the backward
    started: C.Started | None  # the all-gather, issued without autograd
    dims: list[int]
    sizes: list[int]  # sizes along dims after the gather


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket of a lowered gather: its leaves and the collectives that gather them.

    ``comms``: one per sharded mesh dim, in the order they are gathered (see [Note: order of
    mesh dims]; only the first may be asynchronous); ``replicas``: the replicated mesh dims
    (HSDP), reduced in the backward; ``local``: every mesh dim has one rank (see [Note: one rank
    communicates nothing] in ``_collectives``)."""

    index: tuple[int, ...]
    layouts: tuple[Layout, ...]
    sharded: tuple[int, ...]  # the sharded mesh dims
    comms: tuple[C.Comm, ...]
    replicas: tuple[C.Comm, ...]
    out_dtype: torch.dtype
    local: bool
    post: _post_forward.Post | None = None  # see [Note: reshard to a smaller mesh]
    wire: Any = None  # a packed bucket's ``_packed.Wire``: see [Note: FSDP2's all-gather protocol]


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A group's gather for one structure of its leaves (layouts, dtypes), lowered once for
    one execution mode: its buckets and their collectives. See :func:`lower`."""

    buckets: tuple[Bucket, ...]
    count: int
    opts: Options
    mode: Mode
    flat_dtypes: tuple[torch.dtype, ...]  # each leaf's copy-in dtype (see [Note: flat dtype])
    local: bool  # every bucket is local: nothing is ever pending
    aliases: bool  # some bucket is local: a full tensor may be its shard itself
    shards_only: bool  # every full tensor is its shard itself: nothing to gather or free
    packed: bool = False  # some bucket is packed (see [Note: one byte buffer per collective])

    @property
    def keeps(self) -> bool:
        """Some bucket keeps a slice after forward (see [Note: reshard to a smaller mesh])."""
        return any(b.post is not None for b in self.buckets)


@dataclasses.dataclass(frozen=True)
class _Started:
    """One bucket's gather, issued."""

    bucket: Bucket
    state: _Level | list[torch.Tensor]  # a pending gather, or (nothing to gather) the results
    comms: tuple[C.Comm, ...]  # the bucket's, or this call's weighted ones


@dataclasses.dataclass(frozen=True)
class Inflight:
    """Gathers issued by :func:`issue`; :func:`finish` waits and copies them out."""

    buckets: list[_Started]
    count: int


def _comm(
    layout: Layout, mesh_dim: int, opts: Options, dtype, mode: Mode, first: bool = False
) -> C.Comm:
    """``dtype``: the dtype the all-gather sends when no ``param_dtype`` is set. ``mode``: the
    collective's (see [Note: one way per mode] in ``_collectives``). ``first``: the
    reduction that runs first on the gradient. The mean's extra divisor ``layout.over`` goes
    with one mesh dim: the one gathered first (reduced last in backward), or the first
    replicated one if none is sharded.

    [Note: the first reduction carries the weight]
    ``"mean"`` divides every reduction by its own group's size (``1/W`` in all). A
    ``"weighted"`` call's weight ``n_r / N`` is this rank's alone, so it must scale this rank's
    own contribution once, before anything is summed: it goes to the reduction that runs
    first, and the others sum. In a gather's backward that is the reduction of the last mesh
    dim gathered -- the first sharded mesh dim, or without one the last replicated dim (the
    last ``Broadcast``) --; in :func:`scatter` the first sharded, else the first replicated.
    """
    mesh = layout.spec.mesh
    gather = opts.param_dtype or dtype
    weighted = first and opts.counts is not None
    over = layout.over if layout.over > 1 and mesh_dim == _carrier(layout) else 1
    return C.Comm(
        group=mesh.get_group(mesh_dim),
        world=mesh.size(mesh_dim),
        label=opts.label,
        gather_dtype=gather,
        reduce_dtype=opts.reduce_dtype or gather,
        mean=opts.grad_reduce == "mean",
        weight=_counts.weight(opts.counts, mesh) if weighted else None,  # type: ignore[arg-type]
        mode=mode,
        over=over,
    )


def _carrier(layout: Layout) -> int:
    sharded, replicated = _mesh_dims(layout)
    return sharded[-1] if sharded else replicated[0]


def _mesh_dims(layout: Layout) -> tuple[list[int], list[int]]:
    """(sharded, replicated) mesh dims of a leaf."""
    placements = layout.spec.placements
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    return sharded, [i for i in range(len(placements)) if i not in sharded]


def _buckets(
    dtypes: Sequence[torch.dtype], layouts: Sequence[Layout], speaking: Sequence[bool] = ()
) -> list[list[int]]:
    """Leaves of one mesh, placement kinds, dtype and expert size, in order of first leaf; with
    ``speaking`` (see ``_packed``), every dtype of a mesh and kinds with a protocol leaf in one
    (see [Note: one byte buffer per collective])."""
    keys: dict[tuple, list[int]] = {}
    kind = lambda lay: (lay.spec.mesh, tuple(isinstance(p, Shard) for p in lay.spec.placements))
    packed = {(*kind(lay), lay.over) for lay, s in zip(layouts, speaking, strict=False) if s}
    for i, (dtype, lay) in enumerate(zip(dtypes, layouts, strict=True)):
        key = (*kind(lay), lay.over)
        keys.setdefault(key if key in packed else (*key, dtype), []).append(i)
    return list(keys.values())


def _split(flat: torch.Tensor, shapes, dims, sizes) -> list[torch.Tensor]:
    """Split a flat buffer into tensors of ``shapes``, each narrowed along its dim (if not None)
    to its size."""
    out = []
    for piece, shape, d, n in zip(
        flat.split([math.prod(s) for s in shapes]), shapes, dims, sizes, strict=True
    ):
        x = piece.view(shape)
        out.append(x if d is None or x.shape[d] == n else x.narrow(d, 0, n))
    return out


def _start_level(xs, layouts, mesh_dim: int, comm: C.Comm, replicas=(), after=None) -> _Level:
    """Pad; where the comm's mode issues early (plain autograd, a capture, a trace), also issue
    the all-gather of one mesh dim (``after``: see :func:`issue`).

    [Note: issue early, record late]
    Autograd runs ready backward nodes newest first. If the all-gather's node were created
    when a prefetch issues it (before the current group computes), its backward -- the
    reduce-scatter -- would run only after the current group's whole backward. So the
    collective is issued here without autograd, and the ``AllGather`` node is created in
    :func:`_finish_level`, when the group is first used, with the pre-gathered buffer: its
    reduce-scatter then starts as soon as this group's backward ends. (Under ``torch.func``
    everything happens when finishing, synchronously.)
    """
    dims = [lay.dim(mesh_dim) for lay in layouts]
    sizes = [lay.levels[mesh_dim][d] for lay, d in zip(layouts, dims, strict=True)]
    padded = [_pad(x, d, -(-n // comm.world)) for x, d, n in zip(xs, dims, sizes, strict=True)]
    # under torch.compile too (see [Note: collectives under torch.compile])
    started = C.start_all_gather(comm, padded, after) if comm.way.early else None
    if all(x.numel() == 0 for x in xs):
        # [Note: empty shards are reduced synchronously]
        # A pending gradient is waited where it reaches a wait node, found by its storage. If all
        # of this rank's shards are empty (uneven sizes), only padding comes back, and the empty
        # gradients autograd passes on share no storage with it: nothing would ever wait.
        comm, replicas = comm.synchronous(), [r.synchronous() for r in replicas]
    return _Level(padded, comm, tuple(replicas), started, dims, sizes)


def _finish_level(level: _Level, into: Sequence[torch.Tensor] | None = None, then=None):
    """Wait, record the autograd node and copy out; with ``into``, copy each result into those
    tensors instead (refilling freed storage), straight from the buffer when no padding is cut
    off, else through one parameter-sized temporary at a time. ``then``: the post-backward
    callback of :class:`_CopyOut` (only where the level takes that path: :func:`_copies_once`)."""
    gathered = level.started.wait() if level.started is not None else None
    traced = level.comm.way.traced
    if gathered is not None and not torch.is_grad_enabled() and not traced:
        buffer = gathered  # what AllGather returns, without its node (a re-gather's refill)
    else:
        buffer = C.AllGather.apply(level.comm, level.replicas, gathered, *level.pieces)
    if gathered is not None and traced:  # see [Note: one operation per group, not per tensor]
        chunks = tuple(tuple(p.shape) for p in level.pieces)
        copies = _opaque.Copies(level.comm.world, chunks, tuple(level.dims), tuple(level.sizes))
        return list(_opaque.CopyOut.apply(buffer, copies))
    if gathered is not None and not any(level.dims):  # see [Note: one copy-out per bucket]
        chunks = tuple(tuple(p.shape) for p in level.pieces)
        if into is None:
            world, sizes = level.comm.world, tuple(level.sizes)
            out = list(_CopyOut.apply(buffer, world, chunks, sizes, then))
        else:
            out = _refill_rows(into, buffer.view(level.comm.world, -1), chunks)
        _release([buffer], keep=(), traced=traced)
        return out
    rows = buffer.view(level.comm.world, -1)
    shapes = [tuple(p.shape) for p in level.pieces]
    out = []
    for r, shape, d, n in zip(
        rows.split([math.prod(s) for s in shapes], dim=1),
        shapes,
        level.dims,
        level.sizes,
        strict=True,
    ):
        if into is not None and n == level.comm.world * shape[d]:
            out.append(_refill_chunks(into[len(out)], r, shape, d))
            continue
        full = _from_rank_major(r, shape, d)
        full = full if full.shape[d] == n else full.narrow(d, 0, n)
        out.append(full if into is None else _refill(into[len(out)], full))
    if gathered is not None:
        _release([buffer], keep=out, traced=traced)
    return out


class _CopyOut(C._Function):
    """The full tensors of an all-gather's output ``[W * S]`` of pieces sharded on dim 0: views
    of one new buffer, filled by one ``split_with_sizes_copy``; backward: one concatenation.

    [Note: one copy-out per bucket]
    Copied out tensor by tensor (a split, a view, a reshape that copies, a narrow for padding),
    each full tensor costs several operations in forward and as many autograd nodes in
    backward, per parameter and per step: on a GPU, where the step waits for the host, that
    was most of the difference between funcshard's and FSDP2's host time at several ranks. For
    the common layout (every piece sharded on dim 0, so that each full tensor is its rows of the
    rank-major buffer, one after the other) the copy-out is one operation into one buffer and
    one node whose backward concatenates the gradients back into the rank-major layout the
    reduce-scatter takes. The full tensors share the buffer's storage: the scheduler frees and
    refills it once per bucket (its storages are found by address). Other layouts, ``torch.func``
    transforms and ``torch.compile`` take the general path (the latter ``_opaque.CopyOut``).

    [Note: the copy-out node is the post-backward node]
    This node's backward runs when autograd has the gradients of all of its full tensors: where
    the scheduler's post-backward callback must run (``Notify`` on the group's full tensors,
    which costs a view per parameter per step). Where a group's gather is this one node (one
    bucket, gathered over one mesh dim, its gradients not captured for ZeRO-2), the node runs
    the callback itself (``then``, see :func:`finish_notifying`), before it concatenates.
    """

    @staticmethod
    def forward(buffer: torch.Tensor, world: int, chunks, sizes, then=None):
        numels = [math.prod(c) for c in chunks]
        flat = buffer.new_empty(world * sum(numels))
        # each piece's padded full tensor at its offset in ``flat``, seen as its [W, n] rows and
        # as the full tensor (narrowed to its size): one view each, made from ``flat`` directly
        rows, fulls, at = [], [], 0
        for c, n, size in zip(chunks, numels, sizes, strict=True):
            rows.append(flat.as_strided((world, n), (n, 1), at))
            strides = C.contiguous_strides((world * c[0], *c[1:]))
            fulls.append(flat.as_strided((size, *c[1:]), strides, at))
            at += world * n
        torch.split_with_sizes_copy(buffer.view(world, -1), numels, dim=1, out=rows)
        return tuple(fulls)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.world, ctx.chunks, _, ctx.then = inputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.then is not None:  # see [Note: the copy-out node is the post-backward node]
            grads = ctx.then(grads)
        world, rows = ctx.world, []
        for g, c in zip(grads, ctx.chunks, strict=True):
            padded = world * c[0]
            if g.shape[0] != padded:  # zeros where the gather padded
                g = torch.cat([g, g.new_zeros(padded - g.shape[0], *c[1:])])
            n = math.prod(c)
            rows.append(g.view(world, n) if g.is_contiguous() else g.reshape(world, n))
        return torch.cat(rows, dim=1).view(-1), None, None, None, None


def _refill_rows(targets: Sequence[torch.Tensor], rows: torch.Tensor, chunks) -> list:
    """Refill ``targets`` (:class:`_CopyOut`'s results, whose storage was freed) from a gathered
    ``[W, S]`` buffer with one copy, keeping their version counters: the rows of each target's
    padded full tensor are a strided view of its storage, also where its own view is narrowed."""
    world, numels = rows.shape[0], [math.prod(c) for c in chunks]
    views = [  # called under no_grad: the views record no history
        t.as_strided((world, n), (n, 1), t.storage_offset())
        for t, n in zip(targets, numels, strict=True)
    ]
    with torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
        torch.split_with_sizes_copy(rows, numels, dim=1, out=views)
    return list(targets)


def _refill_chunks(target: torch.Tensor, rows: torch.Tensor, chunk_shape, dim: int):
    """:func:`_refill` with ``_from_rank_major(rows, chunk_shape, dim)``, copied chunk by chunk
    into ``target``'s own memory: one copy, no full-size temporary."""
    w = rows.shape[0]
    chunks = rows.view(w, *chunk_shape).movedim(0, dim)
    with torch.autograd._unsafe_preserve_version_counter(target):
        target.detach().unflatten(dim, (w, chunk_shape[dim])).copy_(chunks)
    return target


def _release(tensors: Sequence[torch.Tensor], keep: Sequence[torch.Tensor], traced: bool) -> None:
    """Free the storage of a finished all-gather's output now.

    [Note: releasing collective buffers]
    After the wait, c10d's work object still references the collective's buffers (gloo keeps
    the last work until the next one), so dropping our references frees nothing until the next
    collective -- one group too late for the prefetch window. The output is ours, read by
    nobody once copied out (autograd saves nothing of it), so its storage is emptied here,
    unless a result is a view of it (single-tensor buckets). (Reduction inputs we own are freed
    the same way when waited: see ``_collectives.wait``.)
    """
    if traced:  # traced tensors have no storage: the compiler frees after the last use
        return
    kept = {storage_key(t) for t in keep}
    for t in tensors:
        if storage_key(t) not in kept:
            t.untyped_storage().resize_(0)


def _flat_dtype(opts: Options, dtype: torch.dtype) -> torch.dtype:
    """See [Note: flat dtype]."""
    gather = opts.param_dtype or dtype
    return gather if (opts.reduce_dtype or gather) == gather else dtype


def lower(
    dtypes: Sequence[torch.dtype],
    layouts: Sequence[Layout],
    opts: Options,
    mode: Mode,
    post_forward: int | None = None,
    speaking: Sequence[bool] | None = None,
) -> Lowered:
    """The gather of leaves of ``dtypes`` (their local shards') and ``layouts``, lowered once
    for ``mode``: buckets, collectives and dtypes depend on the structure alone.

    ``post_forward``: the group's ``reshard_after_forward=N`` (``N >= 2``), for which eager
    buckets get their sub-group of ``N`` ranks (see [Note: reshard to a smaller mesh]).
    ``speaking``: per leaf, whether its shard speaks FSDP2's all-gather protocol
    (``_subclass.speaking``; ``None``: none does); their buckets are packed (see [Note: one
    byte buffer per collective]).

    Raises:
        ValueError: ``post_forward`` does not divide the size of a bucket's sharded mesh dim.
        NotImplementedError: a protocol leaf not sharded along dim 0 over one mesh dim, or
            inside a ``torch.func`` transform.
    """
    if opts.grad_reduce == "weighted":
        _counts.refuse_experts([lay.path for lay in layouts if lay.over > 1])
    flat = tuple(_flat_dtype(opts, d) for d in dtypes)
    if speaking is not None:
        _packed.check(layouts, speaking, mode)
        flat = tuple(d if s else f for d, f, s in zip(dtypes, flat, speaking, strict=True))
    buckets = []
    for idx in _buckets(flat, layouts, speaking or ()):
        lays = tuple(layouts[i] for i in idx)
        out_dtype = opts.param_dtype or dtypes[idx[0]]
        sharded, replicated = _mesh_dims(lays[0])
        comms = tuple(  # see [Note: order of mesh dims]
            _comm(lays[0], m, opts, out_dtype, mode if j == 0 else mode.waited)
            for j, m in enumerate(reversed(sharded))
        )
        replicas = tuple(_comm(lays[0], r, opts, flat[idx[0]], mode) for r in replicated)
        # one rank everywhere, and no expert-parallel mean to divide by
        local = all(c.world == 1 and c.over == 1 for c in (*comms, *replicas))
        post = None
        if speaking is not None and any(speaking[i] for i in idx):
            wire = _packed.Wire(tuple(speaking[i] for i in idx), sharded[0], opts.param_dtype,
                                opts.reduce_dtype)  # fmt: skip
            buckets.append(Bucket(tuple(idx), lays, tuple(sharded), comms, replicas,
                                  out_dtype, False, None, wire))  # fmt: skip
            continue
        if post_forward is not None and sharded:
            sizes = [lays[0].spec.mesh.size(m) for m in sharded]
            _post_forward.check(opts.label, post_forward, sizes, [lay.path for lay in lays])
            if mode is Mode.EAGER and len(sharded) == 1:
                mesh = lays[0].spec.mesh
                post = _post_forward.post(comms[0], mesh, sharded[0], post_forward)
        buckets.append(
            Bucket(tuple(idx), lays, tuple(sharded), comms, replicas, out_dtype, local, post)
        )
    local = [b.local for b in buckets]
    uncast = all(d == f == (opts.param_dtype or d) for d, f in zip(dtypes, flat, strict=True))
    packed = any(b.wire is not None for b in buckets)
    return Lowered(
        tuple(buckets), len(dtypes), opts, mode, flat, all(local), any(local),
        all(local) and uncast, packed,
    )  # fmt: skip


def _weighted(b: Bucket, counts) -> tuple[tuple[C.Comm, ...], tuple[C.Comm, ...]]:
    """``b``'s collectives for one ``"weighted"`` call: the first reduction of the gradient
    carries this rank's weight (see [Note: the first reduction carries the weight])."""
    weight = _counts.weight(counts, b.layouts[0].spec.mesh)
    if b.comms:
        return (*b.comms[:-1], dataclasses.replace(b.comms[-1], weight=weight)), b.replicas
    return b.comms, (*b.replicas[:-1], dataclasses.replace(b.replicas[-1], weight=weight))


def arm(tensors: Sequence[torch.Tensor], lowered: Lowered) -> list[torch.Tensor]:
    """Cast shards to their copy-in dtype and, under plain autograd, put a wait node on them
    (``Notify`` with ``waiting``): where the backward reduce-scatter of these shards is waited.

    Calling it before the gather is issued (the scheduler arms the next group when the
    current one starts) places that wait after the current group's backward, whatever the
    prefetch: see [Note: pending tensors] in ``_collectives``. Nothing between that node and
    the all-gather reads the gradient (only pads, concatenations and views), which is why the
    cast comes first. A local group has nothing pending: no wait node.
    """
    dtypes = lowered.flat_dtypes
    cast = [C.cast(x, d) for x, d in zip(tensors, dtypes, strict=True)]
    if not lowered.mode.asynchronous or lowered.local or not torch.is_grad_enabled():
        return cast
    if lowered.packed:  # frozen low-precision shards (QLoRA's): nothing to wait for, no alias
        live = [i for i, x in enumerate(cast) if x.requires_grad]
        waited = C.Notify.apply(C.waiting(lowered.opts.label), *(cast[i] for i in live))
        for i, x in zip(live, waited, strict=True):
            cast[i] = x
        return cast
    return list(C.Notify.apply(C.waiting(lowered.opts.label), *cast))


def issue(
    tensors: Sequence[torch.Tensor],
    lowered: Lowered,
    armed: Sequence[torch.Tensor] | None = None,
    counts: Sequence[float | None] | None = None,
    kept: Sequence[torch.Tensor | None] | None = None,
) -> Inflight:
    """Start gathering ``tensors`` (logical local shards) to their full logical shapes, as
    ``lowered`` says.

    ``armed``: the result of :func:`arm` for these tensors, if already made. Under plain
    autograd each bucket's first all-gather is left pending; :func:`finish` waits.
    ``counts``: every rank's, for a ``"weighted"`` call (see [Note: the first reduction
    carries the weight]).
    ``kept``: per bucket, the slice :func:`keep` kept after forward, or ``None``: those
    buckets are gathered from it within their sub-group (a re-gather, without autograd).
    """
    shards, tensors = tensors, list(armed) if armed is not None else arm(tensors, lowered)
    # see [Note: a gather's copy-in follows the waits before it] in _compile
    after = after_waits() if lowered.mode is Mode.TRACED else None
    started = []
    for j, b in enumerate(lowered.buckets):
        xs = [tensors[i] for i in b.index]
        comms, replicas = (b.comms, b.replicas) if counts is None else _weighted(b, counts)
        state: _Level | list[torch.Tensor] | Any
        slice_ = None if kept is None else kept[j]
        if b.wire is not None:  # see [Note: FSDP2's all-gather protocol] in _packed
            opts = lowered.opts.counted(counts) if counts is not None else lowered.opts
            own = [shards[i] for i in b.index]
            state = _packed.issue(b.wire, b.layouts, xs, own, comms[0], opts)
        elif slice_ is not None:  # see [Note: reshard to a smaller mesh]
            state = _from_kept(b, slice_)
        elif b.local:  # see [Note: one rank communicates nothing] in _collectives
            comm = b.comms[0] if b.comms else b.replicas[0]
            state = [C.one_rank(x, comm) for x in xs]
        elif b.comms:
            state = _start_level(xs, b.layouts, b.sharded[-1], comms[0], replicas, after)
        else:
            flat = torch.cat([x.reshape(-1) for x in xs])
            for r in replicas:
                flat = C.Broadcast.apply(flat, r)
            none = [None] * len(xs)
            state = _split(flat, [tuple(x.shape) for x in xs], none, none)
        started.append(_Started(b, state, comms))
    return Inflight(started, len(tensors))


def keep(fulls: Sequence[torch.Tensor], lowered: Lowered) -> list[torch.Tensor | None]:
    """Per bucket, the slice of ``fulls`` (a group's gathered tensors) kept after forward, or
    ``None`` (see [Note: reshard to a smaller mesh])."""
    return [
        None
        if b.post is None
        else _post_forward.keep([fulls[i] for i in b.index], b.layouts, b.sharded[0], b.post)
        for b in lowered.buckets
    ]


def _from_kept(b: Bucket, kept: torch.Tensor) -> _Level:
    """The re-gather of a bucket from its kept slice: the sub-group's all-gather, which gives
    the whole dim's ``[W, S]`` buffer; copied out as the full gather (``_finish_level``)."""
    m, comm = b.sharded[0], b.comms[0]
    dims = [lay.dim(m) for lay in b.layouts]
    sizes = [lay.levels[m][d] for lay, d in zip(b.layouts, dims, strict=True)]
    # the pieces only give their shapes: the gathered buffer is handed to AllGather ready
    scalar = kept.new_empty(())
    pieces = [scalar.expand(s) for s in _post_forward.padded_shapes(b.layouts, m, comm.world)]
    started = C.start_all_gather(b.post.comm, [kept])  # type: ignore[union-attr]
    return _Level(pieces, comm, (), started, dims, sizes)


def wait_transfers(inflight: Inflight) -> None:
    """Wait for :func:`issue`'s transfers, copying nothing out (:func:`finish` does that).

    Lets a caller allocate the results' memory only once the collectives' own buffers (gloo's
    full-size scratch) are gone: see [Note: refill after the transfer] in ``_schedule``.
    """
    for b in inflight.buckets:
        packed = b.bucket.wire is not None  # a ``_packed.Packing``
        if packed or (isinstance(b.state, _Level) and b.state.started is not None):
            b.state.started.transferred()


def finish(inflight: Inflight, into: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Wait for :func:`issue`'s gathers and return the full tensors, in the order given.

    ``into``: tensors of the results' shapes and dtypes to copy the results into (under
    ``no_grad``, keeping their version counters: a re-gather refilling freed storage).
    """
    return _finish(inflight, into, None)


def finish_notifying(inflight: Inflight, then) -> tuple[list[torch.Tensor], bool]:
    """:func:`finish`, and whether the gather's own node runs ``then`` (a post-backward callback,
    as ``Notify``'s, or ``None``) when the results' gradients are complete: where the gather is one
    :class:`_CopyOut` (see [Note: the copy-out node is the post-backward node]). If not, the
    caller puts its ``Notify`` on the results."""
    taken = then is not None and _copies_once(inflight)
    return _finish(inflight, None, then if taken else None), taken


def _copies_once(inflight: Inflight) -> bool:
    """Whether the gather is one :class:`_CopyOut` node: one bucket, gathered over one mesh dim,
    issued (not under ``torch.compile``), every piece sharded on dim 0."""
    if len(inflight.buckets) != 1:
        return False
    started = inflight.buckets[0]
    if started.bucket.wire is not None:  # the packed gather's node (``_packed.Gathered``)
        return True
    level = started.state
    return (
        isinstance(level, _Level)
        and not level.comm.way.traced
        and len(started.bucket.sharded) == 1
        and level.started is not None
        and not any(level.dims)
    )


def _finish(inflight: Inflight, into, then) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * inflight.count
    for started in inflight.buckets:
        b = started.bucket
        targets = None if into is None else [into[i] for i in b.index]
        fulls = started.state
        if b.wire is not None:  # see [Note: FSDP2's all-gather protocol] in _packed
            if targets is None:
                fulls = _finish_packed(fulls, then)
            else:
                fulls = _packed.refill(fulls, targets)
            for i, full in zip(b.index, fulls, strict=True):
                out[i] = full
            continue
        if isinstance(fulls, _Level):
            more = b.sharded[:-1]  # further sharded mesh dims: synchronous
            fulls = _finish_level(fulls, None if more else targets, then)
            for m, comm in zip(reversed(more), started.comms[1:], strict=True):
                level = _start_level(fulls, b.layouts, m, comm)
                fulls = _finish_level(level, targets if m == more[0] else None)
        elif targets is not None:
            fulls = [_refill(t, f) for t, f in zip(targets, fulls, strict=True)]
        for i, full in zip(b.index, fulls, strict=True):
            out[i] = C.cast(full, b.out_dtype)
    return out  # type: ignore[return-value]


def _finish_packed(p: _packed.Packing, then=None) -> list[torch.Tensor]:
    """The full tensors of a packed bucket's first gather (see ``_packed``), recorded by
    autograd: their gradients are reduce-scattered to the shards (:class:`_PackedGather`)."""
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in p.xs):
        with torch.no_grad():
            return _packed.rebuild(p)
    return list(_PackedGather.apply(p, then, *p.xs))


class _PackedGather(C._Function):
    """A packed bucket's full tensors from its gather; backward: ``then`` (the post-backward
    callback, see [Note: the copy-out node is the post-backward node]), then :func:`scatter`
    of the differentiable leaves' gradients to their shards (in the call's ``grad_reduce``,
    dtypes and mode; an unused output reduces as zeros)."""

    @staticmethod
    def forward(p: _packed.Packing, then, *xs):
        return tuple(_packed.rebuild(p))

    @staticmethod
    def setup_context(ctx, inputs, output):
        p, ctx.then, *xs = inputs
        ctx.p = dataclasses.replace(p, started=None, xs=(), shards=(), metadata=())
        ctx.like = [(x.dtype, x.device) for x in xs]
        ctx.set_materialize_grads(False)
        frozen = [y for x, y in zip(xs, output, strict=True) if not x.requires_grad]
        ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.then is not None:
            grads = ctx.then(grads)
        p, needs = ctx.p, ctx.needs_input_grad[2:]
        idx = [i for i, n in enumerate(needs) if n]
        fulls = []
        for i in idx:
            g = grads[i]
            if g is None:  # an unused output: zeros, as the gather's backward reduces them
                dtype, device = ctx.like[i]
                dtype = p.wire.param_dtype or dtype
                g = torch.zeros(p.layouts[i].levels[0], dtype=dtype, device=device)
            fulls.append(g)
        layouts, dtypes = [p.layouts[i] for i in idx], [ctx.like[i][0] for i in idx]
        reduced = iter(scatter(fulls, layouts, dtypes, p.opts, p.mode))
        return (None, None, *(next(reduced) if n else None for n in needs))


def gather(tensors: Sequence[torch.Tensor], layouts: Sequence[Layout], opts: Options):
    """All-gather ``tensors`` to full tensors: :func:`issue` then :func:`finish`."""
    static = dataclasses.replace(opts, counts=None)
    speaks = _subclass.speaking(tensors)
    lowered = lower([t.dtype for t in tensors], layouts, static, Mode.now(), None, speaks)
    return finish(issue(tensors, lowered, counts=opts.counts))


def scatter(
    fulls: Sequence[torch.Tensor],
    layouts: Sequence[Layout],
    out_dtypes: Sequence[torch.dtype],
    opts: Options,
    mode: Mode,
) -> list[torch.Tensor]:
    """Reduce-scatter full (logical) tensors to the local shards described by ``layouts``.

    The adjoint of :func:`gather`: sharded mesh dims from the first to the last, then an
    all-reduce of the (smallest) flat result over replicated mesh dims, in ``mode`` (the call's):
    synchronous, unless collectives may stay pending there; then a bucket whose last step is a
    reduce-scatter already in the results' dtypes returns its results pending (see [Note:
    pending tensors] in ``_collectives``: the caller waits each with ``wait``). Outside autograd
    the concatenated input is donated.
    """
    out: list[torch.Tensor | None] = [None] * len(fulls)
    for idx in _buckets([t.dtype for t in fulls], layouts):
        xs, lays = [fulls[i] for i in idx], [layouts[i] for i in idx]
        sharded, replicated = _mesh_dims(lays[0])
        red = _comm(lays[0], 0, opts, xs[0].dtype, mode).reduce_dtype
        pending = mode.asynchronous and not replicated and all(out_dtypes[i] == red for i in idx)
        for j, m in enumerate(sharded):
            last = j == len(sharded) - 1
            comm = _comm(
                lays[0], m, opts, xs[0].dtype, mode if pending and last else mode.waited, j == 0
            )
            dims = [lay.dim(m) for lay in lays]
            chunks = [-(-x.shape[d] // comm.world) for x, d in zip(xs, dims, strict=True)]
            rows = [
                _to_rank_major(_pad(x, d, c * comm.world), d, comm.world)
                for x, d, c in zip(xs, dims, chunks, strict=True)
            ]
            flat = torch.cat(rows, dim=1).reshape(-1)
            flat = C.ReduceScatter.apply(flat, comm, red, not torch.is_grad_enabled())
            if last:
                flat = _all_reduce(flat, lays[0], replicated, opts, mode.waited)
            shapes = [
                (*x.shape[:d], c, *x.shape[d + 1 :])
                for x, d, c in zip(xs, dims, chunks, strict=True)
            ]
            sizes = [lay.levels[m + 1][d] for lay, d in zip(lays, dims, strict=True)]
            xs = _split(flat, shapes, dims, sizes)
        if not sharded:
            flat = C.cast(torch.cat([x.reshape(-1) for x in xs]), red)
            flat = _all_reduce(flat, lays[0], replicated, opts, mode.waited, first=True)
            xs = _split(flat, [x.shape for x in xs], [None] * len(xs), [None] * len(xs))
        for i, x in zip(idx, xs, strict=True):
            out[i] = C.cast(x, out_dtypes[i])
    return out  # type: ignore[return-value]


def _all_reduce(
    flat, layout: Layout, mesh_dims, opts: Options, mode: Mode, first=False
) -> torch.Tensor:
    """All-reduce over ``mesh_dims`` in order; ``first``: the first of them is the first
    reduction of the gradient (see :func:`_comm`)."""
    for i, m in enumerate(mesh_dims):
        comm = _comm(layout, m, opts, flat.dtype, mode, first and i == 0)
        flat = C.AllReduce.apply(flat, comm)
    return flat
