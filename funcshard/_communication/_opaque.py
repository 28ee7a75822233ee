"""A group's copies as single operations of a compiled graph.

[Note: one operation per group, not per tensor]
Under ``torch.compile`` (see [Note: funcshard under torch.compile] in ``_compile``) a group's
copies around its collectives were per-tensor code: the copy-in of its shards into the
all-gather's input (a ``cat``), the copy-out of each full parameter from the gathered rows (a
view and a copy per tensor) and, in backward, the copy of each full gradient into the
reduce-scatter's input (a ``cat`` of per-tensor views). Inductor makes each tensor's piece a
buffer of its own -- a scheduler node, C++ code, a kernel -- so these copies were several
nodes of the graph per parameter tensor and a large share of its compile time (BENCHMARKS.md,
section 7). Here each is one custom operator over the whole group, the way
FSDP2's ``all_gather_copy_in`` / ``split_with_sizes_copy`` / ``chunk_cat`` are: one node in
the graph, eager torch code at run time (the same copies the eager paths make).

* ``funcshard::copy_in(out, pieces, after)``: the pieces flattened, cast and concatenated
  into ``out``. ``after`` is not read: it orders the copy (see [Note: a gather's copy-in follows
  the waits before it] in ``_compile``).
* ``funcshard::copy_out(out, gathered, ...)``: the full tensors, from the rank-major rows of an
  all-gather, one after the other in ``out``; :class:`CopyOut` returns them as views of it.
* ``funcshard::copy_grads(out, grads, ...)``: :class:`CopyOut`'s backward, the full gradients in
  the rank-major layout of the all-gather (``None``: zeros), ready to be reduce-scattered.

Each writes into ``out``, a buffer the graph allocates (an operator that mutates its argument,
re-inplaced by inductor, so nothing is copied): inductor then plans that memory with the rest
of the graph's and reuses it from group to group. Buffers allocated inside the operators were
invisible to that planning, and while gloo still held the previous group's collective inputs
the step's peak grew by a group or two.

A group's layout is passed as flat lists of ints (the operators' schema has no nested lists):
``shapes`` the pieces' (padded chunk) shapes concatenated, ``ndims`` their lengths, ``dims`` the
dim each piece is gathered along, ``sizes`` the full length along it (padding cut off).
Only while compiling with plain autograd (``Mode.TRACED``, see ``_mode``): the operators have no
``torch.func`` rules, and eager code gains nothing from them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

_LAYOUT = "int world, int[] shapes, int[] ndims, int[] dims, int[] sizes"


@dataclasses.dataclass(frozen=True)
class Copies:
    """A gather's layout: the pieces' (padded chunk) shapes, gathered along ``dims`` over
    ``world`` ranks to ``sizes`` along those dims."""

    world: int
    chunks: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]
    sizes: tuple[int, ...]

    def args(self) -> tuple:
        """The operators' layout arguments (see the module's docstring)."""
        shapes = [n for s in self.chunks for n in s]
        return self.world, shapes, [len(s) for s in self.chunks], list(self.dims), list(self.sizes)

    def fulls(self) -> list[tuple[int, ...]]:
        return [_full(c, d, n) for c, d, n in zip(self.chunks, self.dims, self.sizes, strict=True)]


def _full(chunk: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    return (*chunk[:dim], size, *chunk[dim + 1 :])


def _chunks(shapes: Sequence[int], ndims: Sequence[int]) -> list[tuple[int, ...]]:
    out, at = [], 0
    for n in ndims:
        out.append(tuple(shapes[at : at + n]))
        at += n
    return out


@torch.library.custom_op("funcshard::copy_in", mutates_args=("out",), schema=(
    "(Tensor(a!) out, Tensor[] pieces, Tensor? after) -> ()"
))  # fmt: skip
def _copy_in(out: torch.Tensor, pieces: list[torch.Tensor], after) -> None:
    targets = list(out.split([p.numel() for p in pieces]))
    torch._foreach_copy_(targets, [p.reshape(-1) for p in pieces])


@_copy_in.register_fake
def _(out, pieces, after) -> None:
    return None


@torch.library.custom_op("funcshard::copy_out", mutates_args=("out",), schema=(
    f"(Tensor(a!) out, Tensor gathered, {_LAYOUT}) -> ()"
))  # fmt: skip
def _copy_out(out, gathered, world, shapes, ndims, dims, sizes) -> None:
    chunks = _chunks(shapes, ndims)
    fulls = [_full(c, d, n) for c, d, n in zip(chunks, dims, sizes, strict=True)]
    rows = gathered.view(world, -1).split([math.prod(c) for c in chunks], dim=1)
    targets = out.split([math.prod(f) for f in fulls])
    for r, t, c, d, full in zip(rows, targets, chunks, dims, fulls, strict=True):
        source = r.view(world, *c).movedim(0, d)  # [..., W, chunk, ...]: rank-major along d
        if full[d] == world * c[d]:
            t.view(*c[:d], world, c[d], *c[d + 1 :]).copy_(source)
        else:  # padding cut off the last ranks' chunks
            t.view(full).copy_(source.flatten(d, d + 1).narrow(d, 0, full[d]))


@_copy_out.register_fake
def _(out, gathered, world, shapes, ndims, dims, sizes) -> None:
    return None


@torch.library.custom_op("funcshard::copy_grads", mutates_args=("out",), schema=(
    f"(Tensor(a!) out, Tensor?[] grads, {_LAYOUT}) -> ()"
))  # fmt: skip
def _copy_grads(out, grads, world, shapes, ndims, dims, sizes) -> None:
    chunks = _chunks(shapes, ndims)
    columns = out.view(world, -1).split([math.prod(c) for c in chunks], dim=1)
    for g, col, c, d in zip(grads, columns, chunks, dims, strict=True):
        target = col.view(world, *c).movedim(0, d)  # [..., W, chunk, ...]
        if g is None:
            target.zero_()
            continue
        padded = world * c[d]
        if g.shape[d] != padded:  # zeros where the gather padded
            g = torch.cat([g, g.new_zeros(*g.shape[:d], padded - g.shape[d], *g.shape[d + 1 :])], d)
        target.copy_(g.unflatten(d, (world, c[d])))


@_copy_grads.register_fake
def _(out, grads, world, shapes, ndims, dims, sizes) -> None:
    return None


def copy_in(pieces: Sequence[torch.Tensor], dtype: torch.dtype, after=None) -> torch.Tensor:
    """``pieces`` flattened, cast to ``dtype`` and concatenated (one operation); ``after``: a
    tensor the copy must follow (not read)."""
    out = pieces[0].new_empty(sum(p.numel() for p in pieces), dtype=dtype)
    torch.ops.funcshard.copy_in(out, list(pieces), after)
    return out


class CopyOut(torch.autograd.Function):
    """The full tensors of an all-gather's output ``[W * S]``, views of one buffer made by one
    ``copy_out``; backward: one ``copy_grads``."""

    @staticmethod
    def forward(gathered: torch.Tensor, copies: Copies):
        fulls = copies.fulls()
        flat = gathered.new_empty(sum(math.prod(f) for f in fulls))
        torch.ops.funcshard.copy_out(flat, gathered, *copies.args())
        pieces = flat.split([math.prod(f) for f in fulls])
        # a 1-D piece has its shape already: a view operation less to trace (a bias, a norm)
        return tuple(p if len(f) == 1 else p.view(f) for p, f in zip(pieces, fulls, strict=True))

    @staticmethod
    def setup_context(ctx, inputs, output):
        gathered, ctx.copies = inputs
        ctx.dtype, ctx.device = gathered.dtype, gathered.device
        ctx.set_materialize_grads(False)  # no zeros for unused outputs: copy_grads fills them

    @staticmethod
    def backward(ctx, *grads):
        copies = ctx.copies
        numel = copies.world * sum(math.prod(c) for c in copies.chunks)
        flat = torch.empty(numel, dtype=ctx.dtype, device=ctx.device)
        torch.ops.funcshard.copy_grads(flat, list(grads), *copies.args())
        return flat, None
