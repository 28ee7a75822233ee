"""Device meshes for the tests' rank processes."""

from __future__ import annotations

import functools


@functools.cache
def mesh(*shape: int, names: tuple[str, ...] | None = None, device: str = "cpu"):
    """A cached DeviceMesh in a rank process (2-D meshes create process groups once)."""
    from torch.distributed.device_mesh import init_device_mesh

    if names is None and len(shape) == 2:
        names = ("replicate", "shard")
    return init_device_mesh(device, shape, mesh_dim_names=names)
