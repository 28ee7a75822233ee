"""How a call executes: decided once, where the call starts, and passed on as data.

[Note: the execution mode is data]
What the scheduler and the collectives may do depends on where they run: under plain autograd
a collective may stay pending (overlap) and a group may be freed after forward (refilled by
saved-tensor hooks); inside a ``torch.func`` transform (or anomaly mode) everything is
synchronous and nothing is freed (functorch refuses saved-tensor hooks and would need rules
for the wait itself); while ``torch.compile`` traces, collectives are recorded into the graph
and frees are the compiler's. This module is the one place that asks torch's global state
(:meth:`Mode.now`, and for code that no call's mode reaches -- an autograd Function's ``apply``,
a DTensor hook -- :func:`transformed` and :func:`capturing`; ``_compat.compiling`` for
``torch.compile``): a call asks once, at its entry, and hands the answer to everything it runs.

[Note: capture is a mode]
While a CUDA graph is captured (``fs.cuda_graph``, or ``torch.cuda.graph`` by hand) the step
runs op by op as in ``EAGER`` -- pending collectives, frees after forward, saved-tensor hooks --
but nothing runs: the device work is recorded and replayed later, without Python. Its own rules
follow from that. What the host does once (planning, the ranks' agreement through the store,
hooks' bookkeeping) happens at the capture only, and is right for every replay only because the
step is the same at every call (the graph is keyed by the inputs' structure, shapes and
values). What the host *reads* from the device (``.item()``, a branch on a tensor, a copy to the
CPU) cannot be captured at all, and a value the host *holds* (a CPU step count, a learning rate
as a number computed from one) would be frozen at its captured value: so the optimizer refuses
host counts in this mode (see [Note: counts on the device] in ``optim/_adam_sgd``) and
``fs.cuda_graph`` refuses host reads and CPU tensors by name.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import sys
from collections.abc import Iterator

import torch

from ._compat import compiling

# set by fs.cuda_graph around its capture (also for its CPU stand-in in tests); a capture by hand
# with torch.cuda.graph is seen through torch's own query
_CAPTURING = contextvars.ContextVar("funcshard_capturing", default=False)


def transformed() -> bool:
    """A ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) is active here: its
    interpreter stack is not empty."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def refuse_jacfwd(label: str, world: int) -> None:
    """Raise if a collective's ``jvp`` runs under ``torch.func.jacfwd`` (or ``hessian``).

    [Note: jacfwd through a collective]
    ``jacfwd`` is ``vmap(jvp)`` over the standard basis of its inputs, built *per rank*: with
    sharded inputs every rank pushes basis vector ``i`` of its own shard at the same time, so the
    all-gathered tangent has a one on every rank and each "column" sums several ranks' columns
    (with uneven shards the ranks' batch sizes even differ and the collective fails). No rule
    of the collective can tell this from a legitimate ``vmap(jvp)`` over sharded tangents, so the
    caller is recognised by its frame: ``push_jvp`` inside ``torch/_functorch/eager_transforms``.
    ``tests/test_reliability.py`` checks that jacfwd is refused, so that a torch upgrade that
    renames it fails there rather than in someone's Jacobian.
    """
    if world == 1:
        return
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "push_jvp" and code.co_filename.endswith("eager_transforms.py"):
            raise ValueError(
                f"torch.func.jacfwd (or hessian) through funcshard's collectives ({label}) is "
                "not supported: every rank would push basis vectors of its own shard at once, "
                "mixing the ranks' columns. Use torch.func.jacrev, or gather first (full = "
                "fs.unshard(sharded) outside the transform), take jacfwd with respect to the full "
                "tensors, and fs.reduce the result if you need it sharded. jacfwd with respect "
                "to inputs (not parameters) is fine."
            )
        frame = frame.f_back


def capturing() -> bool:
    """A CUDA graph is being captured on this thread's current stream (see [Note: capture is
    a mode])."""
    if _CAPTURING.get():
        return True
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def capture() -> Iterator[None]:
    """Run the body in :attr:`Mode.CAPTURED` (``fs.cuda_graph``'s capture)."""
    token = _CAPTURING.set(True)
    try:
        yield
    finally:
        _CAPTURING.reset(token)


class Mode(enum.Enum):
    """Where a call runs (see [Note: the execution mode is data])."""

    EAGER = "eager"  # plain autograd: pending collectives, frees after forward
    ANOMALY = "anomaly"  # plain autograd in anomaly mode: synchronous, nothing freed
    SYNCHRONOUS = "synchronous"  # inside torch.func transforms or anomaly mode
    TRACED = "traced"  # torch.compile tracing plain autograd
    TRACED_SYNCHRONOUS = "traced synchronous"  # torch.compile tracing a torch.func transform
    CAPTURED = "captured"  # recorded into a CUDA graph: see [Note: capture is a mode]

    @staticmethod
    def now() -> Mode:
        """The mode of code running here, from torch's global state."""
        inside = transformed()
        if compiling():
            return Mode.TRACED_SYNCHRONOUS if inside else Mode.TRACED
        if inside:
            return Mode.SYNCHRONOUS
        if torch.is_anomaly_enabled():
            return Mode.ANOMALY
        return Mode.CAPTURED if capturing() else Mode.EAGER

    @property
    def waited(self) -> Mode:
        """The mode of a collective that must complete before the call goes on (the later
        collectives of a chain, a gather of empty shards): where collectives may stay pending
        (``EAGER``, ``CAPTURED``), plain autograd's synchronous way (``ANOMALY``'s: the same ops,
        waited at once); the other modes wait already."""
        return Mode.ANOMALY if self.asynchronous else self

    @property
    def asynchronous(self) -> bool:
        """Collectives may return pending tensors (see [Note: pending tensors] in
        ``_collectives``)."""
        return self in (Mode.EAGER, Mode.CAPTURED)

    @property
    def eager(self) -> bool:
        """Op by op under plain autograd, as called: run now (``EAGER``) or recorded into a CUDA
        graph (``CAPTURED``), with the same ops either way."""
        return self in (Mode.EAGER, Mode.CAPTURED)

    @property
    def plain(self) -> bool:
        """Plain autograd: not inside a ``torch.func`` transform, not traced (where
        ``torch.utils.checkpoint`` may run)."""
        return self in (Mode.EAGER, Mode.ANOMALY, Mode.CAPTURED)

    @property
    def traced(self) -> bool:
        """``torch.compile`` is tracing."""
        return self in (Mode.TRACED, Mode.TRACED_SYNCHRONOUS)

    @property
    def frees(self) -> bool:
        """Groups may be freed after forward and gathered again for backward (saved-tensor
        hooks run here)."""
        return self in (Mode.EAGER, Mode.TRACED, Mode.CAPTURED)

    @property
    def captured(self) -> bool:
        """A CUDA graph is being captured: host reads are refused, host values frozen."""
        return self is Mode.CAPTURED
