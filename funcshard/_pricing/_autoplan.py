"""``autoplan``: the plan that :func:`~funcshard.explain` predicts fastest within a memory budget.

[Note: a pruned search over explained plans]
Every candidate is a real plan, scheduled and run once on fake tensors by ``explain`` (a tenth of
a second to a few seconds each), so the search stays small. It fixes one knob at a time, each at
the values the earlier stages chose:

1. grouping, at prefetch 1, reshard after forward, no recompute: each candidate policy (the
   given one; by default each module class that repeats in a ``ModuleList`` / ``Sequential``,
   and the whole model as one group), and each merged with ``merge_groups`` at 2 and 4 times its
   largest group. Each grouping is also explained with every group recomputing, so that a
   grouping that fits only with recompute is not lost. The best two go on.
2. reshard after forward x which groups recompute (none, every 4th, every 2nd, all), at
   prefetch 1, for those groupings.
3. forward x backward prefetch depth (0, 1, 2 each) for the best of stage 2.

The objective is explain's ``predicted_step_s`` among plans whose ``peak_bytes`` is within the
budget; among plans predicted within 3% of the fastest, the one with the fewest plan steps (see
[Note: plans the model cannot tell apart]). Plans the scheduler refuses (a merged group cannot
recompute: its members are not one module) are skipped. When nothing fits, the smallest-memory
plan there is -- the finest grouping, everything recomputed, no prefetch -- is explained too, so
the error can name the smallest budget that fits.

[Note: one plan on every rank]
Each rank's explanation is its own (uneven shards, measured rates), so ranks could choose
differently, and different plans hang. On a real multi-rank process group, rank 0's result is
broadcast -- its error too, so that no rank raises while another waits: ``autoplan`` is then
collective.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn

from .._execution._schedule import schedule
from .._plans._bucketing import merge_groups
from .._plans._grouping import Policy, by_type
from .._plans._plan import Plan, plan
from .._trees._extract import extract
from ..transforms import shard
from . import _explain
from ._explain import Explanation, Hardware

# Reshard-after-forward values tried in stage 2. An int form (reshard to a smaller mesh after
# forward) slots in here as further values once ``plan`` accepts it.
RESHARD_CHOICES: tuple[bool | int, ...] = (True, False)
# Recompute selections tried in stage 2 (see Plan.with_recompute): none, every 4th, every 2nd, all.
RECOMPUTE_CHOICES: tuple[bool | int, ...] = (False, 4, 2, True)
PREFETCH_CHOICES: tuple[int, ...] = (0, 1, 2)
MERGE_FACTORS: tuple[int, ...] = (2, 4)


@dataclasses.dataclass(frozen=True)
class Tried:
    """One explained candidate: ``description`` (its grouping and settings), the ``plan``,
    explain's ``peak_bytes`` and ``predicted_step_s``, and whether it ``fits`` the budget."""

    description: str
    plan: Plan
    peak_bytes: int
    predicted_step_s: float
    fits: bool


@dataclasses.dataclass(frozen=True)
class Autoplanned:
    """What :func:`autoplan` chose and why: the ``plan``, its ``explanation``, the
    ``memory_budget`` and every candidate ``tried`` (in the order explained). Print it for a
    table of the candidates."""

    plan: Plan
    explanation: Explanation
    memory_budget: int
    tried: tuple[Tried, ...]

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:9.2f} MiB"
        lines = [
            f"autoplan: {len(self.tried)} plans explained, budget {mib(self.memory_budget)}",
            f"chosen: {self._describe(self.plan)}: peak {mib(self.explanation.peak_bytes)}, "
            f"predicted step {self.explanation.predicted_step_s * 1e3:.3f} ms",
            f"  {'peak':>13}  {'step ms':>9}  fits  plan",
        ]
        for t in self.tried:
            mark = "*" if t.plan == self.plan else " "
            lines.append(
                f"{mark} {mib(t.peak_bytes)}  {t.predicted_step_s * 1e3:9.3f}  "
                f"{'yes ' if t.fits else 'no  '}  {t.description}"
            )
        return "\n".join(lines)

    def _describe(self, p: Plan) -> str:
        return next((t.description for t in self.tried if t.plan == p), "?")


