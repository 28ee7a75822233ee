"""``schedule``: run a module on sharded parameters, one group at a time, following a Plan.

The plan (``_plan.py``) says what happens; this file only follows it, lowered once per
structure and execution mode (``_program.py``: [Note: the plan lowered]). Per call, a ``_Run``
keeps the state of each group (sharded, in flight, unsharded, freed: [Note: a group's states])
and two cursors, one over the lowered forward and one over the lowered backward:

* forward: the module gets :class:`~funcshard._trees._deferred.Deferred` parameters; the first
  use of a parameter of the next planned group moves the forward cursor there, executing the
  steps on the way (gather, wait, prefetch, free);
* backward (plain autograd only): autograd's saved-tensor hooks tell which group's saved
  parameter is being unpacked; that moves the backward cursor (re-gather, wait, prefetch); a
  ``Notify`` node on each group's full tensors (or the gather's own copy-out node: [Note: the
  copy-out node is the post-backward node] in ``_flat``) runs when the group's gradients are
  complete, and frees the group; the reduce-scatter itself is the gather's own backward.

[Note: reshard after forward without saved-tensor tricks inside torch.func]
Freeing a group after its forward means emptying the *storage* of its full tensors (which
autograd keeps for backward) and refilling it before they are read again, as FSDP2 does.
The refill is triggered by ``torch.autograd.graph.saved_tensors_hooks`` on unpack, exactly when
the data is needed. ``torch.func`` transforms refuse saved-tensor hooks (pytorch #122729), so
under them nothing is freed: groups are still gathered one by one in the planned order, but
stay unsharded until the transformed call returns (the memory of ``reshard_after_forward=False``
for the whole step). Gradients are correct either way.

[Note: per-call state is not reachable from the graph]
The autograd graph of a call outlives the call (it is kept by the loss, the gradients' history
or a user's reference), and a Python object held by a graph node through a C++ edge is invisible
to Python's cycle collector. ``_Run`` holds each group's full tensors, whose ``Notify`` (or
copy-out) node holds the post-backward callback: if that callback held the ``_Run``, every
step's state (its full parameters included) would stay alive forever. So the callback holds
only a weak reference; during backward the ``_Run`` is kept alive by the saved-tensor hooks of
the nodes that still need it, and once none does there is nothing left to free.

[Note: a plan under torch.compile]
Under ``torch.compile`` the scheduler runs once, while the step is traced (see [Note: funcshard
under torch.compile] in ``_compile``), and what it does becomes straight-line code in the graph:
the plan's ``all_gather`` steps issue functional all-gathers (prefetches: issued early, waited
where the group is first used), in the plan's order, forward and backward. Freeing cannot be
recorded -- traced tensors have no storage to empty -- but it need not be: the compiler frees a
tensor after its last use. So reshard-after-forward means making the forward's gathered tensors
*not used* in backward: the saved-tensor hooks run during the trace (``_compile`` lets them), the
pack hook recognises a group's full tensors (or views of them) by the tensor they view, and the
unpack hook, which the backward trace calls where the group's backward starts, gathers the group
again (the plan's backward steps, with their prefetch) and hands autograd the same view of the
new tensors. The compiled backward then re-gathers each resharded group, as FSDP2 does, and the
forward's gathers die after their last forward use. No ``Notify`` and no post-backward frees are
needed (nothing is pending across autograd: see [Note: collectives under torch.compile]).

[Note: refill after the transfer]
A re-gather (backward, after reshard) copies its result into the group's freed storage. That
storage is reallocated only once the all-gather's transfer has finished: gloo's worker thread
holds a full-size scratch buffer while it transfers, and allocating the target meanwhile would
hold both at once, at backward's memory peak (``benchmarks/memory.py`` measured 32 MiB per rank
more than FSDP2's peak on 1024x4096 MLP blocks). The copy itself is the same either way.

[Note: out-of-plan use]
Every rank issues the plan's collectives in the plan's order, whatever the module's forward does:
runs it skips are gathered and reduce-scattered (with zero gradients, exactly), and a use the
plan cannot serve without a gather of its own is not gathered on demand: see [Note: the
collectives follow the plan] in ``_deviation``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .._communication import _counts, _flat, _grad_layout, _liveness, _packed
from .._communication._collectives import Notify
from .._communication._consensus import cached_digest, defer, failing, leaf
from .._plans._plan import Plan, Step, after_forward, post_forward_ranks
from .._runtime import _compile, _sink
from .._runtime._compat import storage_key
from .._runtime._mode import Mode
from .._runtime._profiling import span
from .._trees import _parallel, _subclass
from .._trees._activation_checkpoint import bind, check_not_reentrant, current_frame, reparametrized
from .._trees._deferred import Deferred
from .._trees._extract import Walk, aliases, call, check_not_wrapped, slots
from .._trees._spec import LocalShard, as_locals, check_materialized
from . import _deviation, _program, _recompute, _regions


def schedule(
    module: nn.Module,
    plan: Plan,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    grad_reduce: str = "mean",
) -> Callable[..., Any]:
    """``apply(sharded, *args, buffers=None, count=None, **kwargs)`` running ``module`` as
    ``plan`` says.

    ``apply`` equals ``functional_call(module, (unshard(sharded), buffers), args, kwargs)`` in
    value and gradient, with FSDP2's memory behaviour: one group unsharded at a time plus
    ``plan.prefetch`` gathers in flight, groups freed after forward and gathered again in
    backward, each group's gradients reduce-scattered as soon as its backward ends.

    Args:
        module: the module the plan was made for (its own parameters are not used; it may be
            on the meta device).
        plan: from :func:`~funcshard.plan`.
        param_dtype, reduce_dtype, grad_reduce: as in :func:`~funcshard.unshard`; a group's own
            dtypes in the plan (:class:`~funcshard.Group`) take precedence. ``apply``'s
            ``count`` is :func:`~funcshard.unshard`'s (``"mean"`` also infers 0 from a
            leading dim of 0 in ``args`` / ``kwargs``).

    ``sharded`` is the flat ``{fqn: DTensor}`` dict from :func:`~funcshard.shard` (LocalShards
    inside ``torch.func``); entries for parameters outside the plan's groups (ignored ones) must
    be plain tensors and are passed through unchanged.

    Raises:
        ValueError: a planned parameter is missing from ``sharded``, or a sharded one is in no
            group; a recompute group is not a module holding only its own group's parameters;
            bad ``grad_reduce`` or ``count``, or an empty batch with ``"mean"`` (see
            :func:`~funcshard.unshard`).
        TypeError: ``sharded`` is not a mapping, or a planned entry is not a shard.
    """
    reduction = _counts.reduction(grad_reduce)
    group_of = plan.group_of()
    tied = aliases(module)
    unplanned = [n for n, _ in module.named_parameters() if n not in group_of and n not in tied]
    recomputed = _recompute.modules(module, plan)  # see [Note: recompute as part of the plan]
    regions = _regions.modules(module, plan)  # see [Note: identical groups compiled once]

    @_compile.traced  # see [Note: funcshard under torch.compile]
    def apply(
        sharded: Mapping[str, Any], *args: Any, buffers=None, count=None, **kwargs: Any
    ) -> Any:
        with failing("schedule"):  # see [Note: one status per call] in _consensus
            params = _check_tree(sharded, group_of, unplanned)
            count = _counts.own("schedule", reduction, count, (args, kwargs))
            options = _flat.Options("", param_dtype, reduce_dtype, reduction)
            run = _Run(plan, sharded, options, Mode.now(), count)
            deferred = {fqn: Deferred(fqn, resolver=run, **run.metadata(fqn)) for fqn in group_of}
            walk = Walk.of(module)  # see [Note: one walk per call] in _extract
            check_not_wrapped(module, "functional_call", walk)
            named = slots(module, ({**params, **deferred}, buffers or {}), True, False, walk)
        run.bind_regions(module, named)
        as_regions = (  # regions only in the trace recorded: [Note: identical groups compiled once]
            _recompute.recomputing(regions, _regions.regioned({}))
            if run.mode is Mode.TRACED and _compile.recording()
            else contextlib.nullcontext()
        )
        with (
            run.saved_tensor_hooks(),
            _recompute.recomputing(recomputed),
            as_regions,
            _naming_freed(run),
        ):
            out = call(module, named, args, kwargs)
        return run.end_forward(out)

    apply.scheduled = Scheduled(module, plan, param_dtype, reduce_dtype, grad_reduce)
    return apply


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """What :func:`schedule` made an ``apply`` of (its attribute ``scheduled``): the module, the
    plan and the call's dtypes, for tools that read the step without running it
    (:func:`~funcshard.explain`)."""

    module: nn.Module
    plan: Plan
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    grad_reduce: str


@contextlib.contextmanager
def _naming_freed(run: _Run):
    """Name the freed groups when the forward reads freed storage: a tensor computed from a
    parameter (``w = self.a.weight.t()``) kept past its group's free (see docs/failures.md)."""
    try:
        yield
    except RuntimeError as e:
        if "data is not allocated yet" not in str(e):
            raise
        freed = {n for n, g in run.groups.items() if g.raw is not None and not g.resident}
        params = {g.name: list(g.params) for g in run.plan.groups if g.name in freed}
        raise RuntimeError(
            "schedule: the forward read a tensor whose storage the plan had freed: a tensor "
            f"computed from a parameter of the freed group(s) {params} (e.g. "
            "`w = self.a.weight.t()` kept and used after that group's last planned use) was "
            "used after the free. Use parameters inside the forward of the module that owns "
            "them, put the modules that share such a tensor in one group, or set "
            "reshard_after_forward=False for that group."
        ) from e


