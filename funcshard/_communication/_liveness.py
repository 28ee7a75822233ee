"""Each rank's heartbeat, its record of what it is doing, and how it ended.

[Note: a heartbeat per rank]
From its first funcshard call on (:func:`doing`), every rank runs a daemon thread, the
*watcher*, that adds 1 to its counter ``funcshard/beat/<rank>`` in the process group's store
every ``BEAT`` seconds (through its own connection: ``Store.clone``), after publishing its host
and pid once. Only waiting ranks read others' counters (``_peers``), and silence alone never
makes a peer dead (see [Note: a paused rank is not a dead rank] there). The same counter
carries requests for reports in its high bits (``ASKED``; see [Note: a hang explains itself] in
``_hangs``): the ``add`` that beats also tells the watcher whether it was asked, so the normal
path costs one store round trip per rank per ``BEAT``, and the watcher takes the GIL twice per
``BEAT`` (on a machine whose cores are all busy, each time the GIL changes threads costs an OS
scheduling delay: BENCHMARKS.md).

[Note: how a rank ended]
A rank that ends publishes ``funcshard/end/<rank>`` (:class:`~._peers.Ended`): ``failed``, with
its error's first line and the line of the user's code it was raised from (an uncaught
exception, through ``sys.excepthook``), or ``exited`` (at interpreter exit, ``atexit``), each
with its count of funcshard calls (the per-call checks of all ranks: ``RECORD.calls``). A
waiting rank quotes it instead of saying "is gone": ``rank 1 failed first: ValueError: ...``,
or ``rank 1 exited ... after 8 funcshard calls, while this rank is at call 9``. At exit, a rank
waits (up to the wait's limit; ``_ENDING`` seconds if it failed) until every peer has ended or
is gone: a store hosted here thus outlives the peers that read it, and a rank that exited after
fewer calls than a peer says so and exits with status 1, since it left its peers waiting (a
batch it skipped alone).

[Note: what a rank is doing]
``RECORD`` is this process's last funcshard call (``fs.checkpoint.save``, the optimizer's clip,
a scheduled ``apply``), the plan step the schedule last executed (forward or backward), the last
collective funcshard issued (its operation, group and label, and this rank's count of them) and
the store exchange it waits in, if any. Updating it is a few attribute stores (no formatting, no
I/O), so it is kept always; it is read only when someone asks. It is per process, not passed
around, because the watcher thread reads it while the main thread is blocked.

[Note: no thread at exit]
The watcher is stopped and joined at interpreter exit (``atexit``, which runs before the
interpreter tears down its threads), and stops by itself when the process group it serves is
destroyed: a daemon thread that is inside a store call while torch shuts down could otherwise
take the GIL from a finalizing interpreter and abort the process. It imports no funcshard
module but ``_peers`` (which imports none), so any module may note what it does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import sys
import threading
import time
import traceback

import torch.distributed as dist

from . import _peers
from ._peers import ASKED, BEAT, PREFIX, SILENT, Ended, Peers, limit

_ENDING = BEAT + SILENT  # seconds a rank that failed waits at exit for its peers to end
_STACK = 30  # frames of each rank's stack in a report
# the folders whose frames are not the user's line in a published error
_NOT_USERS = tuple(
    os.path.dirname(os.path.dirname(os.path.abspath(m))) + os.sep for m in (__file__, dist.__file__)
)


class _Record:
    """What this rank is doing (see [Note: what a rank is doing])."""

    __slots__ = ("call", "calls", "collective", "exchange", "issued", "step", "thread")

    def __init__(self) -> None:
        self.call: str | None = None
        self.thread: int | None = None  # the thread that made the last funcshard call
        self.step: tuple | None = None  # (plan step, in forward)
        self.collective: tuple | None = None  # (op, group, label)
        self.issued = 0  # collectives funcshard issued on this rank
        self.exchange: str | None = None  # the store exchange this rank waits in
        self.calls = 0  # the per-call checks of all ranks this rank began (``_store``)

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
    __slots__ = ("ended", "group", "rank", "size", "stop", "store", "thread")

    def __init__(self) -> None:
        self.group: object = None
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.store: dist.Store | None = None  # a connection of the main thread's, for the end
        self.rank, self.size = 0, 1
        self.ended: Ended | None = None  # what this rank published of its end


_WATCHER = _Watcher()
_PREVIOUS_HOOK: list = []  # sys.excepthook before ours


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
    _WATCHER.store, _WATCHER.rank, _WATCHER.size = _connection(store), rank, dist.get_world_size()
    _WATCHER.ended = None
    store.set(f"{PREFIX}alive/{rank}", f"{_peers.HOST} {os.getpid()}")
    store.add(f"{PREFIX}beat/{rank}", 1)
    if sys.excepthook is not _excepthook:
        _PREVIOUS_HOOK[:] = [sys.excepthook]
        sys.excepthook = _excepthook
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


def stop() -> None:
    """Stop this rank's watcher and wait for it (see [Note: no thread at exit])."""
    _WATCHER.stop.set()
    thread, _WATCHER.thread, _WATCHER.group = _WATCHER.thread, None, None
    _WATCHER.store = None
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=BEAT + 5.0)


