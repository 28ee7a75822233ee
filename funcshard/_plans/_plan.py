"""The schedule, as data: which group is gathered, waited for, computed and freed when.

This file is the whole schedule. :func:`plan` picks the groups and the forward order;
``Plan.__post_init__`` turns them into the exact list of steps of a training step
(``_plan_steps``); ``_schedule.py`` only *follows* that list.

[Note: the order is written down, not discovered]
FSDP2 prefetches backward "naively using the reverse post-forward order, which may have
mistargeted prefetches" (``_fsdp_param_group.py``). Here the forward order is explicit:
given, recorded once from a dry run on meta tensors or from one real forward over the shards, or
the depth-first module order. It is a list of *runs*: a group may appear several times (a root
whose embedding is used first and its head last, a parent whose layers run between its
children's). A group is freed after its last run.

[Note: the root group]
As FSDP2, the root group (named ``""``) is not resharded after forward: it stays unsharded from
the start of forward to the end of backward, so it is gathered once per step even when used
both first and last (a tied embedding/head). ``Plan.groups`` holds a per-group flag; edit it with
:meth:`Plan.replace` if you want otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ._grouping import Policy, any_of, by_type, group
from ._plan_meshes import meshes_of
from ._record import record_order

OPS = ("all_gather", "wait", "forward", "free", "reshard", "backward", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a training step: ``op`` (one of ``OPS``) applied to group ``group``."""

    op: str
    group: str

    def __str__(self) -> str:
        return f"{self.op:<15}{self.group or '<root>'}"


@dataclasses.dataclass(frozen=True)
class Group:
    """A parameter group: its name (the module fqn, ``""`` for the root) and parameters.

    ``param_dtype`` / ``reduce_dtype``: this group's mixed precision (as in
    :func:`~funcshard.unshard`); ``None`` takes the value given to :func:`~funcshard.schedule`.
    ``recompute``: the group's module (``module.get_submodule(name)``) keeps no activations in
    forward and recomputes its forward in backward (activation checkpointing; see
    [Note: recompute as part of the plan]). Not for the root group ``""``.
    ``reshard_after_forward``: what the group keeps after its last forward run, as FSDP2's
    ``fully_shard`` argument: ``True`` its shards only (the full tensors are freed and gathered
    again in backward, plan step ``free``); ``False`` its full tensors, until its backward ends
    (no step); an int ``N``: a ``1/N`` slice of them, so that backward gathers them again within
    a sub-group of ``N`` ranks only (plan step ``reshard``; see [Note: reshard to a smaller
    mesh]). ``N`` must divide the size of the group's sharded mesh dim (checked by
    :func:`~funcshard.schedule`); ``N == 1`` is ``False``, ``N`` equal to that size is ``True``.
    ``meshes``: how the group's parameters are communicated, as ``(label, params)`` pairs, one
    per mesh (and kind of placement): ``("gathered over dp(4)", ("w", "b"))``, ``("gathered
    over efsdp(2), expert parallel over ep(2) (mean over 4)", ("experts.w1",))``. Filled by
    :meth:`Plan.with_meshes` (or ``plan(..., sharded=)``); ``()``: not known. Descriptive (the
    collectives follow the shards themselves), so plans that differ only here compare equal.
    """

    name: str
    params: tuple[str, ...]
    reshard_after_forward: bool | int = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    recompute: bool = False
    meshes: tuple[tuple[str, tuple[str, ...]], ...] = dataclasses.field(default=(), compare=False)


