"""shard / unshard round trips and shard's semantics, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import funcshard as fs

from _checks import raises
from _mesh import mesh

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


def _full(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def roundtrip(cases, mesh_shape):
    """Each case: (shape, dtype index, placements as ('S', d) / ('R',)). Returns failures."""
    m = mesh(*mesh_shape)
    failures = []
    for i, (shape, dt, pls) in enumerate(cases):
        full = _full(shape, DTYPES[dt], seed=i)
        pl = tuple(Shard(p[1]) if p[0] == "S" else Replicate() for p in pls)
        with CommDebugMode() as comm:
            tree = fs.shard({"x": full, "nested": [full * 2]}, m, pl)
        if comm.get_total_counts():
            failures.append((shape, pl, "shard communicated"))
        expected = distribute_tensor(full, m, pl, src_data_rank=None).to_local()
        if not torch.equal(tree["x"].to_local(), expected):
            failures.append((shape, pl, "local shard differs from DTensor's"))
        back = fs.unshard(tree)
        if not (torch.equal(back["x"], full) and torch.equal(back["nested"][0], full * 2)):
            failures.append((shape, pl, "unshard(shard(x)) != x"))
        if back["x"].dtype != full.dtype or type(back["x"]) is not torch.Tensor:
            failures.append((shape, pl, "wrong result type"))
    return failures


@st.composite
def _case(draw, mesh_ndim):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    dt = draw(st.integers(0, len(DTYPES) - 1))
    pls = tuple(
        ("S", draw(st.integers(0, ndim - 1))) if ndim and draw(st.booleans()) else ("R",)
        for _ in range(mesh_ndim)
    )
    return shape, dt, pls


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cases=st.lists(_case(1), min_size=1, max_size=4))
def test_roundtrip_is_exact_2_ranks(world2, cases):
    assert world2.run(roundtrip, cases, (2,)) == [[], []]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cases=st.lists(_case(1), min_size=1, max_size=4))
def test_roundtrip_is_exact_4_ranks(world4, cases):
    assert world4.run(roundtrip, cases, (4,)) == [[]] * 4


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cases=st.lists(_case(2), min_size=1, max_size=4))
def test_roundtrip_is_exact_2x2_mesh(world4, cases):
    assert world4.run(roundtrip, cases, (2, 2)) == [[]] * 4


def semantics():
    m = mesh(dist.get_world_size())
    w = torch.randn(5, 3, requires_grad=True)
    b = torch.randn(3)
    out = fs.shard({"w": w, "b": b, "s": torch.tensor(2.0), "none": None}, m)
    full_w = out["w"]
    assert isinstance(full_w, DTensor) and full_w.is_leaf and full_w.requires_grad
    assert not out["b"].requires_grad and out["none"] is None
    assert out["w"].placements == (Shard(0),) and out["s"].placements == (Replicate(),)
    local = out["w"].to_local()
    assert (
        local.is_contiguous()
        and local.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    )
    # a callable chooses per parameter (like FSDP2's shard_placement_fn)
    by_fn = fs.shard({"w": w, "b": b}, m, lambda path, t: Shard(1) if path == "w" else None)
    assert by_fn["w"].placements == (Shard(1),) and by_fn["b"].placements == (Shard(0),)
    # HSDP default on a 2-D mesh
    return True


def test_shard_semantics(world2):
    assert world2.run(semantics) == [True, True]


def hsdp_default():
    out = fs.shard({"w": torch.randn(4, 2)}, mesh(2, 2))
    return out["w"].placements == (Replicate(), Shard(0))


def test_hsdp_default_placements(world4):
    assert all(world4.run(hsdp_default))


def errors():
    m = mesh(dist.get_world_size())
    return [
        raises(
            lambda: fs.shard({"a": {"w": torch.ones(2)}}, m, Partial()),
            ValueError,
            "a.w",
            "Partial",
            "Shard(dim) or Replicate()",
        ),
        raises(
            lambda: fs.shard({"s": torch.tensor(1.0)}, m, Shard(0)),
            ValueError,
            "'s'",
            "0-d",
            "Replicate()",
        ),
        raises(
            lambda: fs.shard({"w": torch.ones(2, 2)}, m, Shard(2)),
            ValueError,
            "'w'",
            "out of range",
        ),
        raises(lambda: fs.shard({"w": torch.ones(2), "lr": 0.1}, m), TypeError, "'lr'", "float"),
        raises(
            lambda: fs.shard(fs.shard({"w": torch.ones(2)}, m), m),
            ValueError,
            "'w'",
            "already a DTensor",
        ),
        raises(
            lambda: fs.shard({"w": torch.ones(2)}, m, (Shard(0), Shard(0))),
            ValueError,
            "'w'",
            "one placement per mesh dim",
        ),
    ]


def test_shard_errors(world2):
    for rank in world2.run(errors):
        assert rank == [None] * len(rank), rank


def mesh_mismatch():
    sub = mesh(2, 2)["shard"]  # 2 ranks of a 4-rank world
    return raises(
        lambda: fs.shard({"w": torch.ones(4)}, sub),
        ValueError,
        "2 ranks",
        "process group has 4",
        "init_device_mesh",
    )


def test_mesh_must_cover_the_world(world4):
    assert world4.run(mesh_mismatch) == [None] * 4


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_uneven_and_tiny_dims(request, world):
    w = request.getfixturevalue(world)
    cases = [
        ((1,), 0, (("S", 0),)),
        ((3, 5), 0, (("S", 1),)),
        ((7, 1), 1, (("S", 0),)),
        ((0, 3), 0, (("S", 0),)),
        ((), 0, (("R",),)),
    ]
    assert w.run(roundtrip, cases, (w.world,)) == [[]] * w.world
