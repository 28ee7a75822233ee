"""funcshard's collectives: the only place where communication happens.

New-style ``autograd.Function``s over the c10d collectives, each with a ``jvp`` and a ``vmap``
rule, so they compose with plain autograd and with every ``torch.func`` transform:

=================  =============================================  =======================
Function           forward                                        backward
=================  =============================================  =======================
``AllGather``      all-gather of pieces, flattened rank-major     reduce-scatter, then
                                                                  all-reduce over replicas
``ReduceScatter``  reduce-scatter (scaled)                        ``AllGather``
``Broadcast``      identity (the value used on every rank)        ``AllReduce``
``AllReduce``      all-reduce (scaled)                            ``Broadcast``
=================  =============================================  =======================

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
used, a backward reduce-scatter when the gradient crosses a wait node (``Notify`` with
``waiting``, placed upstream of the gather, so autograd runs the next group's backward in
between). Every Function waits its inputs, and ``_flat`` waits before any plain op reads the
data, so a pending tensor never escapes. Under ``torch.func`` transforms (and anomaly mode)
everything is synchronous: functorch would need batching and grad rules for the wait itself.

[Note: CUDA streams]
With NCCL, overlap needs no streams of ours: ProcessGroupNCCL runs every collective on its own
stream, made to wait (by an event) for the work already queued on the caller's stream -- the
copy into the all-gather's slot included -- and ``work.wait()`` / ``wait_tensor`` make the
caller's stream wait for the collective's event without blocking the host. So a prefetched
all-gather runs while the compute stream runs the previous group, and the caching allocator
cannot hand the buffers to another stream's work early (the process group keeps them alive
until its work ends). What FSDP2 does beyond that, and funcshard does not (yet): the copy-in
on a stream of its own, so that it overlaps compute too.

[Note: one rank communicates nothing]
Over a mesh dim of one rank an all-gather returns its input, a reduce-scatter or all-reduce its
input in the reduce dtype (the mean over one rank is the value itself): no collective is
issued, as FSDP2 does at world size 1, and values and dtypes are those of the collective. A
bucket whose mesh dims all have one rank (world size 1; a mesh dim of size 1 in HSDP) skips the
flat buffer too: each full tensor is :class:`OneRank` of its shard -- the shard itself, or its
cast to the compute dtype -- so the scheduler never frees or refills what is the shard's own
memory.

[Note: collectives under torch.compile]
While ``torch.compile`` traces (see [Note: funcshard under torch.compile] in ``_compile``), the
functional collectives are recorded into the graph, and a collective's result is the output of
its ``wait_tensor``: every reader must read that output, or the compiler could schedule a read
before the wait. So nothing is pending across autograd (no ``Notify`` waits, no donated inputs),
``wait`` returns ``wait_tensor``'s output for the collectives issued in this trace and leaves
other tensors alone, and :func:`start_all_gather` issues the functional all-gather early (a
prefetch) and lets its ``wait`` stand where the gathered tensors are first used. The Functions'
``jvp`` rules never meet Dynamo: it does not trace inside funcshard.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import functools
import inspect
import math

import torch
import torch.distributed as dist

from .._runtime._compat import all_gather_single, storage_key
from .._runtime._compile import issued, waited, waits_for
from .._runtime._mode import Mode, refuse_jacfwd, transformed
from .._runtime._profiling import span
from . import _debug, _hangs, _opaque

_ops = torch.ops._c10d_functional

# Inputs donated to pending reductions, freed when their output is waited for: c10d's work
# object would otherwise keep them alive until the next collective. {output storage: input}
_DONATED: dict[int, torch.Tensor] = {}
# Storages of the outputs returned pending (see [Note: pending tensors]): ``wait`` on any other
# tensor returns at once, without a dispatch of ``wait_tensor``.
_PENDING: set[int] = set()


@dataclasses.dataclass(frozen=True)
class Comm:
    """Static description of one collective: process group, dim and dtypes.

    ``dim`` is the dim of the (physical) tensor to gather/scatter along; ``vmap`` rules move the
    batch dim to the front and increment it. ``gather_dtype`` is the dtype sent by all-gather and
    ``reduce_dtype`` the dtype reductions run in (``None``: the input's). ``mean`` scales
    reductions by ``1/(world * over)``: ``over`` is the size of the expert-parallel dims whose
    ranks' losses the gradient already sums (see [Note: expert parallelism] in ``_parallel``);
    ``weight`` (``grad_reduce="weighted"``) scales this rank's input by it instead (see [Note:
    ranks that average over different counts] in ``_counts``). ``mode``: the execution mode the
    collective runs in, which picks how it is issued, waited for and what it frees (see [Note:
    one way per mode]; the default: plain autograd, waited at once).
    """

    group: dist.ProcessGroup = dataclasses.field(compare=False)
    world: int
    label: str
    dim: int = 0
    gather_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    mean: bool = True
    weight: float | None = None
    mode: Mode = Mode.ANOMALY
    over: int = 1

    def synchronous(self) -> Comm:
        """This collective, completed before the call goes on (see :attr:`Mode.waited`)."""
        return dataclasses.replace(self, mode=self.mode.waited)

    def inside_transform(self) -> Comm:
        """This collective as a ``jvp`` or ``vmap`` rule runs it: inside a ``torch.func``
        transform, synchronous."""
        mode = Mode.TRACED_SYNCHRONOUS if self.mode.traced else Mode.SYNCHRONOUS
        return dataclasses.replace(self, mode=mode)

    def batched(self) -> Comm:
        return dataclasses.replace(self.inside_transform(), dim=self.dim + 1)

    @property
    def way(self) -> _Way:
        return _WAYS[self.mode]


@dataclasses.dataclass(frozen=True)
class _Way:
    """How a collective runs in one execution mode (see [Note: one way per mode])."""

    pending: bool  # its output may be returned pending, waited where it is first read
    early: bool  # an all-gather may be issued before its autograd node is recorded
    traced: bool  # functional collectives in torch.compile's graph, waited by the trace
    frees: bool  # a donated input's storage is emptied as soon as it is dead
    registers: bool  # an issued c10d work is registered until waited, and settled at exit


# [Note: one way per mode]
# A collective is issued, waited for and its buffers released differently in each execution
# mode (see [Note: the execution mode is data] in ``_runtime/_mode``). A ``Comm`` carries its
# mode, decided where its call was lowered, and every choice below reads this table -- not
# torch's global state. Plain autograd (``EAGER``) may leave outputs pending and issues a
# prefetched all-gather early, registering its c10d work until it is waited (see [Note: no
# collective of ours in flight at exit]). A CUDA-graph capture (``CAPTURED``) runs the same
# ops, recorded for replay, with one rule of its own: no registry of works in flight, whose
# pruning asks each work whether it finished -- an event query, which a capture forbids --
# and whose graph waits for every collective it issued anyway. Synchronous modes (a later
# collective of a chain: ``EAGER.waited`` is ``ANOMALY``; ``torch.func``) wait at once, and
# under ``torch.func`` free nothing (its tensors are wrappers). Traced modes record functional
# collectives that the compiler schedules and frees.
_WAYS: dict[Mode, _Way] = {
    Mode.EAGER: _Way(pending=True, early=True, traced=False, frees=True, registers=True),
    Mode.CAPTURED: _Way(pending=True, early=True, traced=False, frees=True, registers=False),
    Mode.ANOMALY: _Way(pending=False, early=False, traced=False, frees=True, registers=True),
    Mode.SYNCHRONOUS: _Way(pending=False, early=False, traced=False, frees=False, registers=True),
    Mode.TRACED: _Way(pending=False, early=True, traced=True, frees=False, registers=False),
    Mode.TRACED_SYNCHRONOUS: _Way(
        pending=False, early=False, traced=True, frees=False, registers=False
    ),
}


def wait(t: torch.Tensor) -> torch.Tensor:
    """Wait for a pending collective output; a no-op on any other tensor. Returns ``t``.

    Waits on a detached alias: the work is found by storage, and ``wait_tensor``'s own
    (old-style) autograd must not enter our graphs. Never call it on functorch-wrapped tensors.
    Called on any tensor by code that holds no ``Comm`` (every Function waits its inputs), it
    asks the registries, not the mode: the trace's (see [Note: collectives under
    torch.compile]; empty outside a trace) and the pending outputs' (empty inside one).
    """
    if waits_for(t):
        return waited(_ops.wait_tensor(t))
    if not _PENDING:
        return t
    ptr = storage_key(t)
    if ptr not in _PENDING:
        return t
    _PENDING.discard(ptr)
    try:
        _ops.wait_tensor(t.detach())
    except RuntimeError as e:  # a peer died, or is not at this collective: say which
        _hangs.explain(e, "a collective")
        raise
    donated = _DONATED.pop(ptr, None)
    if donated is not None:
        donated.untyped_storage().resize_(0)
    return t


def _reduce_input(x: torch.Tensor, comm: Comm, donated: bool) -> tuple[torch.Tensor, bool, str]:
    """``x`` in the reduce dtype, pre-divided for ``mean`` or pre-scaled by ``weight`` (in place
    if donated or a fresh copy: a sum of already-averaged terms cannot overflow in low
    precision; a weight of 0 gives zeros, even for a NaN gradient), unless the backend averages
    (see [Note: the backend averages]). Also: whether the result is ours to free, and the
    reduction to run (``"sum"`` or ``"avg"``)."""
    red = comm.reduce_dtype or x.dtype
    if red != x.dtype:
        cast = x.to(red)
        if donated:
            _free_donated(x, comm)  # see [Note: the cast frees its source]
        x, donated = cast, True
    n = comm.world * comm.over
    if comm.weight == 0:
        x, donated = (x.zero_() if donated else torch.zeros_like(x)), True
    elif comm.weight is not None:
        x, donated = (x.mul_(comm.weight), True) if donated else (x * comm.weight, True)
    elif comm.mean and n > 1:
        if _averages(comm, red, x.device.type):
            return x.contiguous(), donated, "avg"
        x, donated = (x.div_(n), True) if donated else (x / n, True)
    return x.contiguous(), donated, "sum"


def _averages(comm: Comm, dtype: torch.dtype, device_type: str) -> bool:
    """Whether ``comm``'s mean is the backend's own average (``ReduceOp.AVG``).

    [Note: the backend averages]
    ``grad_reduce="mean"`` divides each reduction by its group's size. NCCL divides as part of
    the reduction (``ReduceOp.AVG``), as FSDP2 uses it for float32 and bfloat16: no division
    kernel, and no pass over the gradient before the reduce-scatter. Elsewhere the input is
    divided first: gloo has no AVG, a float16 sum of undivided terms could overflow, and a
    divisor that is not the group's size (``over``: expert-parallel dims) is not an average.
    torch's fake process group (the benchmarks' many ranks on one GPU) takes NCCL's path.
    """
    if comm.world == 1 or comm.over != 1 or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:  # the backend serving this device type (a group may have one per device type)
        backend = comm.group._get_backend(torch.device(device_type))
    except RuntimeError:
        return False
    return type(backend).__name__ in ("ProcessGroupNCCL", "FakeProcessGroup")


def _free_donated(x: torch.Tensor, comm: Comm) -> None:
    """Free the storage of a donated tensor that nothing reads any more.

    [Note: the cast frees its source]
    A gradient reduced in another dtype than it was computed in (``param_dtype=bf16``,
    ``reduce_dtype=fp32``) is cast before the reduce-scatter. The full-size gradient is donated
    (a fresh concatenation made by autograd for this node alone), so once cast it is dead; but
    autograd holds it as the backward's argument until the node returns, i.e. across the
    reduce-scatter's issue -- where gloo also clones the cast input. Emptying its storage right
    after the cast keeps one full-size gradient instead of two at that moment (FSDP2 frees its
    unsharded gradients after the copy-in in the same way). Only the whole storage of a plain
    tensor is freed: never under ``torch.compile`` (no storage) or ``torch.func`` (wrappers).
    """
    if not comm.way.frees:
        return
    storage = x.untyped_storage()
    if storage.nbytes() == x.numel() * x.element_size() and x.is_contiguous():
        storage.resize_(0)


def _pending_or_waited(y: torch.Tensor, comm: Comm, donated: torch.Tensor | None):
    if comm.way.pending and y.numel():  # see [Note: empty shards are reduced synchronously]
        if donated is not None:
            _DONATED[storage_key(y)] = donated
        return y
    return wait(y)


def _issued(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``y``, a functional collective's output just issued: pending until :func:`wait`."""
    if comm.way.traced:
        return issued(y)
    _PENDING.add(storage_key(y))
    return y


