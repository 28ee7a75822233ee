"""``reduce``: full gradients computed by the user -> shards placed like a sharded tree."""

from __future__ import annotations

import torch

from .._communication import _counts, _flat
from .._communication._consensus import failing
from .._runtime._compile import traced
from .._runtime._mode import Mode
from .._trees._dtensor import dtensors_of, unwrap
from .._trees._parallel import model_local
from .._trees._spec import LocalShard, ShardSpec, spec_of
from .._trees._tree import PyTree, flatten, flatten_like, unflatten


@traced  # see [Note: funcshard under torch.compile]
def reduce(
    full_grads: PyTree,
    like: PyTree,
    *,
    op: str = "mean",
    reduce_dtype: torch.dtype | None = None,
    count: float | torch.Tensor | None = None,
) -> PyTree:
    """Reduce-scatter full per-rank tensors into shards placed like ``like``.

    For gradients you computed yourself on full parameters (per-sample gradients after clipping,
    accumulated micro-batches, ...). One reduce-scatter per bucket, plus an all-reduce over
    replicated mesh dims. Differentiable (its backward is an all-gather).

    Args:
        full_grads: a tree with the structure of ``like`` whose leaves are full tensors of the
            global (per-member, under ``vmap``) shapes, or ``None`` for no gradient (frozen
            parameters): those come back ``None``, without communication.
        like: the sharded tree to match: DTensors, or LocalShards inside ``torch.func``.
        op: ``"mean"`` averages over all ranks (DDP/FSDP), ``"sum"`` adds, ``"weighted"``
            weights each rank by its ``count`` (``n_r / N``).
        reduce_dtype: dtype of the communication; results come back in ``like``'s dtypes.
        count: this rank's number of samples (or tokens), as in :func:`~funcshard.unshard`:
            required by ``"weighted"``; a count of 0 with ``"mean"`` is an error on every rank.

    Returns:
        ``like``'s structure: DTensors (or LocalShards, matching ``like``'s leaves).

    Raises:
        ValueError: the trees' structures differ (naming the keys), a shape does not match; bad
            ``op`` or ``count``.
        TypeError: a leaf of ``full_grads`` is not a tensor, or of ``like`` not a shard.
    """
    with failing("reduce"):  # see [Note: one status per call] in _consensus
        op = _counts.reduction(op, "op")
        count = _counts.own("reduce", op, count)
        paths, like_leaves, spec = flatten(like, none_is_leaf=True)
        fulls = flatten_like(
            full_grads, like, what="full_grads", like_what="like", none_is_leaf=True
        )
        given = [i for i, f in enumerate(fulls) if f is not None]
        layouts, dtypes, specs = [], [], []
        for i, path, full, leaf in ((i, paths[i], fulls[i], like_leaves[i]) for i in given):
            shard_spec = spec_of(path, leaf, "reduce")
            if not isinstance(full, torch.Tensor):
                raise TypeError(
                    f"reduce: full_grads at {path!r} is a {type(full).__name__}, not a tensor."
                )
            lead = len(shard_spec.shape) - full.dim()
            if lead < 0 or tuple(full.shape) != shard_spec.shape[lead:]:
                raise ValueError(
                    f"reduce: full_grads at {path!r} has shape {list(full.shape)}, expected the "
                    f"full shape {list(shard_spec.shape)} of the parameter it reduces into."
                )
            if shard_spec.dp_dims is not None:  # FSDP x TP: scatter the TP-local part over dp
                fulls[i] = model_local(path, full, shard_spec)
            layouts.append(_flat.Layout.stripped(path, shard_spec, lead))
            specs.append(shard_spec)
            dtypes.append(leaf.tensor.dtype if isinstance(leaf, LocalShard) else leaf.dtype)
        opts = _flat.Options("reduce", reduce_dtype=reduce_dtype, grad_reduce=op)
        entries = [(paths[i], s, d, True) for i, s, d in zip(given, specs, dtypes, strict=True)]
        wire = ("grad_dtypes", tuple(fulls[i].dtype for i in given))
        counts = _counts.agree("reduce", op, count, None, entries, (*opts.key(), wire))
        opts = opts.counted(counts)
    mode = Mode.now().waited
    reduced = _flat.scatter([fulls[i] for i in given], layouts, dtypes, opts, mode) if given else []
    outs: list = [None] * len(fulls)
    for i, out in zip(given, _like(reduced, [like_leaves[i] for i in given]), strict=True):
        outs[i] = out
    return unflatten(spec, outs)


def _like(outs: list[torch.Tensor], leaves) -> list:
    """Each result in the form of its ``like`` leaf: a LocalShard, or a DTensor (also under
    torch.func wrappers; see [Note: DTensor trees inside torch.func]), in one call."""
    dtensors = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, LocalShard)]
    specs = [ShardSpec.of(unwrap(leaves[i])) for i in dtensors]
    made = dtensors_of([outs[i] for i in dtensors], specs)
    result = [LocalShard(out, leaf.spec) if isinstance(leaf, LocalShard) else None
              for out, leaf in zip(outs, leaves, strict=True)]  # fmt: skip
    for i, d in zip(dtensors, made, strict=True):
        result[i] = d
    return result
