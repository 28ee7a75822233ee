"""FSDP x tensor parallel (the torchtitan recipe): funcshard's 2-D layout against the unsharded
model on the global batch and against FSDP2 + TP on the same mesh."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import funcshard as fs

from _checks import raises
from _mesh import mesh
from _tp import (
    Counter,
    batch,
    dp_rank,
    loss,
    make,
    parallelized,
)


def _global_loss(value: torch.Tensor, m) -> float:
    """The mean over data-parallel ranks of their losses (tp ranks hold the same one)."""
    v = value.detach().clone()
    dist.all_reduce(v)
    return v.item() / m.size()


def layout_vs_fsdp2():
    """fs.shard(params, mesh['dp']) of a TP module holds FSDP2's shards: same meshes,
    placements, local shards; full_tensor() is the unsharded parameter."""
    m, model = parallelized()
    _, ref = parallelized()
    fully_shard(ref, mesh=m["dp"])
    sharded = fs.shard(fs.extract(model)[0], m["dp"])
    plain = dict(make().named_parameters())
    out = []
    for k, p in ref.named_parameters():
        s = sharded[k]
        out.append((
            k,
            s.device_mesh == p.device_mesh and s.placements == p.placements,
            torch.equal(s.to_local(), p.to_local()),
            torch.equal(s.full_tensor(), plain[k]),
        ))  # fmt: skip
    return out


def test_layout_is_fsdp2s(world4):
    for rank in world4.run(layout_vs_fsdp2):
        for k, same_placement, same_local, same_full in rank:
            assert same_placement and same_local and same_full, k


def unshard_vs_unsharded(steps: int):
    """fs.value_and_grad over fs.unshard of the 2-D layout vs the unsharded model on the global
    batch: loss, every gradient's full tensor, and SGD steps."""
    m, model = parallelized()
    sharded = fs.shard(fs.extract(model)[0], m["dp"])
    ref = make()
    out = []

    def loss_fn(p, x, y):
        full = fs.unshard(p)
        return loss(fs.functional_call(model, full, (x,)), y)

    for step in range(steps):
        x, y = batch(step, dp_rank(m))
        value, grads = fs.value_and_grad(loss_fn)(sharded, x, y)
        gx, gy = batch(step)
        ref_loss = loss(ref(gx), gy)
        ref_loss.backward()
        rp = dict(ref.named_parameters())
        grad_err = max((g.full_tensor() - rp[k].grad).abs().max().item() for k, g in grads.items())
        same = all(g.placements == sharded[k].placements for k, g in grads.items())
        ref_norm = torch.stack([p.grad.norm() for p in rp.values()]).norm()
        norm_err = abs(fs.optim.global_norm(grads).item() - ref_norm.item())
        out.append((abs(_global_loss(value, m) - ref_loss.item()), grad_err, same, norm_err))
        with torch.no_grad():
            for p in rp.values():
                p -= 0.1 * p.grad
                p.grad = None
            sharded = {k: p - 0.1 * grads[k] for k, p in sharded.items()}
    return out


def test_unshard_vs_unsharded(world4):
    for rank in world4.run(unshard_vs_unsharded, 2):
        for loss_err, grad_err, same, norm_err in rank:
            assert loss_err < 1e-6 and grad_err < 1e-6 and same and norm_err < 1e-5, rank