@dataclasses.dataclass(frozen=True)
class Plan:
    """An explicit, editable schedule. Compare with ``==``, print it, save it as JSON.

    ``order`` is the forward order of group *runs* (names may repeat); ``backward_order`` is the
    backward order (default: ``order`` reversed). ``forward`` and ``backward`` are the steps,
    derived from the other fields: change those with :meth:`replace` to get a new plan.
    ``per_rank_skips``: whether ranks' forwards may skip different runs of the plan (a layer
    drop drawn on each rank). Either way every rank issues the plan's collectives, and a rank
    that skips a run reduces zero gradients for it; by default ranks whose forwards skipped
    different runs raise at their next call (see [Note: the collectives follow the plan] in
    ``_execution/_deviation``).
    """

    groups: tuple[Group, ...]
    order: tuple[str, ...]
    backward_order: tuple[str, ...] | None = None
    prefetch: int = 1
    backward_prefetch: int = 1
    per_rank_skips: bool = False
    forward: tuple[Step, ...] = dataclasses.field(init=False)
    backward: tuple[Step, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("groups", tuple(self.groups))
        set_("order", tuple(self.order))
        set_("backward_order", tuple(self.backward_order or reversed(self.order)))
        _validate(self)
        after = {g.name: after_forward(g.reshard_after_forward) for g in self.groups}
        forward = _plan_steps(self.order, self.prefetch, (), "forward", after.__getitem__)
        # a group is unsharded at the start of backward if it was never freed in forward
        kept = set(after) - {s.group for s in forward if s.op in _RELEASES}
        backward = _plan_steps(
            self.backward_order,
            self.backward_prefetch,
            kept,
            "backward",
            lambda g: ("reduce_scatter", "free"),
        )
        set_("forward", tuple(forward))
        set_("backward", tuple(backward))

    def replace(self, **changes: Any) -> Plan:
        """A new plan with some fields changed (``order``, ``prefetch``, ``groups``, ...)."""
        if "order" in changes and "backward_order" not in changes:
            changes["backward_order"] = None
        return dataclasses.replace(self, **changes)

    def with_recompute(self, which: bool | int | Iterable[str]) -> Plan:
        """A new plan where exactly the groups ``which`` selects recompute their forward in
        backward (the others do not); see [Note: recompute as part of the plan].

        ``which``: ``True`` every group but the root; ``False`` / ``None`` none; an int ``k >= 1``
        every k-th group in forward order, the root left out (the k-th, 2k-th, ...: ``2`` is
        every other block, as torchtitan's ``selective_ac_option``); an iterable of group
        names: those ("selective").

        Raises:
            ValueError: ``k < 1``; a name that is not a group, or the root group ``""``.
        """
        chosen = _recompute_names(self, which)
        return self.replace(
            groups=tuple(dataclasses.replace(g, recompute=g.name in chosen) for g in self.groups)
        )

    def with_meshes(self, sharded: Mapping[str, Any]) -> Plan:
        """A new plan whose groups say on which mesh dims each parameter is gathered and reduced
        (:attr:`Group.meshes`, printed under each group): ``sharded`` is the ``{fqn: DTensor}``
        dict of :func:`~funcshard.shard` (LocalShards too). The same on every rank.

        Raises:
            ValueError: a parameter of the groups is missing from ``sharded``.
            TypeError: one is not a shard.
        """
        found = meshes_of(self.groups, sharded)
        return self.replace(
            groups=tuple(dataclasses.replace(g, meshes=found[g.name]) for g in self.groups)
        )

    def group_of(self) -> dict[str, str]:
        """``{parameter fqn: group name}``."""
        return {p: g.name for g in self.groups for p in g.params}

    def to_json(self) -> str:
        return json.dumps(
            {
                "groups": [_group_json(g) for g in self.groups],
                "order": list(self.order),
                "backward_order": list(self.backward_order),
                "prefetch": self.prefetch,
                "backward_prefetch": self.backward_prefetch,
                "per_rank_skips": self.per_rank_skips,
                "forward": [[s.op, s.group] for s in self.forward],
                "backward": [[s.op, s.group] for s in self.backward],
            },
            indent=1,
        )

    @staticmethod
    def from_json(text: str) -> Plan:
        """The plan saved by :meth:`to_json`.

        Raises:
            ValueError: the saved steps are not the ones its fields produce (steps are derived:
                edit ``order`` / ``prefetch`` / ``groups`` instead); a field is missing.
        """
        d = json.loads(text)
        _fields(
            d, "the plan", ("groups", "order", "backward_order", "prefetch", "backward_prefetch")
        )
        plan = Plan(
            groups=tuple(_group_from_json(g) for g in d["groups"]),
            order=tuple(d["order"]),
            backward_order=tuple(d["backward_order"]),
            prefetch=d["prefetch"],
            backward_prefetch=d["backward_prefetch"],
            per_rank_skips=d.get("per_rank_skips", False),
        )
        for name in ("forward", "backward"):
            if name in d and [[s.op, s.group] for s in getattr(plan, name)] != d[name]:
                raise ValueError(
                    f"Plan.from_json: the saved {name} steps differ from those its order, "
                    "prefetch and groups produce. Steps are derived: edit those fields instead."
                )
        return plan

    def __str__(self) -> str:
        lines = [
            f"Plan: {len(self.groups)} groups, prefetch={self.prefetch}, "
            f"backward_prefetch={self.backward_prefetch}"
            + (", per_rank_skips=True" if self.per_rank_skips else ""),
            "groups:",
        ]
        width = max((len(g.name or "<root>") for g in self.groups), default=6)
        for g in self.groups:
            notes = [n for n in (_after_forward_note(g.reshard_after_forward),) if n]
            notes += [f"{k} {str(v).removeprefix('torch.')}" for k, v in _dtypes(g) if v]
            notes += ["recomputed in backward"] if g.recompute else []
            extra = f"  ({', '.join(notes)})" if notes else ""
            lines.append(f"  {g.name or '<root>':<{width}}  {len(g.params)} params{extra}")
            lines.extend(f"      {label}: {', '.join(params)}" for label, params in g.meshes)
        lines.append("order: " + " -> ".join(n or "<root>" for n in self.order))
        for title, steps in (("forward", self.forward), ("backward", self.backward)):
            lines.append(f"{title}:")
            lines.extend(f"  {i:3d}  {s}" for i, s in enumerate(steps))
        return "\n".join(lines)


def plan(
    module: nn.Module,
    policy: Policy | None = None,
    *,
    prefetch: int = 1,
    backward_prefetch: int = 1,
    reshard_after_forward: bool | int = True,
    order: Sequence[str] | None = None,
    backward_order: Sequence[str] | None = None,
    example_args: Any = None,
    example_kwargs: dict[str, Any] | None = None,
    sharded: Mapping[str, Any] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    ignored: Iterable[Any] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    recompute: bool | int | Iterable[str] | None = None,
    per_rank_skips: bool = False,
) -> Plan:
    """The plan for ``module``: groups from :func:`~funcshard.group`, and their order.

    Args:
        module: the root module. Its parameters may already be on meta: built there, or moved
            there after :func:`~funcshard.extract` (which records the ties the move breaks).
        policy: grouping policy (``None``: one group, the root).
        prefetch: forward all-gathers in flight ahead of the group computing (``0``: none).
        backward_prefetch: the same for the re-gathers in backward.
        reshard_after_forward: free each group's unsharded parameters after its last forward use
            and gather them again for backward (the root group excepted, see [Note: the root
            group]); ``False`` keeps them until the group's backward ends; an int ``N`` keeps a
            ``1/N`` slice, gathered again in backward within sub-groups of ``N`` ranks (see
            :class:`Group`).
        order: the forward order of group names (repeats allowed). Default: recorded from
            ``example_args`` if given, else the depth-first module order (a group containing
            other groups runs again after them).
        backward_order: default ``order`` reversed.
        example_args / example_kwargs: inputs for a dry run on the meta device that records the
            order in which groups are used; no compute, no communication.
        sharded / buffers: record the order from one real forward on ``example_args`` instead,
            over these shards (the ``{fqn: DTensor}`` dict of :func:`~funcshard.shard`, ignored
            parameters as plain tensors) and buffers: for a forward that cannot run on meta
            (``.item()``, data-dependent code). Collective: call it on every rank. No grad, no
            effect on the RNG or the buffers. The plan's groups also show the shards' meshes
            (see :meth:`Plan.with_meshes`).
        ignored: parameters/modules left out of every group (see :func:`~funcshard.group`).
        param_dtype / reduce_dtype: every group's mixed precision (see :class:`Group`), except
            that with a low-precision ``param_dtype`` each BatchNorm module becomes a group of its
            own in float32, with a warning (see [Note: BatchNorm stays in full precision]).
        recompute: which groups recompute their forward in backward (activation
            checkpointing): ``True`` all but the root, an int ``k`` every k-th, or a list of
            group names; see :meth:`Plan.with_recompute`. Default: none.
        per_rank_skips: the ranks' forwards may skip different runs of groups (a layer drop
            drawn on each rank, as DDP's ``find_unused_parameters``); by default ranks whose
            forwards skipped different runs raise a ``RuntimeError`` at their next call (see
            :class:`Plan`).

    Groups without parameters are dropped.

    Raises:
        ValueError: ``order`` names an unknown group; negative prefetch; ``sharded`` without
            example inputs, or lacking a parameter of the groups; ranks whose real forwards used
            the groups in different orders (on every rank); ``recompute`` names an unknown group
            or the root.
        RuntimeError: the dry run failed on meta tensors (pass ``sharded=`` or ``order=``).
    """
    recorded = example_args is not None or example_kwargs is not None
    if sharded is not None and (order is not None or not recorded):
        raise ValueError(
            "plan: sharded= is for recording the order from a real forward: pass the inputs as "
            "example_args= / example_kwargs=, and no order=."
        )
    policy, full_precision = _batchnorm_rule(module, policy, param_dtype)
    groups = []
    for name, params in group(module, policy, ignored).items():
        if params:
            dtypes = (torch.float32,) * 2 if name in full_precision else (param_dtype, reduce_dtype)
            reshard = reshard_after_forward if name != "" else False
            groups.append(Group(name, tuple(params), reshard, *dtypes))
    if full_precision:
        names = [n for n in full_precision if any(g.name == n for g in groups)]
        warnings.warn(
            f"plan: BatchNorm modules {names} get groups of their own in float32 "
            f"(param_dtype={param_dtype} is not supported by BatchNorm's kernels, which take "
            "low-precision inputs with float32 parameters). Edit plan.groups to change it.",
            stacklevel=2,
        )
    if order is None:
        if recorded:
            order = record_order(
                module, groups, example_args, example_kwargs, sharded=sharded, buffers=buffers
            )
        else:
            order = _depth_first_order(module, [g.name for g in groups])
    made = Plan(
        tuple(groups), tuple(order), backward_order, prefetch, backward_prefetch, per_rank_skips
    )
    made = made if sharded is None else made.with_meshes(sharded)
    return made if recompute is None else made.with_recompute(recompute)


def _recompute_names(p: Plan, which: bool | int | Iterable[str] | None) -> set[str]:
    """The group names ``which`` selects (see :meth:`Plan.with_recompute`). Activation
    checkpointing is a per-group field of the plan, printed, saved and edited like the rest; how
    it runs is [Note: recompute as part of the plan] in ``_recompute.py``."""
    if which is None or which is False:
        return set()
    blocks = [n for n in dict.fromkeys(p.order) if n != ""]
    blocks += [g.name for g in p.groups if g.name and g.name not in blocks]
    if which is True:
        return set(blocks)
    if isinstance(which, int):
        if which < 1:
            raise ValueError(
                f"Plan.with_recompute: an int selects every k-th group and must be >= 1, got "
                f"{which}; pass False for none."
            )
        return set(blocks[which - 1 :: which])
    if isinstance(which, str):
        which = [which]
    names = list(which)
    if "" in names:
        raise ValueError(_ROOT_RECOMPUTES)
    unknown = sorted(set(names) - {g.name for g in p.groups})
    if unknown:
        raise ValueError(
            f"Plan.with_recompute: {unknown} are not groups of the plan; groups are "
            f"{[g.name for g in p.groups]}."
        )
    return set(names)


_ROOT_RECOMPUTES = (
    "Plan: the root group '' cannot recompute its forward in backward (its module is the whole "
    "model, which schedule runs itself); recompute the groups inside it (e.g. recompute=True "
    "selects every group but the root), or give the root's modules groups of their own."
)


def _batchnorm_rule(module, policy, param_dtype) -> tuple[Policy | None, list[str]]:
    """The policy with each BatchNorm module a group, and those modules' names, when
    ``param_dtype`` is a low precision; else ``(policy, [])``.

    [Note: BatchNorm stays in full precision]
    FSDP1 (``MixedPrecision._module_classes_to_ignore``) wraps each BatchNorm module in its own
    unit in full precision, because BatchNorm's kernels reject low-precision parameters; they do
    accept low-precision *inputs* with float32 parameters (the output keeps the input's dtype),
    so no cast is needed around them. The rule is written into the plan (per-group dtypes), where
    it can be read and edited.
    """
    if param_dtype is None or param_dtype.itemsize >= 4:
        return policy, []
    names = [n for n, m in module.named_modules() if isinstance(m, _BatchNorm)]
    if not names:
        return policy, []
    rule = by_type(_BatchNorm)
    return (rule if policy is None else any_of(policy, rule)), names


def _dtypes(g: Group) -> tuple[tuple[str, torch.dtype | None], ...]:
    return (("param_dtype", g.param_dtype), ("reduce_dtype", g.reduce_dtype))


def _group_json(g: Group) -> dict[str, Any]:
    d = dataclasses.asdict(g)
    d.update({k: None if v is None else str(v).removeprefix("torch.") for k, v in _dtypes(g)})
    return d


def _fields(d: Any, what: str, names: tuple[str, ...]) -> None:
    missing = [n for n in names if not isinstance(d, dict) or n not in d]
    if missing:
        raise ValueError(
            f"Plan.from_json: {what} lacks the field(s) {missing}; pass the text that "
            "Plan.to_json wrote (unedited fields included)."
        )


def _group_from_json(d: dict[str, Any]) -> Group:
    _fields(
        d,
        f"group {d.get('name') if isinstance(d, dict) else d!r}",
        ("name", "params", "reshard_after_forward"),
    )
    dtype = lambda name: None if name is None else getattr(torch, name)
    return Group(
        d["name"],
        tuple(d["params"]),
        d["reshard_after_forward"],
        dtype(d.get("param_dtype")),
        dtype(d.get("reduce_dtype")),
        d.get("recompute", False),  # absent in plans saved before recompute existed
        tuple((label, tuple(params)) for label, params in d.get("meshes", ())),
    )


def _depth_first_order(module: nn.Module, names: Sequence[str]) -> list[str]:
    """Groups in ``named_modules()`` order; a group runs again after the groups inside it."""
    wanted, runs, open_ = set(names), [], []
    for fqn, _ in module.named_modules():
        if fqn not in wanted:
            continue
        while open_ and not _contains(open_[-1], fqn):
            _close(open_.pop(), runs)
        runs.append(fqn)
        open_.append(fqn)
    while open_:
        _close(open_.pop(), runs)
    return runs


def _contains(outer: str, inner: str) -> bool:
    return outer == "" or inner.startswith(outer + ".")


def _close(name: str, runs: list[str]) -> None:
    if runs[-1] != name:
        runs.append(name)


def _upcoming(order, i, count) -> list[str]:
    """The ``count`` distinct groups that run next after run ``i`` (its own group excluded)."""
    out: list[str] = []
    for g in order[i + 1 :]:
        if len(out) == count:
            break
        if g != order[i] and g not in out:
            out.append(g)
    return out


def _plan_steps(order, prefetch, resident, compute, after_last) -> list[Step]:
    """Walk the runs of ``order``: gather a group before its run (``prefetch`` groups ahead),
    ``compute`` it, and after its last run append ``after_last(group)`` steps.

    ``resident`` groups start unsharded. See [Note: the order is written down, not discovered].
    """
    steps, resident, pending = [], set(resident), set()
    last = {g: i for i, g in enumerate(order)}
    for i, g in enumerate(order):
        if g not in resident | pending:
            steps.append(Step("all_gather", g))
            pending.add(g)
        if g in pending:
            steps.append(Step("wait", g))
            pending.remove(g)
            resident.add(g)
        for h in _upcoming(order, i, prefetch):
            if h not in resident | pending:
                steps.append(Step("all_gather", h))
                pending.add(h)
        steps.append(Step(compute, g))
        if i == last[g]:
            for op in after_last(g):
                steps.append(Step(op, g))
            if any(op in _RELEASES for op in after_last(g)):
                resident.remove(g)
    return steps


_RELEASES = ("free", "reshard")  # forward steps after which a group is no longer unsharded


def after_forward(value: bool | int) -> tuple[str, ...]:
    """The plan steps after a group's last forward run, for its ``reshard_after_forward``:
    ``("free",)``, ``("reshard",)`` (an int ``N >= 2``) or ``()`` (kept unsharded)."""
    if value is True:
        return ("free",)
    if value is False or value == 1:
        return ()
    return ("reshard",)


def post_forward_ranks(value: bool | int) -> int | None:
    """``N`` for ``reshard_after_forward=N >= 2`` (a group resharded to a smaller mesh), else
    ``None``."""
    return value if after_forward(value) == ("reshard",) else None  # type: ignore[return-value]


def _after_forward_note(value: bool | int) -> str:
    if value is True:
        return ""
    if not after_forward(value):
        return "kept unsharded after forward"
    return f"resharded to {value} ranks after forward"


def _validate(p: Plan) -> None:
    names = [g.name for g in p.groups]
    for g in p.groups:
        v = g.reshard_after_forward
        if not (isinstance(v, bool) or (isinstance(v, int) and v >= 1)):
            raise ValueError(
                f"Plan: group {g.name or '<root>'!r} has reshard_after_forward={v!r}; pass True "
                "(free after forward), False (keep unsharded) or an int N >= 1 (keep a 1/N "
                "slice, gathered again within N ranks), e.g. the number of ranks per node."
            )
    if len(set(names)) != len(names):
        raise ValueError(f"Plan: duplicate group names in {names}.")
    if any(g.recompute for g in p.groups if g.name == ""):
        raise ValueError(_ROOT_RECOMPUTES)
    params = [x for g in p.groups for x in g.params]
    if len(set(params)) != len(params):
        dup = sorted({x for x in params if params.count(x) > 1})
        raise ValueError(f"Plan: parameters {dup} are in more than one group.")
    for field in ("order", "backward_order"):
        unknown = sorted(set(getattr(p, field)) - set(names))
        if unknown:
            raise ValueError(
                f"Plan: {field} names {unknown}, which are not groups; groups are {names}."
            )
    for field in ("prefetch", "backward_prefetch"):
        value = getattr(p, field)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"Plan: {field} must be an int >= 0, got {value!r}.")
