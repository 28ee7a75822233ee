"""A plan lowered into what one call's executor runs (``_schedule``), once per structure.

[Note: the plan lowered]
A :class:`~funcshard.Plan` is what the user reads: every step of a training step, forward and
backward, with its group. The executor needs, at each of a group's compute steps, the steps
since the previous one -- and not all of them are its own to run, depending on the execution
mode (see [Note: the execution mode is data]) and on which groups are frozen:

* ``all_gather`` and ``wait``: the executor's, always.
* ``free`` and ``reshard`` in forward: the executor's where groups can be freed (plain
  autograd, or a trace); elsewhere (inside ``torch.func``) nothing is freed and the step is
  dropped. ``reshard`` keeps a slice (see [Note: reshard to a smaller mesh] in
  ``_post_forward``).
* ``free`` in backward: a frozen group has no gradients to wait for, so the executor frees it
  when the plan moves on; any other group is freed by its post-backward callback, when
  autograd has its gradients (the step marks where that happens), and under a trace by the
  compiler after the last use.
* ``reduce_scatter``: the adjoint of the group's gather, issued by autograd when the group's
  gradients are complete -- where the plan puts it. It stays autograd's on every path, so that
  ``torch.func`` transforms (``grad``, ``vmap``, ``jvp``) derive and batch it like any other
  operation; the executor has nothing to run for it.

:func:`lower` does this filtering once per (plan, mode, frozen groups) and groups the steps by
the compute step they precede, so that moving to a group's next run is a lookup, not a scan.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

from .._plans._plan import Plan, Step
from .._runtime._mode import Mode


@dataclasses.dataclass(frozen=True)
class Phase:
    """One direction of a lowered plan.

    ``runs[j]`` is the group of the ``j``-th compute step, ``before[j]`` the steps the executor
    runs before it (since run ``j - 1``), ``arm[j]`` the group whose gather is armed when run
    ``j`` starts (forward only, see ``_flat.arm``), ``rest`` the steps after the last run,
    ``last[g]`` the index of group ``g``'s last run.
    """

    compute: str  # "forward" or "backward"
    runs: tuple[str, ...]
    before: tuple[tuple[Step, ...], ...]
    arm: tuple[str | None, ...]
    rest: tuple[Step, ...]
    last: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class Program:
    """A plan lowered for a mode and a set of frozen groups: see [Note: the plan lowered]."""

    forward: Phase
    backward: Phase


def lower(plan: Plan, mode: Mode, frozen: frozenset[str]) -> Program:
    """``plan`` lowered for ``mode``, with the groups in ``frozen`` holding no parameter that
    requires grad."""
    return Program(
        _phase(plan.forward, "forward", mode, frozen),
        _phase(plan.backward, "backward", mode, frozen),
    )


def _phase(steps: tuple[Step, ...], compute: str, mode: Mode, frozen: frozenset[str]) -> Phase:
    runs, before, pending = [], [], []
    for step in steps:
        if step.op == compute:
            runs.append(step.group)
            before.append(tuple(pending))
            pending = []
        elif _runs(step, compute, mode, frozen):
            pending.append(step)
    arm = tuple(
        next((g for g in runs[j + 1 :] if g != runs[j]), None) if compute == "forward" else None
        for j in range(len(runs))
    )
    last = types.MappingProxyType({g: j for j, g in enumerate(runs)})
    return Phase(compute, tuple(runs), tuple(before), arm, tuple(pending), last)


def _runs(step: Step, compute: str, mode: Mode, frozen: frozenset[str]) -> bool:
    """Whether the executor runs ``step`` (see [Note: the plan lowered])."""
    if step.op in ("free", "reshard"):
        return mode.frees and (compute == "forward" or step.group in frozen)
    return step.op in ("all_gather", "wait")


class Cursor:
    """A position in a lowered phase: the run last entered."""

    def __init__(self, phase: Phase) -> None:
        self.phase, self.run = phase, -1

    def current(self) -> str | None:
        return self.phase.runs[self.run] if self.run >= 0 else None

    def find(self, group: str) -> int | None:
        """The next run of ``group`` after the current one."""
        runs = self.phase.runs
        return next((j for j in range(self.run + 1, len(runs)) if runs[j] == group), None)

    def advance(self, j: int) -> list[tuple[tuple[Step, ...], str]]:
        """Move to run ``j``; return, for each run on the way (``j`` last), the steps before it
        and its group: those of runs the module skipped included (every rank issues the same
        collectives; see [Note: the collectives follow the plan] in ``_deviation``)."""
        runs, before = self.phase.runs, self.phase.before
        todo = [(before[k], runs[k]) for k in range(self.run + 1, j + 1)]
        self.run = j
        return todo

    def rest(self) -> list[tuple[tuple[Step, ...], str | None]]:
        """Move past the last run; return the runs on the way as :meth:`advance` does, then the
        steps after the last run (with the group ``None``)."""
        last = len(self.phase.runs)
        if self.run >= last:  # already past
            return []
        todo = self.advance(last - 1) if self.run < last - 1 else []
        self.run = last
        return [*todo, (self.phase.rest, None)]