def schedule_vs_fsdp2(steps: int, shape=(2, 2), names=("dp", "tp")):
    """fs.schedule (a group per block) + fs.optim.adamw vs fully_shard per block + root over the
    same TP module + torch.optim.AdamW: loss, every gradient's full tensor, parameters after
    each step, and the collectives per mesh dim. ``names[:-1]`` are the data-parallel dims
    (two: HSDP x TP)."""
    m, model = parallelized(shape=shape, names=names)
    _, ref = parallelized(shape=shape, names=names)
    dp = m[names[:-1]]
    for b in ref.blocks:
        fully_shard(b, mesh=dp)
    fully_shard(ref, mesh=dp)
    sharded = fs.shard(fs.extract(model)[0], dp)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(type(model.blocks[0]))))
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(sharded)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(steps):
        x, y = batch(step, _dp_index(dp), dp=dp.size())
        with Counter(m) as ours:
            value, grads = fs.value_and_grad(lambda p, x, y: loss(apply(p, x), y))(sharded, x, y)
        with Counter(m) as theirs:
            ref_loss = loss(ref(x), y)
            ref_loss.backward()
        rp = dict(ref.named_parameters())
        grad_err = max(
            (g.full_tensor() - rp[k].grad.full_tensor()).abs().max().item()
            for k, g in grads.items()
        )
        sharded, state = fs.optim.step(opt, sharded, grads, state)
        ref_opt.step()
        ref_opt.zero_grad()
        param_err = max((p.to_local() - rp[k].to_local()).abs().max().item()
                        for k, p in sharded.items())  # fmt: skip
        out.append((abs(value.item() - ref_loss.item()), grad_err, param_err,
                    ours.counts, theirs.counts))  # fmt: skip
    return out


def _dp_index(dp) -> int:
    """This rank's position among the data-parallel ranks (row-major over dp's dims)."""
    index = 0
    for size, c in zip(dp.shape, dp.get_coordinate(), strict=True):
        index = index * size + c
    return index


def test_schedule_and_adamw_vs_fsdp2_tp(world4):
    for rank in world4.run(schedule_vs_fsdp2, 3):
        for loss_err, grad_err, param_err, ours, theirs in rank:
            assert loss_err < 1e-6 and grad_err < 1e-6 and param_err < 1e-6, rank
            assert ours == theirs, (ours, theirs)
            assert {dim for _, dim in ours} == {"dp", "tp"}
            # gathers and reduce-scatters over dp only; TP's all-reduces over tp only
            assert all(dim == ("tp" if kind == "all_reduce" else "dp") for kind, dim in ours)


def test_hsdp_x_tp_vs_fsdp2(worlds):
    names = ("dp_replicate", "dp_shard", "tp")
    for rank in worlds(8).run(schedule_vs_fsdp2, 2, (2, 2, 2), names):
        for loss_err, grad_err, param_err, ours, theirs in rank:
            assert loss_err < 1e-6 and grad_err < 1e-6 and param_err < 1e-6, rank
            assert ours == theirs, (ours, theirs)
            # gathers and reduce-scatters over dp_shard, gradient all-reduces over
            # dp_replicate, TP's over tp
            assert {dim for _, dim in ours} == set(names), ours


def _adamw_state(m, model):
    sharded = fs.shard(fs.extract(model)[0], m["dp"])
    opt = fs.optim.adamw(1e-2)
    state = opt.init(sharded)
    x, y = batch(0, dp_rank(m))
    _, grads = fs.value_and_grad(lambda p: loss(fs.functional_call(model, fs.unshard(p), (x,)), y))(
        sharded
    )
    return fs.optim.step(opt, sharded, grads, state)


def checkpoint_reshard(path: str, shape: tuple[int, ...]):
    """Save params + AdamW state of the (2, 2) layout; load them onto ``shape`` -- (dp, tp) or a
    1-D FSDP mesh -- and compare every full tensor; the loaded tree trains (fs.unshard)."""
    m, model = parallelized()
    params, state = _adamw_state(m, model)
    saved = {"params": params, "opt": state}
    fs.checkpoint.save(path, saved)
    if len(shape) == 2:
        m2, model2 = parallelized(seed=1, shape=shape)
        like_params = fs.shard(fs.extract(model2)[0], m2["dp"])
    else:
        model2 = make(seed=1)
        like_params = fs.shard(fs.extract(model2)[0], mesh_1d(shape))
    like = {"params": like_params, "opt": fs.optim.adamw(1e-2).init(like_params)}
    loaded = fs.checkpoint.load(path, like)
    a = optree_leaves(saved)
    b = optree_leaves(loaded)
    err = max(
        (x.full_tensor() - y.full_tensor()).abs().max().item() for x, y in zip(a, b, strict=True)
    )
    placed = all(
        x.placements == y.placements and x.device_mesh == y.device_mesh
        for x, y in zip(optree_leaves(like), b, strict=True)
    )
    full = fs.unshard(loaded["params"])
    unshard_err = max(
        (_full(full[k]) - v.full_tensor()).abs().max().item() for k, v in params.items()
    )
    return err, placed, unshard_err


