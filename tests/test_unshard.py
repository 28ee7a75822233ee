"""unshard / reduce / value_and_grad against the unsharded model, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard

import funcshard as fs

from _checks import raises
from _comm import Collectives
from _mesh import mesh
from _models import lm_loss, make, reference_step, shard_of, tokens

_c10d = torch.ops._c10d_functional


def _max_err(grads, ref):
    return max(
        (g.to_local() - shard_of(ref[k], g)).abs().max().item() if g.to_local().numel() else 0
        for k, g in grads.items()
    )


def parity(mesh_shape, grad_reduce="mean", placement=None):
    """One value_and_grad step of TinyLM vs the unsharded reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make()
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(*mesh_shape), placement)
    buffers = {k: v.clone() for k, v in buffers.items()}
    model.to("meta")  # unties head/embed: extract's record must keep them tied
    batch = tokens(rank)

    def loss_fn(p):
        full = fs.unshard(p, grad_reduce=grad_reduce)
        return lm_loss(fs.functional_call(model, (full, buffers), (batch,)), batch)

    loss, grads = fs.value_and_grad(loss_fn)(sharded)
    ref_loss, ref_grads, ref_buffers = reference_step(make(), [tokens(r) for r in range(world)])
    if grad_reduce == "sum":
        ref_grads = {k: v * world for k, v in ref_grads.items()}
    mean_loss = loss.clone()
    dist.all_reduce(mean_loss)
    assert all(
        isinstance(g, DTensor) and g.placements == sharded[k].placements for k, g in grads.items()
    )
    assert set(grads) == set(params)
    return {
        "loss": abs(mean_loss.item() / world - ref_loss.item()),
        "grad": _max_err(grads, ref_grads),
        "buffers": max(
            (buffers[k] - ref_buffers[rank][k]).abs().max().item()
            for k in buffers
            if buffers[k].is_floating_point()
        ),
    }


def _check(results, tol=1e-5):
    for r in results:
        assert r["loss"] < tol and r["grad"] < tol and r["buffers"] < tol, r


@pytest.mark.parametrize("grad_reduce", ["mean", "sum"])
def test_gradient_parity_2_ranks(world2, grad_reduce):
    _check(world2.run(parity, (2,), grad_reduce))


def test_gradient_parity_4_ranks(world4):
    _check(world4.run(parity, (4,)))


def test_gradient_parity_hsdp_2x2(world4):
    _check(world4.run(parity, (2, 2)))


def _dim1(path, t):
    return Shard(1) if t.dim() >= 2 else None


def test_gradient_parity_shard_dim_1(world2):
    _check(world2.run(parity, (2,), "mean", _dim1))