def _check_tree(sharded, group_of, unplanned) -> dict[str, Any]:
    """The entries passed through unchanged (those outside the plan's groups)."""
    if not isinstance(sharded, Mapping):
        raise TypeError(
            f"schedule: apply takes the flat {{fqn: DTensor}} dict of fs.shard(fs.extract(module)"
            f"[0], mesh), got {type(sharded).__name__}."
        )
    missing = [p for p in group_of if p not in sharded]
    if missing:
        raise ValueError(
            f"schedule: parameters {missing} of the plan are missing from the sharded tree; pass "
            "the dict from fs.shard(fs.extract(module)[0], mesh) for the module of the plan."
        )
    absent = [n for n in unplanned if n not in sharded]
    if absent:
        raise ValueError(
            f"schedule: the module's parameters {absent} are in no group of the plan and not in "
            "the tree. Pass ignored parameters as plain tensors. If they are tied to planned "
            "ones, the tie was lost: call fs.extract on the very module you schedule, before "
            "moving it to meta (a copy made afterwards has its ties broken and unrecorded)."
        )
    extra = {k: v for k, v in sharded.items() if k not in group_of}
    stray = [k for k, v in extra.items() if isinstance(v, DTensor | LocalShard)]
    if stray:
        raise ValueError(
            f"schedule: {stray} are sharded but in no group of the plan; make the plan from the "
            "same module (fs.plan), or pass ignored parameters as plain tensors."
        )
    return extra


