"""Exchanges of a value per rank through the process group's key-value store (no collective).

Used by the per-call agreement of the ranks (``_consensus``: [Note: one status per call]), debug
mode's checked collectives (``_debug``) and record/replay (``_record``). Imports no funcshard
module but ``_liveness``, ``_peers`` and ``_hangs`` (which import no other), so every layer can
exchange.

[Note: one sequence per set of ranks]
Exchanges are numbered per default process group and set of ranks, not per group object: a
mesh's group over all ranks and the default group share one sequence, so that the per-call
checks and the debug mode's per-collective checks (``_debug``) of one rank always meet the other
ranks' exchange of the same number, whatever group each was made for. Both publish under the
same name (``CALL``), so a rank that is one exchange ahead meets the other's kind of exchange
and both raise (instead of waiting under different keys). Each rank deletes its key of the
previous exchange once the next one completed (everyone has read it by then).

[Note: waiting for a rank that is gone]
The wait polls the store (with a short back-off: no busy loop, no c10d timeout warnings) and,
every quarter second, asks what is known of the ranks it still waits for (see [Note: a paused
rank is not a dead rank] in ``_peers``): for a rank that ended (its error, or an exit after
fewer calls) or died, its key is set to ``GONE`` and that clause by the first rank to notice,
so every rank sees it and raises, quoting it. A rank that is alive but does not come within the
limit (see [Note: a hang explains itself] in ``_hangs``) makes every waiting rank raise with
every rank's report. A store that cannot be reached (its host, usually rank 0's, died) is
reported as such, not as a timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator

import torch.distributed as dist

from . import _hangs, _liveness, _peers

GONE = b"G"  # a value that stands in for the value of a rank that ended or died
COLLECTIVE = b"C"  # the start of a value of debug mode's exchanges (``_debug``)
CALL = "status"  # the exchange of the per-call checks and of debug mode's collectives
# per (default group, set of ranks): see [Note: one sequence per set of ranks]
_SEQUENCE: dict[tuple, itertools.count] = {}
_LAST: dict[tuple, str] = {}  # this rank's key of its last exchange
_GROUP_RANKS: dict[dist.ProcessGroup, tuple[int, ...]] = {}
_ALONE: list[bool] = []  # see alone()


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Within the block, this rank answers every exchange for all ranks (each gets its value).

    [Note: one rank stands for all]
    ``fs.explain`` runs one rank's step on fake tensors, without the other ranks: its agreement
    checks must not wait for ranks that are not there. The ranks it describes run the same
    program, so the answer every rank would give is this one's.
    """
    _ALONE.append(True)
    try:
        yield
    finally:
        _ALONE.pop()


def exchange(what: str, value: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Publish ``value`` and return every rank's of ``group`` (default: all), in group rank
    order, through the default store. Every rank of ``group`` must call it at the same point
    with the same ``what``; groups of the same ranks share one sequence of exchanges (see
    [Note: one sequence per set of ranks]).

    Raises:
        RuntimeError: the store cannot be reached; or the ranks that did not come are dead, or
            did not come within the limit (with every rank's report).
    """
    ranks = ranks_of(group or dist.group.WORLD)
    if _ALONE:
        return [value] * len(ranks)
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    stream = (dist.group.WORLD, ranks)  # a new default group (re-initialised) starts afresh
    seq = next(_SEQUENCE.setdefault(stream, itertools.count()))
    name = "" if len(ranks) == dist.get_world_size() else "-".join(map(str, ranks))
    if not name:  # the count of funcshard calls a rank's end reports
        _liveness.RECORD.calls = seq + 1
    prefix = f"funcshard/agree/{name}/{seq}/{what}/"
    keys = [f"{prefix}{r}" for r in ranks]
    try:
        if _liveness.RECORD.thread is None:  # no funcshard call noted yet: start the heartbeat
            _liveness.doing("a funcshard exchange")
        store.set(keys[ranks.index(rank)], value)
        _wait(store, keys, ranks, f"funcshard's store exchange #{seq} ({what})")
        values = store.multi_get(keys)
        # everyone has read the previous exchange: drop this rank's key of it
        previous, _LAST[stream] = _LAST.get(stream), keys[ranks.index(rank)]
        if previous is not None:
            store.delete_key(previous)
    except dist.DistNetworkError as e:
        raise RuntimeError(
            f"funcshard: rank {rank} cannot reach the process group's store ({e}): the process "
            "that hosts it (rank 0, or the launcher's store) or its host is gone. Restart the "
            "job."
        ) from e
    return values


def ranks_of(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of ``group`` (cached)."""
    found = _GROUP_RANKS.get(group)
    if found is None:
        found = _GROUP_RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return found


def _wait(store: dist.Store, keys: list[str], ranks: tuple[int, ...], where: str) -> None:
    """Until every key is set; see [Note: waiting for a rank that is gone]."""
    limit = _peers.limit(store)
    peers = _peers.Peers(store, _liveness.RECORD.calls)
    start = checked = time.monotonic()
    pause, polls = 5e-5, 0
    while not store.check(keys):
        polls += 1
        if polls < 20:  # a store round trip each: peers a little late cost no sleep
            continue
        if polls == 20:
            _liveness.RECORD.exchange = f"{where}, during {_liveness.RECORD.call}"
        now = time.monotonic()
        if now - start > limit:
            missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
            try:
                _hangs.hang(
                    f"{where} of {_liveness.RECORD.call}", missing, now - start, ranks, peers
                )  # raises
            finally:
                _liveness.RECORD.exchange = None
        if now - checked > 0.25:
            checked = now
            for r, k in zip(ranks, keys, strict=True):
                gone = not store.check([k]) and peers.dead(r)
                if gone:
                    store.set(k, GONE + gone.encode())  # stands in for it: every rank sees it
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    _liveness.RECORD.exchange = None
