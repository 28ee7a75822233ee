"""``explain``: one rank's training step, predicted from its plan -- memory, collectives, time.

[Note: the step, run on fake tensors]
The plan says which groups are gathered, computed and freed when; what it cannot say is what
the model allocates in between. So ``explain`` runs the real step -- ``apply`` under
:func:`~funcshard.value_and_grad`, then the optimizer -- once, on fake tensors
(``FakeTensorMode``: shapes, dtypes and storages, no data). Nothing is computed or communicated:
collectives on fake tensors return at once, and the agreement checks answer for every rank
(see [Note: one rank stands for all] in ``_store``). A dispatch mode (``_Ledger``) sees every
operator: the storages it allocates (each tagged with the plan step that made it, and freed
when the storage dies or the schedule empties it), its FLOPs and the bytes it touches, and every
collective, with the group that issued it (``_liveness.RECORD``: the plan step and collective
the schedule notes for hang reports). The result is what this rank's step does, step by step;
its timeline is the plan's own steps.

[Note: time from counts]
Each operator costs ``max(flops / peak, bytes / memory bandwidth) + per-operator overhead``
(the host's dispatch, the part that dominates small models); each collective
``latency + wire bytes / link bandwidth``, with ring algorithms' wire bytes. Two lanes follow
the program: compute runs the operators in order, communication runs the collectives in the
order they are issued, one at a time; a plan's ``wait`` step (or a pending reduce-scatter's
wait) holds compute until its collectives end. What communication adds to the compute lane is
the *exposed* part. The rates are :class:`Hardware`: given, or measured on this machine
(:meth:`Hardware.measure`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils.flop_counter import flop_registry

from .._communication import _liveness, _store, _updates
from .._execution._schedule import Scheduled
from .._plans._plan import Plan, Step
from .._runtime._compat import all_gather_single, fake_kernel, storage_key
from .._trees._subclass import inner, is_subclass

CATEGORIES = (
    "parameters",
    "optimizer state",
    "gathered parameters",
    "gradients",
    "activations",
    "temporaries",
    "inputs",
)
_PHASES = ("forward", "backward", "optimizer")


# ---- what is reported ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GroupCost:
    """One group's bytes on this rank, and its compute.

    ``shard_bytes``: its parameters' local shards; ``gathered_bytes``: its full parameters in
    the compute dtype (what a gather makes); ``grad_bytes``: its sharded gradients (kept after
    backward); ``reduce_bytes``: its full gradients in the reduce dtype (what a reduce-scatter
    takes); ``optimizer_bytes``: the optimizer state of its parameters; ``activation_bytes``:
    what its forward leaves alive for backward (a recomputing group: its inputs only);
    ``forward_flops`` / ``backward_flops``: FLOPs of its compute steps (backward includes a
    recompute).
    """

    name: str
    params: int
    reshard_after_forward: bool | int
    recompute: bool
    shard_bytes: int
    gathered_bytes: int
    grad_bytes: int
    reduce_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    forward_flops: int
    backward_flops: int


@dataclasses.dataclass(frozen=True)
class Collective:
    """Collectives of one kind, group, mesh dimension, size and phase: ``count`` per step.

    ``mesh_dim``: e.g. ``"dp (4 ranks)"``; ``in_bytes`` / ``out_bytes``: this rank's input and
    output of one of them; ``wire_bytes``: what one sends and receives over the ring."""

    kind: str
    group: str
    mesh_dim: str
    phase: str
    in_bytes: int
    out_bytes: int
    wire_bytes: int
    count: int


@dataclasses.dataclass(frozen=True)
class Moment:
    """One plan step of the timeline: the most bytes alive while it ran (``bytes``), and those
    bytes by category; ``start_s`` / ``end_s``: when it runs on the compute lane."""

    phase: str
    index: int  # in the plan's steps of ``phase`` (the optimizer: 0)
    step: Step
    bytes: int
    by_category: dict[str, int]
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The rates the time prediction uses (see [Note: time from counts]).

    ``flops_per_s``: by compute dtype (a missing dtype takes ``float32``'s);
    ``memory_bytes_per_s``: memory bandwidth of elementwise work; ``op_overhead_s``: host time
    per operator; ``link_bytes_per_s`` / ``latency_s``: of one collective, per rank;
    ``cache_bytes`` / ``cache_bytes_per_s``: an operator that touches at most ``cache_bytes``
    moves them at this rate instead (``0``: no cache tier); ``step_overhead_s``: the
    scheduler's host time per plan step it executes (see [Note: the host's cost]);
    ``overlap``: the share of a collective's time that can pass under compute (``1``: NCCL on
    its own engines; see [Note: collectives on the cores that compute])."""

    flops_per_s: Mapping[torch.dtype, float]
    memory_bytes_per_s: float
    op_overhead_s: float
    link_bytes_per_s: float
    latency_s: float
    name: str = "given"
    cache_bytes: int = 0
    cache_bytes_per_s: float = 0.0
    step_overhead_s: float = 0.0
    overlap: float = 1.0
    flops_curve: Mapping[torch.dtype, tuple[tuple[float, float], ...]] = dataclasses.field(
        default_factory=dict
    )

    def flops(self, dtype: torch.dtype, work: float | None = None) -> float:
        """The FLOP rate of ``dtype``; with ``work`` (one operator's FLOPs) and a measured
        ``flops_curve`` of ``(flops, rate)`` points, the rate at that size (interpolated in
        log FLOPs, the ends held): small matmuls run below the peak, in bf16 on a CPU far
        below."""
        curve = self.flops_curve.get(dtype)
        if not curve or not work:
            return self.flops_per_s.get(dtype, self.flops_per_s[torch.float32])
        at = math.log(work)
        points = [(math.log(f), r) for f, r in curve]
        if at <= points[0][0]:
            return points[0][1]
        for (x0, r0), (x1, r1) in itertools.pairwise(points):
            if at <= x1:
                return r0 + (r1 - r0) * (at - x0) / (x1 - x0)
        return points[-1][1]

    def to_dict(self) -> dict[str, Any]:
        """The rates as JSON-ready data (dtypes by name)."""
        return _plain(self)

    def operator_s(self, flops: float, moved: int, dtype: torch.dtype) -> float:
        """The predicted time of one operator: its FLOPs or its bytes, whichever bounds it,
        plus the host's cost of an operator."""
        cached = self.cache_bytes_per_s and moved <= self.cache_bytes
        bandwidth = self.cache_bytes_per_s if cached else self.memory_bytes_per_s
        computing = flops / self.flops(dtype, flops) if flops else 0.0
        return self.op_overhead_s + max(computing, moved / bandwidth)

    @staticmethod
    def h100() -> Hardware:
        """An H100 SXM at typical attained rates: 60% of its dense peaks, NVLink within a
        node, and a small per-operator host cost (a graphed or compiled step)."""
        return Hardware(
            {torch.bfloat16: 0.6 * 989e12, torch.float16: 0.6 * 989e12, torch.float32: 0.6 * 67e12},
            memory_bytes_per_s=0.8 * 3.35e12,
            op_overhead_s=2e-6,
            link_bytes_per_s=0.8 * 450e9,
            latency_s=20e-6,
            name="H100 (nominal)",
        )

    @staticmethod
    def measure(group: dist.ProcessGroup | None = None, *, device: str = "cpu") -> Hardware:
        """Rates measured here in about a second: a matmul per dtype, an add of 64 MiB
        tensors (memory) and of 256 KiB ones (the cache tier, for operators of up to 4 MiB),
        the host's cost per operator of a tiny eager training step, and -- with ``group``
        (collective: every rank of it calls this) -- an all-gather of 16 MiB and of 4 bytes
        on it, and the scheduler's host cost per plan step, from a tiny funcshard step sharded
        over it (see [Note: the host's cost]). Without a group the link takes the memory
        bandwidth (ranks on one host) and plan steps cost nothing beyond their operators."""
        curve = {dt: _matmul_curve(dt, device) for dt in (torch.float32, torch.bfloat16)}
        flops = {dt: max(r for _, r in points) for dt, points in curve.items()}
        x = torch.empty(1 << 24, device=device)  # 64 MiB
        memory = 3 * x.nbytes / _seconds(lambda: torch.add(x, x))
        y = torch.empty(1 << 16, device=device)  # 256 KiB
        cached = 3 * y.nbytes / _seconds(lambda: torch.add(y, y), repeat=50)
        overhead = _host_s(device)
        link, latency = memory, 0.0
        if group is not None and dist.get_world_size(group) > 1:
            world = dist.get_world_size(group)
            big = torch.empty(1 << 22, device=device)
            out = torch.empty(world * big.numel(), device=device)
            tiny, tiny_out = big[:1], out[:world]
            latency = _seconds(lambda: all_gather_single(tiny_out, tiny, group=group))
            spent = _seconds(lambda: all_gather_single(out, big, group=group))
            link = out.nbytes * (world - 1) / world / max(spent - latency, 1e-9)
        rates = Hardware(
            flops,
            memory,
            overhead,
            link,
            latency,
            f"measured ({device})",
            4 << 20,
            cached,
            overlap=_CPU_OVERLAP if device == "cpu" else 1.0,
            flops_curve=curve,
        )
        if group is not None and dist.get_world_size(group) > 1:
            per_op, per_step = _host_costs(group, rates)
            rates = dataclasses.replace(rates, op_overhead_s=per_op, step_overhead_s=per_step)
        return rates


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What one rank's step does, predicted from its plan (see :func:`explain`).

    ``groups``: per group, bytes and FLOPs (:class:`GroupCost`); ``timeline``: the plan's steps
    in the order they ran, forward, backward, then the optimizer (:class:`Moment`);
    ``peak_bytes``: the most bytes alive at once; ``peak_at``: the moment it falls in;
    ``collectives``: every collective the step issues (:class:`Collective`); times in seconds:
    ``compute_s`` (the compute lane alone), ``communication_s`` (the communication lane alone),
    ``exposed_communication_s`` and ``predicted_step_s`` (both lanes, overlapped as the plan
    overlaps them)."""

    plan: Plan
    rank: int
    world: int
    groups: tuple[GroupCost, ...]
    timeline: tuple[Moment, ...]
    peak_bytes: int
    peak_at: Moment
    collectives: tuple[Collective, ...]
    flops: int
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    predicted_step_s: float
    hardware: Hardware
    operators: int
    transfers: tuple[tuple[str, str, float, float], ...] = ()  # (kind, group, start_s, end_s)

    @property
    def at_peak(self) -> dict[str, int]:
        """Bytes alive at the peak, by category."""
        return dict(self.peak_at.by_category)

    def fits(self, budget_bytes: float) -> bool:
        return self.peak_bytes <= budget_bytes

    def to_json(self) -> str:
        """Everything, as JSON (dtypes as names, steps as ``[op, group]``)."""

        return json.dumps(_plain(self), indent=1)

    def __str__(self) -> str:
        return _table(self)

    def plot(self, path: str) -> None:
        """Write a PNG: memory over the timeline by category, with the collective lanes."""
        from ._explain_plot import plot

        plot(self, path)


# ---- the entry point -----------------------------------------------------------------------
def explain(
    apply: Callable[..., Any],
    params: Mapping[str, Any],
    *args: Any,
    optimizer: Any = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    loss: Callable[..., torch.Tensor] | None = None,
    hardware: Hardware | None = None,
    **kwargs: Any,
) -> Explanation:
    """Predict one training step of ``apply`` on this rank: memory, collectives and time.

    The step is ``fs.value_and_grad`` of ``loss(apply(params, *args, buffers=buffers,
    **kwargs), *args)`` (default loss: the sum of the output's floating tensors), then
    ``fs.optim.step(optimizer, ...)`` if an optimizer is given. It runs once on fake tensors
    (see [Note: the step, run on fake tensors]): nothing is computed or communicated, and other
    ranks need not call it.

    Args:
        apply: what :func:`~funcshard.schedule` returned (it carries its plan and dtypes).
        params: the ``{fqn: DTensor}`` shards of :func:`~funcshard.shard`, real or on the meta
            device (only their shapes, dtypes, meshes and placements are read); plain tensors
            for parameters outside the plan.
        args / kwargs: ``apply``'s inputs (real, meta or fake tensors: shapes are read).
        optimizer: an ``fs.optim`` transformation: its state is counted, its step run.
        buffers: the module's buffers, as passed to ``apply``.
        loss: ``loss(output, *args) -> scalar`` when the output is not itself the loss
            (e.g. cross-entropy over logits, whose temporaries can set the peak).
        hardware: the rates for the time prediction; default :meth:`Hardware.measure` on
            ``params``' device (compute only: the link then takes the memory bandwidth).

    Returns:
        An :class:`Explanation` (print it for a table; ``to_json()``; ``plot(path)``).

    Raises:
        TypeError: ``apply`` is not a scheduled apply; a planned parameter is not a DTensor.
        ValueError / RuntimeError: whatever the step itself would raise on these inputs.
    """
    scheduled = getattr(apply, "scheduled", None)
    if not isinstance(scheduled, Scheduled):
        raise TypeError(
            "fs.explain: apply must be what fs.schedule returned (it carries the plan); got "
            f"{apply!r}. Pass your loss as loss=, not a wrapper around apply."
        )
    plan = scheduled.plan
    group_of = plan.group_of()
    for fqn in group_of:
        if not isinstance(params.get(fqn), DTensor):
            raise TypeError(
                f"fs.explain: parameter {fqn!r} must be a DTensor shard (from fs.shard, real or "
                f"on meta), got {type(params.get(fqn)).__name__}."
            )
    mesh = next(params[f] for f in group_of).device_mesh
    device = mesh.device_type
    hardware = hardware or Hardware.measure(device=device)
    local_shapes = {k: _local_shape(v) for k, v in params.items()}
    ledger = _Ledger(plan, hardware)
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    from .._execution._autodiff import value_and_grad
    from ..optim import step as optim_step

    reduce = loss or _sum_of_floats
    with _store.alone(), fake_mode, _leaving_no_trace(), ledger:
        fake = {k: _fake_shard(v, local_shapes[k], device) for k, v in params.items()}
        fake_args, fake_kwargs, fake_buffers = optree.tree_map(
            lambda t: _fake(t, device) if isinstance(t, torch.Tensor) else t,
            (args, kwargs, dict(buffers or {})),
            none_is_leaf=True,
        )
        ledger.resident(fake, "parameters")
        ledger.resident((fake_args, fake_kwargs, fake_buffers), "inputs")
        state = None
        if optimizer is not None:
            with ledger.phase_of("optimizer", counted=False):
                state = _counters_known(optimizer.init(fake), fake_mode)
            ledger.resident(state, "optimizer state", retag=True)
        ledger.begin()

        def step_loss(p):
            out = apply(p, *fake_args, buffers=fake_buffers, **fake_kwargs)
            ledger.output_ready()
            return reduce(out, *fake_args)

        _, grads = value_and_grad(step_loss)(fake)
        ledger.end_backward(grads)
        if optimizer is not None:
            with ledger.phase_of("optimizer"):
                optim_step(optimizer, fake, grads, state)
        ledger.finish()
    return ledger.explanation(scheduled, params, local_shapes, state, hardware, mesh)


def _plain(x: Any) -> Any:
    """``x`` as JSON-ready data: dataclasses as dicts, dtypes by name, steps as ``[op, group]``,
    plans as their JSON."""
    if isinstance(x, Step):
        return [x.op, x.group]
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if isinstance(x, Plan):
        return json.loads(x.to_json())
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, Mapping):
        return {_plain(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x


def _sum_of_floats(out: Any, *args: Any) -> torch.Tensor:
    leaves = [t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    floats = [t for t in leaves if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError(
            "fs.explain: apply's output has no floating tensor that requires grad; pass loss= "
            "to say what the step differentiates."
        )
    return sum(t.sum() for t in floats)


# ---- fake inputs ---------------------------------------------------------------------------
def _local_shape(t: Any) -> tuple[int, ...] | None:
    if isinstance(t, DTensor):
        return tuple(t._local_tensor.shape)
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _fake(t: torch.Tensor, device: str) -> torch.Tensor:
    """A fake tensor like ``t`` (meta tensors land on ``device``)."""
    where = device if t.device.type == "meta" else t.device
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=where)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


def _fake_shard(t: Any, local_shape, device: str) -> Any:
    if not isinstance(t, DTensor):
        return _fake(t, device) if isinstance(t, torch.Tensor) else t
    local = t._local_tensor
    if is_subclass(local):  # a low-precision shard: of its class, around fake inner tensors
        names, ctx = local.__tensor_flatten__()
        inner = {n: _fake(getattr(local, n), device) for n in names}
        local = type(local).__tensor_unflatten__(inner, ctx, local.shape, local.stride())
    else:
        local = torch.empty(local_shape, dtype=t.dtype, device=device)
    made = DTensor.from_local(
        local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
    return made.requires_grad_(t.requires_grad)


def _counters_known(state: Any, mode) -> Any:
    """``state`` with its scalars that are not shards (step counts, which the optimizers read
    on the host) made fake tensors that know their value, 0 (the first step). Private:
    ``FakeTensorMode``'s
    converter (see tests/test_explain.py::test_private_torch_api_of_explain)."""

    def known(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.ndim:
            return t
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            zero = torch.zeros((), dtype=t.dtype)
        return mode.fake_tensor_converter.from_real_tensor(mode, zero, make_constant=True)

    return optree.tree_map(known, state, none_is_leaf=True)


@contextlib.contextmanager
def _leaving_no_trace():
    """Restore what the fake step changes in this rank's records afterwards: it is not this
    rank's step. ``_liveness.RECORD`` (the call, plan step and collectives a hang report
    shows; the ledger reads the step), and the optimizer updates not yet checked with the
    other ranks (see [Note: the optimizer rides the next check] in ``_updates``): the fake
    step's update must not count, and its agreement checks must not consume the real ones."""
    record = _liveness.RECORD
    fields = ("call", "step", "collective", "issued")
    before = {f: getattr(record, f) for f in fields}
    updates = list(_updates._PENDING), _updates._DROPPED[0]
    record.step = record.collective = None
    try:
        yield
    finally:
        for f, v in before.items():
            setattr(record, f, v)
        _updates._PENDING[:] = updates[0]
        _updates._DROPPED[0] = updates[1]


