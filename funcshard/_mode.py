"""How a call executes: decided once, where the call starts, and passed on as data.

[Note: the execution mode is data]
What the scheduler and the collectives may do depends on where they run: under plain autograd
a collective may stay pending (overlap) and a group may be freed after forward (refilled by
saved-tensor hooks); inside a ``torch.func`` transform (or anomaly mode) everything is
synchronous and nothing is freed (functorch refuses saved-tensor hooks and would need rules
for the wait itself); while ``torch.compile`` traces, collectives are recorded into the graph
and frees are the compiler's. :meth:`Mode.now` is the one place that asks torch's global state;
a call asks once, at its entry, and hands the answer to everything it runs.
"""

from __future__ import annotations

import enum

import torch

from ._compat import compiling


class Mode(enum.Enum):
    """Where a call runs (see [Note: the execution mode is data])."""

    EAGER = "eager"  # plain autograd: pending collectives, frees after forward
    ANOMALY = "anomaly"  # plain autograd in anomaly mode: synchronous, nothing freed
    SYNCHRONOUS = "synchronous"  # inside torch.func transforms or anomaly mode
    TRACED = "traced"  # torch.compile tracing plain autograd
    TRACED_SYNCHRONOUS = "traced synchronous"  # torch.compile tracing a torch.func transform

    @staticmethod
    def now() -> Mode:
        """The mode of code running here, from torch's global state."""
        transformed = torch._C._functorch.peek_interpreter_stack() is not None
        if compiling():
            return Mode.TRACED_SYNCHRONOUS if transformed else Mode.TRACED
        if transformed:
            return Mode.SYNCHRONOUS
        return Mode.ANOMALY if torch.is_anomaly_enabled() else Mode.EAGER

    @property
    def asynchronous(self) -> bool:
        """Collectives may return pending tensors (see [Note: pending tensors] in
        ``_collectives``)."""
        return self is Mode.EAGER

    @property
    def plain(self) -> bool:
        """Plain autograd: not inside a ``torch.func`` transform, not traced (where
        ``torch.utils.checkpoint`` may run)."""
        return self in (Mode.EAGER, Mode.ANOMALY)

    @property
    def traced(self) -> bool:
        """``torch.compile`` is tracing."""
        return self in (Mode.TRACED, Mode.TRACED_SYNCHRONOUS)

    @property
    def frees(self) -> bool:
        """Groups may be freed after forward and gathered again for backward (saved-tensor
        hooks run here)."""
        return self in (Mode.EAGER, Mode.TRACED)
