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


def test_every_mode_has_a_way():
    """[Note: one way per mode]: each execution mode picks its collectives' rules from one
    table, and a collective that must complete at once never stays pending."""
    from funcshard._communication._collectives import _WAYS
    from funcshard._runtime._mode import Mode

    assert set(_WAYS) == set(Mode)
    for mode in Mode:
        assert _WAYS[mode].pending == mode.asynchronous
        assert not _WAYS[mode.waited].pending
        assert _WAYS[mode].traced == mode.traced
        # inside torch.func (wrappers) and under torch.compile (no storage) nothing is freed
        assert _WAYS[mode].frees == mode.plain


def gather_in(mode_name: str):
    """An early all-gather issued in ``mode``: its result, and whether its c10d work sits in the
    registry of works in flight (see [Note: one way per mode])."""
    from funcshard._communication import _collectives as C
    from funcshard._runtime._mode import Mode

    group = mesh(dist.get_world_size()).get_group(0)
    comm = C.Comm(group, dist.get_world_size(), "test", mode=Mode[mode_name])
    x = torch.full((3,), float(dist.get_rank()))
    started = C.start_all_gather(comm, [x])
    registered = id(started.work) in C._UNFINISHED
    out = started.wait()
    return out.tolist(), registered, id(started.work) in C._UNFINISHED


def test_a_capture_registers_no_work_in_flight(world2):
    """Captured, the same in-place all-gather as eager, but not registered (pruning the registry
    queries CUDA events, which a capture forbids); eager, registered until waited."""
    expected = [0.0] * 3 + [1.0] * 3
    for out, registered, after in world2.run(gather_in, "EAGER"):
        assert (out, registered, after) == (expected, True, False)
    for out, registered, after in world2.run(gather_in, "CAPTURED"):
        assert (out, registered, after) == (expected, False, False)