@dataclasses.dataclass(frozen=True)
class _GroupStatic:
    """One group's part of :class:`_Static`: its leaves' layouts and specs, and its gather
    lowered for the call's mode (``_flat.lower``)."""

    layouts: tuple[_flat.Layout, ...]
    specs: tuple
    lowered: _flat.Lowered


@dataclasses.dataclass(frozen=True)
class _Static:
    """What a call computes from its tree's structure alone: each group's layouts and lowered
    gather. See [Note: per-structure state of a call]."""

    groups: dict[str, _GroupStatic]
    program: _program.Program  # the plan lowered for the mode and the frozen groups
    agreement: tuple  # agree's arguments, and the digest (checked at every call)
    shards_only: bool  # no group gathers or frees anything (see [Note: nothing to refill])


_STATIC: collections.OrderedDict[tuple, _Static] = collections.OrderedDict()
_STATIC_SIZE = 64  # structures remembered per process (least recently used dropped)


def _static(plan: Plan, names, locals_, specs, opts: _flat.Options, mode: Mode, count=None):
    """The layouts and lowered gathers of a call, checked (materialised shards, ranks agree),
    and every rank's count (see [Note: ranks that average over different counts]).

    [Note: per-structure state of a call]
    Per call, ``schedule`` needs each parameter's ``Layout`` (its spec's shapes per mesh dim,
    checked against the local shard), each group's gather lowered for the execution mode
    (buckets, collectives, dtypes) and the ranks' agreement on the structure (see
    ``_consensus``). These depend only on the plan, the options, the mode, and per leaf on
    the spec, local shape, dtype, device and ``requires_grad``: that tuple is the cache key,
    together with the default process group and the identity of each mesh (an equal mesh of
    another process group must not reuse a layout holding the old mesh, whose groups the
    collectives use). Hashing the key costs about as much as the agreement check's own key
    did, and everything else is skipped. Not under ``torch.compile`` (symbolic shapes; the trace
    runs once anyway). The cache is bounded (least recently used structures are dropped), and
    a dropped structure is checked again when it comes back.
    """
    key = None
    if not mode.traced:
        leaves = tuple(
            (s, type(t), t.dtype, t.requires_grad, t.shape, t.device)
            for s, t in zip(specs, locals_, strict=True)
        )
        meshes = tuple(dict.fromkeys(id(s.mesh) for s in specs))
        world = dist.group.WORLD if dist.is_initialized() else None
        key = (plan, opts, mode, world, meshes, leaves)
        found = _STATIC.get(key)
        if found is not None:
            _STATIC.move_to_end(key)
            counts = _counts.agree("schedule", opts.grad_reduce, count, locals_, *found.agreement)
            return found, counts
    layouts = tuple(
        _flat.Layout.of(p, spec, t) for p, spec, t in zip(names, specs, locals_, strict=True)
    )
    check_materialized(names, locals_, "schedule")
    entries = [leaf(p, spec, t) for p, spec, t in zip(names, specs, locals_, strict=True)]
    agreement = (entries, (*opts.key(), *_agreed(plan)))
    agreement = (*agreement, None, cached_digest("schedule", *agreement))
    counts = _counts.agree("schedule", opts.grad_reduce, count, locals_, *agreement)
    names_grad = {p: t.requires_grad for p, t in zip(names, locals_, strict=True)}
    groups, at = {}, 0
    for g in plan.groups:
        n = len(g.params)
        options = _flat.Options(
            g.name,
            g.param_dtype or opts.param_dtype,
            g.reduce_dtype or opts.reduce_dtype,
            opts.grad_reduce,
        )
        dtypes = [t.dtype for t in locals_[at : at + n]]
        post = post_forward_ranks(g.reshard_after_forward)
        speaks = _subclass.speaking(locals_[at : at + n])  # see [Note: FSDP2's all-gather ...]
        lowered = _flat.lower(dtypes, layouts[at : at + n], options, mode, post, speaks)
        groups[g.name] = _GroupStatic(layouts[at : at + n], tuple(specs[at : at + n]), lowered)
        at += n
    frozen = frozenset(g.name for g in plan.groups if not any(names_grad[p] for p in g.params))
    shards_only = all(g.lowered.shards_only for g in groups.values())
    static = _Static(groups, _program.lower(plan, mode, frozen), agreement, shards_only)
    if key is not None:
        while _STATIC and len(_STATIC) >= _STATIC_SIZE:
            _STATIC.popitem(last=False)
        _STATIC[key] = static
    return static, counts


