"""Which rank died, and what every rank is doing when one waits too long.

[Note: a heartbeat per rank]
From its first funcshard call on (:func:`doing`), every rank runs a daemon thread, the
*watcher*, that adds 1 to its counter ``funcshard/beat/<rank>`` in the process group's store
every ``_BEAT`` seconds (through its own connection: ``Store.clone``), after publishing its host
and pid once. A rank that waits for a peer (at a store exchange, or after a collective failed)
calls the peer dead when its process on this host is gone (at once), or when its counter has
not moved for ``_SILENT`` seconds as seen by the waiting rank's own clock (no clocks are
compared across hosts): a rank on any host is named within ``_BEAT + _SILENT`` seconds of its
death. A rank that is alive but stuck keeps beating, and is covered by the wait's limit (see
[Note: a hang explains itself]). Only waiting ranks read others' counters. The same counter
carries requests for reports in its high bits (``_ASKED``): the ``add`` that beats also tells
the watcher whether it was asked, so the normal path costs one store round trip per rank per
``_BEAT``, and the watcher takes the GIL twice per ``_BEAT`` (on a machine whose cores are all
busy, each time the GIL changes threads costs an OS scheduling delay: BENCHMARKS.md).

[Note: what a rank is doing]
``RECORD`` is this process's last funcshard call (``fs.checkpoint.save``, the optimizer's clip,
a scheduled ``apply``), the plan step the schedule last executed (forward or backward), the last
collective funcshard issued (its operation, group and label, and this rank's count of them) and
the store exchange it waits in, if any. Updating it is a few attribute stores (no formatting, no
I/O), so it is kept always; it is read only when someone asks. It is per process, not passed
around, because the watcher thread reads it while the main thread is blocked.

[Note: a hang explains itself]
A rank that waits for its peers longer than the limit (``FUNCSHARD_WAIT_TIMEOUT`` seconds;
default: the store's timeout, which is the process group's) asks every rank what it is doing:
it adds ``_ASKED`` to every rank's heartbeat counter; every watcher that sees its requests'
count move answers once, whatever the number of requests since its last answer, under
``funcshard/report/answer/<rank>`` (so many ranks asking at once cost no more writes), with the
number of the latest request it saw, its ``RECORD`` and the Python stack of the thread
that made the last funcshard call (``sys._current_frames``: works while that thread is blocked
in a collective, which releases the GIL), and prints that answer on its own stderr. The waiting
rank raises one error that lists, per rank, what it was doing and its stack. Ranks blocked in a
collective get the same listing when that collective fails (its timeout, or a peer's death:
:func:`explain`).

[Note: no thread at exit]
The watcher is stopped and joined at interpreter exit (``atexit``, which runs before the
interpreter tears down its threads), and stops by itself when the process group it serves is
destroyed: a daemon thread that is inside a store call while torch shuts down could otherwise
take the GIL from a finalizing interpreter and abort the process. It imports no other funcshard
module, so any module may note what it does.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence

import torch.distributed as dist

_BEAT = 1.0  # seconds between two heartbeats of a rank
_ASKED = 1 << 32  # a request for a report, added to a rank's heartbeat counter
_SILENT = 5.0  # seconds without a heartbeat after which a rank is dead
_ANSWER = 3.0  # seconds a rank asking for reports waits for the answers (beyond _BEAT)
_STACK = 30  # frames of each rank's stack in a report
_PREFIX = "funcshard/"


class _Record:
    """What this rank is doing (see [Note: what a rank is doing])."""

    __slots__ = ("call", "collective", "exchange", "issued", "step", "thread")

    def __init__(self) -> None:
        self.call: str | None = None
        self.thread: int | None = None  # the thread that made the last funcshard call
        self.step: tuple | None = None  # (plan step, in forward)
        self.collective: tuple | None = None  # (op, group, label)
        self.issued = 0  # collectives funcshard issued on this rank
        self.exchange: str | None = None  # the store exchange this rank waits in

    def describe(self) -> str:
        parts = [f"last funcshard call: {self.call or 'none yet'}"]
        if self.step is not None:
            step, forward = self.step
            parts.append(
                f"plan step: {step.op} {step.group or '<root>'} "
                f"({'forward' if forward else 'backward'})"
            )
        if self.collective is not None:
            op, group, label = self.collective
            parts.append(
                f"last collective funcshard issued: {op} for {label!r} on ranks "
                f"{_ranks(group)}, its #{self.issued} on this rank{_sequence(group)}"
            )
        if self.exchange is not None:
            parts.append(f"now waiting at {self.exchange}")
        return "; ".join(parts)


RECORD = _Record()


class _Watcher:
    __slots__ = ("group", "stop", "thread")

    def __init__(self) -> None:
        self.group: object = None
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()


_WATCHER = _Watcher()
_HOST = socket.gethostname()  # tests stand in another host here


def doing(call: str) -> None:
    """Note that this rank is in funcshard call ``call`` (e.g. ``"fs.checkpoint.save"``), and
    start its heartbeat if it runs none for the current process group (see [Note: a heartbeat
    per rank])."""
    RECORD.call, RECORD.step = call, None
    RECORD.thread = threading.get_ident()
    if _WATCHER.group is not dist.group.WORLD:
        start()


def step(plan_step, forward: bool) -> None:
    """Note the plan step the schedule executes."""
    RECORD.step = (plan_step, forward)


def collective(op: str, group: dist.ProcessGroup, label: str) -> None:
    """Note a collective funcshard is about to issue."""
    RECORD.collective = (op, group, label)
    RECORD.issued += 1


def start() -> None:
    """Start (or restart, for a new default process group) this rank's watcher."""
    world = dist.group.WORLD
    stop()
    if world is None or dist.get_world_size() == 1:
        _WATCHER.group = world
        return
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    _WATCHER.group, _WATCHER.stop = world, threading.Event()
    own = _connection(store)
    if own is None:
        return
    store.set(f"{_PREFIX}alive/{rank}", f"{_HOST} {os.getpid()}")
    store.add(f"{_PREFIX}beat/{rank}", 1)
    _WATCHER.thread = threading.Thread(
        target=_watch,
        args=(own, rank, world, _WATCHER.stop),
        name="funcshard-watcher",
        daemon=True,
    )
    _WATCHER.thread.start()


