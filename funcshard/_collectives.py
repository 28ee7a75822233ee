"""funcshard's collectives: the only place where communication happens.

Four new-style ``autograd.Function``s over the non-mutating c10d functional ops, each with a
``jvp`` and a ``vmap`` rule, so they compose with plain autograd and with every ``torch.func``
transform (see ``shared/notes/torch-func-and-collectives.md``):

==============  =========================  ==========================
Function        forward                    backward
==============  =========================  ==========================
``AllGather``   all-gather                 ``ReduceScatter``
``ReduceScatter`` reduce-scatter (scaled)   ``AllGather``
``Broadcast``   identity (replicated use)  ``AllReduce``
``AllReduce``   all-reduce (scaled)        ``Broadcast``
==============  =========================  ==========================

[Note: mean is a choice of inner product, not a scaled backward]
``grad_reduce="mean"`` must equal the gradient of the *mean over ranks* of each rank's loss. Scaling
the all-gather's backward by ``1/W`` gives that for first derivatives but is wrong for second
ones (a path through two backward collectives would be scaled twice). Instead, only the
*reductions* (``ReduceScatter``, ``AllReduce``) are scaled by ``1/W`` and their adjoints are the
unscaled ``AllGather`` / ``Broadcast``. These are the exact adjoints for the inner product that
averages replicated values over ranks, so ``grad``, ``grad(grad)``, ``jvp`` and ``vjp`` all agree
with the unsharded computation of the rank-mean loss. ``"sum"`` uses scale 1: exact adjoints.

[Note: pending tensors]
Under plain autograd a collective may return its output *pending* (issued, not waited), so that
communication overlaps with computation: a forward all-gather is waited when its group is first
used, a backward reduce-scatter when the gradient crosses :class:`Wait` (placed just upstream of
the collective, so autograd runs later-created backward nodes -- the next group's backward --
in between). Every Function waits its inputs, and ``_flat`` waits before any plain op reads
the data, so a pending tensor never escapes. Under ``torch.func`` transforms (and anomaly mode)
everything is synchronous: functorch would need batching/grad rules for the wait itself.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.profiler import record_function

_ops = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class Comm:
    """Static description of one collective: process group, dim and dtypes.

    ``dim`` is the dim of the (physical) tensor to gather/scatter along; ``vmap`` rules move the
    batch dim to the front and increment it. ``gather_dtype`` is the dtype sent by all-gather and
    ``reduce_dtype`` the dtype reductions run in (``None``: the input's). ``mean`` scales
    reductions by ``1/world``.
    """

    group: str
    world: int
    label: str
    dim: int = 0
    gather_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    mean: bool = True
    async_op: bool = False

    def synchronous(self) -> Comm:
        return dataclasses.replace(self, async_op=False)

    def batched(self, ndim_added: int = 1) -> Comm:
        return dataclasses.replace(self, dim=self.dim + ndim_added, async_op=False)


def wait(t: torch.Tensor) -> torch.Tensor:
    """Wait for a pending collective output; a no-op on any other tensor. Returns ``t``.

    Waits on a detached alias: the work is found by storage, and ``wait_tensor``'s own
    (old-style) autograd must not enter our graphs. Never call it on functorch-wrapped tensors.
    """
    _ops.wait_tensor(t.detach())
    return t


def async_allowed() -> bool:
    """Whether collectives issued here may return pending tensors (see [Note: pending tensors])."""
    return torch._C._functorch.peek_interpreter_stack() is None and not torch.is_anomaly_enabled()


def _reduce_input(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    x = x.to(comm.reduce_dtype or x.dtype)
    # Pre-divide: the sum of already-averaged terms cannot overflow in low precision.
    return x / comm.world if comm.mean and comm.world > 1 else x


def _all_gather(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    x = wait(x).to(comm.gather_dtype or x.dtype)
    with record_function(f"funcshard::all_gather ({comm.label})"):
        y = _ops.all_gather_into_tensor(x.contiguous(), comm.world, comm.group)
    if comm.dim == 0:
        return y if comm.async_op else wait(y)
    y = wait(y).view(comm.world, *x.shape).movedim(0, comm.dim)
    return y.reshape(*x.shape[: comm.dim], -1, *x.shape[comm.dim + 1 :])


def _reduce_scatter(x: torch.Tensor, comm: Comm, out_dtype: torch.dtype) -> torch.Tensor:
    x = _reduce_input(wait(x), comm)
    d, w = comm.dim, comm.world
    if (
        d != 0
    ):  # [A, W*c, B] -> [W*A, c, B]: rank r's chunk is contiguous and comes back as [A, c, B]
        x = x.unflatten(d, (w, x.shape[d] // w)).movedim(d, 0).flatten(0, 1)
    with record_function(f"funcshard::reduce_scatter ({comm.label})"):
        y = _ops.reduce_scatter_tensor(x.contiguous(), "sum", w, comm.group)
    if d == 0 and comm.async_op and y.dtype == out_dtype:
        return y
    return wait(y).to(out_dtype)


def _all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    x = wait(x)
    y = _reduce_input(x, comm)
    with record_function(f"funcshard::all_reduce ({comm.label})"):
        y = _ops.all_reduce(y.contiguous(), "sum", comm.group)
    if comm.async_op and y.dtype == x.dtype:
        return y
    return wait(y).to(x.dtype)


def _moved(x: torch.Tensor, bdim: int) -> torch.Tensor:
    return x.movedim(bdim, 0)


def start_all_gather(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Issue the all-gather of ``x`` outside autograd; the result, pending if ``comm.async_op``,
    is handed to :class:`AllGather` later (see [Note: issue early, record late] in ``_flat``)."""
    with torch.no_grad():
        return _all_gather(x.detach(), comm)


class AllGather(torch.autograd.Function):
    """Gather equal-sized pieces along ``comm.dim``; backward: :class:`ReduceScatter`.

    ``gathered``: the result of :func:`start_all_gather` for ``x``, if already issued.
    """

    @staticmethod
    def forward(x: torch.Tensor, comm: Comm, gathered: torch.Tensor | None = None):
        return gathered if gathered is not None else _all_gather(x, comm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.in_dtype = inputs[1], inputs[0].dtype

    @staticmethod
    def backward(ctx, g):
        return ReduceScatter.apply(g, ctx.comm, ctx.in_dtype), None, None

    @staticmethod
    def jvp(ctx, t, _, __):
        return AllGather.apply(t, ctx.comm.synchronous())

    @staticmethod
    def vmap(info, in_dims, x, comm, gathered=None):
        if in_dims[0] is None:
            return AllGather.apply(x, comm.synchronous()), None
        return AllGather.apply(_moved(x, in_dims[0]), comm.batched()), 0


class ReduceScatter(torch.autograd.Function):
    """Sum (``comm.mean``: average) over ranks, keep this rank's chunk of ``comm.dim``, return it
    in ``out_dtype``; backward: :class:`AllGather`."""

    @staticmethod
    def forward(x: torch.Tensor, comm: Comm, out_dtype: torch.dtype) -> torch.Tensor:
        return _reduce_scatter(x, comm, out_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.in_dtype = inputs[1], inputs[0].dtype

    @staticmethod
    def backward(ctx, g):
        comm = dataclasses.replace(ctx.comm, gather_dtype=ctx.in_dtype)
        return AllGather.apply(g, comm), None, None

    @staticmethod
    def jvp(ctx, t, _, __):
        return ReduceScatter.apply(t, ctx.comm.synchronous(), t.dtype)

    @staticmethod
    def vmap(info, in_dims, x, comm, out_dtype):
        if in_dims[0] is None:
            return ReduceScatter.apply(x, comm.synchronous(), out_dtype), None
        return ReduceScatter.apply(_moved(x, in_dims[0]), comm.batched(), out_dtype), 0


class Broadcast(torch.autograd.Function):
    """Identity: the same value used on every rank of ``comm``; backward: :class:`AllReduce`."""

    @staticmethod
    def forward(x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return wait(x).view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return AllReduce.apply(g, ctx.comm), None

    @staticmethod
    def jvp(ctx, t, _):
        return t.view_as(t)

    @staticmethod
    def vmap(info, in_dims, x, comm):
        return Broadcast.apply(x, comm.synchronous()), in_dims[0]


class AllReduce(torch.autograd.Function):
    """Sum (``comm.mean``: average) over the ranks of ``comm``; backward: :class:`Broadcast`."""

    @staticmethod
    def forward(x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return _all_reduce(x, comm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return Broadcast.apply(g, ctx.comm), None

    @staticmethod
    def jvp(ctx, t, _):
        return AllReduce.apply(t, ctx.comm.synchronous())

    @staticmethod
    def vmap(info, in_dims, x, comm):
        return AllReduce.apply(x, comm.synchronous()), in_dims[0]


class Wait(torch.autograd.Function):
    """Identity on tensors whose backward waits for their (possibly pending) gradients.

    See [Note: pending tensors]. Only used under plain autograd; ``label`` names the wait in
    profiler traces.
    """

    @staticmethod
    def forward(label: str, *xs: torch.Tensor):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.label = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        with record_function(ctx.label):
            return (None, *(g if g is None else wait(g) for g in grads))

    @staticmethod
    def jvp(ctx, _, *tangents):
        return tuple(t.view_as(t) for t in tangents)
