"""``check_plan``: does a module use its groups as the plan says? A dry run on meta tensors, or
one real forward over the shards."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._plans._plan import Plan
from .._plans._record import record_order


@dataclasses.dataclass(frozen=True)
class PlanCheck:
    """What a dry run of the module found about a plan; ``str()`` is a readable report.

    ``planned`` is the plan's forward order of group runs, ``used`` the order in which the
    module used them (consecutive uses of a group merged into one run). ``out_of_order``: the
    groups whose runs differ between the two (used earlier, later, more or fewer times than
    planned, or used but not in ``plan.order``); ``never_used``: groups of the plan whose
    parameters the forward never touched. ``ok`` when both are empty and the orders are equal.
    """

    planned: tuple[str, ...]
    used: tuple[str, ...]
    out_of_order: tuple[str, ...]
    never_used: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.planned == self.used and not self.never_used

    def first_difference(self) -> int | None:
        """Index of the first run where ``used`` and ``planned`` differ (``None``: equal)."""
        for i, (p, u) in enumerate(zip(self.planned, self.used, strict=False)):
            if p != u:
                return i
        n = min(len(self.planned), len(self.used))
        return None if len(self.planned) == len(self.used) else n

    def __str__(self) -> str:
        if self.ok:
            return f"check_plan: ok, the module uses its groups as planned: {_runs(self.used)}"
        lines = [
            "check_plan: the module does not use its groups as planned",
            f"  planned: {_runs(self.planned)}",
            f"  used:    {_runs(self.used)}",
        ]
        i = self.first_difference()
        if i is not None:
            at = lambda seq: _name(seq[i]) if i < len(seq) else "(nothing)"
            lines.append(
                f"  first difference at run {i}: planned {at(self.planned)}, used {at(self.used)}"
            )
        if self.out_of_order:
            lines.append(f"  out of the planned order: {', '.join(map(_name, self.out_of_order))}")
        if self.never_used:
            lines.append(f"  never used: {', '.join(map(_name, self.never_used))}")
        if self.out_of_order:
            lines.append(
                "  Record the order from inputs like the real ones "
                "(fs.plan(..., example_args=(...), example_kwargs={...})), or pass order= to "
                "fs.plan."
            )
        if self.never_used:
            lines.append(
                "  Leave parameters the forward does not use out of the groups (ignored=)."
            )
        return "\n".join(lines)


def check_plan(
    module: nn.Module,
    plan: Plan,
    *example_args: Any,
    sharded: Mapping[str, Any] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    **example_kwargs: Any,
) -> PlanCheck:
    """Run ``module`` once on the example inputs and compare the order in which it uses its
    parameter groups with ``plan.order``.

    Without ``sharded``: a dry run on meta copies of the inputs, with shape-only parameters; no
    data, no collectives, no process group needed. ``module`` may already be on meta (built
    there, or moved there after :func:`~funcshard.extract`, which records the ties the move
    breaks). With ``sharded`` (and ``buffers``): one real forward without grad over the shards,
    for a forward that cannot run on meta, as ``fs.plan(..., sharded=...)`` records it;
    collective: call it on every rank.

    Out-of-order runs are not wrong with :func:`~funcshard.schedule` (it gathers on demand,
    with a warning), only slower; groups never used are gathered and reduce-scattered for
    nothing.

    Raises:
        ValueError: the plan names parameters that ``module`` does not have; with ``sharded``:
            ranks whose forwards used the groups in different orders (on every rank).
        RuntimeError: the forward cannot run on meta tensors (data-dependent control flow,
            ``.item()``, ...): pass ``sharded=``.
    """
    known = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    unknown = sorted(p for g in plan.groups for p in g.params if p not in known)
    if unknown:
        raise ValueError(
            f"check_plan: the plan's groups name parameters that {type(module).__name__} does not "
            f"have: {unknown[:6]}{' ...' if len(unknown) > 6 else ''}. Pass the module the plan "
            "was made for."
        )
    used = record_order(
        module, plan.groups, example_args, example_kwargs, sharded=sharded, buffers=buffers,
        fn="check_plan",
    )  # fmt: skip
    return _compare(plan, tuple(used))


def _compare(plan: Plan, used: tuple[str, ...]) -> PlanCheck:
    never = tuple(g.name for g in plan.groups if g.name not in used)
    differing: list[str] = []
    matcher = difflib.SequenceMatcher(None, plan.order, used, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op != "equal":
            for name in (*plan.order[i1:i2], *used[j1:j2]):
                if name not in differing and name not in never:
                    differing.append(name)
    return PlanCheck(plan.order, used, tuple(differing), never)


def _name(group: str) -> str:
    return group or "<root>"


def _runs(order) -> str:
    return " -> ".join(map(_name, order)) or "(no group)"