def _flat_pieces(pieces, dim: int, dtype) -> torch.Tensor:
    return torch.cat([cast(p.flatten(dim), dtype) for p in pieces], dim=dim)


def _keep_pieces(g: torch.Tensor, shapes, keep, comm: Comm) -> torch.Tensor:
    """The gradient of an all-gather output ``[..., W * S]`` restricted to the pieces in ``keep``
    (``[..., W * S']``, still rank-major)."""
    d = comm.dim
    rows = g.unflatten(d, (comm.world, -1))
    parts = rows.split([math.prod(s[d:]) for s in shapes], dim=d + 1)
    kept = [p for p, k in zip(parts, keep, strict=True) if k]
    return torch.cat(kept, dim=d + 1).flatten(d, d + 1)


def _split_pieces(flat: torch.Tensor, shapes, comm: Comm) -> list[torch.Tensor]:
    """``flat`` (``[..., S]``, batch dims before ``comm.dim``) split into pieces of ``shapes``.
    Under plain autograd, unbatched, one view per piece made from ``flat`` (a split and a view
    cost two)."""
    dim = comm.dim
    numels = [math.prod(s[dim:]) for s in shapes]
    if dim == 0 and flat.is_contiguous() and comm.mode.plain:
        at, out = flat.storage_offset(), []
        for s, n in zip(shapes, numels, strict=True):
            out.append(flat.as_strided(s, contiguous_strides(s), at))
            at += n
        return out
    return [f.view(s) for f, s in zip(flat.split(numels, dim=dim), shapes, strict=True)]


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, as torch computes them (a dim of size 0
    counts as 1)."""
    strides, at = [], 1
    for n in reversed(shape):
        strides.append(at)
        at *= max(n, 1)
    return tuple(reversed(strides))


def _all_gather(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Gather ``x`` along ``comm.dim`` (synchronously unless ``dim == 0`` and async)."""
    x = wait(x)
    x = cast(x, comm.gather_dtype or x.dtype)
    if comm.world == 1:  # see [Note: one rank communicates nothing]
        return x
    _debug.check("all_gather", comm.group, comm.label, x)  # see [Note: checked collectives]
    with span("all_gather", comm.label):
        y = _ops.all_gather_into_tensor(x.contiguous(), comm.world, comm.group.group_name)
        y = _issued(y, comm)
    if comm.dim == 0:
        return _pending_or_waited(y, comm, None)
    y = wait(y).view(comm.world, *x.shape).movedim(0, comm.dim)
    return y.reshape(*x.shape[: comm.dim], -1, *x.shape[comm.dim + 1 :])