def _agreed(plan: Plan) -> tuple[tuple[str, str], ...]:
    """The plan as the ranks compare it (see ``_consensus``): one entry per group, so that a
    plan grouped differently on one rank is named by its first differing group."""
    groups = tuple(
        (f"plan group {g.name or '<root>'}", f"params {list(g.params)}, reshard_after_forward="
         f"{g.reshard_after_forward}, param_dtype={g.param_dtype}, reduce_dtype="
         f"{g.reduce_dtype}, recompute={g.recompute}")
        for g in plan.groups
    )  # fmt: skip
    order = f"{list(plan.order)}, backward {list(plan.backward_order or ())}"
    prefetch = f"{plan.prefetch}, backward {plan.backward_prefetch}"
    return (*groups, ("plan order", order), ("plan prefetch", prefetch))


def _storage(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage; ``None`` for a wrapper tensor subclass, which has none
    (an all-to-all's ``AsyncCollectiveTensor`` in an expert-parallel forward: never ours)."""
    try:
        return storage_key(t)
    except RuntimeError:
        return None


class _Saved:
    """What the pack hook keeps for a saved tensor that belongs to a group's full parameters."""

    __slots__ = ("follows", "group", "raw", "tensor")

    def __init__(self, group: str, tensor: torch.Tensor, raw: list[torch.Tensor], follows: bool):
        self.group, self.tensor, self.raw = group, tensor, raw  # raw: the gather it came from
        self.follows = follows  # saved by a use the plan runs: its unpack moves the cursor


class State(enum.Enum):
    """Where one group is in one call (see [Note: a group's states])."""

    SHARDED = "sharded"  # not gathered in this call yet
    IN_FLIGHT = "in flight"  # a gather issued, not waited
    UNSHARDED = "unsharded"  # the full tensors are usable
    FREED = "freed"  # the full tensors' storage is released, their autograd history kept


# [Note: a group's states]
# A group starts SHARDED. Gathering it moves it to IN_FLIGHT (issued, a prefetch) and waiting
# to UNSHARDED; freeing it (after its forward, under plain autograd or a trace) to FREED, from
# which a re-gather goes IN_FLIGHT again and refills the same tensors. A prefetch that is never
# waited for is finished and dropped (back to SHARDED, or FREED). Any other move is a bug in the
# executor and raises at once, naming the group and both states.
_MOVES = {
    (State.SHARDED, State.IN_FLIGHT),
    (State.IN_FLIGHT, State.UNSHARDED),
    (State.IN_FLIGHT, State.SHARDED),
    (State.UNSHARDED, State.FREED),
    (State.FREED, State.IN_FLIGHT),
    (State.IN_FLIGHT, State.FREED),
}


class _Group:
    """One group's state in one call (see [Note: a group's states])."""

    def __init__(self, name, leaves, locals_, static: _GroupStatic, mode: Mode, counts) -> None:
        self.name, self.leaves, self.locals = name, leaves, locals_
        self.layouts, self.specs = static.layouts, static.specs  # specs: FSDP x TP, see wrap
        self.lowered, self.mode = static.lowered, mode
        self.opts = static.lowered.opts.counted(counts)  # this call's: see _counts
        self.counts = self.opts.counts
        self.state = State.SHARDED
        self.inflight: _flat.Inflight | None = None
        self.armed: list[torch.Tensor] | None = None  # see _flat.arm
        self.raw: list[torch.Tensor] | None = None  # gathered tensors (storage owners)
        self.fulls: list[torch.Tensor] | None = None  # what the module computes with
        self.local_fulls: list[torch.Tensor] | None = None  # the same, before wrap (FSDP x TP)
        self.storages: list[tuple[torch.UntypedStorage, int]] = []
        # per bucket, the slice kept after forward (see [Note: reshard to a smaller mesh])
        self.kept: list[torch.Tensor | None] | None = None
        self.frozen = not any(t.requires_grad for t in locals_)

    def _move(self, to: State) -> None:
        if (self.state, to) not in _MOVES:
            raise RuntimeError(
                f"funcshard: internal error: group {self.name!r} cannot go from "
                f"{self.state.value} to {to.value}. Please report it with the plan (print(plan))."
            )
        self.state = to

    @property
    def resident(self) -> bool:
        return self.state is State.UNSHARDED

    @property
    def pending(self) -> bool:
        return self.state is State.IN_FLIGHT

    def arm(self) -> None:
        """Arm the first gather (see ``_flat.arm``), unless armed already or issued (a prefetch
        issued before the current group's compute armed it then)."""
        if self.raw is None and self.armed is None and self.state is State.SHARDED:
            self.armed = _flat.arm(self.locals, self.lowered)

    def issue(self) -> None:
        if self.state in (State.UNSHARDED, State.IN_FLIGHT):
            return
        if self.raw is None:  # first gather: recorded by autograd
            self.arm()
            self.inflight = _flat.issue(self.locals, self.lowered, self.armed, self.counts)
            self.armed = None
        else:  # a re-gather only refills storage: not part of the graph
            kept, self.kept = self.kept, None  # within the sub-groups, from the kept slices
            with torch.no_grad():
                self.inflight = _flat.issue(
                    self.locals, self.lowered, counts=self.counts, kept=kept
                )
        self._move(State.IN_FLIGHT)

    def wait(self, notify: Callable | None) -> None:
        """Make the full tensors usable. ``notify``: the first gather's post-backward callback."""
        if self.resident:
            return
        self.issue()
        inflight, self.inflight = self.inflight, None
        with span("wait", self.name):
            if self.raw is None:
                # see [Note: the copy-out node is the post-backward node] in _flat; not where
                # autograd stops at the full tensors (sync_grads=False's sink: the copy-out's
                # backward never runs) or takes their gradients elsewhere (ZeRO-2's capture)
                stops = _sink.current() is not None or _grad_layout.captures(self.leaves)
                then = None if notify is None or stops else notify
                self.raw, notified = _flat.finish_notifying(inflight, then)
                self.storages = self._own_storages() if self.mode.eager else []
                # the post-backward callback frees: nothing to free, no node
                notify = notify if self.storages and not notified else None
                fulls = _grad_layout.capture(self.leaves, self.raw, self.opts)  # ZeRO-2
                self.local_fulls = list(Notify.apply(notify, *fulls)) if notify else fulls
                self.fulls = _parallel.wrap(self.local_fulls, self.specs)
            elif self.mode is Mode.TRACED:  # new tensors: see [Note: a plan under torch.compile]
                with torch.no_grad():
                    self.raw = _flat.finish(inflight)
            else:  # refill the freed storage in place, see [Note: refill after the transfer]
                with torch.no_grad():
                    _flat.wait_transfers(inflight)
                    for s, nbytes in self.storages:
                        s.resize_(nbytes)
                    _flat.finish(inflight, into=self.raw)
        self._move(State.UNSHARDED)

    def _own_storages(self) -> list[tuple[torch.UntypedStorage, int]]:
        """The storages of the full tensors that are freed after forward: not those of the
        shards themselves (a mesh of one rank gathers nothing, see ``_flat``)."""
        shards = {storage_key(t) for t in self.locals} if self.lowered.aliases else ()
        seen = {}
        # a full tensor rebuilt by FSDP2's hooks holds the storage of its gathered outputs
        for t in _packed.owners(self.raw) if self.lowered.packed else self.raw:
            s, key = t.untyped_storage(), storage_key(t)
            if key not in shards:
                seen.setdefault(key, (s, s.nbytes()))
        return list(seen.values())

    @property
    def freeable(self) -> bool:
        """Whether freeing releases anything: a trace's tensors always (the compiler frees
        them), plain autograd's when they have storage of their own."""
        return self.mode is Mode.TRACED or bool(self.storages)

    def free(self, keep: bool = False) -> None:
        """Release the full tensors' storage; ``keep``: after forward, keep the slices of
        ``reshard_after_forward=N`` first (see [Note: reshard to a smaller mesh])."""
        self.kept = None
        if self.pending:  # a prefetch that was never needed
            with torch.no_grad():
                _flat.finish(self.inflight)
            self.inflight = None
            self._move(State.SHARDED if self.raw is None else State.FREED)
        if self.resident and self.freeable:
            with span("reshard" if keep else "free", self.name):
                # nothing to keep for a forward without backward (no_grad)
                if keep and self.lowered.keeps and torch.is_grad_enabled():
                    with torch.no_grad():
                        self.kept = _flat.keep(self.raw, self.lowered)
                for s, _ in self.storages:
                    s.resize_(0)
            self._move(State.FREED)

    def pointers(self) -> list[int]:
        """Keys of the full tensors for ``_Run.owner``: their storages' addresses; traced, the
        ids of the tensors they view (see [Note: a plan under torch.compile])."""
        if self.mode is Mode.TRACED:
            raw = _packed.owners(self.raw) if self.lowered.packed else self.raw or ()
            return [id(_compile.root(t)) for t in raw] if self.resident else []
        return [storage_key(s) for s, _ in self.storages if s.nbytes()]


class _Run:
    """The state of one ``apply`` call and of its backward."""

    def __init__(
        self, plan: Plan, sharded: Mapping[str, Any], opts: _flat.Options, mode: Mode, count=None
    ) -> None:
        self.plan = plan
        self.sink = _sink.current()
        # see [Note: the execution mode is data]: EAGER frees and refills with saved-tensor
        # hooks (which torch.func refuses, see [Note: reshard after forward ...]); TRACED in
        # the graph's terms (see [Note: a plan under torch.compile])
        self.mode = mode
        self.groups: dict[str, _Group] = {}
        self.index: dict[str, tuple[_Group, int]] = {}
        names = [p for g in plan.groups for p in g.params]
        locals_, specs = as_locals(names, [sharded[p] for p in names], "schedule")
        static, counts = _static(plan, names, locals_, specs, opts, mode, count)
        self.shards_only = static.shards_only
        self.packed = any(g.lowered.packed for g in static.groups.values())
        at = 0
        for g in plan.groups:
            n = len(g.params)
            leaves = [sharded[p] for p in g.params]
            static_g = static.groups[g.name]
            state = _Group(g.name, leaves, locals_[at : at + n], static_g, mode, counts)
            at += n
            self.groups[g.name] = state
            for i, p in enumerate(g.params):
                self.index[p] = (state, i)
        self.forward = _program.Cursor(static.program.forward)
        self.backward = _program.Cursor(static.program.backward)
        self.in_forward = True
        self.owner: dict[int, str] = {}  # storage key -> group, while unsharded
        self.range = None
        self.holding: set[str] = set()  # groups the operation being resolved uses
        self.held_frees: list[tuple[_Group, bool]] = []  # (group, keep a slice)
        # checkpoint regions: see [Note: activation checkpointing inside a funcshard call]
        self.rebind: tuple[nn.Module, dict[str, Any]] | None = None
        self.pending_backward = set(self.groups)  # groups whose backward has not completed
        self.recomputing = 0
        # see [Note: the collectives follow the plan] in _deviation: the groups the operation
        # being resolved uses outside the plan, those of them it gets zeros for, and the
        # Skipped zeros of the runs the forward skipped
        self.outside: set[str] = set()
        self.zeroed: set[str] = set()
        self.skipped: list[torch.Tensor] = []
        self.deviated: set[str] = set()  # groups already named to the user
        self.sealed: str | None = None  # a recompute group's forward is running (_recompute)

    # ---- what the module sees ------------------------------------------------------------
    def metadata(self, fqn: str):
        state, i = self.index[fqn]
        local = state.locals[i]
        layout, spec = state.layouts[i], state.specs[i]
        # a 2-D layout's module sees the DTensor of the global shape
        shape = layout.levels[0] if spec.dp_dims is None else spec.shape[layout.lead :]
        dtype, dtensor = state.lowered.opts.param_dtype or local.dtype, spec.dp_dims is not None
        return {"shape": shape, "dtype": dtype, "device": local.device, "dtensor": dtensor}

    def resolve(self, fqns) -> list[torch.Tensor]:
        """The full tensors for one operation (see ``_deferred.Resolver``)."""
        if self.sealed is not None:  # only the recompute group's own parameters
            foreign = [f for f in fqns if self.index[f][0].name != self.sealed]
            if foreign:
                _recompute.refuse(self.sealed, foreign)
        places = [self.index[fqn] for fqn in fqns]
        self.holding = {state.name for state, _ in places}
        if self.in_forward and self.rebind is not None:
            self._bind_region()
        for state in dict.fromkeys(state for state, _ in places):
            if self.in_forward:
                followed = self._use(self.forward, state.name)
            elif self.recomputing:  # a checkpoint region's forward, again, in backward
                followed = self._use(self.backward, state.name)
            else:  # the module kept a Deferred and used it after forward
                followed = False
            if not followed:  # see [Note: the collectives follow the plan] in _deviation
                self.outside.add(state.name)
                if not self._outside(state.name):
                    self.zeroed.add(state.name)
        if self.zeroed:  # see [Note: the collectives follow the plan] in _deviation
            return [self._zeros(state, i) if state.name in self.zeroed else state.fulls[i]
                    for state, i in places]  # fmt: skip
        return [state.fulls[i] for state, i in places]

    def release(self) -> None:
        """The operation ran: do the frees held back while it needed its groups."""
        self.holding = set()
        if self.outside:
            self.outside, self.zeroed = set(), set()
        held, self.held_frees = self.held_frees, []
        for state, keep in held:
            self._free(state, keep)

    # ---- checkpoint regions (see [Note: activation checkpointing inside a funcshard call]) --
    def bind_regions(self, module: nn.Module, named: dict[str, Any]) -> None:
        """Bind the checkpoint regions this call runs (eager grad mode only) to ``named``."""
        if torch.is_grad_enabled() and self.mode.plain:
            self.rebind = (module, named)

    def _bind_region(self) -> None:
        frame = current_frame(skip_owner=self)
        if frame is not None:
            bind(frame, self._recompute)
        else:
            check_not_reentrant()

    @contextlib.contextmanager
    def _recompute(self):
        self.recomputing += 1
        try:
            with reparametrized(*self.rebind):
                yield
        finally:
            self.recomputing -= 1

    # ---- moving through the plan ---------------------------------------------------------
    def _use(self, cursor: _program.Cursor, group: str) -> bool:
        """Move ``cursor`` to ``group``'s next run and make it usable; ``False`` (nothing done)
        if the plan has no run of ``group`` ahead, or -- in forward -- ``group`` is unsharded
        and its next run is not the next one (an early use, not a skip: see [Note: the
        collectives follow the plan] in ``_deviation``)."""
        if cursor.current() != group:
            j = cursor.find(group)
            if j is None:
                return False
            if j > cursor.run + 1 and cursor is self.forward and self.groups[group].resident:
                return False  # needs no gather: used early, not a skip (see _deviation)
            self._advance(cursor, j)
            following = cursor.phase.arm[j]
            if following is not None and torch.is_grad_enabled():
                self.groups[following].arm()  # see _flat.arm: overlap of its reduce-scatter
            self._enter(cursor.phase.compute, group)
        self._ensure(group)
        return True

    def _execute(self, step: Step) -> None:
        """Run one step of the lowered plan (see [Note: the plan lowered] in ``_program``)."""
        state = self.groups[step.group]
        _liveness.step(step, self.in_forward)  # see [Note: what a rank is doing] in _liveness
        if step.op == "all_gather":
            state.issue()
        elif step.op == "wait":
            self._make_resident(state)
        elif step.op in ("free", "reshard"):  # reshard: see [Note: reshard to a smaller mesh]
            keep = step.op == "reshard"
            if state.name in self.holding:  # needed by the operation being resolved
                self.held_frees.append((state, keep))
            else:
                self._free(state, keep)

    def _ensure(self, group: str) -> None:
        """Make ``group`` usable where the plan has it (it is unsharded, or being gathered)."""
        state = self.groups[group]
        if not state.resident:
            self._make_resident(state)

    def _outside(self, group: str) -> bool:
        """``group`` is used where the plan does not run it: whether it is usable -- unsharded,
        being gathered, or communicating nothing; if not, the use gets zeros and the rank an
        error (see [Note: the collectives follow the plan] in ``_deviation``)."""
        state = self.groups[group]
        if state.resident:
            return True
        if state.pending:
            self._make_resident(state)
            return True
        cursor = self.forward if self.in_forward else self.backward
        if state.lowered.local or self.mode.traced or self.mode.captured:
            why = "it communicates nothing" if state.lowered.local else (
                "recorded once: every rank's graph must take the same path")  # fmt: skip
            warnings.warn(
                f"funcshard: rank {dist.get_rank()}: group {group!r} used out of the planned "
                f"{cursor.phase.compute} order (planned: {cursor.current()!r}); gathering it on "
                f"demand ({why}). Record the plan with example inputs like this call's "
                "(fs.plan(..., example_args=(...), example_kwargs={...})), or pass order= to "
                "fs.plan.",
                stacklevel=5,
            )
            self._make_resident(state)
            return True
        error = _deviation.out_of_plan(
            dist.get_rank(), group, cursor.phase.compute, cursor.current(), cursor.phase.runs,
            _deviation.caller(),
        )  # fmt: skip
        if group not in self.deviated:
            self.deviated.add(group)
            warnings.warn(f"funcshard: {error}", stacklevel=5)
            defer(error)
        return False

    def _make_resident(self, state: _Group) -> None:
        first = state.raw is None
        eager = self.mode.eager and torch.is_grad_enabled()
        state.wait(self._post_backward(state) if eager else None)
        if first and self.sink is not None:  # see [Note: gradient accumulation without ...]
            _parallel.refuse_unsynced([lay.path for lay in state.layouts], state.specs, "schedule")
            self.sink.track(state.leaves, state.raw)
        for p in state.pointers():
            self.owner[p] = state.name

    def _free(self, state: _Group, keep: bool = False) -> None:
        for p in state.pointers():
            self.owner.pop(p, None)
        state.free(keep)

    def _post_backward(self, state: _Group) -> Callable:
        # see [Note: per-call state is not reachable from the graph]
        run, name = weakref.ref(self), state.name

        def done(grads):
            if (live := run()) is not None:
                live._exit()
                live._reach(name, live.backward.phase.last.get(name))
                _liveness.step(Step("reduce_scatter", name), False)  # its backward is complete
                live._free(live.groups[name])
                live.backward_done(name)
            return grads

        return done

    def backward_done(self, name: str) -> None:
        """Group ``name``'s backward is complete; after the last group's, nothing will run a
        checkpoint region again: drop the module's bindings, whose stand-ins refer to this run
        (a cycle that would keep the run, and what it holds, until the cycle collector runs)."""
        self.pending_backward.discard(name)
        if not self.pending_backward:
            self.rebind = None

    def end_forward(self, out: Any) -> Any:
        """The forward returned ``out``: run the rest of the plan's forward (the runs the module
        skipped included), and return ``out`` (with the zeros of skipped runs: see [Note: the
        collectives follow the plan] in ``_deviation``)."""
        self._exit()
        backward = torch.is_grad_enabled()
        for steps, group in self.forward.rest():
            for step in steps:
                state = self.groups[step.group]
                if step.op == "wait" and state.pending and (state.frozen or not backward):
                    state.free()  # a prefetch nothing will use
                else:
                    self._execute(step)
            if group is not None:
                self._skip(group)
        self.in_forward = False
        if self.frees:  # groups gathered on demand are freed like planned ones
            after = {g.name: after_forward(g.reshard_after_forward) for g in self.plan.groups}
            for name, state in self.groups.items():
                if after[name] and (state.resident or state.pending):
                    self._free(state, after[name] == ("reshard",))
        return _deviation.attach(out, self.skipped) if self.skipped else out

    def _skip(self, group: str) -> None:
        """The forward skipped a run of ``group``: see [Note: the collectives follow the plan]
        in ``_deviation``."""
        state = self.groups[group]
        backward = torch.is_grad_enabled() and not self.mode.traced  # traced: see the Note
        if not (backward and state.resident and state.local_fulls):
            return
        fulls = [t for t in state.local_fulls if t.requires_grad]
        if fulls:
            run = weakref.ref(self)  # see [Note: per-call state is not reachable from the graph]

            def reached():
                if (live := run()) is not None:
                    live._reach(group, live.backward.find(group))

            self.skipped.append(_deviation.Skipped.apply(reached, *fulls))

    def _reach(self, group: str, j: int | None) -> None:
        """Autograd reached ``group``'s backward without unpacking a saved tensor of it (a run
        the forward skipped; a run whose inputs need no gradient, which saves no parameter;
        its gradients complete): run the plan's backward steps up to its run ``j`` as an unpack
        would, but leave its own gather in flight (nothing reads it). See [Note: the
        collectives follow the plan] in ``_deviation``."""
        if j is not None and self.backward.run < j and self.frees:
            self._advance(self.backward, j, group)

    def _advance(self, cursor: _program.Cursor, j: int, own: str | None = None) -> None:
        """Move ``cursor`` to run ``j``, executing the plan's steps on the way (but the wait of
        group ``own``); a run passed without being entered is one the module skipped (see
        [Note: the collectives follow the plan] in ``_deviation``)."""
        first = cursor.run + 1
        for k, (steps, group) in enumerate(cursor.advance(j), first):
            for step in steps:
                if step.op != "wait" or step.group != own:
                    self._execute(step)
            if k < j and cursor is self.forward:
                self._skip(group)

    def _zeros(self, state: _Group, i: int) -> torch.Tensor:
        """Zeros for the ``i``-th full tensor of ``state``, detached from it."""
        if state.fulls is not None:
            return torch.zeros_like(state.fulls[i])
        meta = self.metadata(state.layouts[i].path)
        zeros = torch.zeros(state.layouts[i].levels[0], dtype=meta["dtype"], device=meta["device"])
        return _parallel.wrap([zeros], [state.specs[i]])[0]

    # ---- backward ------------------------------------------------------------------------
    @property
    def frees(self) -> bool:
        """Whether groups are freed after forward (and gathered again by the hooks)."""
        return self.mode.frees

    def saved_tensor_hooks(self):
        """[Note: nothing to refill]
        The hooks refill freed groups for backward (and move the backward cursor: prefetch,
        profiler ranges). Where every group's full tensors are its shards themselves (a mesh
        of one rank, no cast: see [Note: one rank communicates nothing] in ``_collectives``),
        nothing is ever freed or gathered, and the hooks would only cost a call per saved
        tensor: they are left out, and so are the backward's per-group profiler ranges."""
        if not (self.frees and torch.is_grad_enabled()) or self.shards_only:
            return contextlib.nullcontext()
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        return _compile.with_recorded_hooks(hooks) if self.mode is Mode.TRACED else hooks

    def _pack(self, t: torch.Tensor):
        if not self.owner:
            return t
        # FSDP x TP: autograd saves the module's DTensors, whose local tensors are ours
        local = t._local_tensor if isinstance(t, DTensor) else t
        traced = self.mode is Mode.TRACED
        key = id(_compile.root(local)) if traced else _storage(local)
        group = self.owner.get(key)
        if group is None and self.packed and _subclass.is_subclass(local):  # see _packed
            inner = _subclass.inner(local)
            keys = (id(_compile.root(x)) for x in inner) if traced else map(_storage, inner)
            group = next((self.owner[k] for k in keys if k in self.owner), None)
        if group is None:
            return t
        return _Saved(group, t, self.groups[group].raw, group not in self.outside)

    def _unpack(self, saved):
        if isinstance(saved, _Saved):
            group = saved.group  # see [Note: the collectives follow the plan] in _deviation
            followed = saved.follows and self._use(self.backward, group)
            if not followed and not self._outside(group):
                return torch.zeros_like(saved.tensor)
            state = self.groups[group]
            if self.mode is Mode.TRACED and state.raw is not saved.raw:  # gathered again since
                if _subclass.is_subclass(saved.tensor):  # rebuilt by FSDP2's hooks
                    return _packed.regathered(saved.tensor, saved.raw, state.raw)
                return _compile.regathered(saved.tensor, saved.raw, state.raw)
            return saved.tensor
        return saved

    def _enter(self, op: str, group: str) -> None:
        self._exit()
        _liveness.step(Step(op, group), self.in_forward)  # the compute step, as plan steps
        self.range = span(op, group)
        self.range.__enter__()

    def _exit(self) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
