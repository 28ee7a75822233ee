"""Rank-major rows: how an all-gather's buffer lays out a gathered tensor, and back.

An all-gather over ``W`` ranks returns ``[W, S]``: row ``r`` holds rank ``r``'s padded pieces,
one after the other. A tensor sharded along ``dim`` is its ``W`` chunks concatenated along
``dim``; these are the conversions between the two (and the zero-padding of a short chunk),
shared by the gathers of ``_flat`` and the packed gathers of ``_packed``.
"""

from __future__ import annotations

import torch


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad ``dim`` to ``size``. A concatenation, whose backward is a view (``F.pad``'s
    copies), so a pending gradient passes through unread."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:dim], extra, *x.shape[dim + 1 :])], dim=dim)


def _from_rank_major(rows: torch.Tensor, chunk_shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """``[W, prod(chunk_shape)]`` -> the W chunks concatenated along ``dim``."""
    w = rows.shape[0]
    out = rows.view(w, *chunk_shape).movedim(0, dim)
    return out.reshape(*chunk_shape[:dim], w * chunk_shape[dim], *chunk_shape[dim + 1 :])


def _to_rank_major(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """Inverse of :func:`_from_rank_major`: ``[.., W*c, ..]`` -> ``[W, numel / W]``."""
    if dim == 0:  # the rows are the chunks already: one view (a copy if not contiguous)
        return x.reshape(world, -1)
    return x.unflatten(dim, (world, x.shape[dim] // world)).movedim(dim, 0).reshape(world, -1)


def _refill(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Copy ``value`` into ``target`` (a tensor autograd saved) without bumping its version."""
    with torch.autograd._unsafe_preserve_version_counter(target):
        target.detach().copy_(value)
    return target
