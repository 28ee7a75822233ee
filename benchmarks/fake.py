"""A fake process group in one process: collectives that move nothing, for any world size.

torch ships the backend for its own tests (``torch.testing._internal.distributed.fake_pg``):
every collective returns at once with uninitialised outputs. funcshard's agreement check
(``_consensus``) exchanges a fingerprint through the process group's store, which the fake
store does not implement; ``_MirrorStore`` answers it as if every imaginary rank had published
what this one did.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

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


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0, device: str = "cpu") -> Iterator[DeviceMesh]:
    """A 1-D mesh of ``device`` (``"cuda"``: every rank's work on this process's GPU) over a
    fake process group of ``world`` ranks (this process is ``rank``)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    store = _MirrorStore()  # referenced until the group is destroyed (c10d keeps no Python ref)
    dist.init_process_group("fake", store=store, rank=rank, world_size=world)
    # c10d wraps the store in a (C++) PrefixStore, whose calls reach only the methods c10d's
    # Python trampoline forwards (not delete_key): the exchange gets the mirror itself
    c10d = dist.distributed_c10d
    default_store, c10d._get_default_store = c10d._get_default_store, lambda s=store: s
    try:
        mesh = init_device_mesh(device, (world,))
        mesh.store = store  # type: ignore[attr-defined]  # for counting the exchanges
        yield mesh
    finally:
        c10d._get_default_store = default_store
        dist.destroy_process_group()
        del store
