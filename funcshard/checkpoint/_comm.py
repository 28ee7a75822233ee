"""The little coordination checkpointing needs: who am I, and "rank 0 does it, all learn how it
went" (so that a failure on rank 0 raises on every rank instead of leaving the others waiting)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from .._communication import _hangs


def rank_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default group; ``(0, 1)`` without one."""
    if distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def on_rank(fn: Callable[[], Any], src: int = 0) -> Any:
    """``fn()`` on rank ``src``; its result (or its exception, raised again) on every rank.

    Collective: every rank calls it at the same point; also serves as a barrier.
    """
    rank, _ = rank_world()
    outcome: list[Any] = [None]
    if rank == src:
        try:
            outcome = [("ok", fn())]
        except Exception as e:
            outcome = [("err", e)]
    if distributed():
        with peers_named("a checkpoint's broadcast"):
            dist.broadcast_object_list(outcome, src=src)
    status, value = outcome[0]
    if status == "err":
        raise value
    return value


def all_ok(error: BaseException | None) -> None:
    """Raise on every rank if any rank had an error (the first one, with its rank).

    An error that every rank has alike (the same type and message: one DCP gathered from all
    ranks) is raised as it is, its type kept.
    """
    mine = None if error is None else (type(error), str(error))
    errors = [mine]
    if distributed():
        errors = [None] * rank_world()[1]
        with peers_named("a checkpoint's all_gather"):
            dist.all_gather_object(errors, mine)
    if error is not None and all(e == mine for e in errors):
        raise error
    for r, e in enumerate(errors):
        if e is not None:
            kind, message = e
            raise RuntimeError(f"rank {r}: {kind.__name__}: {message}") from error


@contextlib.contextmanager
def peers_named(what: str) -> Iterator[None]:
    """Around collectives only (c10d's, or DCP's, which raise what fails locally as a
    ``CheckpointException``): one that fails because a peer died names that rank, or lists what
    every rank is doing (see ``_hangs.explain``)."""
    try:
        yield
    except RuntimeError as e:
        _hangs.explain(e, what)
        raise
