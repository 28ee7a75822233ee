"""Ranks that disagree, or fail alone: an error on every rank, before the first collective.

[Note: one status per call]
Collectives are matched by their order alone. If ranks pass trees that differ in keys, shapes,
dtypes, placements or options, their collectives differ in size or meaning: gloo aborts the
process ("Received data size doesn't match"), or -- worse -- sizes happen to agree and the
result is garbage. And if one rank raises before its collectives (a missing key, a shard on
meta) while the others go on, a program that catches the error pairs that rank's next call with
the others' current one. So every call of ``unshard``, ``reduce`` and a scheduled ``apply``
publishes one status before its first collective -- a 64-bit hash of its structure (with this
rank's count of samples: see [Note: ranks that average over different counts] in ``_counts``),
or its error -- and reads everyone's:

- all hashes equal: the call goes on, with every rank's count (the hash of a structure seen
  before is cached: the cost is the exchange alone);
- some rank failed: every rank raises, the failing one its own error, the others the same type
  naming that rank and its message; no rank has issued a collective, so a caught error leaves
  the ranks in step;
- hashes differ: every rank publishes its description, reads the others', and raises the same
  ``ValueError`` naming the first differing leaf.

An error a rank finds where raising would leave the others in a collective without it (a
scheduled forward that used a group where the plan had already freed it: see [Note: the
collectives follow the plan] in ``_execution/_deviation``) is kept (:func:`defer`) and published
as that rank's error at its next call's check: every rank raises it there.

The exchange goes through the process group's key-value store, not a collective: it adds
nothing to the sequence of collectives (whose counts FSDP2 users compare, and which must stay
identical on every rank). Its cost (three store round trips per call; BENCHMARKS.md) is paid
once per ``apply`` (one per step) or per ``unshard`` / ``reduce`` call. Under
``torch.compile`` it runs while tracing only.

The exchange itself, its numbering and its wait (which names a rank that is gone, and explains a
hang with every rank's report) are ``_store``'s: see [Note: one sequence per set of ranks] and
[Note: waiting for a rank that is gone] there.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import functools
import hashlib
import pickle
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .._runtime._compile import untraced
from .._trees import _parallel
from .._trees._spec import ShardSpec
from .._trees._subclass import is_subclass
from . import _liveness, _store, _updates
from ._updates import by_rank, differences, taken

Leaf = tuple[str, ShardSpec, "torch.dtype | str", bool]
_DIGESTS: collections.OrderedDict[tuple, int] = collections.OrderedDict()
_REMEMBERED = 1024  # structures whose hash is cached, per process
_ERROR, _GONE, _COLLECTIVE = b"E", _store.GONE, _store.COLLECTIVE
_exchange = _store.exchange
_DEFERRED: list[Exception] = []  # see defer


def agree(
    fn: str,
    leaves: Sequence[Leaf],
    options: tuple = (),
    error: Exception | None = None,
    digest: int | None = None,
    count: float | None = None,
) -> list[float | None]:
    """Check that every rank passes the same structure to ``fn`` and that none failed; return
    every rank's ``count``.

    Every rank calls it once per call of ``fn``, before ``fn``'s first collective; a rank whose
    local checks failed takes part with its ``error`` (see :func:`failing`). ``leaves``:
    ``(path, spec, dtype, differentiated)`` per leaf; ``options``: hashable ``(name, value)``
    pairs that must agree too (dtypes of the communication, a plan); ``digest``: their
    :func:`digest`, if the caller keeps it; ``count``: this rank's count of samples, or
    ``None`` (see [Note: ranks that average over different counts] in ``_counts``).

    Raises:
        ValueError: on every rank, naming the first leaf (or option) that differs and how.
        ``error`` (on this rank), or the same type naming the rank that failed (on the others).
        RuntimeError: a rank is gone, or the store cannot be reached.
    """
    if error is None and _DEFERRED:
        error = _DEFERRED.pop()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return [count]
    try:
        return _agree(fn, leaves, options, error, digest, count)
    except Exception as e:
        e._funcshard_agreed = True  # type: ignore[attr-defined]  # see failing
        raise


def _agree(fn, leaves, options, error, digest, count) -> list[float | None]:
    updates, updated = taken()  # see [Note: the optimizer rides the next check]
    with untraced():  # under torch.compile: checked at trace time, never part of the graph
        if error is not None:
            status = _ERROR + pickle.dumps((type(error).__name__, str(error)))
        else:
            status = str(cached_digest(fn, leaves, options) if digest is None else digest)
            status = f"{status}/{updates}|{'' if count is None else repr(count)}".encode()
        everyone = _exchange("status", status)
    failed = [(r, s) for r, s in enumerate(everyone) if s[:1] in (_ERROR, _GONE, _COLLECTIVE)]
    if failed:
        if error is not None:
            raise error
        raise _failure(fn, *failed[0])
    digests, counts = zip(*(s.split(b"|", 1) for s in everyone), strict=True)
    if any(d != digests[0] for d in digests):
        with untraced():
            entries = [("<call>", fn), *_describe(leaves, options), *updated]
            described = _exchange("entries", pickle.dumps(entries))
        raise ValueError(_message(fn, [pickle.loads(b) for b in described]))
    return [float(c) if c else None for c in counts]


def defer(error: Exception) -> None:
    """Raise ``error`` at this rank's next :func:`agree` -- so on every rank, before any
    collective of that call -- for an error found where raising at once would leave the other
    ranks in a collective without this one (see [Note: the collectives follow the plan] in
    ``_execution/_deviation``). Only the first error is kept until then."""
    if not _DEFERRED:
        _DEFERRED.append(error)


@contextlib.contextmanager
def failing(fn: str) -> Iterator[None]:
    """Around a call's local checks and its :func:`agree`: an exception raised inside (before
    the exchange) is first announced to the other ranks through :func:`agree`, then raised, so
    that it takes part in the same exchange as their statuses. Keep the call's collectives
    outside the block. Notes ``fn`` as this rank's current call (see ``_liveness``)."""
    _liveness.doing(fn)
    try:
        yield
    except Exception as e:
        if not getattr(e, "_funcshard_agreed", False):
            agree(fn, (), (), error=e)  # raises e
        raise