@overload
def autoplan(
    module: nn.Module,
    mesh: Any,
    *args: Any,
    memory_budget: int,
    explain: Literal[False] = False,
    **options: Any,
) -> Plan: ...
@overload
def autoplan(
    module: nn.Module,
    mesh: Any,
    *args: Any,
    memory_budget: int,
    explain: Literal[True],
    **options: Any,
) -> Autoplanned: ...
def autoplan(
    module: nn.Module,
    mesh: Any,
    *args: Any,
    memory_budget: int,
    optimizer: Any = None,
    policy: Policy | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    loss: Callable[..., torch.Tensor] | None = None,
    hardware: Hardware | None = None,
    explain: bool = False,
    **kwargs: Any,
) -> Plan | Autoplanned:
    """The plan predicted fastest whose predicted peak memory is within ``memory_budget``.

    Searches grouping, prefetch depths, reshard after forward and which groups recompute (see
    [Note: a pruned search over explained plans]), scoring each candidate with
    :func:`~funcshard.explain` on this rank's shards. Returns an ordinary :class:`Plan`: schedule
    it with ``fs.schedule(module, plan, param_dtype=..., reduce_dtype=...)`` (its groups also
    carry the dtypes).

    Args:
        module: the model, real or on the meta device (only shapes are read: the parameters
            are sharded on meta).
        mesh: the data-parallel mesh the parameters will be sharded over (:func:`~funcshard.shard`'s
            default placements), real or over a fake process group.
        args / kwargs: one step's inputs for this rank (real, meta or fake tensors).
        memory_budget: bytes one rank may hold at its peak (explain's ``peak_bytes``: parameters,
            optimizer state, gathered parameters, gradients, activations, temporaries, inputs).
        optimizer: an ``fs.optim`` transformation (its state counts).
        policy: the grouping to use; default: search (each module class repeated in a
            ``ModuleList`` / ``Sequential``, and one group).
        param_dtype / reduce_dtype: mixed precision, set on every group of the plan.
        loss: ``loss(output, *args) -> scalar``, as in :func:`~funcshard.explain`.
        hardware: the rates; default :meth:`Hardware.measure` over the mesh's last dim (its
            link, and funcshard's host cost per operator on it), measured once.
        explain: return an :class:`Autoplanned` (plan, explanation, every candidate tried)
            instead of the plan alone.

    Collective on a real process group of several ranks: every rank calls it and gets rank 0's
    choice (see [Note: one plan on every rank]).

    Raises:
        ValueError: ``memory_budget`` is not a positive int; no plan fits (the message names the
            smallest peak seen, the plan that had it, and what to change).
    """
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(
            f"fs.autoplan: memory_budget must be a positive int of bytes, got {memory_budget!r}."
        )
    hardware = hardware or Hardware.measure(mesh.get_group(mesh.ndim - 1), device=mesh.device_type)
    search = _Search(
        module,
        mesh,
        args,
        kwargs,
        memory_budget,
        optimizer,
        param_dtype,
        reduce_dtype,
        loss,
        hardware,
    )
    try:
        outcome: Autoplanned | str = search.run(policy)
    except ValueError as error:
        outcome = str(error)
    result = _broadcast(outcome)
    if isinstance(result, str):
        raise ValueError(result)
    return result if explain else result.plan


