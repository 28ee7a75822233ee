"""Muon on sharded matrices, with ``torch.optim.Muon``'s arguments and arithmetic.

Per matrix, as ``torch.optim.Muon`` does it: ``buf.lerp_(g, 1 - momentum)``; the update ``u =
g.lerp(buf, momentum)`` (Nesterov) or ``buf``; ``O = NS(u)``, the Newton-Schulz orthogonalisation
in bfloat16; ``p *= 1 - lr * weight_decay``; ``p -= adjusted_lr * O``. Every step but ``NS`` is
elementwise and runs on the local shards; ``NS`` needs the whole matrix and runs once per matrix,
on its owner rank (see [Note: one owner per matrix] in ``_whole``). The blocks travel in
bfloat16: ``NS`` converts its input to bfloat16 first and returns bfloat16, so converting each
block before sending it and adding the returned block afterwards is the same arithmetic, with
half the bytes of float32.

[Note: torch.optim.Muon's private functions]
``_zeropower_via_newtonschulz`` and ``_adjust_lr`` are private functions of
``torch.optim._muon``; they are imported here and nowhere else, so that the numbers are torch's
own. ``tests/test_muon.py`` compares with ``torch.optim.Muon`` step by step, so a torch upgrade
that moves or changes them fails there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from .._trees._spec import ShardSpec
from .._trees._tree import PyTree, flatten, map_with_path
from . import _whole
from ._adam_sgd import (
    LearningRate,
    _check,
    _check_lr,
    _check_state,
    _count,
    _count_of,
    _differences,
    _Hyper,
    _lr_at,
    _no_updates,
    _pair,
    _writable,
)
from ._base import GradientTransformation, local, without_grad
from ._masked import Mask, resolve

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


class MuonState(NamedTuple):
    """State of :func:`muon`: ``count`` (int64, updates done) and ``momentum`` (the momentum
    buffers, ``momentum_buffer`` in torch.optim: a tree like the parameters, DTensors with their
    placements; ``None`` for non-floating-point parameters)."""

    count: torch.Tensor
    momentum: PyTree


class _Muon(NamedTuple):
    hp: _Hyper
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    eps: float
    ns_steps: int
    adjust_lr_fn: str | None
    stacked: Mask | None


def muon(
    lr: LearningRate,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    *,
    stacked: Mask | None = None,
) -> GradientTransformation:
    """Muon as ``torch.optim.Muon`` computes it, on sharded 2-D parameters.

    Each matrix (a ``[m, n]`` DTensor with any placements, uneven shards included) is
    orthogonalised once, on one owner rank; the owners are balanced by cost over the ranks, and
    the blocks go there and back by two ``all_to_all_single`` calls per step for all matrices
    (see [Note: one owner per matrix]). Matrices held whole by a rank (plain tensors, replicated
    ones) are orthogonalised in place, without communication.

    Args:
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as
            in ``torch.optim.Muon`` (``adjust_lr_fn``: ``None``/``"original"`` scales the lr by
            ``sqrt(max(1, m / n))``, ``"match_rms_adamw"`` by ``0.2 * sqrt(max(m, n))``). ``lr``
            may be a schedule, as for :func:`adam`.
        stacked: which parameters are stacks of matrices ``[k, m, n]`` (expert weights), as a
            predicate ``fn(path, param) -> bool`` or a tree of bools: each of the ``k`` matrices
            is orthogonalised (and its lr adjusted) on its own, as ``k`` separate parameters of
            ``torch.optim.Muon`` would be. A stack sharded on its first dim only needs no
            communication.

    Raises:
        ValueError: an invalid argument (negative ``lr``/``momentum``/``weight_decay``, unknown
            ``adjust_lr_fn``, ``ns_steps >= 100``, not 3 coefficients); from ``init``/``update``:
            a parameter that is not 2-D (or 3-D and ``stacked``), naming it.
    """
    _check_lr("muon", lr)
    _check("muon", "momentum", momentum, momentum >= 0, ">= 0")
    _check("muon", "weight_decay", weight_decay, weight_decay >= 0, ">= 0")
    _check("muon", "adjust_lr_fn", adjust_lr_fn, adjust_lr_fn in ADJUST_LR_FNS, _FNS)
    _check("muon", "ns_steps", ns_steps, isinstance(ns_steps, int) and 0 <= ns_steps < 100, _NS)
    _check("muon", "ns_coefficients", ns_coefficients, len(ns_coefficients) == 3, "3 numbers")
    hp = _Hyper("muon", lr, float(weight_decay), None, None, ())
    m = _Muon(
        hp, float(momentum), nesterov, tuple(ns_coefficients), eps, ns_steps, adjust_lr_fn, stacked
    )
    return GradientTransformation(
        functools.partial(_init, m),
        functools.partial(_update, m, inplace=False),
        functools.partial(_update, m, inplace=True),
    )


_FNS = "None, 'original' or 'match_rms_adamw' (torch.optim.Muon's)"
_NS = "an int in [0, 100) (torch.optim.Muon refuses 100 or more)"


def _check_dims(m: _Muon, tree: PyTree) -> None:
    """Every floating-point leaf of ``tree`` is 2-D, or 3-D and selected by ``stacked``."""
    paths, leaves, _ = flatten(tree, none_is_leaf=True)
    stacked = resolve(m.stacked, tree, "muon") if m.stacked is not None else [False] * len(leaves)
    for path, x, s in zip(paths, leaves, stacked, strict=True):
        if x is None or not x.is_floating_point() or x.dim() == (3 if s else 2):
            continue
        if s:
            raise ValueError(
                f"muon: {path!r} is selected by stacked= but has shape {list(x.shape)}; a stack "
                "of matrices is 3-D, [k, m, n]."
            )
        raise ValueError(
            f"muon: {path!r} has shape {list(x.shape)}; Muon orthogonalises 2-D matrices "
            "(torch.optim.Muon refuses other shapes too). Optimize embeddings, the head, norms "
            "and biases with AdamW: fs.optim.muon_adamw(...) or fs.optim.partition(...); for a "
            "stack of matrices ([experts, out, in]) pass stacked=."
        )


@without_grad
def _init(m: _Muon, params: PyTree) -> MuonState:
    _check_dims(m, params)
    zeros = map_with_path(
        lambda _, p: torch.zeros_like(p) if p.is_floating_point() else None, params
    )
    return MuonState(_count(), zeros)


@without_grad
def _update(m: _Muon, grads, state, params=None, *, inplace: bool):
    _check_state("muon", state, MuonState)
    pairs, fields = _pair("muon", grads, params, {"momentum": state.momentum})
    trained = [p if g is not None else None for p, g in zip(pairs.params, pairs.grads, strict=True)]
    _check_dims(m, pairs.rebuild(trained))
    count = _count_of("muon", state)
    lr = _lr_at(m.hp, count)
    bufs = _writable(fields["momentum"], pairs.active, inplace)
    targets = _writable(pairs.params, pairs.active, inplace)
    updates = []  # the input of NS per active leaf, in bfloat16 (a copy: NS divides it in place)
    for i in pairs.active:
        g, buf = local(pairs.grads[i]), local(bufs[i])
        buf.lerp_(g, 1 - m.momentum)
        u = g.lerp(buf, m.momentum) if m.nesterov else buf
        updates.append(u.to(torch.bfloat16, copy=True))
    leaves = [pairs.params[i] for i in pairs.active]
    orthogonal = _orthogonalise(m, leaves, updates)
    for k, i in enumerate(pairs.active):
        p = local(targets[i])
        p.mul_(1 - lr * m.hp.weight_decay)
        adjusted = _adjust_lr(lr, m.adjust_lr_fn, pairs.params[i].shape[-2:])
        for index, o in orthogonal[k]:
            (p if index is None else p[index]).add_(o, alpha=-adjusted)
    if inplace:
        state.count.add_(1)
        return _no_updates(pairs), state
    return _differences(pairs, targets), MuonState(state.count + 1, pairs.rebuild(bufs))


def _orthogonalise(m: _Muon, leaves: list, updates: list[torch.Tensor]) -> list[list]:
    """``NS`` of every matrix: per leaf, ``[(local index or None, this rank's block of NS)]``."""
    layouts, blocks, where = [], {}, []
    for k, (x, u) in enumerate(zip(leaves, updates, strict=True)):
        spec = ShardSpec.of(x) if isinstance(x, DTensor) else None
        layouts.append(_whole.Layout.of(spec) if spec is not None else None)
        start = spec.local_offset()[0] if spec is not None and x.dim() == 3 else 0
        units = (
            [(k, None, None)] if x.dim() == 2 else [(k, start + j, j) for j in range(u.shape[0])]
        )
        where.append(units)
        for unit in units:
            block = u if unit[2] is None else u[unit[2]]
            if block.numel():
                blocks[unit[:2]] = block
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = _whole.plan(tuple(layouts), rank, world)

    def ns(unit, whole: torch.Tensor) -> torch.Tensor:
        return _zeropower_via_newtonschulz(whole, m.ns_coefficients, m.ns_steps, m.eps)

    device = updates[0].device if updates else torch.device("cpu")
    done = _whole.exchange(plan, blocks, ns, torch.bfloat16, device)
    return [[(j, done[(k, b)]) for k, b, j in units if (k, b) in done] for units in where]
