"""Tensor-subclass leaves (low-precision weights) checkpointed as their inner tensors.

[Note: a subclass is saved as its inner tensors]
DCP writes a shard as bytes and reads any block of a saved tensor into a target with ``narrow``
and ``copy_``; a subclass such as torchao's ``NF4Tensor`` has neither at other offsets than 0,
and what its bytes mean is its own (4-bit codes, per-block scales). So a subclass leaf is saved
as the plain tensors it is made of (``__tensor_flatten__``), each under ``<key>/<name>`` and
placed so that every world size finds its part:

* an inner tensor of the shard's own shape (float8 training's high-precision weight) is placed
  like the shard itself: the same global shape and placements;
* an inner tensor that the subclass's ``fsdp_pre_all_gather`` hands to the all-gather (NF4's
  packed data and scales) is, by FSDP2's protocol, one rank's part of the full parameter's,
  which is the ranks' parts concatenated along dim 0: it is placed as ``Shard(0)`` of that
  concatenation on the sharded mesh dim;
* an inner tensor the hook passes in its metadata, or a 0-d one (NF4's code book and mean of the
  scales), is the same on every rank: saved once, as a plain tensor.

Loading fills plain tensors placed the same way for the ``like`` leaf -- so a checkpoint saved
on 2 ranks loads on 4 -- and rebuilds the subclass with ``__tensor_unflatten__`` and the
``like`` shard's own flatten context (its shapes on this world size). Bytes are copied, never
quantized again: every value is the saved one. An inner tensor that fits none of the three is
an error naming the leaf.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._communication._packed import pre_all_gather
from .._trees import _parallel
from .._trees._subclass import is_subclass, speaks


def local_of(leaf: Any) -> torch.Tensor | None:
    """The subclass ``leaf`` is (plain leaves) or holds (DTensors), else ``None``."""
    if not isinstance(leaf, torch.Tensor):
        return None
    local = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
    return local if is_subclass(local) else None


def describe(leaf: torch.Tensor) -> dict[str, Any]:
    """What the manifest adds for a subclass leaf: its class, compared by ``load``."""
    local = local_of(leaf)
    return {} if local is None else {"subclass": type(local).__qualname__}


def inner_tensors(key: str, leaf: torch.Tensor) -> dict[str, torch.Tensor]:
    """The DCP entries of a subclass leaf: ``{<key>/<name>: placed inner tensor}`` (see [Note:
    a subclass is saved as its inner tensors]).

    Raises:
        NotImplementedError: an inner tensor whose placement cannot be told.
    """
    local = local_of(leaf)
    names, _ = local.__tensor_flatten__()
    placed = _placements(key, leaf, local, names)
    return {f"{key}/{n}": _placed(leaf, getattr(local, n).detach(), placed[n]) for n in names}


def targets(key: str, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fresh tensors to load ``like``'s inner tensors into, placed as :func:`inner_tensors`."""
    local = local_of(like)
    names, _ = local.__tensor_flatten__()
    placed = _placements(key, like, local, names)
    return {f"{key}/{n}": _placed(like, torch.empty_like(getattr(local, n)), placed[n])
            for n in names}  # fmt: skip


def rebuilt(key: str, like: torch.Tensor, loaded: dict[str, torch.Tensor]) -> torch.Tensor:
    """``like``'s subclass made of the loaded inner tensors (its DTensor, if ``like`` is one)."""
    local = local_of(like)
    names, ctx = local.__tensor_flatten__()
    inner = {}
    for n in names:
        t = loaded[f"{key}/{n}"]
        inner[n] = t._local_tensor if isinstance(t, DTensor) else t
    value = type(local).__tensor_unflatten__(inner, ctx, local.shape, local.stride())
    if isinstance(like, DTensor):
        value = DTensor.from_local(
            value, like.device_mesh, like.placements, run_check=False, shape=like.shape,
            stride=like.stride(),
        )  # fmt: skip
    return value.requires_grad_(like.requires_grad)


def _placements(key, leaf, local, names) -> dict[str, str]:
    """Per inner tensor: ``"like"`` (the shard's placement), ``"rows"`` (dim-0 part of a
    concatenation) or ``"same"`` (replicated)."""
    out, wire, meta = {}, None, None
    for n in names:
        t = getattr(local, n)
        if tuple(t.shape) == tuple(local.shape):
            out[n] = "like"
        elif t.dim() == 0:
            out[n] = "same"
        else:
            if wire is None:
                wire, meta = _hook_tensors(leaf, local)
            out[n] = "rows" if _among(t, wire) else "same" if _among(t, meta) else ""
    unknown = [n for n, v in out.items() if not v]
    if unknown and isinstance(leaf, DTensor):
        raise NotImplementedError(
            f"checkpoint: {key!r} is a {type(local).__name__} whose inner tensors {unknown} are "
            "neither of its shard's shape, nor what its fsdp_pre_all_gather gathers or passes "
            "on: funcshard cannot tell which part of them each rank holds. Save its value in a "
            "plain dtype instead (and quantize again after loading)."
        )
    return {n: v or "same" for n, v in out.items()}


def _hook_tensors(leaf, local) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors ``local``'s ``fsdp_pre_all_gather`` gathers, and those in its metadata."""
    if not isinstance(leaf, DTensor) or not speaks(local):
        return [], []
    mesh, dim = leaf.device_mesh, _sharded_dim(leaf)
    mesh = mesh if mesh.ndim == 1 else _parallel.submesh(mesh, (dim,))
    with torch.no_grad():
        inputs, metadata = pre_all_gather(local, mesh, leaf.shape)
    tensors = [t for t in torch_pytree.tree_leaves(metadata) if isinstance(t, torch.Tensor)]
    return list(inputs), tensors


def _sharded_dim(leaf: DTensor) -> int:
    dims = [i for i, p in enumerate(leaf.placements) if isinstance(p, Shard)]
    return dims[0] if len(dims) == 1 else -1


def _among(t: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """``t`` is one of ``tensors`` (the same memory, offset and shape)."""
    ptr = t.untyped_storage().data_ptr()
    return any(
        o.untyped_storage().data_ptr() == ptr
        and o.storage_offset() == t.storage_offset()
        and o.shape == t.shape
        for o in tensors
    )


def _placed(leaf, inner: torch.Tensor, how: str) -> torch.Tensor:
    if not isinstance(leaf, DTensor) or how == "same":
        return inner
    mesh, placements = leaf.device_mesh, leaf.placements
    if how == "like":
        shape, stride = leaf.shape, leaf.stride()
    else:  # "rows": this rank's part of the ranks' concatenation along dim 0
        dim = _sharded_dim(leaf)
        shape = torch.Size((inner.shape[0] * mesh.size(dim), *inner.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        placements = tuple(Shard(0) if i == dim else Replicate() for i in range(mesh.ndim))
    return DTensor.from_local(inner, mesh, placements, run_check=False, shape=shape, stride=stride)
