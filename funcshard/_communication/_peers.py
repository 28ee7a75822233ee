"""What a waiting rank knows of its peers: how they ended, their processes, their silence.

[Note: a paused rank is not a dead rank]
A silent heartbeat (see [Note: a heartbeat per rank] in ``_liveness``) proves nothing: a rank
stopped by a debugger or a job scheduler (SIGSTOP), or one inside a C call that holds the GIL (a
tokenizer, a decoder, a large pickle), stops beating and is healthy. So a waiting rank
(:class:`Peers`) calls a peer dead only on evidence:

- the peer published how it ended (:class:`Ended`; see [Note: how a rank ended] in
  ``_liveness``);
- its process on this host is gone or a zombie (``/proc``; a process that exists, in any state,
  is alive);
- a collective with it failed (a reset connection) and the peer, on another host, has been
  silent for ``SILENT`` seconds.

A peer silent for ``_QUIET`` seconds is reported once per wait, as a warning naming it and what
is known (its ``/proc`` state on this host), and the rank keeps waiting. Silence alone fails the
job only at the wait's limit (the process group's timeout: [Note: a hang explains itself] in
``_hangs``), whose error says how long each silent peer has been silent. Times are this rank's
clock since it began to watch: no clocks are compared across hosts. Imports no funcshard
module.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import warnings
from typing import NamedTuple

import torch.distributed as dist

BEAT = 1.0  # seconds between two heartbeats of a rank
ASKED = 1 << 32  # a request for a report, added to a rank's heartbeat counter
PREFIX = "funcshard/"
SILENT = 5.0  # seconds of silence after which a peer elsewhere is dead, once a collective failed
_QUIET = 10.0  # seconds of silence after which a waiting rank warns (once per peer and wait)
HOST = socket.gethostname()  # tests stand in another host here
_STATES = {  # /proc's state letters of a process that is alive
    "T": "stopped (state T: a debugger or a suspend?)",
    "t": "stopped by a debugger (state t)",
    "R": "running (state R: busy in a call that holds the GIL, or in work outside funcshard?)",
    "S": "sleeping (state S: waiting for something outside funcshard?)",
    "D": "in an uninterruptible wait (state D: disk, network file system or swap?)",
}


class Ended(NamedTuple):
    """How a rank ended (see [Note: how a rank ended]): ``how`` is ``"failed"`` or
    ``"exited"``; ``calls`` its count of funcshard calls; ``error`` the first line of its
    error and where it was raised (failed only)."""

    how: str
    calls: int
    error: str = ""

    def clause(self, rank: int, calls: int) -> str:
        """What a waiting rank, at its call ``calls``, says of ``rank``."""
        if self.how == "failed":
            return f"rank {rank} failed first: {self.error}"
        return (
            f"rank {rank} exited (with no uncaught error) after {self.calls} funcshard calls, "
            f"while this rank is at call {calls}: the ranks made different numbers of "
            "funcshard calls (a batch skipped on some ranks only, or a call made on some ranks "
            "only: decide such things on every rank alike)"
        )


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


class Peers:
    """A waiting rank's view of its peers: how they ended, their processes on this host, when
    each heartbeat counter last moved by this rank's clock (see [Note: a paused rank is not a
    dead rank]). ``calls``: this rank's count of funcshard calls; ``failed``: a collective with
    them failed (evidence of a death elsewhere)."""

    def __init__(self, store: dist.Store, calls: int, failed: bool = False) -> None:
        self.store, self.calls, self.failed = store, calls, failed
        self.seen: dict[int, tuple[int | None, float]] = {}
        self.where: dict[int, str] = {}  # "host pid" of each rank, once published
        self.warned: set[int] = set()

    def dead(self, rank: int) -> str | None:
        """A clause saying how ``rank`` ended or is known to be dead, else ``None``; warns once
        when it has been silent for ``_QUIET`` seconds."""
        end = self.ended(rank)
        if end is not None:
            return end.clause(rank, self.calls)
        state = self.state(rank)
        if state in ("exited", "Z", "X"):
            host, pid = self.where[rank].rsplit(" ", 1)
            how = "has exited" if state == "exited" else "is a zombie"
            return f"rank {rank} is gone (its process {pid} on {host} {how})"
        silent = self.silent(rank)
        if self.failed and state is None and silent >= SILENT:
            return (
                f"rank {rank} is gone (no heartbeat for {silent:.0f} s from another host, and "
                "the collective failed: its process or its host died)"
            )
        if silent >= _QUIET and rank not in self.warned:
            self.warned.add(rank)
            warnings.warn(
                f"funcshard: rank {rank} has not responded for {silent:.0f} s; "
                f"{self.known(rank)}. Rank {dist.get_rank()} keeps waiting (up to "
                "FUNCSHARD_WAIT_TIMEOUT, default the process group's timeout).",
                RuntimeWarning,
                stacklevel=2,
            )
        return None

    def ended(self, rank: int) -> Ended | None:
        """What ``rank`` published of its end, if it did."""
        key = f"{PREFIX}end/{rank}"
        return Ended(*pickle.loads(self.store.get(key))) if self.store.check([key]) else None

    def lost(self, rank: int) -> bool:
        """Whether a rank that published no end is not worth waiting for at exit: it never
        watched, its process is gone, or it has been silent for ``SILENT`` s elsewhere."""
        state = self.state(rank)
        return (
            rank not in self.where
            or state in ("exited", "Z", "X")
            or (state is None and self.silent(rank) >= SILENT)
        )

    def state(self, rank: int) -> str | None:
        """``rank``'s process state on this host (``/proc``'s letter, ``"exited"``), or
        ``None`` (another host, no ``/proc``, or not published yet)."""
        if rank not in self.where:
            key = f"{PREFIX}alive/{rank}"
            if not self.store.check([key]):
                return None
            self.where[rank] = self.store.get(key).decode()
        host, pid = self.where[rank].rsplit(" ", 1)
        return _process_state(int(pid)) if host == HOST else None

    def silent(self, rank: int) -> float:
        """Seconds since ``rank``'s heartbeat last moved, as this rank has seen it (0 for a rank
        that never beat: it made no funcshard call yet)."""
        key = f"{PREFIX}beat/{rank}"
        if not self.store.check([key]):
            return 0.0
        beat, now = int(self.store.get(key)) % ASKED, time.monotonic()
        last = self.seen.get(rank)
        if last is None or last[0] != beat:
            self.seen[rank] = (beat, now)
            return 0.0
        return now - last[1]

    def known(self, rank: int) -> str:
        """What is known of a silent ``rank``'s process."""
        state = self.state(rank)
        if rank not in self.where:
            return "it has not published its host yet (no funcshard call so far)"
        host, pid = self.where[rank].rsplit(" ", 1)
        if state is None:
            return (
                f"its process {pid} runs on host {host}, which this rank cannot inspect: it "
                "may be paused or busy in a call that holds the GIL, or its host may be lost"
            )
        return f"its process {pid} on {host} is {_STATES.get(state, f'in state {state}')}"


def _process_state(pid: int) -> str | None:
    """``/proc``'s state letter of process ``pid`` on this host, ``"exited"``, or ``None``
    (alive, state unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "exited"
    except OSError:  # no /proc: ask the OS
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except OSError:
            pass
        return None