# ---- the ledger ----------------------------------------------------------------------------
_COLLECTIVES = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
}
_WAITS = {"wait_tensor"}
# [Note: storages emptied in place]
# funcshard frees a group's full parameters, the buffers of its gathers and the inputs gloo
# copies by ``untyped_storage().resize_(0)``, and refills a freed group the same way: not
# operators, so the dispatch mode does not see them. Their sizes are read again where they can
# have changed: when the schedule notes a new plan step (frees and refills are steps), after a
# collective or its wait (the buffers around it), and for an operator's output that is an
# existing storage (the copy into a refilled one).
_EMPTIED = ("gathered parameters", "temporaries")


@dataclasses.dataclass
class _Storage:
    ref: weakref.ref
    nbytes: int
    category: str
    group: str | None
    phase: str


@dataclasses.dataclass
class _Issued:
    kind: str
    group: str
    pg: Any
    phase: str
    in_bytes: int
    out_bytes: int
    end_s: float
    outputs: tuple[int, ...]
    held: int  # bytes the backend holds on this thread until the wait (gloo's input copy)
    start_s: float = 0.0


class _Ledger(TorchDispatchMode):
    """Follows the fake step operator by operator; see [Note: the step, run on fake tensors]."""

    def __init__(self, plan: Plan, hardware: Hardware) -> None:
        super().__init__()
        self.plan, self.hw = plan, hardware
        self.steps = {"forward": list(plan.forward), "backward": list(plan.backward)}
        self.storages: dict[int, _Storage] = {}
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.phase = "setup"
        self.position: dict[str, int] = {"forward": -1, "backward": -1, "optimizer": 0}
        self.seen_step: Any = None
        self.moments: dict[tuple[str, int], dict] = {}
        self.counting = False
        self.compute_clock = 0.0
        self.comm_clock = 0.0
        self.compute_total = 0.0
        self.comm_total = 0.0
        self.issued: list[_Issued] = []
        self.pending: list[_Issued] = []
        self.flops = {"forward": {}, "backward": {}}
        self.total_flops = 0
        self.operators = 0
        self.activations: dict[str, int] = {}  # group -> bytes alive when forward ends
        self.emptied: dict[int, None] = {}  # see [Note: storages emptied in place]
        self.stale = False

    # -- lifetime of storages
    def _track(self, t: torch.Tensor, category: str, group: str | None) -> None:
        s = t.untyped_storage()
        key = storage_key(s)
        if key in self.storages:
            return
        n = s.nbytes()
        self.storages[key] = _Storage(
            weakref.ref(s, self._died(key)), n, category, group, self.phase
        )
        self.live[category] += n
        if category in _EMPTIED:
            self.emptied[key] = None

    def _died(self, key: int):
        def gone(_):
            entry = self.storages.pop(key, None)
            self.emptied.pop(key, None)
            if entry is not None:
                self.live[entry.category] -= entry.nbytes

        return gone

    def _resync(self, keys) -> None:
        """Storages emptied or refilled in place (a group's free and its re-gather)."""
        for key in keys:
            entry = self.storages.get(key)
            s = entry.ref() if entry is not None else None
            if s is not None and s.nbytes() != entry.nbytes:
                self.live[entry.category] += s.nbytes() - entry.nbytes
                entry.nbytes = s.nbytes()

    def resident(self, tree: Any, category: str, retag: bool = False) -> None:
        for t in _plain_tensors(tree):
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if retag and key in self.storages:
                    entry = self.storages[key]
                    self.live[entry.category] -= entry.nbytes
                    self.live[category] += entry.nbytes
                    entry.category = category
                self._track(t, category, None)

    # -- where in the plan we are
    def begin(self) -> None:
        self.phase, self.counting = "forward", True
        self._moment()

    def output_ready(self) -> None:
        """The forward returned: what its compute steps allocated and is alive is saved."""

    def end_backward(self, grads: Any) -> None:
        for t in _plain_tensors(grads):
            if isinstance(t, torch.Tensor):
                entry = self.storages.get(storage_key(t))
                if entry is not None and entry.category != "gradients":
                    self.live[entry.category] -= entry.nbytes
                    self.live["gradients"] += entry.nbytes
                    entry.category = "gradients"
        self._wait_all()

    @contextlib.contextmanager
    def phase_of(self, phase: str, counted: bool = True):
        before, counting = self.phase, self.counting
        self.phase, self.counting = phase, counted and counting
        if counted:
            self._moment()
        try:
            yield
        finally:
            self.phase, self.counting = before, counting

    def finish(self) -> None:
        self._wait_all()
        self.counting = False

    def _follow_plan(self) -> None:
        """Move the position to the plan step the schedule last noted."""
        noted = _liveness.RECORD.step
        if noted is None or noted is self.seen_step or self.phase not in ("forward", "backward"):
            return
        self.seen_step = noted
        self.stale = True
        step, forward = noted
        phase = "forward" if forward else "backward"
        if phase == "backward" and self.phase == "forward":
            self.phase = "backward"
            self._snapshot_activations()
        steps, at = self.steps[phase], self.position[phase]
        for j in range(at + 1, len(steps)):
            if steps[j] == step:
                self.position[phase] = j
                self.compute_clock += self.hw.step_overhead_s  # see [Note: the host's cost]
                self.compute_total += self.hw.step_overhead_s
                if step.op == "wait":
                    self._wait_group(step.group)
                self._moment()
                return

    def _snapshot_activations(self) -> None:
        for entry in self.storages.values():
            if entry.category == "activations" and entry.group is not None:
                owned = self.activations.get(entry.group, 0)
                self.activations[entry.group] = owned + entry.nbytes

    def _current(self) -> tuple[str, int, Step]:
        if self.phase == "optimizer":
            return "optimizer", 0, Step("optimizer", "")
        at = self.position.get(self.phase, -1)
        steps = self.steps.get(self.phase, [])
        if not steps:
            return self.phase, 0, Step(self.phase, "")
        at = max(at, 0)  # the work before the first step noted goes with the first step
        return self.phase, at, steps[at]

    def _moment(self) -> None:
        phase, at, step = self._current()
        key = (phase, at)
        if key not in self.moments:
            self.moments[key] = {"step": step, "bytes": -1, "by": {}, "start": self.compute_clock}
        self._peak()

    def _peak(self) -> None:
        if not self.counting:
            return
        phase, at, _ = self._current()
        moment = self.moments.get((phase, at))
        if moment is None:
            self._moment()
            return
        total = sum(self.live.values())
        if total > moment["bytes"]:
            moment["bytes"], moment["by"] = total, dict(self.live)
        moment["end"] = self.compute_clock

    def _group_now(self) -> str | None:
        _, _, step = self._current()
        return step.group if step.op in ("forward", "backward") else None

    # -- the operators
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor (a low-precision weight) runs it on its inner tensors,
            # which come back here
        self._follow_plan()
        if self.stale:  # see [Note: storages emptied in place]
            self._resync(list(self.emptied))
            self.stale = False
        name = func._overloadpacket.__name__
        out = fake_kernel(func, args, kwargs)  # see [Note: grouped matmuls on fake tensors]
        if not self.counting and self.phase == "setup":
            return out
        kind = _COLLECTIVES.get(name)
        if kind is not None:
            self._collective(kind, func, args, out)
            self.stale = True
        elif name in _WAITS:
            self._wait_tensor(args[0])
            self.stale = True
        else:
            self._compute(func, args, kwargs, out)
        category = self._category(kind)
        for t in optree.tree_leaves(out, none_is_leaf=True):
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key in self.storages:
                    self._resync((key,))
                else:
                    self._track(t, category, self._group_now())
        self._peak()
        return out

    def _category(self, kind: str | None) -> str:
        phase, _, step = self._current()
        if kind == "reduce_scatter" or kind == "all_reduce":
            return "gradients"
        if kind == "all_gather" or step.op in ("all_gather", "wait", "reshard"):
            return "gathered parameters"
        if phase == "forward" and step.op == "forward":
            return "activations"
        if phase == "optimizer" and not self.counting:
            return "optimizer state"
        return "temporaries"

    def _compute(self, func, args, kwargs, out) -> None:
        outs = [t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not self.counting or not outs:  # metadata (``prim.device``, sizes): no work
            return
        self.operators += 1
        flops = 0
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
        elif packet is torch.ops.aten._grouped_mm:  # torch's counter has no formula for it:
            flops = 2 * args[0].numel() * out.shape[-1]  # each row of mat_a meets N columns
        tensors = [
            t for t in optree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
        ]
        view = (
            outs
            and all(any(_same_storage(o, i) for i in tensors if i is not o) for o in outs)
            and func.is_view
        )
        moved = 0 if view else sum(t.numel() * t.element_size() for t in tensors)
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        cost = self.hw.op_overhead_s if view else self.hw.operator_s(flops, moved, dtype)
        self.compute_clock += cost
        self.compute_total += cost
        if flops:
            self.total_flops += flops
            group = self._group_now()
            if group is not None and self.phase in self.flops:
                self.flops[self.phase][group] = self.flops[self.phase].get(group, 0) + flops

    def _collective(self, kind: str, func, args, out) -> None:
        if not self.counting:
            return
        self.operators += 1
        _, pg, label = _liveness.RECORD.collective or (kind, None, "")
        outs = _tensors(out)
        if func.namespace == "_c10d_functional":  # input first, output returned
            src, dst = _tensors(args[0:1]), outs
        elif kind == "all_reduce":  # in place
            src = dst = _tensors(args[0:1])
        else:  # c10d's: (output, input, ...)
            src, dst = _tensors(args[1:2]), _tensors(args[0:1])
        in_bytes = sum(t.numel() * t.element_size() for t in src)
        out_bytes = sum(t.numel() * t.element_size() for t in dst)
        world = dist.get_world_size(pg) if pg is not None else 1
        full = out_bytes if kind == "all_gather" else in_bytes
        wire = full * (world - 1) // world * (2 if kind == "all_reduce" else 1)
        start = max(self.compute_clock, self.comm_clock)
        spent = self.hw.latency_s + wire / self.hw.link_bytes_per_s
        self.comm_clock = start + spent
        self.comm_total += spent
        self.compute_clock += (1.0 - self.hw.overlap) * spent  # see Hardware.overlap
        issued = _Issued(
            kind,
            label,
            pg,
            self.phase,
            in_bytes,
            out_bytes,
            self.comm_clock,
            tuple(storage_key(t) for t in (*dst, *outs)),
            in_bytes if kind == "reduce_scatter" and _copies_input(pg, src) else 0,
        )
        self.live["gradients"] += issued.held
        issued.start_s = start
        self.issued.append(issued)
        self.pending.append(issued)

    def _wait_group(self, group: str) -> None:
        for c in [c for c in self.pending if c.group == group and c.kind == "all_gather"]:
            self._waited(c)

    def _wait_tensor(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        for c in [c for c in self.pending if key in c.outputs]:
            self._waited(c)

    def _waited(self, c: _Issued) -> None:
        self.compute_clock = max(self.compute_clock, c.end_s)
        self.live["gradients"] -= c.held
        self.pending.remove(c)

    def _wait_all(self) -> None:
        for c in list(self.pending):
            self._waited(c)

    # -- the result
    def explanation(self, scheduled, params, local_shapes, state, hw, mesh) -> Explanation:
        plan = scheduled.plan
        moments = []
        for (phase, index), m in sorted(
            self.moments.items(), key=lambda kv: (_PHASES.index(kv[0][0]), kv[0][1])
        ):
            if m["bytes"] < 0:
                continue
            moments.append(
                Moment(
                    phase,
                    index,
                    m["step"],
                    m["bytes"],
                    m["by"],
                    m["start"],
                    m.get("end", m["start"]),
                )
            )
        peak = max(moments, key=lambda m: m.bytes)
        groups = _group_costs(scheduled, params, local_shapes, state, self)
        collectives = _collectives(self.issued, mesh)
        step_s = max(self.compute_clock, self.comm_clock)
        return Explanation(
            plan=plan,
            rank=dist.get_rank() if dist.is_initialized() else 0,
            world=dist.get_world_size() if dist.is_initialized() else 1,
            groups=groups,
            timeline=tuple(moments),
            peak_bytes=peak.bytes,
            peak_at=peak,
            collectives=collectives,
            flops=self.total_flops,
            compute_s=self.compute_total,
            communication_s=self.comm_total,
            exposed_communication_s=max(step_s - self.compute_total, 0.0),
            predicted_step_s=step_s,
            hardware=hw,
            operators=self.operators,
            transfers=tuple((c.kind, c.group, c.start_s, c.end_s) for c in self.issued),
        )


def _copies_input(pg, src: list[torch.Tensor]) -> bool:
    """Whether ``pg``'s reduce-scatter copies its input on the calling thread (gloo), where
    it stays until the collective is waited for.

    [Note: gloo's buffers]
    Two buffers of ProcessGroupGloo that no dispatched operator makes (the fake step cannot
    see them) show in this rank's measured memory (``peak_bytes(this_thread=True)``):

    - a reduce-scatter's copy of its input, made on the calling thread when issued and freed
      when the collective is waited for (see [Note: gloo copies reduce-scatter inputs] in
      ``_collectives``). Counted: ``held``, as gradients, until the wait.
    - an all-gather's flat output, which gloo's worker allocates, receives into and copies out
      of, then frees when the transfer ends. The worker runs with the issuing thread's
      thread-local state, so the profiler attributes the allocation to the issuing thread.
      Not counted: it lives only while the transfer is in flight, and how long that is
      depends on the other ranks' progress and on how the host schedules gloo's threads.
      Held from the issue to the end of the transfer on the communication lane, it made a
      peak at every prefetch's issue that the real steps do not have (+3% to +9% over the
      models measured; +7% on a 4-block MLP whose measured peak is matched without it). Left
      out, the prediction is low by up to one group's gathered bytes when a gather is still
      in flight at the real peak (a 2-block Llama on gloo: -4% on 2 ranks, -7% on 4;
      ``benchmarks/explain_accuracy.py``).
    """
    from .._communication._collectives import copies_reduce_scatter_input

    return pg is not None and bool(src) and copies_reduce_scatter_input(pg, src[0].device.type)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(x, none_is_leaf=True) if isinstance(t, torch.Tensor)]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return storage_key(a) == storage_key(b)


def _nbytes(t: Any) -> int:
    return sum(x.numel() * x.element_size() for x in _plain_tensors(t))


def _plain_tensors(tree: Any) -> list[Any]:
    """The leaves of ``tree``, a DTensor as its local tensor and a tensor subclass (a
    low-precision weight) as its inner tensors: what holds memory."""
    out = []
    for t in optree.tree_leaves(tree, none_is_leaf=True):
        t = t._local_tensor if isinstance(t, DTensor) else t
        out.extend(inner(t) if isinstance(t, torch.Tensor) and is_subclass(t) else (t,))
    return out


def _group_costs(scheduled, params, local_shapes, state, ledger) -> tuple[GroupCost, ...]:
    plan = scheduled.plan
    group_of = plan.group_of()
    optimizer = dict.fromkeys((g.name for g in plan.groups), 0)
    if state is not None:
        paths, leaves, _ = optree.tree_flatten_with_path(state, none_is_leaf=True)
        for path, leaf in zip(paths, leaves, strict=True):
            owner = next((group_of[k] for k in path if isinstance(k, str) and k in group_of), None)
            if owner is not None:
                optimizer[owner] += _nbytes(leaf)
    # a group of low-precision weights gathers what their hooks choose: its first gather's bytes
    sent = {}
    for c in ledger.issued:
        if c.kind == "all_gather" and c.phase == "forward":
            sent.setdefault(c.group, c.out_bytes)
    out = []
    for g in plan.groups:
        compute = g.param_dtype or scheduled.param_dtype
        reduce = g.reduce_dtype or scheduled.reduce_dtype
        shard = gathered = grad = reduced = 0
        for p in g.params:
            t = params[p]
            own = t.dtype
            numel_local = math.prod(local_shapes[p])
            shard += _nbytes(t) if is_subclass(t._local_tensor) else numel_local * own.itemsize
            gathered += t.numel() * (compute or own).itemsize
            grad += numel_local * own.itemsize if t.requires_grad else 0
            reduced += t.numel() * (reduce or compute or own).itemsize if t.requires_grad else 0
        if any(is_subclass(params[p]._local_tensor) for p in g.params):
            gathered = sent.get(g.name, gathered)
        out.append(
            GroupCost(
                g.name,
                len(g.params),
                g.reshard_after_forward,
                g.recompute,
                shard,
                gathered,
                grad,
                reduced,
                optimizer[g.name],
                ledger.activations.get(g.name, 0),
                ledger.flops["forward"].get(g.name, 0),
                ledger.flops["backward"].get(g.name, 0),
            )
        )
    return tuple(out)


def _mesh_dims(mesh) -> dict[str, str]:
    """``{process group name: "name (n ranks)"}`` for each dim of ``mesh``."""
    names = mesh.mesh_dim_names or tuple(f"dim {i}" for i in range(mesh.ndim))
    out = {}
    for i in range(mesh.ndim):
        out[mesh.get_group(i).group_name] = f"{names[i]} ({mesh.size(i)} ranks)"
    return out


def _collectives(issued: list[_Issued], mesh) -> tuple[Collective, ...]:
    dims = _mesh_dims(mesh)
    counted: dict[tuple, int] = {}
    for c in issued:
        world = dist.get_world_size(c.pg) if c.pg is not None else 1
        name = c.pg.group_name if c.pg is not None else ""
        dim = dims.get(name, f"sub-group ({world} ranks)")
        full = c.out_bytes if c.kind == "all_gather" else c.in_bytes
        wire = full * (world - 1) // world * (2 if c.kind == "all_reduce" else 1)
        key = (c.kind, c.group, dim, c.phase, c.in_bytes, c.out_bytes, wire)
        counted[key] = counted.get(key, 0) + 1
    return tuple(Collective(*k, count=n) for k, n in counted.items())


# ---- measuring the machine -----------------------------------------------------------------
def _matmul_curve(dtype: torch.dtype, device: str) -> tuple[tuple[float, float], ...]:
    """``(flops, rate)`` of square matmuls of growing size in ``dtype``."""
    sizes = (64, 128, 256, 512) if device == "cpu" else (512, 1024, 2048, 4096)
    points = []
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        points.append((2.0 * n**3, 2.0 * n**3 / _seconds(lambda a=a: a @ a, 7)))
    return tuple(points)


# [Note: collectives on the cores that compute]
# A GPU's collectives run on engines of their own, beside the kernels: all of a prefetched
# gather can hide under compute. A CPU rank's gloo transfers run on worker threads that share
# the cores the ranks compute on, so only part of them does. On this project's 2-core machine
# (BENCHMARKS.md section 15), counting none of it hidden made the step times closest and
# counting all of it ranked plans worst (prefetch looked free); half is what measured CPU rates
# assume. Pass ``Hardware(..., overlap=...)`` for a host with cores to spare.
_CPU_OVERLAP = 0.5


def _host_costs(group: dist.ProcessGroup, rates: Hardware) -> tuple[float, float]:
    """The host's cost per operator and per plan step, from two tiny steps scheduled over
    ``group`` -- eight layers as eight groups, and as one -- timed, less what ``rates``
    predict for them without host costs: two equations in the two costs.

    [Note: the host's cost]
    On a small model the step's time is mostly the host's: Python in the modules, autograd
    and dispatch, per operator (``op_overhead_s``), and funcshard's own work per plan step:
    gathers issued and waited for, frees, stand-ins resolved, hooks (``step_overhead_s``). The
    second is what makes a plan of many groups slower than one of few on the same operators.
    Both are fitted to two tiny funcshard steps on the very process group, which differ mostly
    in their number of plan steps; each is timed by the median of several runs, so a rank that
    shares its cores is measured sharing them. Without a process group, the cost per operator
    is a tiny eager step's and plan steps cost nothing more. Collective: every rank of
    ``group`` runs the steps.
    """
    from torch.distributed.device_mesh import DeviceMesh

    from .._execution._autodiff import value_and_grad
    from .._execution._schedule import schedule
    from .._plans._grouping import by_type
    from .._plans._plan import plan
    from .._trees._extract import extract
    from ..transforms import shard

    device = rates.name.removeprefix("measured (").removesuffix(")")
    mesh = DeviceMesh.from_group(group, device)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(8))).to(device)
    params, _ = extract(model)
    sharded = shard(params, mesh)
    x = torch.randn(8, 16, device=device)
    bare = dataclasses.replace(rates, op_overhead_s=0.0, step_overhead_s=0.0)
    rows = []
    for policy in (by_type(torch.nn.Linear), None):
        apply = schedule(model, plan(model, policy))
        spent = _seconds(lambda a=apply: value_and_grad(lambda p: a(p, x).sum())(sharded), 9)
        e = explain(apply, sharded, x, hardware=bare)
        steps = sum(m.phase != "optimizer" for m in e.timeline)
        rows.append((e.operators, steps, spent - e.predicted_step_s))
    (o1, s1, t1), (o2, s2, t2) = rows
    per_step = max((t1 * o2 - t2 * o1) / (s1 * o2 - s2 * o1), 0.0)
    per_op = max((t2 - per_step * s2) / o2, rates.op_overhead_s)
    return per_op, per_step