def mixed_precision(reduce_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make(batchnorm=False)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(world))
    batch = tokens(rank)

    def loss_fn(p):
        full = fs.unshard(p, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        assert all(v.dtype == torch.bfloat16 for v in full.values())
        return lm_loss(fs.functional_call(model, full, (batch,)).float(), batch)

    with Collectives() as wire:
        _, grads = fs.value_and_grad(loss_fn)(sharded)
    # reference: each rank's bf16 gradients, averaged in the reduce dtype
    ref = None
    for r in range(world):
        m = make(batchnorm=False).to(torch.bfloat16)
        b = tokens(r)
        lm_loss(m(b).float(), b).backward()
        g = {n: p.grad.to(reduce_dtype or torch.bfloat16) / world for n, p in m.named_parameters()}
        ref = g if ref is None else {n: ref[n] + g[n] for n in g}
    err = max(
        (grads[k].to_local() - shard_of(ref[k].float(), grads[k])).abs().max().item() for k in grads
    )
    return sorted({(n, d) for n, d, _ in wire.sent}), {g.dtype for g in grads.values()}, err


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_mixed_precision_wire_dtypes(world2, reduce_dtype):
    sent, grad_dtypes, err = world2.run(mixed_precision, reduce_dtype)[0]
    assert sent == sorted(
        {
            ("all_gather", torch.bfloat16),
            ("reduce_scatter", reduce_dtype or torch.bfloat16),
        }
    )
    assert grad_dtypes == {torch.float32}
    assert err < (2e-2 if reduce_dtype is None else 1e-2), err


def tree_structure():
    m = mesh(dist.get_world_size())
    tree = {"a": [torch.randn(3, 2), None], "b": {"c": torch.randn(5)}, "d": None}
    back = fs.unshard(fs.shard(tree, m))
    return (
        back["a"][1] is None and back["d"] is None and torch.equal(back["b"]["c"], tree["b"]["c"])
    )


def test_none_entries_are_kept(world2):
    assert all(world2.run(tree_structure))


def unshard_errors():
    m = mesh(dist.get_world_size())
    sharded = fs.shard({"w": torch.randn(4, 2), "b": torch.randn(2)}, m)
    meta = fs.shard({"layer.w": torch.empty(4, 2, device="meta")}, m)
    return [
        raises(lambda: fs.unshard(meta), RuntimeError, "layer.w", "meta", "fs.materialize"),
        raises(lambda: fs.unshard({**sharded, "lr": 0.1}), TypeError, "'lr'", "float"),
        raises(lambda: fs.unshard({"w": torch.randn(4, 2)}), TypeError, "'w'", "fs.shard"),
        raises(
            lambda: fs.unshard({"w": DTensor.from_local(torch.ones(2, 2), m, [Partial()])}),
            ValueError,
            "'w'",
            "Partial",
        ),
        raises(lambda: fs.unshard(sharded, grad_reduce="avg"), ValueError, "grad_reduce"),
    ]


def test_unshard_errors(world2):
    for rank in world2.run(unshard_errors):
        assert rank == [None] * len(rank), rank


def reduce_matches_reference(mesh_shape, op):
    """reduce() of per-rank full tensors == slices of their sum / mean, for mixed placements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = mesh(*mesh_shape)
    shapes = {"a": (7, 3), "b": (3, 5), "s": (), "t": (1,)}
    placements = {"a": None, "b": Shard(1), "s": None, "t": None}
    like = {k: fs.shard({k: torch.zeros(s)}, m, placements[k])[k] for k, s in shapes.items()}
    per_rank = [
        {
            k: torch.randn(s, generator=torch.Generator().manual_seed(r * 10 + i))
            for i, (k, s) in enumerate(shapes.items())
        }
        for r in range(world)
    ]
    out = fs.reduce(per_rank[rank], like, op=op)
    errs = []
    for k in shapes:
        total = sum(p[k] for p in per_rank) / (world if op == "mean" else 1)
        assert out[k].placements == like[k].placements
        errs.append(
            (out[k].to_local() - shard_of(total, like[k])).abs().max().item()
            if out[k].to_local().numel()
            else 0.0
        )
    return max(errs)


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_reduce(world2, op):
    assert max(world2.run(reduce_matches_reference, (2,), op)) < 1e-5


def test_reduce_hsdp(world4):
    assert max(world4.run(reduce_matches_reference, (2, 2), "mean")) < 1e-5


def reduce_errors():
    m = mesh(dist.get_world_size())
    like = fs.shard({"w": torch.zeros(4, 2), "b": torch.zeros(2)}, m)
    return [
        raises(
            lambda: fs.reduce({"w": torch.ones(4, 2)}, like),
            ValueError,
            "missing from full_grads",
            "'b'",
        ),
        raises(
            lambda: fs.reduce(
                {"w": torch.ones(4, 2), "b": torch.ones(2), "x": torch.ones(1)}, like
            ),
            ValueError,
            "not in like",
            "'x'",
        ),
        raises(
            lambda: fs.reduce({"w": torch.ones(2, 4), "b": torch.ones(2)}, like),
            ValueError,
            "'w'",
            "[2, 4]",
            "[4, 2]",
        ),
        raises(
            lambda: fs.reduce({"w": torch.ones(4, 2), "b": torch.ones(2)}, like, op="max"),
            ValueError,
            "op",
        ),
    ]


def test_reduce_errors(world2):
    for rank in world2.run(reduce_errors):
        assert rank == [None] * len(rank), rank


def plain_backward():
    """unshard composes with a hand-written .backward(): grads land on the DTensor leaves."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make()
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(world))
    batch = tokens(rank)
    lm_loss(fs.functional_call(model, (fs.unshard(sharded), buffers), (batch,)), batch).backward()
    _, ref, _ = reference_step(make(), [tokens(r) for r in range(world)])
    return _max_err({k: v.grad for k, v in sharded.items()}, ref)


def test_plain_backward(world2):
    assert max(world2.run(plain_backward)) < 1e-5
