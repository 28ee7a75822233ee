"""Ranks that disagree about a tree: an error on every rank, before the first collective.

[Note: one fingerprint per new structure]
Collectives are matched by their order alone. If ranks pass trees that differ in keys, shapes,
dtypes, placements or options, their collectives differ in size or meaning: gloo aborts the
process ("Received data size doesn't match"), or -- worse -- sizes happen to agree and the
result is garbage. So before the first collective of a structure it has not seen, each rank
publishes a 64-bit hash of its structure and reads everyone's. On a match the structure is
remembered and later calls with it pay one set lookup. On a mismatch every rank has read every
hash, so every rank takes the error path together: it publishes its description, reads the
others', and raises the same error naming the first differing leaf.

The exchange goes through the process group's key-value store, not a collective: it adds
nothing to the sequence of collectives (whose counts FSDP2 users compare, and which must stay
identical on every rank), and a rank that never arrives makes the others fail after the store's
timeout with an error that says so, rather than poisoning a collective.

What this cannot see: a rank whose structure is already remembered while another rank's is new
(the first skips the check and goes on to its collectives). Ranks that *change* their trees
differently in the middle of a run are caught only by the store or process-group timeout; see
docs/failures.md.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import _parallel
from ._compile import untraced
from ._spec import ShardSpec

Leaf = tuple[str, ShardSpec, torch.dtype, bool]
_AGREED: set[tuple] = set()
_REMEMBERED = 1024  # structures remembered per process
_SEQUENCE: dict[object, itertools.count] = {}


def agree(fn: str, leaves: Sequence[Leaf], options: tuple = ()) -> None:
    """Check that every rank passes the same structure to ``fn``; remember it if so.

    ``leaves``: ``(path, spec, dtype, differentiated)`` per leaf; ``options``: hashable
    ``(name, value)`` pairs that must agree too (dtypes of the communication, a plan).

    Raises:
        ValueError: on every rank, naming the first leaf (or option) that differs and how.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    key = (dist.group.WORLD, fn, tuple(leaves), options)
    if key in _AGREED:
        return
    with untraced():  # under torch.compile: checked at trace time, never part of the graph
        entries = _describe(leaves, options)
    if _same_everywhere(_digest(entries)):
        if len(_AGREED) >= _REMEMBERED:  # a run that keeps making new trees: start over
            _AGREED.clear()
        _AGREED.add(key)
        return
    everyone = [pickle.loads(b) for b in _exchange("entries", pickle.dumps(entries))]
    raise ValueError(_message(fn, everyone))


def each_rank(what: str, value: str) -> list[str]:
    """Every rank's ``value``, in rank order (``[value]`` without a process group), through the
    store: no collective. All ranks must call it at the same point."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    return [v.decode() for v in _exchange(what, value.encode())]


def leaf(path: str, spec: ShardSpec, local: torch.Tensor) -> Leaf:
    """The entry of a shard whose gradient flows back through the collectives if it requires
    grad (see [Note: frozen leaves] in ``_autodiff``)."""
    return (path, spec, local.dtype, local.requires_grad)


def _describe(leaves, options) -> list[tuple[str, str]]:
    out = []
    for path, spec, dtype, grad in leaves:
        placements = ", ".join(str(p) for p in spec.placements)
        mesh = _parallel.describe(spec.mesh)  # the same on every rank, sub-meshes too
        grad = "requires grad" if grad else "no grad"
        out.append((path, f"{dtype} {list(spec.shape)} ({placements}) on mesh {mesh}, {grad}"))
    out.extend((f"<{name}>", repr(value)) for name, value in options)
    return out


def _digest(entries) -> int:
    h = hashlib.blake2b(repr(entries).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


def _same_everywhere(digest: int) -> bool:
    digests = _exchange("digest", str(digest).encode())
    return all(d == digests[0] for d in digests)


def _exchange(what: str, value: bytes) -> list[bytes]:
    """Publish ``value`` and return every rank's, in rank order (through the default store)."""
    store = dist.distributed_c10d._get_default_store()
    group = dist.group.WORLD
    seq = _SEQUENCE.setdefault(group, itertools.count())
    prefix = f"funcshard/agree/{next(seq)}/{what}/"
    keys = [f"{prefix}{r}" for r in range(dist.get_world_size())]
    store.set(keys[dist.get_rank()], value)
    try:
        store.wait(keys, store.timeout)
    except (RuntimeError, dist.DistStoreError) as e:
        raise RuntimeError(
            f"funcshard: rank {dist.get_rank()} checked that every rank passes the same tree, but "
            f"not every rank took part within {store.timeout} ({e}). A rank is stuck or dead, or "
            "the ranks changed their trees differently in the middle of the run (see "
            "docs/failures.md)."
        ) from e
    return store.multi_get(keys)


def _message(fn: str, everyone: list[list[tuple[str, str]]]) -> str:
    tables = [dict(entries) for entries in everyone]
    paths = dict.fromkeys(path for entries in everyone for path, _ in entries)
    path = next((p for p in paths if len({t.get(p) for t in tables}) > 1), None)
    if path is None:
        where = "in the order of their leaves"
    else:
        seen = (t.get(path) or "absent" for t in tables)
        where = f"at {path!r} (" + "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen)) + ")"
    return (
        f"{fn}: ranks disagree {where}. Every rank must pass the same tree -- the same keys, "
        "shapes, dtypes, placements, frozen parameters and options -- in the same order: build "
        "the model and its shards the same way on every rank (same seed or checkpoint, no "
        "rank-dependent configuration)."
    )