def _connection(store: dist.Store) -> dist.Store | None:
    """The watcher's own connection to ``store``: a clone; the store itself if c10d's (those
    are thread-safe) cannot clone; ``None`` (no watcher) for a store written in Python."""
    try:
        return store.clone()
    except Exception:
        return store if type(store).__module__.startswith("torch") else None


@atexit.register
def stop() -> None:
    """Stop this rank's watcher and wait for it (see [Note: no thread at exit])."""
    _WATCHER.stop.set()
    thread, _WATCHER.thread, _WATCHER.group = _WATCHER.thread, None, None
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=_BEAT + 5.0)


def _watch(store: dist.Store, rank: int, world: object, stop: threading.Event) -> None:
    answered = 0
    try:
        while not stop.wait(_BEAT):
            if dist.group.WORLD is not world:  # destroyed (or replaced): nothing to serve
                return
            asked = store.add(f"{_PREFIX}beat/{rank}", 1) // _ASKED
            if asked > answered:
                answer = _answer(rank)
                store.set(f"{_PREFIX}report/answer/{rank}", pickle.dumps((asked, answer)))
                answered = asked
                print(
                    f"funcshard: rank {rank} was asked what it is doing: "
                    f"{pickle.loads(answer)['doing']}",
                    file=sys.stderr,
                    flush=True,
                )
    except Exception:  # the store is gone (its host died, or the job ends): nothing to serve
        return


def _answer(rank: int) -> bytes:
    frame = sys._current_frames().get(RECORD.thread or threading.main_thread().ident)
    frames = traceback.extract_stack(frame) if frame is not None else []
    while frames and frames[-1].filename == __file__:  # this rank asks: not its own report
        frames.pop()
    stack = "".join(traceback.format_list(frames[-_STACK:]))
    return pickle.dumps(
        {
            "rank": rank,
            "where": f"{_HOST} pid {os.getpid()}",
            "doing": RECORD.describe(),
            "stack": stack,
        }
    )


def _ranks(group) -> list[int] | str:
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # destroyed since
        return "?"


def _sequence(group) -> str:
    try:
        return f" (c10d sequence number {group._get_sequence_number_for_group()} on that group)"
    except Exception:  # not every backend counts
        return ""


# ---- waiting for peers -------------------------------------------------------------------------
def limit(store: dist.Store) -> float:
    """Seconds a rank waits for its peers before it asks them for reports and raises (see
    [Note: a hang explains itself])."""
    value = os.environ.get("FUNCSHARD_WAIT_TIMEOUT", "")
    if not value:
        return store.timeout.total_seconds()
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(
            f"FUNCSHARD_WAIT_TIMEOUT={value!r}: expected a number of seconds > 0 (how long a "
            "rank waits for its peers before every rank reports what it is doing)."
        )
    return seconds