def _reduce_scatter(x, comm: Comm, out_dtype: torch.dtype, donated: bool) -> torch.Tensor:
    x, ours, op = _reduce_input(wait(x), comm, donated)
    if comm.world == 1:  # see [Note: one rank communicates nothing]
        return cast(x, out_dtype)
    d, w = comm.dim, comm.world
    if d != 0:  # [A, W*c, B] -> [W*A, c, B]: rank r's chunk is contiguous, returns as [A, c, B]
        x = x.unflatten(d, (w, x.shape[d] // w)).movedim(d, 0).flatten(0, 1).contiguous()
    _debug.check("reduce_scatter", comm.group, comm.label, x)
    with span("reduce_scatter", comm.label):
        y = _issued(_ops.reduce_scatter_tensor(x, op, w, comm.group.group_name), comm)
    if d == 0 and comm.way.pending and y.dtype == out_dtype:
        if ours and copies_reduce_scatter_input(comm.group, x.device.type):
            x.untyped_storage().resize_(0)  # see [Note: gloo copies reduce-scatter inputs]
            ours = False
        return _pending_or_waited(y, comm, x if ours else None)
    return cast(wait(y), out_dtype)


def copies_reduce_scatter_input(group: dist.ProcessGroup, device_type: str) -> bool:
    """Whether ``group``'s reduce-scatter of ``device_type`` tensors copies its input when issued.

    [Note: gloo copies reduce-scatter inputs]
    ProcessGroupGloo implements reduce-scatter as a clone of the input (made when the
    collective is issued, on the calling thread) all-reduced in the background. An input we
    own is therefore dead once issued, and freeing it at once keeps a reduce-scatter that
    overlaps the next group's backward as lean as FSDP2's, which waits for it right away.
    The clone itself is gloo's: it is freed only when the work is waited (not when its
    transfer ends; ``is_completed()`` stays false until then), so it stays alive until the
    wait node after the next group's backward -- the price of that overlap on gloo.
    ``tests/test_collectives.py`` checks this behaviour of gloo, so that a torch upgrade that
    changes it fails there and not in someone's gradients.
    """
    try:  # the backend serving this device type (a group may have one per device type)
        backend = group._get_backend(torch.device(device_type))
    except RuntimeError:
        return False
    return isinstance(backend, dist.ProcessGroupGloo)


def _all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    x = wait(x)
    y, _, op = _reduce_input(x, comm, False)
    if comm.world == 1:  # see [Note: one rank communicates nothing]
        return cast(y, x.dtype)
    _debug.check("all_reduce", comm.group, comm.label, y)
    with span("all_reduce", comm.label):
        y = _issued(_ops.all_reduce(y, op, comm.group.group_name), comm)
    if comm.way.pending and y.dtype == x.dtype and y.numel():
        return y
    return cast(wait(y), x.dtype)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without dispatching ``aten::to`` when ``x`` has that dtype already (``to``
    returns ``x`` itself then, as this does)."""
    return x if x.dtype == dtype else x.to(dtype)


def alias(x: torch.Tensor) -> torch.Tensor:
    """A view of all of ``x``: what a Function returns for an input it passes on unchanged.
    One ATen operation (``view_as`` dispatches two: itself and the ``view`` it calls)."""
    return x.view(x.shape)


def _moved(x: torch.Tensor, bdim: int | None, size: int) -> torch.Tensor:
    return x.expand(size, *x.shape) if bdim is None else x.movedim(bdim, 0)


@dataclasses.dataclass(frozen=True)
class Started:
    """An all-gather issued by :func:`start_all_gather`: its output and c10d work."""

    output: torch.Tensor
    work: dist.Work | None  # None: a functional collective (under torch.compile), or none

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return wait(self.output)
        self.transferred()
        return self.output

    def transferred(self) -> None:
        """Wait for the transfer only (the output is not read yet)."""
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as e:  # a peer died, or is not at this collective: say which
                _hangs.explain(e, "an all_gather")
                raise
            finally:  # waited (or failed): nothing left in flight at exit
                _UNFINISHED.pop(id(self.work), None)


def start_all_gather(
    comm: Comm, pieces, after: torch.Tensor | None = None, flat: bool = False
) -> Started:
    """Issue the all-gather of ``pieces`` outside autograd, copying them straight into this
    rank's slot of the output (no separate input buffer, as FSDP2's copy-in). The result is
    handed to :class:`AllGather` later (see [Note: issue early, record late] in ``_flat``).
    Plain autograd only (an in-place collective); under ``torch.compile``, the functional one
    (see [Note: collectives under torch.compile]) after a copy-in made by one operation that
    follows ``after`` (see ``_opaque``). See [Note: one way per mode]. ``flat``: the pieces are
    1-D, of the gather dtype (``_packed``'s bytes): copied in by one concatenation."""
    way = comm.way
    if way.traced:
        with torch.no_grad():
            flat = _opaque.copy_in(pieces, comm.gather_dtype or pieces[0].dtype, after)
        with span("all_gather", comm.label):
            y = _ops.all_gather_into_tensor(flat, comm.world, comm.group.group_name)
        return Started(issued(y), None)
    numels = [p.numel() for p in pieces]
    size = sum(numels)
    dtype = comm.gather_dtype or pieces[0].dtype
    output = torch.empty(comm.world * size, dtype=dtype, device=pieces[0].device)
    at = dist.get_rank(comm.group) * size
    slot = output.narrow(0, at, size)
    if flat:
        with torch.no_grad():
            torch.cat(list(pieces), out=slot)
    else:
        slots = []  # each piece's place in the slot, in the piece's shape: one view each
        for p, n in zip(pieces, numels, strict=True):
            slots.append(output.as_strided(p.shape, contiguous_strides(p.shape), at))
            at += n
        with torch.no_grad():  # the output records no history
            torch._foreach_copy_(slots, list(pieces))
    if comm.world == 1:  # see [Note: one rank communicates nothing]
        return Started(output, None)
    _debug.check("all_gather", comm.group, comm.label, slot)
    with span("all_gather", comm.label):
        work = all_gather_single(output, slot, group=comm.group, async_op=True)
    if not way.registers:
        return Started(output, work)
    for key in [k for k, w in _UNFINISHED.items() if w.is_completed()]:
        del _UNFINISHED[key]  # left by a call an error cut short, and finished since
    _UNFINISHED[id(work)] = work
    return Started(output, work)


# [Note: no collective of ours in flight at exit]
# A c10d work carries a copy of the issuing thread's autograd thread-local state, and gloo's
# worker thread runs the collective with that state installed, then restores its own. A gather
# issued inside a scheduled forward carries funcshard's saved-tensor hooks (Python objects):
# installing and restoring them takes the GIL on the worker thread. If that happens while the
# interpreter shuts down -- a forward raised (a shape mismatch, a dtype mix, a missing buffer)
# with a prefetch still in flight, and the script ended -- the worker thread is stopped inside
# C++ code that must not unwind, and the process aborts (`terminate called without an active
# exception`, SIGABRT), so torchrun reports signal 6 instead of the error. So the all-gathers
# funcshard issues asynchronously are registered until they are waited for (every one is, unless an
# error cut the call short: then the registry keeps it, not the call's state), and at exit,
# before the interpreter shuts down, each one still unfinished is waited for, at most
# `_SETTLE_S` seconds (its peers issued it too, unless they failed earlier), and released on
# this thread. `tests/test_exit.py` runs such a script.
_UNFINISHED: dict[int, dist.Work] = {}  # id -> work, issued and not waited for yet
_SETTLE_S = 10.0


@atexit.register
def _settle() -> None:
    """At exit: wait for the asynchronous collectives still in flight (see
    [Note: no collective of ours in flight at exit]); a failure is not reported again."""
    works = list(_UNFINISHED.values())
    _UNFINISHED.clear()
    for work in works:
        if work.is_completed():
            continue
        # the peer is gone, or the wait timed out: the process ends anyway
        with contextlib.suppress(Exception):
            work.wait(datetime.timedelta(seconds=_SETTLE_S))
    del works


class _Function(torch.autograd.Function):
    """``torch.autograd.Function`` whose ``apply`` skips torch's per-call ``inspect`` binding.

    [Note: Function.apply without inspect]
    ``Function.apply`` binds its arguments to ``forward``'s signature with ``inspect.signature``
    on every call (for Functions with ``setup_context``), which costs more than the rest of the
    call: with a few of these Functions per group per step it was a quarter of the scheduler's
    CPU time on a model of 64 small groups (``benchmarks/overhead.py``). Our Functions take
    positional arguments only, so binding only appends ``forward``'s defaults: that is done here
    from a signature read once per class. Under ``torch.func`` transforms torch's own ``apply``
    runs unchanged (it dispatches to functorch), and ``torch.compile`` traces ``forward`` and
    ``backward`` without calling ``apply``.
    """

    @classmethod
    def apply(cls, *args):
        if transformed():
            return super().apply(*args)
        count, defaults = _signature(cls.forward)
        if len(args) < count:
            args = (*args, *defaults[len(args) - count :])
        args = torch._functorch.utils.unwrap_dead_wrappers(args)
        return super(torch.autograd.Function, cls).apply(*args)


@functools.cache
def _signature(forward) -> tuple[int, tuple]:
    """(the number of positional parameters of ``forward``, their defaults); ``(0, ())`` if it
    takes ``*args`` (nothing to fill)."""
    params = list(inspect.signature(forward).parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 0, ()
    return len(params), tuple(p.default for p in params)


class AllGather(_Function):
    """All-gather pieces: the output is ``[W * S]`` (``S``: the pieces' total numel), each rank's
    pieces flattened and concatenated, ranks in order. Dims before ``comm.dim`` are batch dims.

    Backward: reduce-scatter, then an all-reduce over each of ``replicas`` (the replicated mesh
    dims of HSDP), then split into the pieces' gradients. ``gathered``: the output of
    :func:`start_all_gather` for these pieces, if already issued (and waited).
    """

    @staticmethod
    def forward(comm: Comm, replicas, gathered, *pieces):
        if gathered is not None:
            return gathered
        return _all_gather(_flat_pieces(pieces, comm.dim, pieces[0].dtype), comm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        comm, replicas, _, *pieces = inputs
        ctx.comm, ctx.replicas = comm, replicas
        ctx.shapes = [p.shape for p in pieces]
        ctx.dtype, ctx.device = pieces[0].dtype, pieces[0].device
        # the gradient of the output is a fresh buffer that we may scale in place: autograd
        # builds it by concatenating the pieces' gradients (more than one piece)
        ctx.fresh = len(pieces) > 1

    @staticmethod
    def backward(ctx, g):
        needs = ctx.needs_input_grad[3:]
        shapes, fresh = ctx.shapes, ctx.fresh
        if not all(needs):  # frozen pieces: their gradients are not communicated
            g = _keep_pieces(g, shapes, needs, ctx.comm)
            shapes, fresh = [s for s, n in zip(shapes, needs, strict=True) if n], True
        donate = fresh and not torch.is_grad_enabled()  # not under create_graph
        flat = ReduceScatter.apply(g, ctx.comm, ctx.dtype, donate)
        for r in ctx.replicas:
            flat = AllReduce.apply(flat, r)
        grads = iter(_split_pieces(flat, shapes, ctx.comm))
        return (None, None, None, *(next(grads) if n else None for n in needs))

    @staticmethod
    def jvp(ctx, _, __, ___, *tangents):
        refuse_jacfwd(ctx.comm.label, ctx.comm.world)
        tangents = [
            torch.zeros(s, dtype=ctx.dtype, device=ctx.device) if t is None else t
            for t, s in zip(tangents, ctx.shapes, strict=True)
        ]
        return AllGather.apply(ctx.comm.inside_transform(), ctx.replicas, None, *tangents)

    @staticmethod
    def vmap(info, in_dims, comm, replicas, gathered, *pieces):
        moved = [_moved(p, d, info.batch_size) for p, d in zip(pieces, in_dims[3:], strict=True)]
        replicas = tuple(r.inside_transform() for r in replicas)
        return AllGather.apply(comm.batched(), replicas, None, *moved), 0


def one_rank(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The all-gather of ``x`` over mesh dims of one rank each: :class:`OneRank`, or plain
    ``x.to(gather dtype)`` (``x`` itself when no cast is needed: no autograd node at all)
    where the reduce dtype is the gather's or ``x``'s, so that the cast's own backward rounds
    the gradient as the reduction would."""
    gather = comm.gather_dtype or x.dtype
    if comm.reduce_dtype in (None, gather, x.dtype):
        return cast(x, gather)
    return OneRank.apply(x, comm)


class OneRank(_Function):
    """The all-gather over mesh dims of one rank each: ``x`` in ``comm.gather_dtype`` (a view
    of ``x`` when no cast is needed); backward: the gradient in ``comm.reduce_dtype``, then in
    ``x``'s dtype, as the reduce-scatter over one rank returns it. No flat buffer, no copy (see
    [Note: one rank communicates nothing])."""

    @staticmethod
    def forward(x: torch.Tensor, comm: Comm) -> torch.Tensor:
        dtype = comm.gather_dtype or x.dtype
        return alias(x) if x.dtype == dtype else x.to(dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.dtype = inputs[1], inputs[0].dtype

    @staticmethod
    def backward(ctx, g):
        return cast(cast(g, ctx.comm.reduce_dtype or g.dtype), ctx.dtype), None

    @staticmethod
    def jvp(ctx, t, _):
        return OneRank.apply(t, ctx.comm)

    @staticmethod
    def vmap(info, in_dims, x, comm):
        return OneRank.apply(x, comm), in_dims[0]


class ReduceScatter(_Function):
    """Sum (``comm.mean``: average, ``comm.weight``: weighted) over ranks, keep this rank's
    chunk of ``comm.dim``, return it in ``out_dtype``; backward: :class:`AllGather`.
    ``donated``: ``x`` may be scaled in place."""

    @staticmethod
    def forward(x: torch.Tensor, comm: Comm, out_dtype: torch.dtype, donated: bool = False):
        return _reduce_scatter(x, comm, out_dtype, donated)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.in_dtype = inputs[1], inputs[0].dtype

    @staticmethod
    def backward(ctx, g):
        comm = dataclasses.replace(ctx.comm, gather_dtype=ctx.in_dtype)
        return AllGather.apply(comm, (), None, g), None, None, None

    @staticmethod
    def jvp(ctx, t, _, __, ___):
        refuse_jacfwd(ctx.comm.label, ctx.comm.world)
        return ReduceScatter.apply(t, ctx.comm.inside_transform(), t.dtype)

    @staticmethod
    def vmap(info, in_dims, x, comm, out_dtype, donated=False):
        if in_dims[0] is None:
            return ReduceScatter.apply(x, comm.inside_transform(), out_dtype), None
        return ReduceScatter.apply(x.movedim(in_dims[0], 0), comm.batched(), out_dtype), 0


class Broadcast(_Function):
    """Identity: the same value used on every rank of ``comm``; backward: :class:`AllReduce`."""

    @staticmethod
    def forward(x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return alias(wait(x))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return AllReduce.apply(g, ctx.comm), None

    @staticmethod
    def jvp(ctx, t, _):
        return alias(t)

    @staticmethod
    def vmap(info, in_dims, x, comm):
        return Broadcast.apply(x, comm.inside_transform()), in_dims[0]


class AllReduce(_Function):
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
        refuse_jacfwd(ctx.comm.label, ctx.comm.world)
        return AllReduce.apply(t, ctx.comm.inside_transform())

    @staticmethod
    def vmap(info, in_dims, x, comm):
        return AllReduce.apply(x, comm.inside_transform()), in_dims[0]


class Notify(_Function):
    """Identity on tensors; its backward hands their gradients to ``callback`` and returns what
    the callback returns."""

    @staticmethod
    def forward(callback, *xs):
        return tuple(alias(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.callback = inputs[0]
        # a Function's outputs all require grad if any input does: keep frozen ones frozen
        frozen = [y for x, y in zip(inputs[1:], output, strict=True) if not x.requires_grad]
        ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.callback(grads))

    @staticmethod
    def jvp(ctx, _, *tangents):
        return tuple(alias(t) for t in tangents)


def waiting(label: str):
    """A :class:`Notify` callback that waits for the (possibly pending) gradients.

    See [Note: pending tensors]; ``label`` (the group's) names the wait in profiler traces.
    """

    def wait_all(grads):
        with span("wait_reduce_scatter", label):
            return tuple(g if g is None else wait(g) for g in grads)

    return wait_all
