"""Whole-matrix work on sharded matrices: one owner rank per matrix, reached by all-to-all.

[Note: one owner per matrix]
Some updates are functions of a whole matrix (Muon's Newton-Schulz orthogonalisation), which no
shard can compute alone. Gathering every matrix on every rank (what a DTensor ``full_tensor()``
per parameter does) moves ``(W - 1) / W`` of every matrix to each of ``W`` ranks and repeats the
work ``W`` times. Here each matrix gets one *owner*: every rank sends its block of the matrix to
the owner (one ``all_to_all_single`` for all matrices at once), the owner assembles and
transforms it, and a second all-to-all returns each rank its block of the result. Each element
crosses the network at most twice (there and back), which is the least any scheme that computes
each matrix once can move, and the work is done once. Owners are balanced by cost (``m * n *
min(m, n)``, the Newton-Schulz flops up to a constant) with the longest-first greedy rule, the
same on every rank because it only reads static shapes and placements.

A matrix whose every element is on this rank (a plain tensor, a replicated one, or one of a stack
of expert matrices sharded on the stacking dim) is transformed where it is, with no
communication. On an HSDP mesh each replica group (ranks with the same coordinates on the mesh
dims that do not split the matrix) exchanges within itself, with owners at the same positions
in every group.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from .._communication._consensus import before_collective
from .._trees._spec import ShardSpec, _level_shapes, chunk

Unit = tuple[int, int | None]  # (leaf index, index in the stacking dim, or None for a 2-D leaf)
Box = tuple[int, int, int, int]  # (row offset, column offset, rows, columns) in the matrix


@dataclasses.dataclass(frozen=True)
class Layout:
    """A leaf's static layout: global shape, mesh shape and ranks, placements (hashable)."""

    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    ranks: tuple[int, ...]  # global rank of each mesh coordinate, in row-major order
    placements: tuple

    @staticmethod
    def of(spec: ShardSpec) -> Layout:
        ranks = tuple(int(r) for r in spec.mesh.mesh.flatten().tolist())
        return Layout(spec.shape, tuple(spec.mesh.shape), ranks, spec.placements)


@dataclasses.dataclass(frozen=True)
class Plan:
    """This rank's part of the exchange, the same on every call with the same layouts.

    ``local``: units wholly on this rank. ``sends[d]``: the units whose block this rank sends to
    rank ``d`` (``d`` owns them), in unit order. ``owned``: the units this rank owns, with the
    ``(rank, box)`` of every non-empty block, in rank order.
    """

    world: int
    local: tuple[Unit, ...]
    sends: tuple[tuple[Unit, ...], ...]
    owned: tuple[tuple[Unit, tuple[int, int], tuple[tuple[int, Box], ...]], ...]
    collective: bool  # some unit is exchanged: every rank takes part in the all-to-alls
    sent_numel: int  # elements this rank sends to other ranks in one direction
    owned_numel: int  # elements of the matrices it owns


