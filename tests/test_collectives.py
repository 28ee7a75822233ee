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


def test_the_backend_averages_where_it_can():
    """[Note: the backend averages]: a mean over a group whose backend has ``ReduceOp.AVG``
    (NCCL; here torch's fake process group, which moves nothing) goes to the reduction
    undivided, as ``"avg"``, as FSDP2 sends float32 and bfloat16 gradients; float16, a weight,
    and a divisor beyond the group (``over``) are divided first and summed. And a step over the
    fake group runs its reduce-scatters so."""
    import dataclasses

    import funcshard as fs
    from funcshard._communication import _collectives as C
    from funcshard._pricing._fake_world import fake_world

    with fake_world(4) as m:
        comm = C.Comm(group=m.get_group(0), world=4, label="t", reduce_dtype=torch.float32)
        x = torch.ones(8)
        y, ours, op = C._reduce_input(x, comm, False)
        assert op == "avg" and torch.equal(y, x) and not ours  # nothing made, nothing divided
        for other in (
            dataclasses.replace(comm, reduce_dtype=torch.float16),
            dataclasses.replace(comm, over=2),
        ):
            y, ours, op = C._reduce_input(x, other, False)
            n = other.world * other.over
            assert op == "sum" and ours and torch.equal(y, (x.to(y.dtype) / n)), other
        assert C._reduce_input(x, dataclasses.replace(comm, weight=0.5), False)[2] == "sum"
        assert C._reduce_input(x, dataclasses.replace(comm, mean=False), False)[2] == "sum"

        params = fs.shard({"w": torch.ones(8, 2)}, m)
        vg = fs.value_and_grad(lambda p: fs.unshard(p)["w"].sum())
        with torch.profiler.profile() as prof:
            vg(params)
        names = [e.name for e in prof.events()]
        assert "_c10d_functional::reduce_scatter_tensor" in names
        assert "aten::div_" not in names and "aten::div" not in names


def test_gloo_sums_divided_gradients(world2):
    """gloo has no ``ReduceOp.AVG``: the mean is divided first and summed."""

    def reduce_input():
        from funcshard._communication import _collectives as C

        comm = C.Comm(group=dist.group.WORLD, world=2, label="t", reduce_dtype=torch.float32)
        y, _, op = C._reduce_input(torch.ones(4), comm, False)
        return op, y.tolist()

    assert world2.run(reduce_input) == [("sum", [0.5] * 4)] * 2
