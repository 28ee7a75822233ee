"""``unshard``: DTensor (or LocalShard) shards -> full tensors, differentiably."""

from __future__ import annotations

import torch

from .._communication import _consensus, _counts, _flat, _grad_layout
from .._runtime import _sink
from .._runtime._compile import traced
from .._trees import _parallel
from .._trees._spec import as_locals, check_materialized
from .._trees._tree import PyTree, flatten, unflatten


@traced  # see [Note: funcshard under torch.compile]
def unshard(
    sharded: PyTree,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    grad_reduce: str = "mean",
    count: float | torch.Tensor | None = None,
) -> PyTree:
    """All-gather every shard of ``sharded``; return the same tree of plain full tensors.

    One all-gather per bucket of leaves with the same mesh, placement kinds and dtype (usually one
    for the whole tree). Differentiable with plain autograd and every ``torch.func`` transform:
    the backward is a reduce-scatter (plus an all-reduce over replicated mesh dims, e.g. HSDP's
    replicate dim).

    Args:
        sharded: DTensor leaves (from :func:`~funcshard.shard`) or, inside ``torch.func``
            transforms, :class:`~funcshard.LocalShard` leaves (from :func:`~funcshard.to_local`).
            Under ``vmap`` over stacked shards the local tensors lose leading dims: the full
            tensors then have the per-member shape.
        param_dtype: cast each shard to this dtype *before* the all-gather (communication and
            the returned tensors in low precision). Default: the shard's dtype.
        reduce_dtype: dtype of the backward reduce-scatter. Default: ``param_dtype`` (as FSDP2).
            Gradients come back in each shard's own dtype.
        grad_reduce: ``"mean"`` averages gradients over all ranks (DDP/FSDP semantics: the
            gradient of the mean of the ranks' losses, i.e. of the global-batch mean loss when
            each rank averages over an equal local batch); ``"sum"`` is the exact adjoint;
            ``"weighted"`` weights each rank by its ``count`` (``n_r / N``): the gradient of the
            global-batch mean loss when each rank averages over ``count`` samples or tokens.
        count: this rank's number of samples (or tokens) its loss averages over: required by
            ``"weighted"``; with ``"mean"``, a count of 0 is an error on every rank (so is a
            batch tensor with a leading dim of 0 in the enclosing ``fs.value_and_grad``'s
            arguments: see docs/failures.md). A number, or a one-element tensor (``.item()``).

    Returns:
        The same structure with full tensors (global shape, ``param_dtype`` or the shard's dtype);
        for FSDP x TP's 2-D layout, DTensors on the tensor-parallel mesh with the TP placements
        (gathered over the data-parallel dims only; see docs/parallelism.md).

    Raises:
        TypeError: a leaf is not a shard (see :func:`~funcshard.to_local` for ``torch.func``).
        RuntimeError: shards still on the meta device.
        ValueError: bad ``grad_reduce`` or ``count``; a local tensor that does not match its
            spec; with ``"mean"``, a rank whose batch is empty (on every rank, naming it).
        NotImplementedError: ``"weighted"`` under ``torch.compile``.
    """
    with _consensus.failing("unshard"):  # see [Note: one status per call]
        paths, leaves, spec = flatten(sharded)
        locals_, specs = as_locals(paths, leaves, "unshard")
        found = zip(paths, specs, locals_, strict=True)
        layouts = [_flat.Layout.of(p, s, t) for p, s, t in found]
        check_materialized(paths, locals_, "unshard")
        opts = _flat.Options("unshard", param_dtype, reduce_dtype, _counts.reduction(grad_reduce))
        count = _counts.own("unshard", opts.grad_reduce, count)
        entries = zip(paths, specs, locals_, strict=True)
        leaves_ = [_consensus.leaf(p, s, t) for p, s, t in entries]
        counts = _counts.agree("unshard", opts.grad_reduce, count, locals_, leaves_, opts.key())
        opts = opts.counted(counts)
    fulls = _flat.gather(locals_, layouts, opts) if locals_ else []
    fulls = _grad_layout.capture(leaves, fulls, opts)  # see [Note: gradients in the ... layout]
    if (sink := _sink.current()) is not None:  # see [Note: gradient accumulation without ...]
        _parallel.refuse_unsynced(paths, specs, "unshard")
        sink.track(leaves, fulls)
    fulls = _parallel.wrap(fulls, specs)  # FSDP x TP: DTensors on the TP mesh
    return unflatten(spec, fulls)