def _watch(store: dist.Store, rank: int, world: object, stop: threading.Event) -> None:
    answered = 0
    try:
        while not stop.wait(BEAT):
            if dist.group.WORLD is not world:  # destroyed (or replaced): nothing to serve
                return
            asked = store.add(f"{PREFIX}beat/{rank}", 1) // ASKED
            if asked > answered:
                report = answer(rank)
                store.set(f"{PREFIX}report/answer/{rank}", pickle.dumps((asked, report)))
                answered = asked
                print(
                    f"funcshard: rank {rank} was asked what it is doing: "
                    f"{pickle.loads(report)['doing']}",
                    file=sys.stderr,
                    flush=True,
                )
    except Exception:  # the store is gone (its host died, or the job ends): nothing to serve
        return


def answer(rank: int) -> bytes:
    """This rank's report: where it runs, what it is doing, its stack (pickled)."""
    frame = sys._current_frames().get(RECORD.thread or threading.main_thread().ident)
    frames = traceback.extract_stack(frame) if frame is not None else []
    while frames and frames[-1].filename == __file__:  # this rank asks: not its own report
        frames.pop()
    stack = "".join(traceback.format_list(frames[-_STACK:]))
    return pickle.dumps(
        {
            "rank": rank,
            "where": f"{_peers.HOST} pid {os.getpid()}",
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


# ---- how a rank ended --------------------------------------------------------------------------
def failed(error: BaseException) -> None:
    """Publish that this rank fails with ``error`` and is about to end (see [Note: how a rank
    ended]); nothing without a watcher, or once this rank has published its end."""
    if _WATCHER.store is None or _WATCHER.ended is not None:
        return
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    text = text if len(text) <= 400 else text[:400] + " ..."
    frames = traceback.extract_tb(error.__traceback__)
    frame = next((f for f in reversed(frames) if not f.filename.startswith(_NOT_USERS)), None)
    frame = frame or (frames[-1] if frames else None)
    if frame is not None:
        text += f" (raised at {frame.filename}:{frame.lineno}, in {frame.name})"
    _publish(Ended("failed", RECORD.calls, text))


def _publish(ended: Ended) -> None:
    _WATCHER.ended = ended
    _WATCHER.store.set(f"{PREFIX}end/{_WATCHER.rank}", pickle.dumps(tuple(ended)))


def _excepthook(kind, value, tb) -> None:
    with contextlib.suppress(Exception):  # the store is gone: nothing to tell
        failed(value)
    (_PREVIOUS_HOOK[0] if _PREVIOUS_HOOK else sys.__excepthook__)(kind, value, tb)


@atexit.register
def _at_exit() -> None:
    """Publish this rank's end, wait for its peers' and compare the counts of calls; stop the
    watcher (see [Note: how a rank ended] and [Note: no thread at exit])."""
    verdict = None
    if _WATCHER.store is not None:
        with contextlib.suppress(Exception):  # the store is gone: nothing to compare with
            verdict = _compare_at_exit()
    stop()
    if verdict is not None:
        sys.stdout.flush()
        print(verdict, file=sys.stderr, flush=True)
        os._exit(1)


def _compare_at_exit() -> str | None:
    """Publish this rank's end, wait for its peers' ends (and for them to read this one's), and
    return the error of a rank that exited after fewer funcshard calls than a peer."""
    store, rank = _WATCHER.store, _WATCHER.rank
    mine = _WATCHER.ended
    if mine is None:
        mine = Ended("exited", RECORD.calls)
        _publish(mine)
    peers = Peers(store, RECORD.calls)
    others = [r for r in range(_WATCHER.size) if r != rank]
    ends = _collect(peers, others, peers.ended, limit(store) if mine.how == "exited" else _ENDING)
    store.set(f"{PREFIX}end/read/{rank}", b"1")  # the peers may exit: this rank has read theirs
    _collect(peers, list(ends), lambda r: store.check([f"{PREFIX}end/read/{r}"]) or None, _ENDING)
    ahead = {r: e for r, e in ends.items() if e.calls > mine.calls}
    if mine.how != "exited" or not ahead:
        return None
    named = "; ".join(
        f"rank {r} {'failed' if e.how == 'failed' else 'exited'} at call {e.calls}"
        for r, e in ahead.items()
    )
    return (
        f"funcshard: rank {rank} exited after {mine.calls} funcshard calls, but {named}: the "
        "ranks made different numbers of funcshard calls (a batch skipped on some ranks only, "
        "or a call made on some ranks only), so this rank left its peers waiting. Decide such "
        "things on every rank alike (e.g. skip a bad batch on every rank, after an all_reduce "
        "of a flag). This rank exits with status 1."
    )


def _collect(peers: Peers, ranks: list[int], found, seconds: float) -> dict:
    """``found(r)`` of each of ``ranks`` once it is not ``None``, for at most ``seconds``; a
    rank that is lost (``Peers.lost``) is not waited for."""
    out, waiting = {}, list(ranks)
    deadline = time.monotonic() + seconds
    while waiting and time.monotonic() < deadline:
        for r in list(waiting):
            value = found(r)
            if value is not None:
                out[r] = value
            if value is not None or peers.lost(r):
                waiting.remove(r)
        if waiting:
            time.sleep(0.05)
    return out