def each_rank(what: str, value: str) -> list[str]:
    """Every rank's ``value``, in rank order (``[value]`` without a process group), through the
    store: no collective. All ranks must call it at the same point."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    return [v.decode() for v in _exchange(what, value.encode())]


def leaf(path: str, spec: ShardSpec, local: torch.Tensor) -> Leaf:
    """The entry of a shard whose gradient flows back through the collectives if it requires
    grad (see [Note: frozen leaves] in ``_autodiff``); a tensor subclass's (a low-precision
    weight, gathered as its class says: see ``_packed``) names its class with its dtype."""
    dtype: torch.dtype | str = local.dtype
    if type(local) is not torch.Tensor and is_subclass(local):
        dtype = f"{type(local).__qualname__} of {local.dtype}"
    return (path, spec, dtype, local.requires_grad)


def cached_digest(fn: str, leaves: Sequence[Leaf], options: tuple) -> int:
    """The hash of a structure as :func:`agree` compares it (cached per structure)."""
    key = (dist.group.WORLD, fn, tuple(leaves), options)
    found = _DIGESTS.get(key)
    if found is None:
        with untraced():  # under torch.compile: real metadata (the mesh's ranks), not traced
            found = _digest(_describe(leaves, options))
        while len(_DIGESTS) >= _REMEMBERED:
            _DIGESTS.popitem(last=False)
        _DIGESTS[key] = found
    return found


def _describe(leaves, options) -> list[tuple[str, str]]:
    out = []
    for path, spec, dtype, grad in leaves:
        placements = ", ".join(str(p) for p in spec.placements)
        mesh = _parallel.describe(spec.mesh)  # the same on every rank, sub-meshes too
        mesh += f" (expert parallel dims {list(spec.ep_dims)})" if spec.ep_dims else ""
        grad = "requires grad" if grad else "no grad"
        out.append((path, f"{dtype} {list(spec.shape)} ({placements}) on mesh {mesh}, {grad}"))
    out.extend((f"<{name}>", repr(value)) for name, value in options)
    return out


def _digest(entries) -> int:
    h = hashlib.blake2b(repr(entries).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


def _failure(fn: str, rank: int, status: bytes) -> Exception:
    if status[:1] == _COLLECTIVE:
        return RuntimeError(
            f"{fn}: rank {rank} is one collective behind or ahead (it is about to issue "
            f"{status[1:].decode(errors='replace')}) while this rank checks the tree of a new "
            "call: the ranks issued different collectives (FUNCSHARD_DEBUG found it; see "
            "docs/failures.md, control flow that differs between ranks)."
        )
    if status[:1] == _GONE:  # the clause names the rank; see [Note: how a rank ended]
        return RuntimeError(
            f"{fn}: {status[1:].decode()}. No rank issued a collective of this call. Restart "
            "the job (from the last checkpoint) once that is mended."
        )
    kind, message = pickle.loads(status[1:])
    cls = getattr(builtins, kind, None)
    cls = cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError
    return cls(
        f"{fn}: rank {rank} raised {kind}: {message} (raised on every rank, before any "
        "collective of this call, so that the ranks stay in step)"
    )


def _message(fn: str, everyone: list[list[tuple[str, str]]]) -> str:
    calls = [dict(entries).get("<call>", fn) for entries in everyone]
    doing = f" (the ranks are at different calls: {by_rank(calls)})"
    doing = doing if len(set(calls)) > 1 else ""
    optimizer = differences(everyone)  # see [Note: the optimizer rides the next check]
    if optimizer is not None:
        return f"{fn}: {optimizer}{doing}"
    everyone = [[(p, v) for p, v in entries if p != "<call>"] for entries in everyone]
    tables = [dict(entries) for entries in everyone]
    paths = dict.fromkeys(path for entries in everyone for path, _ in entries)
    path = next((p for p in paths if len({t.get(p) for t in tables}) > 1), None)
    if path is None:
        where = "in the order of their leaves"
    else:
        seen = (t.get(path) or "absent" for t in tables)
        where = f"at {path!r} (" + "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen)) + ")"
    where += doing
    return (
        f"{fn}: ranks disagree {where}. Every rank must pass the same tree -- the same keys, "
        "shapes, dtypes, placements, frozen parameters and options -- in the same order: build "
        "the model and its shards the same way on every rank (same seed or checkpoint, no "
        "rank-dependent configuration)."
    )


def recorded(fn: Callable, update: Callable) -> Callable:
    """``fn`` (``update`` or its donated form), leaving a record of ``update``'s transformation
    when called at the top level (not from another transformation's update) on sharded
    gradients; an error raised inside is announced to the other ranks (see
    [Note: the optimizer rides the next check] in ``_updates``)."""

    @functools.wraps(fn)
    def run(grads, state, params=None):
        if not _updates.recorded_here(grads):
            return fn(grads, state, params)
        with failing("fs.optim update"), _updates.recording(update, state):
            return fn(grads, state, params)

    run.funcshard_update = update  # type: ignore[attr-defined]  # what describe shows
    return run


def before_collective(what: str) -> None:
    """Right before an optimizer's collective: if this rank holds records, check them with the
    other ranks now (see [Note: the optimizer rides the next check] in ``_updates``).

    Raises:
        ValueError: on every rank, when the ranks' records differ.
    """
    if _updates.pending():
        agree(f"fs.optim ({what})", (), (("optimizer collective", what),))
