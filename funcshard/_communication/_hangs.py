"""What every rank is doing, when one waits too long or a collective fails.

[Note: a hang explains itself]
A rank that waits for its peers longer than the limit (``FUNCSHARD_WAIT_TIMEOUT`` seconds;
default: the store's timeout, which is the process group's) asks every rank what it is doing:
it adds ``ASKED`` to every rank's heartbeat counter; every watcher that sees its requests'
count move answers once, whatever the number of requests since its last answer, under
``funcshard/report/answer/<rank>`` (so many ranks asking at once cost no more writes), with the
number of the latest request it saw, its ``RECORD`` and the Python stack of the thread
that made the last funcshard call (``sys._current_frames``: works while that thread is blocked
in a collective, which releases the GIL), and prints that answer on its own stderr (see
``_liveness``). The waiting rank raises one error that lists, per rank, what it was doing and
its stack, or, for a rank that does not answer, how long it has been silent and what its
process is doing (see [Note: a paused rank is not a dead rank] in ``_peers``). Ranks blocked in
a collective get the same listing when that collective fails (its timeout, or a peer's death:
:func:`explain`).
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Sequence

import torch.distributed as dist

from . import _liveness
from ._liveness import RECORD
from ._peers import ASKED, BEAT, PREFIX, SILENT, Peers

_ANSWER = 3.0  # seconds a rank asking for reports waits for the answers (beyond BEAT)


def reports(store: dist.Store, ranks: Sequence[int], peers: Peers) -> str:
    """Ask every rank in ``ranks`` what it is doing; the answers, one paragraph per rank (see
    [Note: a hang explains itself])."""
    mine = dist.get_rank()
    asked = {r: store.add(f"{PREFIX}beat/{r}", ASKED) // ASKED for r in ranks if r != mine}
    keys = {r: f"{PREFIX}report/answer/{r}" for r in asked}
    answers = {mine: pickle.loads(_liveness.answer(mine))} if mine in ranks else {}
    dead: dict[int, str] = {}
    deadline = time.monotonic() + BEAT + _ANSWER
    while keys and time.monotonic() < deadline:
        for r, key in list(keys.items()):
            seen, answer = pickle.loads(store.get(key)) if store.check([key]) else (0, None)
            if seen >= asked[r]:
                answers[r] = pickle.loads(answer)
                del keys[r]
            elif (how := peers.dead(r)) is not None:
                dead[r] = how
                del keys[r]
        time.sleep(0.05)
    out = []
    for r in ranks:
        if r in answers:
            a = answers[r]
            stack = a["stack"].rstrip().replace("\n", "\n    ")
            out.append(
                f"rank {r} ({a['where']}): {a['doing']}. Its stack (most recent call "
                f"last):\n    {stack}"
            )
        elif r in dead:
            out.append(dead[r])
        else:
            silent = peers.silent(r)
            out.append(
                f"rank {r}: no answer within {BEAT + _ANSWER:.0f} s"
                + (f", no heartbeat for {silent:.0f} s" if silent else "")
                + f": {peers.known(r)}"
            )
    return "\n  ".join(out)


def hang(
    where: str, behind: Sequence[int], waited: float, ranks: Sequence[int], peers: Peers
) -> None:
    """Raise the error of a rank that waited ``waited`` seconds at ``where`` for the ranks
    ``behind`` (see [Note: a hang explains itself])."""
    listing = reports(peers.store, ranks, peers)
    raise RuntimeError(
        f"funcshard: rank {dist.get_rank()} waited {datetime.timedelta(seconds=round(waited))} "
        f"at {where}, but ranks {list(behind)} did not get there. What each rank is doing:\n  "
        f"{listing}\nThe ranks called funcshard differently (a call one rank skipped or made "
        "alone: a save, a clip, a caught error, one batch fewer), a rank is stuck in other "
        "work, or its host is lost; the limit is FUNCSHARD_WAIT_TIMEOUT (seconds; default: the "
        "process group's timeout). See docs/failures.md."
    )


def explain(error: BaseException, what: str) -> None:
    """For a collective (``what``) that failed with ``error``: raise an error that names the
    ranks that ended or died meanwhile (waiting up to ``BEAT + SILENT`` seconds to tell), or
    lists what every rank is doing, or says that the store's host is gone. Returns (the caller
    raises ``error``) when there is no process group to ask."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = dist.get_rank()
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = list(range(dist.get_world_size()))
        peers = Peers(store, RECORD.calls, failed=True)
        deadline = time.monotonic() + BEAT + SILENT + 0.5
        dead: dict[int, str] = {}
        while not dead and time.monotonic() < deadline:
            dead = {r: how for r in ranks if r != mine and (how := peers.dead(r)) is not None}
            time.sleep(0.1)
        listing = "" if dead else reports(store, ranks, peers)
    except dist.DistNetworkError as e:
        raise RuntimeError(
            f"funcshard: {what} failed on rank {mine}, and the process group's store cannot be "
            f"reached ({e}): the process that hosts it (rank 0, or the launcher's agent) or its "
            "host is gone, which ends every rank's connections. Restart the job (from the last "
            f"checkpoint). This rank was doing: {RECORD.describe()}. The collective's error: "
            f"{error}"
        ) from error
    except Exception:  # no store to ask: the collective's own error says enough
        return
    if dead:
        raise RuntimeError(
            f"funcshard: {what} failed on rank {mine} because {'; '.join(dead.values())}. "
            f"Restart the job (from the last checkpoint). This rank was doing: "
            f"{RECORD.describe()}. The collective's error: {error}"
        ) from error
    raise RuntimeError(
        f"funcshard: {what} failed on rank {mine} ({error}), and no rank is known to be dead. "
        f"What each rank is doing:\n  {listing}\nA rank that is not at the same collective "
        "called funcshard differently (see docs/failures.md)."
    ) from error
