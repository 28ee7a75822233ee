"""``merge_groups``: a plan transformation that merges small consecutive groups into one.

[Note: bucketing is a plan transformation]
Every group costs about the same per step whatever its size: the scheduler's Python work, one
all-gather (two with reshard after forward) and one reduce-scatter, each with its own launch
latency. With many small groups (a deep stack of small layers, a norm in its own group) that
fixed cost dominates the step. SimpleFSDP buckets such collectives inside the compiler, where
the choice is hard to see; here the plan is data, so bucketing is a pure function from plan to
plan: groups that run one after the other in forward are merged into one group -- one
collective -- while the merged group's unsharded size stays within a budget. The result is an
ordinary ``Plan``: print it, check it, save it, edit it, schedule it.

Memory: the scheduler keeps ``1 + prefetch`` groups unsharded (or in flight) at a time, so after
merging that window is at most ``(1 + prefetch) * max_bytes`` (plus the root group), instead of
``1 + prefetch`` of the original groups.

Only groups with a single run in the forward order (and in the backward order) are merged, and
only with neighbours that have the same ``reshard_after_forward``: a group that runs twice (a
root whose embedding is used first and its tied head last) keeps its own place in the schedule.
A group that recomputes in backward (``Group.recompute``) is not merged: its module is what is
recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ._plan import Group, Plan


def merge_groups(
    plan: Plan,
    sizes: nn.Module | Mapping[str, int | torch.Tensor],
    max_bytes: int,
    *,
    param_dtype: torch.dtype | None = None,
) -> Plan:
    """A new plan where consecutive small groups (in forward order) are merged into one group.

    Walks ``plan.order`` and merges each group with the run before it while both run only once
    per direction, neither recomputes, both have the same ``reshard_after_forward``, and the
    merged group's unsharded size stays at most ``max_bytes``. A merged group is named
    ``"first..last"`` after its first and last members and holds their parameters in forward
    order; it is gathered with one collective per dtype (see :func:`~funcshard.schedule`).
    Groups larger than ``max_bytes`` stay as they are. Values and gradients are unchanged; the
    collectives per step drop with the number of groups, and the unsharded window grows to at
    most ``(1 + prefetch) * max_bytes``.

    Args:
        plan: from :func:`~funcshard.plan` (or edited).
        sizes: the module the plan was made for (its parameters may be on meta), or a mapping
            from parameter fqn to its unsharded size in bytes (an int) or to a tensor of its
            global shape and dtype (``fs.extract(module)[0]``, or the sharded DTensors).
        max_bytes: the budget for one merged group's unsharded parameters, in bytes.
        param_dtype: size parameters in this dtype (the ``param_dtype`` of
            :func:`~funcshard.schedule`, which is what is gathered); default: their own dtype.

    Raises:
        ValueError: ``max_bytes`` is not a positive int; ``sizes`` lacks a parameter of the plan;
            a merged name clashes with an existing group name.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"merge_groups: max_bytes must be a positive int, got {max_bytes!r}.")
    nbytes = _group_bytes(plan, _param_bytes(sizes, param_dtype))
    buckets = _buckets(plan, nbytes, max_bytes)
    merged = {g: b for b in buckets if len(b) > 1 for g in b}
    by_name = {g.name: g for g in plan.groups}
    names = {g.name for g in plan.groups}
    new_name = {}
    for b in buckets:
        if len(b) > 1:
            name = f"{b[0] or '<root>'}..{b[-1] or '<root>'}"
            if name in names:
                raise ValueError(
                    f"merge_groups: the merged group {b} would be named {name!r}, which is "
                    "already a group's name; rename that group first (Plan.replace(groups=...))."
                )
            for g in b:
                new_name[g] = name
    groups, done = [], set()
    for g in plan.groups:
        if g.name not in merged:
            groups.append(g)
        elif new_name[g.name] not in done:
            members = [by_name[m] for m in merged[g.name]]
            params = tuple(p for m in members for p in m.params)
            groups.append(Group(new_name[g.name], params, g.reshard_after_forward))
            done.add(new_name[g.name])
    rename = lambda order: _collapse(new_name.get(g, g) for g in order)
    derived = plan.backward_order == tuple(reversed(plan.order))
    return plan.replace(
        groups=tuple(groups),
        order=rename(plan.order),
        backward_order=None if derived else rename(plan.backward_order),
    )


def _param_bytes(sizes, dtype: torch.dtype | None) -> dict[str, int]:
    if isinstance(sizes, nn.Module):
        sizes = dict(sizes.named_parameters())
    if not isinstance(sizes, Mapping):
        raise TypeError(
            f"merge_groups: sizes must be the module or a {{fqn: bytes or tensor}} mapping, got "
            f"{type(sizes).__name__}."
        )
    out = {}
    for fqn, s in sizes.items():
        if isinstance(s, torch.Tensor):
            itemsize = (dtype or s.dtype).itemsize if s.is_floating_point() else s.element_size()
            out[fqn] = s.numel() * itemsize
        else:
            out[fqn] = int(s)
    return out


def _group_bytes(plan: Plan, param_bytes: Mapping[str, int]) -> dict[str, int]:
    missing = [p for g in plan.groups for p in g.params if p not in param_bytes]
    if missing:
        more = " ..." if len(missing) > 6 else ""
        raise ValueError(
            f"merge_groups: no size for parameters {missing[:6]}{more}; pass the module the plan "
            "was made for, or a mapping with every parameter of the plan."
        )
    return {g.name: sum(param_bytes[p] for p in g.params) for g in plan.groups}


def _buckets(plan: Plan, nbytes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """The runs of ``plan.order`` split into buckets of consecutive mergeable groups."""
    once = {  # a recompute group's module is recomputed as a whole: it stays a group
        g.name
        for g in plan.groups
        if plan.order.count(g.name) == 1
        and plan.backward_order.count(g.name) <= 1
        and not g.recompute
    }
    reshard = {
        g.name: (type(g.reshard_after_forward), g.reshard_after_forward) for g in plan.groups
    }
    buckets: list[list[str]] = []
    total = 0
    for g in plan.order:
        last = buckets[-1] if buckets else None
        fits = (
            last is not None
            and g in once
            and last[-1] in once
            and reshard[last[-1]] == reshard[g]  # (kind, value): True is not the int 1
            and total + nbytes[g] <= max_bytes
        )
        if fits:
            last.append(g)
            total += nbytes[g]
        else:
            buckets.append([g])
            total = nbytes[g]
    return buckets


def _collapse(order) -> tuple[str, ...]:
    """``order`` with consecutive repeats of a name merged into one run."""
    out: list[str] = []
    for g in order:
        if not out or out[-1] != g:
            out.append(g)
    return tuple(out)