class Silence:
    """A waiting rank's view of its peers' heartbeats: when each counter last moved, by this
    rank's clock (see [Note: a heartbeat per rank])."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.seen: dict[int, tuple[int | None, float]] = {}
        self.where: dict[int, str] = {}  # "host pid" of each rank, once published

    def dead(self, rank: int) -> str | None:
        """How ``rank`` is known to be dead, else ``None``."""
        if rank not in self.where:
            key = f"{_PREFIX}alive/{rank}"
            if self.store.check([key]):
                self.where[rank] = self.store.get(key).decode()
        gone = _process_gone(self.where[rank]) if rank in self.where else None
        if gone is not None:
            return gone
        key = f"{_PREFIX}beat/{rank}"
        beat = int(self.store.get(key)) % _ASKED if self.store.check([key]) else None
        now = time.monotonic()
        last = self.seen.get(rank)
        if last is None or last[0] != beat:
            self.seen[rank] = (beat, now)
            return None
        if beat is None or now - last[1] < _SILENT:  # never beat: it made no funcshard call yet
            return None
        return f"no heartbeat for {now - last[1]:.0f} s: its process or its host died"


def _process_gone(where: str) -> str | None:
    """How the process ``where`` (``"host pid"``) is known to be dead, else ``None``."""
    host, pid = where.rsplit(" ", 1)
    if host != _HOST:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return f"its process {pid} on {host} has exited"
    except OSError:  # no /proc: ask the OS
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return f"its process {pid} on {host} has exited"
        except OSError:
            pass
        return None
    return f"its process {pid} on {host} is a zombie" if state in ("Z", "X") else None


def reports(store: dist.Store, ranks: Sequence[int], silence: Silence) -> str:
    """Ask every rank in ``ranks`` what it is doing; the answers, one paragraph per rank (see
    [Note: a hang explains itself])."""
    mine = dist.get_rank()
    asked = {r: store.add(f"{_PREFIX}beat/{r}", _ASKED) // _ASKED for r in ranks if r != mine}
    keys = {r: f"{_PREFIX}report/answer/{r}" for r in asked}
    answers = {mine: pickle.loads(_answer(mine))} if mine in ranks else {}
    dead: dict[int, str] = {}
    deadline = time.monotonic() + _BEAT + _ANSWER
    while keys and time.monotonic() < deadline:
        for r, key in list(keys.items()):
            seen, answer = pickle.loads(store.get(key)) if store.check([key]) else (0, None)
            if seen >= asked[r]:
                answers[r] = pickle.loads(answer)
                del keys[r]
            elif (how := silence.dead(r)) is not None:
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
            out.append(f"rank {r}: dead ({dead[r]})")
        else:
            out.append(
                f"rank {r}: no answer within {_BEAT + _ANSWER:.0f} s (its watcher is not "
                "running: it made no funcshard call yet, or holds the GIL)"
            )
    return "\n  ".join(out)


def hang(
    where: str, behind: Sequence[int], waited: float, ranks: Sequence[int], silence: Silence
) -> None:
    """Raise the error of a rank that waited ``waited`` seconds at ``where`` for the ranks
    ``behind`` (see [Note: a hang explains itself])."""
    listing = reports(silence.store, ranks, silence)
    raise RuntimeError(
        f"funcshard: rank {dist.get_rank()} waited {datetime.timedelta(seconds=round(waited))} "
        f"at {where}, but ranks {list(behind)} did not get there. What each rank is doing:\n  "
        f"{listing}\nThe ranks called funcshard differently (a call one rank skipped or made "
        "alone: a save, a clip, a caught error, one batch fewer), or a rank is stuck in other "
        "work; the limit is FUNCSHARD_WAIT_TIMEOUT (seconds; default: the process group's "
        "timeout). See docs/failures.md."
    )


def explain(error: BaseException, what: str) -> None:
    """For a collective (``what``) that failed with ``error``: raise an error that names the
    ranks that died meanwhile (waiting up to ``_BEAT + _SILENT`` seconds to tell), or lists
    what every rank is doing. Returns (the caller raises ``error``) when there is no process
    group or store to ask."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = list(range(dist.get_world_size()))
        mine = dist.get_rank()
        silence = Silence(store)
        deadline = time.monotonic() + _BEAT + _SILENT + 0.5
        dead: dict[int, str] = {}
        while not dead and time.monotonic() < deadline:
            dead = {r: how for r in ranks if r != mine and (how := silence.dead(r)) is not None}
            time.sleep(0.1)
        listing = "" if dead else reports(store, ranks, silence)
    except Exception:  # the store is gone too: the collective's own error says enough
        return
    if dead:
        named = "; ".join(f"rank {r} is gone ({how})" for r, how in dead.items())
        raise RuntimeError(
            f"funcshard: {what} failed on rank {mine} because {named}. Restart the job (from "
            f"the last checkpoint). This rank was doing: {RECORD.describe()}. The collective's "
            f"error: {error}"
        ) from error
    raise RuntimeError(
        f"funcshard: {what} failed on rank {mine} ({error}), and no rank is known to be dead. "
        f"What each rank is doing:\n  {listing}\nA rank that is not at the same collective "
        "called funcshard differently (see docs/failures.md)."
    ) from error
