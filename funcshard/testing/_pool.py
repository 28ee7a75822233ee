"""Pools of rank processes on this machine, for tests: ``Pool(world).run(fn, *args)``.

[Note: how ranks start]
Ranks are forked from multiprocessing's *forkserver*, which imports torch and funcshard once
(``set_forkserver_preload``): the first pool of a process pays for one import of torch
(seconds), later ranks start in milliseconds. Plain ``fork`` is never used: the test process may
run gloo, OpenMP or CUDA threads that a forked child would inherit in an unknown state; the
forkserver is a fresh single-threaded process. The preload list is set when the first pool
starts; if this process's forkserver was already running, ranks import torch themselves (slower,
still correct). Where there is no forkserver (Windows), ranks are spawned. As with any
multiprocessing start method but ``fork``, a script that calls ``run`` at import time must do so
under ``if __name__ == "__main__":`` (multiprocessing re-imports the main module in the ranks).

[Note: rendezvous without ports]
The pool's parent opens a ``TCPStore`` on 127.0.0.1 with port 0 (the OS picks a free one, so
parallel test runs cannot collide, and there is no race between choosing and binding a port);
the ranks join it under a fresh key prefix per start, so ranks restarted after a failure never
read the keys of the ranks they replace. No environment variable is read or set in the test
process.

[Note: failures stop the ranks]
After any failure (a rank raised, hung, died) all ranks are killed, and the next call starts
fresh ones: the survivors may be inside a collective that will never complete, or hold state
the failure left half-done. Before killing a rank that did not finish, its Python stack is taken
with ``faulthandler`` (SIGUSR1), which works while the rank is blocked inside a C++ collective.
Once one rank has failed, the others get ``_GRACE`` seconds to report their own errors (they
often raise the same one) before they are stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch.distributed as dist

from . import _rank
from ._rank import Reply, Setup

_GRACE = 1.0  # seconds the other ranks get to report after one failed
_START_TIMEOUT = 120.0  # seconds for ranks to start and join (a first torch import included)
_DIED_STARTING = (
    "A rank that exits while starting usually could not import the main module, which "
    "multiprocessing re-imports in every rank: call fs.testing from a script under "
    "`if __name__ == '__main__':`, not from a program read from stdin. The rank's own error is "
    "on this process's stderr."
)


class RankError(Exception):
    """``fn`` raised, died or did not finish on some ranks.

    Attributes:
        errors: ``{rank: traceback text}`` of the ranks that raised (or died, or failed to
            start); the first one's exception, when it can be pickled, is the ``__cause__``.
        unfinished: the ranks that had not finished when the others were stopped (timeout, or
            another rank's failure); their stacks are in the message.
    """

    def __init__(self, message: str, errors: dict[int, str], unfinished: tuple[int, ...]):
        super().__init__(message)
        self.errors = errors
        self.unfinished = unfinished

    def __reduce__(self):
        return RankError, (str(self), self.errors, self.unfinished)


@dataclasses.dataclass
class _Rank:
    process: mp.process.BaseProcess
    conn: mp.connection.Connection


@dataclasses.dataclass
class _Live:
    """A pool's running ranks (none when stopped) and their scratch directory. Apart from the
    pool so that a pool dropped without ``close()`` is stopped by its finalizer."""

    ranks: list[_Rank] = dataclasses.field(default_factory=list)
    directory: str | None = None

    def stop(self, kill: bool) -> None:
        for r in self.ranks:
            try:
                if kill:
                    r.process.kill()
                else:
                    r.conn.send_bytes(b"")
            except OSError:
                r.process.kill()
        for r in self.ranks:
            r.process.join(5)
            if r.process.is_alive():
                r.process.kill()
                r.process.join()
            r.conn.close()
        self.ranks.clear()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


class Pool:
    """``world`` rank processes with the default process group initialised, reused across calls.

    Ranks start on the first :meth:`run` (and after a failure); :meth:`close` (or leaving a
    ``with`` block) stops them. Every rank runs with ``torch.distributed`` ready, so
    ``init_device_mesh("cpu", (world,))`` works inside ``fn``; ranks set ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` as torchrun does.

    Args:
        world: number of ranks.
        backend: ``"gloo"`` (CPU), or ``"nccl"`` (rank ``r`` uses GPU ``r``).
        timeout: default seconds for a call; also the process group's timeout, so a collective
            that waits longer raises on its rank.
        threads: ``torch.set_num_threads`` on each rank (``None``: torch's default). One thread
            per rank keeps several ranks on a few cores from fighting over them.

    The arguments are kept as the attributes ``world``, ``backend``, ``timeout``, ``threads``.

    Raises:
        ValueError: ``world < 1`` or ``timeout <= 0``.
    """

    def __init__(
        self,
        world: int = 2,
        *,
        backend: str = "gloo",
        timeout: float = 60.0,
        threads: int | None = 1,
    ) -> None:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"Pool: world must be an int >= 1, got {world!r}.")
        if not timeout > 0:
            raise ValueError(f"Pool: timeout must be > 0 seconds, got {timeout!r}.")
        self.world, self.backend, self.timeout, self.threads = world, backend, timeout, threads
        self._live = _Live()
        self._store: dist.TCPStore | None = None
        self._starts = 0
        self._lock = threading.Lock()
        weakref.finalize(self, self._live.stop, False)  # also at exit

    def __repr__(self) -> str:
        state = "running" if self._live.ranks else "stopped"
        return f"Pool(world={self.world}, backend={self.backend!r}, {state})"

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results, by value, in rank order.

        ``fn`` and its arguments are pickled with cloudpickle (lambdas and local functions
        work) and are the same on every rank: use ``dist.get_rank()`` inside ``fn`` for
        per-rank data. Results: DTensors come back as their local shards, tensors detached on
        the CPU (see [Note: results by value]). Output printed on a rank is echoed here,
        prefixed with ``[rank r]``, when the call returns.

        Args:
            timeout: seconds for ``fn`` to finish on every rank (start-up excluded); default
                the pool's.

        Raises:
            RankError: ``fn`` raised or died on a rank (with its traceback), or some ranks did
                not finish within ``timeout`` (naming them, with their stacks). The ranks are
                stopped, and restarted by the next call.
            TypeError: ``fn`` or its arguments cannot be pickled.
            ValueError: ``timeout <= 0``.
            RuntimeError: called inside a rank of a pool.
        """
        if timeout is not None and not timeout > 0:
            raise ValueError(f"Pool.run: timeout must be > 0 seconds, got {timeout!r}.")
        payload = _dumps(fn, args, kwargs)
        name = getattr(fn, "__qualname__", repr(fn))
        with self._lock:
            if not self._alive():
                self._start()
            try:
                for r in self._live.ranks:
                    r.conn.send_bytes(payload)
                timeout = self.timeout if timeout is None else timeout
                replies = self._collect(timeout)
                self._echo()
                return self._results(name, replies, timeout)
            except BaseException:
                self._live.stop(kill=True)
                raise

    def close(self) -> None:
        """Stop the ranks (a later :meth:`run` starts new ones)."""
        with self._lock:
            self._live.stop(kill=False)
            self._store = None

    # ---- starting and stopping ---------------------------------------------------------
    def _alive(self) -> bool:
        if self._live.ranks and all(r.process.is_alive() for r in self._live.ranks):
            return True
        self._live.stop(kill=True)  # a rank exited between calls: start afresh
        return False

    def _start(self) -> None:
        if _rank.CURRENT is not None:
            rank, world = _rank.CURRENT
            raise RuntimeError(
                f"fs.testing: a pool cannot be started inside a rank (this is rank {rank} of a "
                f"{world}-rank pool). Call collectives directly here; start pools from the test "
                "process."
            )
        if self._store is None:  # See [Note: rendezvous without ports]
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._starts += 1
        self._live.directory = tempfile.mkdtemp(prefix="funcshard-testing-")
        ctx = _context()
        for rank in range(self.world):
            setup = Setup(
                rank,
                self.world,
                self.backend,
                self._store.port,
                f"funcshard.testing/{id(self)}/{self._starts}/",
                self.timeout,
                self.threads,
                self._live.directory,
            )
            parent, child = ctx.Pipe()
            process = ctx.Process(
                target=_rank.serve, args=(setup, child), daemon=True, name=f"rank {rank}"
            )
            process.start()
            child.close()
            self._live.ranks.append(_Rank(process, parent))
        try:
            replies = self._collect(_START_TIMEOUT)
            self._results("starting the ranks", replies, _START_TIMEOUT, _DIED_STARTING)
        except BaseException:
            self._live.stop(kill=True)
            raise

    # ---- one call ----------------------------------------------------------------------
    def _collect(self, timeout: float) -> dict[int, Reply]:
        """Replies as they come, until every rank replied, ``timeout`` passed, or ``_GRACE``
        after a failure. See [Note: failures stop the ranks]."""
        deadline = time.monotonic() + timeout
        replies: dict[int, Reply] = {}
        while len(replies) < self.world:
            waiting = {}
            for i, r in enumerate(self._live.ranks):
                if i not in replies:
                    waiting[r.conn] = waiting[r.process.sentinel] = i
            ready = mp.connection.wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for i in sorted({waiting[obj] for obj in ready}):
                replies[i] = self._receive(i)
                if replies[i].status not in ("ok", "ready"):
                    deadline = min(deadline, time.monotonic() + _GRACE)
        return replies

    def _receive(self, i: int) -> Reply:
        r = self._live.ranks[i]
        try:
            return pickle.loads(r.conn.recv_bytes())
        except (EOFError, OSError):
            r.process.join(1)
            return Reply("died", f"exited with code {r.process.exitcode}\n")

    def _results(self, name: str, replies: dict[int, Reply], timeout: float, died: str = ""):
        """The results in rank order, or the RankError (``died``: a hint if a rank died)."""
        unfinished = tuple(i for i in range(self.world) if i not in replies)
        failed = {i: rep for i, rep in replies.items() if rep.status not in ("ok", "ready")}
        if failed or unfinished:
            stacks = self._stacks(unfinished)
            hint = died if any(r.status == "died" for r in failed.values()) else ""
            raise _error(name, failed, unfinished, stacks, timeout, hint)
        results = []
        for i in range(self.world):
            blob = replies[i].blob
            try:
                results.append(None if blob is None else pickle.loads(blob))
            except Exception as e:
                raise RankError(
                    f"{name}: the result of rank {i} cannot be loaded in the test process ({e!r}).",
                    {i: repr(e)},
                    (),
                ) from e
        return results

    def _stacks(self, ranks: tuple[int, ...]) -> dict[int, str]:
        """The Python stacks of the live ``ranks``, dumped by faulthandler on SIGUSR1."""
        if not ranks or not hasattr(signal, "SIGUSR1") or self._live.directory is None:
            return {}
        paths = {i: _rank.files(self._live.directory, i)["stack"] for i in ranks}
        for i in ranks:
            if self._live.ranks[i].process.is_alive():
                os.kill(self._live.ranks[i].process.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not all(_size(p) for p in paths.values()):
            time.sleep(0.02)
        time.sleep(0.05)  # let the last lines of the dumps land
        return {i: p.read_text() for i, p in paths.items() if _size(p)}

    def _echo(self) -> None:
        """What the ranks printed during the call, to this process's stdout / stderr."""
        if self._live.directory is None:
            return
        for i in range(self.world):
            for kind, stream in (("out", sys.stdout), ("err", sys.stderr)):
                path = _rank.files(self._live.directory, i)[kind]
                text = path.read_text(errors="replace") if _size(path) else ""
                if text:
                    stream.write("".join(f"[rank {i}] {line}\n" for line in text.splitlines()))


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _dumps(fn, args, kwargs) -> bytes:
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"fs.testing: cannot send {name} and its arguments to the ranks: {e!r}. They are "
            "pickled (with cloudpickle, so lambdas and local functions work), together with "
            "every object fn refers to; create unpicklable objects (locks, files, process "
            "groups, meshes) inside fn instead."
        ) from e


def _error(name, failed, unfinished, stacks, timeout, hint) -> RankError:
    """One message for everything that went wrong, tracebacks and stacks included."""
    lines = []
    if failed:
        first = min(failed)
        verb = "raised " if failed[first].status == "err" else ""
        lines.append(
            f"{name} failed on rank{'s' if len(failed) > 1 else ''} {_ranks(failed)}: "
            f"rank {first} {verb}{_last_line(failed[first])}"
        )
    if unfinished:
        many = len(unfinished) > 1
        why = "(waiting for it?)" if failed else f"within {timeout:g} s (hung in a collective?)"
        lines.append(
            f"Rank{'s' if many else ''} {_ranks(unfinished)} did not finish {name} {why}; "
            f"{'their stacks are' if many else 'its stack is'} below."
        )
    lines.append("The ranks were stopped; the next call starts new ones.")
    if hint:
        lines.append(hint)
    by_text: dict[str, list[int]] = {}
    for i, rep in sorted(failed.items()):
        by_text.setdefault(rep.text, []).append(i)
    for text, ranks in by_text.items():
        lines.append(f"--- rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} ---\n{text}")
    for i, text in sorted(stacks.items()):
        lines.append(f"--- rank {i}, stack when stopped ---\n{text}")
    error = RankError("\n".join(lines), {i: r.text for i, r in failed.items()}, unfinished)
    cause = failed[min(failed)].blob if failed else None
    if cause is not None:
        with contextlib.suppress(Exception):  # the rank's exception, if it loads here
            error.__cause__ = pickle.loads(cause)
    return error


def _ranks(ranks) -> str:
    return ", ".join(str(i) for i in sorted(ranks))


def _last_line(reply: Reply) -> str:
    lines = reply.text.strip().splitlines()
    return lines[-1] if lines else reply.status


@functools.cache
def _context() -> mp.context.BaseContext:
    """See [Note: how ranks start]."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["funcshard.testing._rank"])
    return ctx


_SHARED: dict[int, Pool] = {}
_SHARED_LOCK = threading.Lock()


def run(
    fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 60.0, **kwargs: Any
) -> list:
    """``fn(*args, **kwargs)`` on ``world`` gloo ranks; the per-rank results in rank order.

    Uses one pool per world size, started on first use and kept for the next calls (stopped at
    exit): a trivial ``fn`` returns in milliseconds after the first call. ``fn`` runs with the
    default process group initialised; see :meth:`Pool.run` for arguments, results and errors.
    Rank processes are reused, so module state set by one call is seen by the next: seed RNGs
    inside ``fn``. Use a :class:`Pool` for a lifetime of your own, or another backend.

    Raises:
        RankError: ``fn`` raised on a rank, or did not finish on every rank within ``timeout``.
        TypeError: ``fn`` or its arguments cannot be pickled.
    """
    with _SHARED_LOCK:
        if world not in _SHARED:
            _SHARED[world] = Pool(world)
        pool = _SHARED[world]
    return pool.run(fn, *args, timeout=timeout, **kwargs)
