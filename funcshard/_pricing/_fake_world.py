"""A fake process group in one process: collectives that move nothing, for any world size.

torch ships the backend for its own tests (``torch.testing._internal.distributed.fake_pg``):
every collective returns at once with uninitialised outputs. funcshard's agreement check
(``_consensus``) exchanges a fingerprint through the process group's store, which the fake
store does not implement; ``_MirrorStore`` answers it as if every imaginary rank had published
what this one did.

With it, a plan, its shards and :func:`~funcshard.explain` of one rank's step run for a world
of any size and mesh shape without the machines (``python -m funcshard.explain``).
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Iterator, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class _MirrorStore(dist.Store):
    """Every key reads back the last value this rank set (all ranks agree with this one)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = b""
        self.sets = 0  # exchanges published (the agreement's: once per checked call)

    def set(self, key: str, value: bytes) -> None:
        self.last = value
        self.sets += 1

    def get(self, key: str) -> bytes:
        return self.last

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        pass

    def multi_get(self, keys) -> list[bytes]:
        return [self.last] * len(keys)

    def check(self, keys) -> bool:
        return True

    def delete_key(self, key: str) -> bool:
        return True

    def __deepcopy__(self, memo: dict) -> _MirrorStore:
        # the mesh carries the store (``mesh.store``), and torch.compile's guards deep-copy a
        # DTensor's mesh: a copy is this store, as a process group's copy is the group
        return self


@contextlib.contextmanager
def fake_world(
    world: int | Sequence[int],
    rank: int = 0,
    device: str = "cpu",
    names: Sequence[str] | None = None,
) -> Iterator[DeviceMesh]:
    """A mesh of ``device`` (``"cuda"``: every rank's work on this process's GPU) over a fake
    process group; this process is ``rank``.

    ``world``: the number of ranks (a 1-D mesh), or the mesh shape, e.g. ``(2, 4)`` for HSDP's
    ``(replicate, shard)`` over 8 ranks. ``names``: the mesh dims' names (one per dim).

    Raises:
        ValueError: a mesh dim below 1, ``rank`` outside the world, ``names`` of another length,
            or a process group already initialized (destroy it first).
    """
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    shape = (world,) if isinstance(world, int) else tuple(world)
    size = math.prod(shape)
    if not shape or min(shape) < 1 or not 0 <= rank < size:
        raise ValueError(
            f"fake_world: mesh shape {shape} needs every dim >= 1 and rank in [0, {size}); "
            f"got rank {rank}."
        )
    if names is not None and len(names) != len(shape):
        raise ValueError(f"fake_world: {len(names)} names {tuple(names)} for mesh shape {shape}.")
    if dist.is_initialized():
        raise ValueError(
            "fake_world: a process group is already initialized in this process; call "
            "dist.destroy_process_group() first (the fake world replaces the default group)."
        )
    store = _MirrorStore()  # referenced until the group is destroyed (c10d keeps no Python ref)
    dist.init_process_group("fake", store=store, rank=rank, world_size=size)
    # c10d wraps the store in a (C++) PrefixStore, whose calls reach only the methods c10d's
    # Python trampoline forwards (not delete_key): the exchange gets the mirror itself
    c10d = dist.distributed_c10d
    default_store, c10d._get_default_store = c10d._get_default_store, lambda s=store: s
    try:
        dims = tuple(names) if names is not None else None
        mesh = init_device_mesh(device, shape, mesh_dim_names=dims)
        mesh.store = store  # type: ignore[attr-defined]  # for counting the exchanges
        yield mesh
    finally:
        c10d._get_default_store = default_store
        dist.destroy_process_group()
        del store