def _block(layout: Layout, coord: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, size)`` of the block held at mesh coordinate ``coord``."""
    shapes = _level_shapes(layout.shape, layout.mesh_shape, layout.placements, coord)
    offset = [0] * len(layout.shape)
    for i, p in enumerate(layout.placements):
        if isinstance(p, Shard):
            offset[p.dim] += chunk(shapes[i][p.dim], layout.mesh_shape[i], coord[i])[1]
    return tuple(offset), shapes[-1]


def _coords(layout: Layout):
    return list(itertools.product(*(range(n) for n in layout.mesh_shape)))


@functools.lru_cache(maxsize=64)
def plan(layouts: tuple[Layout | None, ...], rank: int, world: int) -> Plan:
    """The exchange for leaves with ``layouts`` (``None``: a plain tensor, wholly local)."""
    local: list[Unit] = []
    exchanged = []  # (cost, unit, {replica key: [(rank, box)] in shard order})
    for leaf, layout in enumerate(layouts):
        if layout is None:
            local.append((leaf, None))
            continue
        stacked = len(layout.shape) == 3
        m, n = layout.shape[-2:]
        split = [isinstance(p, Shard) and p.dim >= len(layout.shape) - 2 for p in layout.placements]
        for b in range(layout.shape[0]) if stacked else [None]:
            groups: dict[tuple, list[tuple[int, Box]]] = {}
            mine = False
            for coord, r in zip(_coords(layout), layout.ranks, strict=True):
                offset, size = _block(layout, coord)
                if stacked and not offset[0] <= b < offset[0] + size[0]:
                    continue
                key = tuple(c for c, s in zip(coord, split, strict=True) if not s)
                groups.setdefault(key, []).append((r, (*offset[-2:], *size[-2:])))
                mine |= r == rank
            if not any(split):
                if mine:
                    local.append((leaf, b))
                continue
            exchanged.append((m * n * min(m, n), (leaf, b), (m, n), groups))
    return _assign(local, exchanged, rank, world)


def _assign(local, exchanged, rank: int, world: int) -> Plan:
    """Owners by the longest-first greedy rule over the shard positions (see [Note: one owner
    per matrix]); loads are counted at the first replica group's ranks."""
    loads: dict[int, int] = {}
    sends: list[list[Unit]] = [[] for _ in range(world)]
    owned = []
    order = sorted(range(len(exchanged)), key=lambda i: (-exchanged[i][0], i))
    owner_pos = {}
    for i in order:
        cost, _, _, groups = exchanged[i]
        first = next(iter(groups.values()))
        pos = min(range(len(first)), key=lambda k: (loads.get(first[k][0], 0), k))
        loads[first[pos][0]] = loads.get(first[pos][0], 0) + cost
        owner_pos[i] = pos
    sent = owned_numel = 0
    for i, (_, unit, shape, groups) in enumerate(exchanged):
        for blocks in groups.values():
            owner = blocks[owner_pos[i]][0]
            for r, box in blocks:
                if r == rank and box[2] * box[3]:
                    sends[owner].append(unit)
                    sent += box[2] * box[3] if owner != rank else 0
            if owner == rank:
                owned.append((unit, shape, tuple((r, b) for r, b in blocks if b[2] * b[3])))
                owned_numel += shape[0] * shape[1]
    sends_ = tuple(tuple(s) for s in sends)
    return Plan(world, tuple(local), sends_, tuple(owned), bool(exchanged), sent, owned_numel)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` as a dtype every backend moves (gloo has no bfloat16 all-to-all; it
    copies the bytes, so float16 carries them unchanged)."""
    return t.view(torch.float16) if t.dtype == torch.bfloat16 else t


def exchange(
    p: Plan,
    blocks: dict[Unit, torch.Tensor],
    fn: Callable[[Unit, torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[Unit, torch.Tensor]:
    """``fn(unit, whole matrix)`` for every unit, returned as this rank's block of the result.

    ``blocks`` holds this rank's 2-D block of every unit it has a non-empty block of (the whole
    matrix for the units in ``p.local``), all of ``dtype`` on ``device``; ``fn`` returns a
    tensor of the matrix's shape and ``dtype``. Two ``all_to_all_single`` calls (none when every
    unit is local), collective over the default process group.
    """
    out = {u: fn(u, blocks[u]) for u in p.local}
    if not p.collective:
        return out
    send = [blocks[u].reshape(-1) for d in range(p.world) for u in p.sends[d]]
    send_splits = [sum(blocks[u].numel() for u in p.sends[d]) for d in range(p.world)]
    recv_splits = [0] * p.world
    for _, _, contributors in p.owned:
        for r, box in contributors:
            recv_splits[r] += box[2] * box[3]
    before_collective("the all-to-all of whole matrices")
    received = _all_to_all(send, send_splits, recv_splits, dtype, device)
    wholes = _assemble(p, received, recv_splits, dtype, device)
    results = {u: fn(u, w) for u, w in wholes.items()}
    back = [
        results[u][r0 : r0 + rows, c0 : c0 + cols].reshape(-1)
        for d in range(p.world)
        for u, _, contributors in p.owned
        for r, (r0, c0, rows, cols) in contributors
        if r == d
    ]
    returned = _all_to_all(back, recv_splits, send_splits, dtype, device)
    for d, flat in enumerate(torch.split(returned, send_splits)):
        sizes = [blocks[u].numel() for u in p.sends[d]]
        for u, piece in zip(p.sends[d], torch.split(flat, sizes), strict=True):
            out[u] = piece.view(blocks[u].shape)
    return out


def _all_to_all(pieces, send_splits, recv_splits, dtype, device) -> torch.Tensor:
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_splits), dtype=dtype, device=device)
    dist.all_to_all_single(_wire(recv), _wire(send), recv_splits, send_splits)
    return recv


def _assemble(p: Plan, received, recv_splits, dtype, device) -> dict[Unit, torch.Tensor]:
    """The owned matrices from the received blocks (source by source, units in order)."""
    wholes = {u: torch.empty(shape, dtype=dtype, device=device) for u, shape, _ in p.owned}
    offsets = list(itertools.accumulate([0, *recv_splits[:-1]]))
    for u, _, contributors in p.owned:
        for r, (r0, c0, rows, cols) in contributors:
            piece = received[offsets[r] : offsets[r] + rows * cols]
            wholes[u][r0 : r0 + rows, c0 : c0 + cols] = piece.view(rows, cols)
            offsets[r] += rows * cols
    return wholes