# ---- the search ----------------------------------------------------------------------------
class _Search:
    """Explains candidates and keeps every result (see [Note: a pruned search ...])."""

    def __init__(
        self, module, mesh, args, kwargs, budget, optimizer, param_dtype, reduce_dtype, loss, hw
    ):
        self.module, self.args, self.kwargs, self.budget = module, args, kwargs, budget
        self.optimizer, self.loss, self.hardware = optimizer, loss, hw
        self.dtypes = param_dtype, reduce_dtype
        params, buffers = extract(module)
        self.meta = {k: _on_meta(v) for k, v in params.items()}
        self.buffers = {k: _on_meta(v) for k, v in buffers.items()}
        self.sharded = shard(self.meta, mesh)
        self.tried: list[Tried] = []
        self.explained: dict[Plan, Explanation] = {}
        self.refused: list[ValueError] = []

    def run(self, policy: Policy | None) -> Autoplanned:
        groupings = self.groupings(policy)
        # stage 1: grouping
        scored = []
        for name, base in groupings:
            plain = self.score(name, base)
            recomputing = self.score(name, self.variant(base, reshard=True, recompute=True))
            scored.append((min(_key(plain), _key(recomputing)), name, base))
        scored.sort(key=lambda s: s[0])
        # stage 2: reshard x recompute, for the best two groupings
        for _, name, base in scored[:2]:
            for reshard in RESHARD_CHOICES:
                for which in RECOMPUTE_CHOICES:
                    self.score(name, self.variant(base, reshard=reshard, recompute=which))
        # stage 3: prefetch depths around the best so far
        best = self.best()
        if best is not None:
            name, _ = best.description.split(" | ", 1)
            for f in PREFETCH_CHOICES:
                for b in PREFETCH_CHOICES:
                    self.score(name, best.plan.replace(prefetch=f, backward_prefetch=b))
        best = self.best()
        if best is None:
            finest = max(groupings, key=lambda g: len(g[1].groups))
            low = self.variant(finest[1], reshard=True, recompute=True)
            self.score(finest[0], low.replace(prefetch=0, backward_prefetch=0))
            best = self.best()
        if best is None:
            raise ValueError(self.nothing_fits())
        return Autoplanned(best.plan, self.explained[best.plan], self.budget, tuple(self.tried))

    def groupings(self, policy: Policy | None) -> list[tuple[str, Plan]]:
        """``(name, plan)`` of each candidate grouping, at prefetch 1, no recompute."""
        policies: list[tuple[str, Policy | None]]
        if policy is not None:
            policies = [("given policy", policy)]
        else:
            policies = [(f"by_type({c.__name__})", by_type(c)) for c in _repeated(self.module)]
            policies.append(("one group", None))
        out: dict[Plan, str] = {}
        for name, pol in policies:
            base = self.plan(pol)
            out.setdefault(base, name)
            sizes = _group_bytes(base, self.meta, self.dtypes[0])
            blocks = [sizes[g.name] for g in base.groups if g.name]
            if len(blocks) < 3 or not self.mergeable(base):
                continue
            for factor in MERGE_FACTORS:
                budget = factor * max(blocks)
                merged = self.with_dtypes(
                    merge_groups(base, self.meta, budget, param_dtype=self.dtypes[0])
                )
                if len(merged.groups) < len(base.groups):
                    out.setdefault(merged, f"{name} merged to {_mib(budget)}")
        return [(name, p) for p, name in out.items()]

    def plan(self, pol: Policy | None) -> Plan:
        param_dtype, reduce_dtype = self.dtypes
        return plan(self.module, pol, param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def mergeable(self, p: Plan) -> bool:
        """``merge_groups`` makes merged groups without dtypes: merge only plans whose groups
        all have the plan-wide ones (not BatchNorm's float32 groups), then set them again."""
        return all((g.param_dtype, g.reduce_dtype) == self.dtypes for g in p.groups)

    def with_dtypes(self, p: Plan) -> Plan:
        param_dtype, reduce_dtype = self.dtypes
        groups = tuple(
            dataclasses.replace(g, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            for g in p.groups
        )
        return p.replace(groups=groups)

    def variant(self, base: Plan, *, reshard: bool | int, recompute: bool | int) -> Plan:
        groups = tuple(
            dataclasses.replace(g, reshard_after_forward=reshard if g.name else False)
            for g in base.groups
        )
        p = base.replace(groups=groups)
        eligible = [g.name for g in p.groups if _is_module_group(self.module, g.name)]
        chosen = _recompute_subset(p, recompute, eligible)
        return p.with_recompute(chosen)

    def score(self, name: str, p: Plan) -> Tried | None:
        """Explain ``p`` (once) and record it; ``None`` if the scheduler or the step refuses
        it with a ValueError (kept in ``refused``: raised if no plan could be explained)."""
        if p in self.explained:
            return next(t for t in self.tried if t.plan == p)
        param_dtype, reduce_dtype = self.dtypes
        try:
            apply = schedule(self.module, p, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            e = _explain.explain(
                apply,
                self.sharded,
                *self.args,
                optimizer=self.optimizer,
                buffers=self.buffers,
                loss=self.loss,
                hardware=self.hardware,
                **self.kwargs,
            )
        except ValueError as error:
            self.refused.append(error)
            return None
        self.explained[p] = e
        t = Tried(_description(name, p), p, e.peak_bytes, e.predicted_step_s, e.fits(self.budget))
        self.tried.append(t)
        return t

    def best(self) -> Tried | None:
        """The fitting plan predicted fastest; among those within ``RESOLUTION`` of it, the one
        with the fewest plan steps (see [Note: plans the model cannot tell apart])."""
        fitting = [t for t in self.tried if t.fits]
        if not fitting:
            return None
        fastest = min(t.predicted_step_s for t in fitting)
        close = [t for t in fitting if t.predicted_step_s <= fastest * (1 + RESOLUTION)]
        return min(close, key=lambda t: (_steps(t.plan), t.predicted_step_s, t.peak_bytes))

    def nothing_fits(self) -> str:
        if not self.tried:  # every candidate failed: the first failure, as explain raised it
            error = self.refused[0]
            raise error
        low = min(self.tried, key=lambda t: t.peak_bytes)
        return (
            f"fs.autoplan: no plan fits memory_budget={self.budget} bytes "
            f"({_mib(self.budget)}); the smallest peak of the {len(self.tried)} plans explained "
            f"is {low.peak_bytes} bytes ({_mib(low.peak_bytes)}), for {low.description}. Pass "
            f"memory_budget >= {low.peak_bytes}, or need less: a smaller batch, a low-precision "
            "param_dtype, a larger mesh, or an optimizer with less state."
        )


# [Note: plans the model cannot tell apart]
# Explain's times are a model: its error is similar across plans of one model, but not zero,
# and measuring the rates moves them a little from run to run. Plans predicted within a few
# percent of the fastest are not told apart by it; of those, autoplan takes the one with the
# fewest plan steps -- fewer groups, gathers and frees: the least host work, which is the part
# of a step the model knows least, and the simplest plan to read.
RESOLUTION = 0.03


def _steps(p: Plan) -> int:
    return len(p.forward) + len(p.backward)


def _key(t: Tried | None) -> tuple[int, float, int]:
    """Sort key of a grouping: fitting first, then by predicted time, then by peak."""
    if t is None:
        return (1, float("inf"), 0)
    return (0 if t.fits else 1, t.predicted_step_s if t.fits else t.peak_bytes, t.peak_bytes)


def _description(name: str, p: Plan) -> str:
    blocks = [g for g in p.groups if g.name]
    recomputing = sum(g.recompute for g in p.groups)
    reshard = {g.reshard_after_forward for g in blocks} or {False}
    return (
        f"{name} | {len(p.groups)} groups, prefetch {p.prefetch}/{p.backward_prefetch}, "
        f"reshard {'/'.join(map(str, sorted(reshard, key=str)))}, "
        f"recompute {recomputing}/{len(blocks)}"
    )


# ---- helpers -------------------------------------------------------------------------------
def _on_meta(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta":
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return out.requires_grad_(t.requires_grad)


def _repeated(module: nn.Module) -> list[type[nn.Module]]:
    """Classes with parameters that appear twice or more among the children of a
    ``ModuleList`` / ``Sequential`` of ``module``, outermost first, leaving out those found only
    inside another such class (a block's ``Sequential`` of ``Linear`` layers: finer groups cost
    the scheduler's per-group host time, which explain does not count)."""
    found: list[type[nn.Module]] = []

    def walk(m: nn.Module, inside: bool) -> None:
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and not inside:
            counts = Counter(type(c) for c in m.children() if any(True for _ in c.parameters()))
            found.extend(c for c, n in counts.items() if n >= 2 and c not in found)
        for c in m.children():
            walk(c, inside or type(c) in found)

    walk(module, False)
    return found


def _group_bytes(p: Plan, meta: dict[str, torch.Tensor], dtype: torch.dtype | None):
    size = lambda t: t.numel() * ((dtype or t.dtype) if t.is_floating_point() else t.dtype).itemsize
    return {g.name: sum(size(meta[f]) for f in g.params) for g in p.groups}


def _is_module_group(module: nn.Module, name: str) -> bool:
    """A group that can recompute: a submodule (merged groups are not; nor the root)."""
    if not name:
        return False
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _recompute_subset(p: Plan, which: bool | int, eligible: Sequence[str]) -> list[str]:
    """The groups of ``eligible`` that ``which`` selects, in forward order (as
    :meth:`Plan.with_recompute`, over the eligible groups only)."""
    order = [n for n in dict.fromkeys(p.order) if n in eligible]
    if which is False:
        return []
    if which is True:
        return order
    return order[which - 1 :: which]


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def _broadcast(result: Autoplanned | str) -> Autoplanned | str:
    """Rank 0's result (or its error message) on every rank of a real multi-rank group (see
    [Note: one plan on every rank])."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return result
    box = [result]
    dist.broadcast_object_list(box, src=0)
    return box[0]
