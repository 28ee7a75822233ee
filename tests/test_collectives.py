"""The collectives' contracts that the rest of funcshard relies on."""

from __future__ import annotations

import torch
import torch.distributed as dist

from _mesh import mesh


def gloo_clones_reduce_scatter_input():
    """[Note: gloo copies reduce-scatter inputs]: overwrite the input right after issuing an
    asynchronous reduce-scatter; the result must not change."""
    from funcshard._communication._collectives import copies_reduce_scatter_input

    group = mesh(dist.get_world_size()).get_group(0)
    world = dist.get_world_size()
    x = torch.arange(world * 1000, dtype=torch.float32) * (dist.get_rank() + 1)
    expected = x.view(world, -1)[dist.get_rank()] * sum(range(1, world + 1)) / (dist.get_rank() + 1)
    y = torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", world, group.group_name)
    x.fill_(float("nan"))
    x.untyped_storage().resize_(0)
    torch.ops._c10d_functional.wait_tensor(y)
    return copies_reduce_scatter_input(group, "cpu"), torch.equal(y, expected)


def test_gloo_copies_reduce_scatter_inputs(world2):
    for claims, holds in world2.run(gloo_clones_reduce_scatter_input):
        assert claims and holds
