"""Debug mode: every collective's description compared across its ranks before it is issued.

[Note: checked collectives]
Collectives are matched by their order alone. When the ranks issue different ones (an
``fs.unshard`` some ranks call and others do not; a scheduled forward's cases that ``_schedule``
cannot keep in step, see [Note: the collectives follow the plan] in ``_execution/_deviation``),
they pair up wrongly: on gloo, mismatched sizes kill a rank with ``terminate called after throwing
gloo::EnforceNotMet`` (an abort ``except`` cannot catch), equal sizes give wrong values; on
NCCL, the ranks hang until the watchdog's timeout (or read garbage). In debug mode -- the
environment variable ``FUNCSHARD_DEBUG=1`` (read at each collective, as
``TORCH_DISTRIBUTED_DEBUG`` is read by c10d) or ``with fs.checking_collectives():`` -- each
eager collective funcshard issues first publishes its description (the operation, the group's
ranks, the plan's step label, the dtype and number of elements, its sequence number) through the
store and reads the other ranks'; a difference is a ``RuntimeError`` on every rank, naming the
group and what each rank was about to do, before anything is issued. The exchanges share one
sequence with the per-call checks of ``_consensus`` (see [Note: one status per call]), so a rank
that is one collective ahead of another meets it there and both raise. Cost: one store exchange
per collective (BENCHMARKS.md). Not under ``torch.compile`` (the graph issues the collectives).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .._runtime._compile import compiling, untraced
from . import _liveness, _store

_FORCED: list[bool] = []  # the stack of checking_collectives()


@contextlib.contextmanager
def checking_collectives(enabled: bool = True) -> Iterator[None]:
    """Within the block, compare every collective funcshard issues across its ranks before
    issuing it (see [Note: checked collectives]); ``enabled=False`` turns the checks off inside
    (also when ``FUNCSHARD_DEBUG=1`` is set). Every rank must enter the block at the same point.

    Raises (from the collectives inside):
        RuntimeError: on every rank of the group, when the ranks' next collectives differ.
    """
    _FORCED.append(bool(enabled))
    try:
        yield
    finally:
        _FORCED.pop()


def enabled() -> bool:
    if _FORCED:
        return _FORCED[-1]
    return os.environ.get("FUNCSHARD_DEBUG", "0") not in ("", "0")


def check(op: str, group: dist.ProcessGroup, label: str, x: torch.Tensor) -> None:
    """Note this collective in this rank's record (see [Note: what a rank is doing] in
    ``_liveness``); in debug mode, compare it with the other ranks' next one."""
    _liveness.collective(op, group, label)
    if not enabled() or compiling() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = f"{op} of {x.numel()} {str(x.dtype).removeprefix('torch.')} for {label!r}"
    everyone = _exchange_collective(group, mine)
    if all(v == mine for v in everyone):
        return
    ranks = dist.get_process_group_ranks(group)
    doing = "; ".join(f"rank {r}: {v}" for r, v in zip(ranks, everyone, strict=True))
    raise RuntimeError(
        f"funcshard (FUNCSHARD_DEBUG): the ranks of process group {ranks} are about to issue "
        f"different collectives ({doing}). Nothing was issued. A collective some ranks issue and "
        "others do not (an fs.unshard on some ranks only; a forward's path the schedule cannot "
        "keep in step, such as a block whose output some ranks drop), or funcshard called "
        "differently; see docs/failures.md, control flow that differs between ranks."
    )


def _exchange_collective(group: dist.ProcessGroup, description: str) -> list[str]:
    """Every rank's description of its next collective on ``group``; a rank that is at a
    per-call check instead (the same exchange: [Note: one sequence per set of ranks] in
    ``_store``) shows as such."""
    with untraced():
        values = _store.exchange(_store.CALL, _store.COLLECTIVE + description.encode(), group)
    out = []
    for v in values:
        if v[:1] == _store.COLLECTIVE:
            out.append(v[1:].decode(errors="replace"))
        elif v[:1] == _store.GONE:
            out.append(v[1:].decode(errors="replace"))  # "rank r is gone (...)", "... failed first"
        else:
            out.append("at the per-call check of a funcshard call, not at a collective")
    return out
