"""Without gradient sync: where the gathers of a ``value_and_grad(sync_grads=False)`` call are
recorded.

[Note: gradient accumulation without communication]
``value_and_grad(fn, sync_grads=False)`` must return each rank's *unreduced* full gradients, so
that micro-batches accumulate locally and one :func:`~funcshard.reduce` follows. While it runs,
a :class:`GradSink` is current (a context variable scoped to that call); every gather made under
it (by ``unshard`` or a schedule) records its full tensors there. ``value_and_grad`` then asks
autograd for the gradients *of those full tensors* instead of the shards: the engine stops at
them, so the reduce-scatters behind them never run. (Returning ``None`` from a node above the
gather would not do: autograd materializes ``None`` as zeros for custom Functions, and the
collective would still run, on zeros.) Gradients reaching a shard other than through a gather
are not part of such a result.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_SINK: contextvars.ContextVar[GradSink | None] = contextvars.ContextVar(
    "funcshard_sink", default=None
)


class GradSink:
    """The full tensors gathered from each differentiated leaf during one call."""

    def __init__(self) -> None:
        self.targets: list[tuple[object, torch.Tensor]] = []

    def track(self, leaves, fulls) -> None:
        if torch.is_grad_enabled():
            self.targets.extend(
                (leaf, t) for leaf, t in zip(leaves, fulls, strict=True) if t.requires_grad
            )


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
