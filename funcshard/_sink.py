"""Where a group's full gradients go: reduce-scatter (default) or, without sync, a sink.

[Note: gradient accumulation without communication]
``value_and_grad(fn, sync_grads=False)`` must return each rank's *unreduced* full gradients, so
that micro-batches accumulate locally and one :func:`~funcshard.reduce` follows. While it runs,
a :class:`GradSink` is current (a context variable scoped to that call). Gathers made under it
(by ``unshard`` or a schedule) put a :class:`Notify` node on their full tensors; its backward
receives the full gradients, adds them to the sink and returns ``None``, so autograd never runs
the reduce-scatter behind it. ``Notify`` is also the scheduler's "this group's backward is
done" signal (see ``_schedule``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import torch

_SINK: contextvars.ContextVar[GradSink | None] = contextvars.ContextVar(
    "funcshard_sink", default=None
)


class GradSink:
    """Full gradients per differentiated leaf, summed over every gather of that leaf."""

    def __init__(self) -> None:
        self._grads: dict[int, torch.Tensor] = {}

    def add(self, leaf, grad: torch.Tensor, dtype: torch.dtype) -> None:
        grad = grad.detach().to(dtype)
        key = id(leaf)
        self._grads[key] = grad if key not in self._grads else self._grads[key] + grad

    def get(self, leaf) -> torch.Tensor | None:
        return self._grads.get(id(leaf))


@contextlib.contextmanager
def collecting() -> Iterator[GradSink]:
    sink = GradSink()
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def current() -> GradSink | None:
    return _SINK.get()


class Notify(torch.autograd.Function):
    """Identity on tensors; its backward hands their gradients to ``callback`` and returns what
    the callback returns (``None`` entries stop the gradient there)."""

    @staticmethod
    def forward(callback, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.callback = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.callback(grads))

    @staticmethod
    def jvp(ctx, _, *tangents):
        return tuple(t.view_as(t) for t in tangents)


def to_sink(sink: GradSink | None, leaves: Sequence, dtypes: Sequence[torch.dtype]) -> Callable:
    """A ``Notify`` callback: gradients go to ``sink`` (then stop), or pass on if it is None."""

    def route(grads):
        if sink is None:
            return grads
        for leaf, g, dtype in zip(leaves, grads, dtypes, strict=True):
            if g is not None:
                sink.add(leaf, g, dtype)
        return (None,) * len(grads)

    return route