def _full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def mesh_1d(shape, names=None):
    return mesh(*shape, names=names)


def optree_leaves(tree):
    import optree

    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor) and x.dim()]


@pytest.mark.parametrize("shape", [(1, 4), (4,)])
def test_checkpoint_loads_onto_another_shape(world4, shape):
    path = tempfile.mkdtemp()
    try:
        for err, placed, unshard_err in world4.run(checkpoint_reshard, f"{path}/ckpt", shape):
            assert err == 0 and placed and unshard_err == 0
    finally:
        shutil.rmtree(path, ignore_errors=True)


def func_grad_vs_unsharded():
    """torch.func.grad over fs.unshard of LocalShards of the 2-D layout, with the model written
    as DTensor ops on the TP mesh (TP's parallel styles themselves use DTensor.from_local, an
    autograd.Function that torch.func refuses: docs/parallelism.md), vs plain autograd on the
    unsharded weights."""
    m, model = parallelized(blocks=1)
    names = ["blocks.0.w1.weight", "blocks.0.w1.bias", "blocks.0.w2.weight", "blocks.0.w2.bias"]
    params = fs.extract(model)[0]
    sharded = fs.shard({k: params[k] for k in names}, m["dp"])
    xd = distribute_tensor(torch.randn(3, 8, generator=torch.Generator().manual_seed(dp_rank(m))),
                           m["tp"], [Replicate()])  # fmt: skip

    def f(p, x):
        w1, b1, w2, b2 = (p[k] for k in names)
        out = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2, b2)
        return (out**2).mean()

    grads = fs.from_local(torch.func.grad(lambda p: f(fs.unshard(p), xd))(fs.to_local(sharded)))
    plain = dict(make(blocks=1).named_parameters())
    ref = {k: plain[k].detach().requires_grad_() for k in names}
    gx = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    gx = torch.cat([gx, torch.randn(3, 8, generator=torch.Generator().manual_seed(1))])
    f(ref, gx).backward()
    return max((grads[k].full_tensor() - ref[k].grad).abs().max().item() for k in names)


def test_torch_func_grad(world4):
    assert max(world4.run(func_grad_vs_unsharded)) < 1e-6


def reduce_vs_value_and_grad():
    """fs.reduce of gradients computed on fs.unshard's tensors (DTensors on tp for TP weights,
    plain tensors for the rest) equals fs.value_and_grad's."""
    m, model = parallelized()
    sharded = fs.shard(fs.extract(model)[0], m["dp"])
    x, y = batch(0, dp_rank(m))

    def loss_fn(p):
        return loss(fs.functional_call(model, fs.unshard(p), (x,)), y)

    _, expected = fs.value_and_grad(loss_fn)(sharded)
    with torch.no_grad():
        full = fs.unshard(sharded)
    full = {k: v.detach().requires_grad_() for k, v in full.items()}
    loss(fs.functional_call(model, full, (x,)), y).backward()
    grads = fs.reduce({k: v.grad for k, v in full.items()}, sharded)
    # a plain full gradient of a TP weight (the same on every tp rank) reduces the same way
    k = "blocks.0.w1.weight"
    plain = fs.reduce({k: full[k].grad.full_tensor()}, {k: sharded[k]})[k]
    errs = [(grads[k] - g).abs().max().item() for k, g in expected.items()]
    return max(errs), (plain - expected[k]).abs().max().item(), grads[k].placements