def _host_s(device: str) -> float:
    """Host time per operator of a tiny eager training step (modules, autograd, dispatch:
    what a model's operator costs beyond its arithmetic): its time over its operators."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    net = net.to(device)
    x = torch.randn(4, 8, device=device)

    def step():
        net(x).sum().backward()

    with _Counting() as counted:
        step()
    return _seconds(step, repeat=20) / max(counted.operators, 1)


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.operators = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators += 1
        return func(*args, **(kwargs or {}))


def _seconds(fn: Callable[[], Any], repeat: int = 5) -> float:
    """The median of ``repeat`` timed calls after one warm-up (as the steps it predicts are
    measured: a machine whose cores are shared is measured shared)."""
    fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ---- the table -----------------------------------------------------------------------------
def _size(n: float) -> str:
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} TiB"


def _table(e: Explanation) -> str:
    lines = [
        f"Explanation: rank {e.rank} of {e.world}, {len(e.groups)} groups, "
        f"{e.operators} operators, {e.flops / 1e9:.3g} GFLOP",
        f"peak {_size(e.peak_bytes)} at {e.peak_at.phase} step {e.peak_at.index} "
        f"({e.peak_at.step.op} {e.peak_at.step.group or '<root>'}):",
    ]
    lines += [f"  {k:<20} {_size(v)}" for k, v in e.at_peak.items() if v]
    header = ("group", "shard", "gathered", "grad", "reduce", "optimizer", "activations", "GFLOP")
    rows = [
        (
            g.name or "<root>",
            _size(g.shard_bytes),
            _size(g.gathered_bytes),
            _size(g.grad_bytes),
            _size(g.reduce_bytes),
            _size(g.optimizer_bytes),
            _size(g.activation_bytes),
            f"{(g.forward_flops + g.backward_flops) / 1e9:.3g}",
        )
        for g in e.groups
    ]
    lines.append("groups:")
    lines += _columns([header, *rows])
    lines.append("collectives per step:")
    crow = [
        (c.kind, c.group or "<root>", c.mesh_dim, c.phase, str(c.count), _size(_full(c)))
        for c in e.collectives
    ]
    lines += _columns([("kind", "group", "mesh dim", "phase", "count", "full bytes"), *crow])
    lines.append(
        f"time ({e.hardware.name}): compute {e.compute_s * 1e3:.3f} ms, communication "
        f"{e.communication_s * 1e3:.3f} ms, exposed {e.exposed_communication_s * 1e3:.3f} ms; "
        f"predicted step {e.predicted_step_s * 1e3:.3f} ms"
    )
    return "\n".join(lines)


def _full(c: Collective) -> int:
    """The full size of a collective: an all-gather's output, a reduction's input."""
    return c.out_bytes if c.kind == "all_gather" else c.in_bytes


def _columns(rows) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
