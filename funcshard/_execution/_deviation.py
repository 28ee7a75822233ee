"""What a scheduled call does when the module's forward does not follow the plan.

[Note: the collectives follow the plan]
Collectives are matched by their order alone: if one rank issues a gather the others do not
issue at that point, gloo aborts the process on mismatched sizes (``gloo::EnforceNotMet``, not
catchable) and NCCL hangs or mixes buffers. So a scheduled call issues the plan's collectives,
in the plan's order, whatever its forward does -- a layer dropped on one rank, a data-dependent
branch, a bug:

* gathers: the executor issues each group's gathers where the plan has them, also for runs the
  forward skips (the cursor steps over them) and for those after the forward's last use
  (:meth:`~funcshard._execution._program.Cursor.rest`).
* reduce-scatters: a group's reduce-scatter is the backward of its gather, run by autograd once
  the group's gradients are complete. A run the forward skipped leaves its group without
  gradients on this rank, so its full tensors get a :class:`Skipped` node -- a zero that
  depends on them -- added to the call's outputs (:func:`attach`): autograd reaches the gather's
  backward and reduce-scatters zeros. The node is made where the skipped run would have
  computed, and autograd runs ready nodes newest first, so it is reached where the group's own
  backward would have been; its backward moves the backward cursor to the group (the re-gather
  and prefetch a saved tensor of the group asks for), then the gather's backward follows: the
  plan's order. The gradients are exact: this rank's loss does not depend on the skipped run,
  and the other ranks' gradients are reduced with its zeros. Still, ranks whose forwards take
  different paths are most often a bug: the groups a rank's forward gathered and never used
  ride its next per-call status (``_consensus.skipped``), and ranks that differ there raise a
  ``RuntimeError`` naming them and the fix on every rank -- unless the plan says ranks may
  skip on their own (``per_rank_skips``: a layer drop drawn on each rank). Groups every rank
  skipped (a module the forward never calls) are no error. Forwards under no_grad reduce
  nothing and are not compared (an early exit at evaluation). Likewise a group whose backward
  unpacks none of its full tensors (the first block, whose input needs no gradient, saves only
  that input) moves the backward cursor to its last run when its gradients are complete,
  before its reduce-scatter: the steps a rank that did unpack them ran there.
* a use the plan cannot serve without a collective of its own -- a group used again after the
  plan freed it (twice where the plan runs it once, or after a later group), or a group the
  plan never runs -- is not gathered on demand: the other ranks, following the plan, issue
  something else there. The rank computes with zeros instead (detached from the group, whose
  saved tensors are not touched), finishes the step with the plan's collectives, warns, and
  raises a ``RuntimeError`` naming the group and the fix at its next funcshard call, where the
  per-call check (``_consensus.defer``) raises it on every rank: the ranks stay in step. A group
  that communicates nothing (a mesh of one rank) is still gathered on demand, with a warning;
  so is any group under ``torch.compile`` or ``fs.jit`` and while a CUDA graph is captured:
  those record the step once and replay it without this code, so no later call could raise,
  and every rank's recorded graph must take the same path anyway.
* a use outside the plan's order of a group that is still unsharded (``reshard_after_forward=
  False``, the root) needs no collective and is exact. So is a use of such a group that the
  plan runs only after other runs (T5's shared embedding, used by the decoder, in a plan of the
  module order that runs it first and last): it is served as it is, without moving the cursor,
  so that the runs in between are not taken as skipped. The saved tensors of such uses do not
  move the backward cursor, which keeps the plan's backward order.

Not kept in step (debug mode, ``FUNCSHARD_DEBUG=1``, names them): a block that the forward runs
on every rank but whose output some ranks drop (their autograd never reaches its gather's
backward, and nothing tells them in time: the backward cursor also passes a group whose
backward autograd runs later, in a legitimate order); ranks whose forwards take different paths
under ``torch.compile`` or ``fs.jit`` (each rank's graph records its own path: a skipped run
gets no zero there, and the compiler drops a gather nothing reads); collectives of one's own
(``dist.all_reduce``) or ``fs.unshard`` calls made on some ranks only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch.distributed.tensor import DTensor, Partial, Replicate

from .._communication._collectives import _Function

_OWN = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


class Skipped(_Function):
    """A zero that depends on ``fulls`` (a group's full tensors); its backward calls
    ``reached`` and passes no gradient on (the gather's backward gets zeros)."""

    @staticmethod
    def forward(reached: Callable[[], None], *fulls: torch.Tensor) -> torch.Tensor:
        return fulls[0].new_zeros(())

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.reached = inputs[0]

    @staticmethod
    def backward(ctx, _):
        ctx.reached()
        return (None,) * len(ctx.needs_input_grad)

    @staticmethod
    def jvp(ctx, _, *tangents):
        return next(t for t in tangents if t is not None).new_zeros(())

    @staticmethod
    def vmap(info, in_dims, reached, *fulls):
        return Skipped.apply(reached, *fulls), None


def attach(out: Any, zeros: Sequence[torch.Tensor]) -> Any:
    """``out`` with the sum of ``zeros`` added to each floating-point tensor in it that
    requires grad: the loss, whatever output it is computed from, then depends on them."""
    total = zeros[0]
    for z in zeros[1:]:
        total = total + z

    def add(x):
        if not (isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point()):
            return x
        zero = total.to(device=x.device if not isinstance(x, DTensor) else total.device)
        zero = zero.to(dtype=x.dtype)
        if isinstance(x, DTensor):
            if any(isinstance(p, Partial) for p in x.placements):
                return x
            mesh = x.device_mesh
            zero = DTensor.from_local(zero, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return x + zero

    return torch_pytree.tree_map(add, out)


def caller() -> str:
    """Where the user's code (not torch's or funcshard's) made the current call: ``file:line``."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN):
        frame = frame.f_back
    if frame is None:
        return ""
    return f" at {frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def out_of_plan(
    rank: int, group: str, phase: str, planned: str | None, runs: Sequence[str], where: str
) -> RuntimeError:
    """The error of a use the plan cannot serve without a collective of its own."""
    times = sum(r == group for r in runs)
    if times:
        what = (
            f"after the plan's last run of it had passed (the plan runs it {times} time(s) per "
            f"{phase}) and freed its full parameters"
        )
    else:
        what = f"which the plan's {phase} never runs"
    order = " -> ".join(repr(r) for r in runs)
    return RuntimeError(
        f"schedule: rank {rank}'s {phase} used group {group!r}{where} {what} (the plan was at "
        f"{planned!r}; planned {phase} order: {order}). Gathering it there would be a collective "
        "the other ranks do not issue at that point, so this rank computed with zeros instead "
        "and finished that step with the plan's collectives: its values and gradients of that "
        "step are wrong. Raised on every rank at the next funcshard call. Make the plan's "
        "order the forward's: record it with example inputs like the call's (fs.plan(..., "
        "example_args=(...), example_kwargs={...})), or pass order= to fs.plan; if the ranks' "
        "forwards take "
        "different paths (data-dependent control flow), use each group only where the plan "
        "runs it (skipping a run is fine), or give the group reshard_after_forward=False (see "
        "docs/failures.md, control flow that differs between ranks)."
    )