def test_reduce(world4):
    for err, plain_err, placements in world4.run(reduce_vs_value_and_grad):
        assert err < 1e-7 and plain_err < 1e-7 and placements[1] == Shard(0)


def bad_inputs():
    from torch.distributed.tensor import DTensor, Partial

    from _mesh import mesh

    m, model = parallelized()
    params = fs.extract(model)[0]
    other = mesh(2, 2, names=("a", "b"))  # another root mesh of the same ranks
    w = params["blocks.0.w1.weight"]
    partial = DTensor.from_local(torch.ones(3, 8), m["tp"], [Partial()])
    odd = parallelize_module(torch.nn.Linear(8, 7, bias=False), m["tp"], ColwiseParallel())
    # the fix the message gives: shard that weight over dp along its other dim
    fixed = fs.shard(fs.extract(odd)[0], m["dp"], lambda p, t: Shard(1) if p == "weight" else None)
    assert torch.equal(fixed["weight"].full_tensor(), fs.extract(odd)[0]["weight"].full_tensor())
    return [
        raises(
            lambda: fs.shard({"w": w}, other["a"]),
            ValueError,
            "'w'",
            "not a sub-mesh of the same root",
            "parallelize on mesh['tp'] and fs.shard on mesh['dp']",
        ),
        raises(
            lambda: fs.shard({"p": partial}, m["dp"]),
            ValueError,
            "'p'",
            "Partial",
            "Shard(d) and Replicate()",
            "redistribute",
        ),
        raises(
            lambda: fs.shard({"w": w}, m["dp"], Shard(2)),
            ValueError,
            "'w'",
            "out of range",
        ),
        raises(  # 7 rows over tp 2, then over dp: DTensor cannot describe it
            lambda: fs.shard(fs.extract(odd)[0], m["dp"]),
            ValueError,
            "'weight'",
            "unequal parts (7 over 2)",
            "along another dim",
        ),
        raises(  # plain parameters on a sub-mesh, with no TP module in sight
            lambda: fs.shard({"norm": torch.ones(4)}, other["a"]),
            ValueError,
            "2 ranks",
            "process group has 4",
            "data-parallel mesh of FSDP x TP",
        ),
        raises(  # a per-parameter mesh that does not cover the ranks
            lambda: fs.shard(
                {"experts": torch.ones(4, 2), "router": torch.ones(2)},
                mesh(4, names=("world",)),
                lambda path, t: (other["b"], Shard(0)) if path == "experts" else None,
            ),
            ValueError,
            "'experts'",
            "its own mesh",
            "does not cover the 4 ranks",
            "mesh of every rank",
        ),
        raises(
            lambda: fs.shard(fs.shard({"w": w}, m["dp"]), m["dp"]),
            ValueError,
            "'w'",
            "already a DTensor",
        ),
    ]


def test_bad_inputs(world4):
    for rank in world4.run(bad_inputs):
        assert rank == [None] * len(rank), rank


def unsynced_refused():
    m, model = parallelized()
    sharded = fs.shard(fs.extract(model)[0], m["dp"])
    x, y = batch(0, dp_rank(m))
    apply = fs.schedule(model, fs.plan(model))

    def via_unshard(p):
        return loss(fs.functional_call(model, fs.unshard(p), (x,)), y)

    def via_schedule(p):
        return loss(apply(p, x), y)

    return [
        raises(
            lambda f=f: fs.value_and_grad(f, sync_grads=False)(sharded),
            NotImplementedError,
            "tensor parallel",
            "sync_grads=True",
        )
        for f in (via_unshard, via_schedule)
    ]


def test_sync_grads_false_is_refused(world4):
    for rank in world4.run(unsynced_refused):
        assert rank == [None, None], rank
