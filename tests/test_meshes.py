"""Beyond one data-parallel mesh, the other layouts: replicated parameters, per-parameter meshes
(a small MoE) and full SPMD (FSDP2's dp_mesh_dims), each against the unsharded model on the
global batch (and FSDP2 where it has the layout)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import funcshard as fs
from funcshard._runtime._compat import HAS_2_13

from _mesh import mesh
from _tp import (
    IN,
    Counter,
    SPMDNet,
    batch,
    loss,
    make,
    make_moe,
    parallelized,
    spmd_net,
)


def replicated_vs_unsharded(shape: tuple[int, ...], steps: int):
    """1-d parameters replicated (kept whole, gradients all-reduced, never gathered), the others
    sharded, under fs.schedule + fs.optim.adamw, vs the unsharded model on the global batch +
    torch.optim.AdamW. ``shape``: a 1-D FSDP mesh, or (dp, tp) with TP on the blocks."""
    if len(shape) == 2:
        m, model = parallelized(shape=shape)
        dp, dims = m["dp"], m
    else:
        model, dp = make(), mesh(*shape, names=("dp",))
        dims = dp
    sharded = fs.shard(
        fs.extract(model)[0], dp, lambda path, t: Replicate() if t.dim() == 1 else None
    )
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(type(model.blocks[0]))))
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(sharded)
    ref = make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    rank = dp.get_local_rank()
    out = []
    for step in range(steps):
        x, y = batch(step, rank, dp=dp.size())
        with Counter(dims) as c:
            value, grads = fs.value_and_grad(lambda p, x, y: loss(apply(p, x), y))(sharded, x, y)
        rp = dict(ref.named_parameters())
        whole = all(_whole(sharded[k], rp[k].detach()) for k in sharded if sharded[k].dim() == 1)
        step_args = (opt, sharded, grads, state, ref, ref_opt, value, batch(step, dp=dp.size()))
        sharded, state, *errors = _adamw_vs_reference(*step_args)
        out.append((*errors, whole, c.counts))
    return out


def _adamw_vs_reference(opt, sharded, grads, state, ref, ref_opt, value, global_batch):
    """The reference's backward on the global batch, then an AdamW step on both sides:
    ``(sharded, state, loss error, max gradient error, max parameter error)``."""
    ref_loss = loss(ref(global_batch[0]), global_batch[1])
    ref_loss.backward()
    rp = dict(ref.named_parameters())
    grad_err = max((g.full_tensor() - rp[k].grad).abs().max().item() for k, g in grads.items())
    sharded, state = fs.optim.step(opt, sharded, grads, state)
    ref_opt.step()
    ref_opt.zero_grad()
    param_err = max((p.full_tensor() - rp[k]).abs().max().item() for k, p in sharded.items())
    value = value.detach().clone()
    dist.all_reduce(value)
    loss_err = abs(value.item() / dist.get_world_size() - ref_loss.item())
    return sharded, state, loss_err, grad_err, param_err


def _whole(d, full: torch.Tensor) -> bool:
    """Whether ``d`` (replicated over dp) holds all of ``full`` -- its TP-local part for a 2-D
    layout, whose last mesh dim is tp."""
    if d.device_mesh.ndim == 2:
        tp = d.device_mesh["tp"]
        full = distribute_tensor(full, tp, d.placements[1:]).to_local()
    local = d.to_local()
    return (
        d.placements[0] == Replicate()
        and local.shape == full.shape
        and torch.allclose(local, full, atol=1e-6)
    )


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_replicated_parameters(world4, shape):
    for rank in world4.run(replicated_vs_unsharded, shape, 2):
        for loss_err, grad_err, param_err, whole, counts in rank:
            assert loss_err < 1e-6 and grad_err < 1e-6 and param_err < 1e-6 and whole, rank
            # 3 groups: gathered in forward, the 2 blocks again in backward (the root stays),
            # a reduce-scatter of each group's sharded gradients and an all-reduce of its
            # replicated ones; TP's own all-reduces (2 per block) over tp
            tp = {("all_reduce", "tp"): 4} if len(shape) == 2 else {}
            expected = {("all_gather", "dp"): 5, ("reduce_scatter", "dp"): 3}
            assert counts == {**expected, ("all_reduce", "dp"): 3, **tp}, counts


def moe_per_parameter_meshes(steps: int):
    """Experts (stacked [E, ...] weights) on their own (ep, edp) mesh, split over experts and
    over a second dim; the router and dense weights on the 1-D mesh of every rank; all in one
    group, each gathered on its own mesh. vs the unsharded model on the global batch +
    torch.optim.AdamW, with the collectives per mesh dim."""
    dense = mesh(4, names=("world",))
    experts = mesh(2, 2, names=("ep", "edp"))
    model, ref = make_moe(), make_moe()

    def placement(path, t):
        return (experts, (Shard(0), Shard(1))) if path in ("w1", "w2") else None

    sharded = fs.shard(fs.extract(model)[0], dense, placement)
    plan = fs.plan(model)
    apply = fs.schedule(model, plan)
    opt = fs.optim.adamw(1e-2)
    state = opt.init(sharded)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank(), dp=4)
        with Counter(dense, experts) as c:
            value, grads = fs.value_and_grad(lambda p, x, y: loss(apply(p, x), y))(sharded, x, y)
        step_args = (opt, sharded, grads, state, ref, ref_opt, value, batch(step, dp=4))
        sharded, state, *errors = _adamw_vs_reference(*step_args)
        meshes = {k: tuple(p.device_mesh.mesh_dim_names) for k, p in sharded.items()}
        out.append((*errors, c.counts, meshes, len(plan.groups)))
    return out


def test_moe_per_parameter_meshes(world4):
    for rank in world4.run(moe_per_parameter_meshes, 2):
        for loss_err, grad_err, param_err, counts, meshes, groups in rank:
            assert loss_err < 1e-6 and grad_err < 1e-6 and param_err < 1e-6, rank
            assert meshes["w1"] == ("ep", "edp") and meshes["router.weight"] == ("world",)
            assert groups == 1
            # one group: the dense bucket over every rank, the experts over edp then ep
            per_dim = {("all_gather", d): 1 for d in ("world", "ep", "edp")}
            per_dim |= {("reduce_scatter", d): 1 for d in ("world", "ep", "edp")}
            assert counts == per_dim, counts


def full_spmd_vs_fsdp2(steps: int):
    """Parameters that are DTensors of the whole (dp, tp) mesh, sharded with fs.shard(params,
    mesh['dp']) (FSDP2's dp_mesh_dims): the module computes on the whole mesh with the batch
    sharded over dp. vs fully_shard(net, mesh, dp_mesh_dims=...) and the unsharded net."""

    # a mesh of its own: the (dp, tp) mesh of the other tests holds TP-sub-mesh layouts
    m = mesh(2, 2, names=("batch", "model"))
    net, ref = spmd_net(m), spmd_net(m)
    from torch.distributed.fsdp import DataParallelMeshDims  # torch >= 2.13

    fully_shard(ref, mesh=m, dp_mesh_dims=DataParallelMeshDims(shard="batch"))
    sharded = fs.shard(fs.extract(net)[0], m["batch"])
    torch.manual_seed(0)
    plain = SPMDNet()
    out = []
    for step in range(steps):
        gx, gy = (t[:, :IN] if t.shape[1] >= IN else t for t in batch(step))
        xd = distribute_tensor(gx, m, [Shard(0), Replicate()])
        yd = distribute_tensor(gy, m, [Shard(0), Replicate()])

        def loss_fn(p, xd, yd):
            return loss(fs.functional_call(net, fs.unshard(p), (xd,)), yd).full_tensor()

        value, grads = fs.value_and_grad(loss_fn)(sharded, xd, yd)
        ref_loss = loss(ref(xd), yd).full_tensor()
        # the gradients arrive as partial sums of the global-batch loss's gradient; FSDP2
        # averages them over dp (its default divide factor; a factor of 1 needs PREMUL_SUM,
        # which gloo lacks), funcshard adds them: scale FSDP2's loss by the dp size
        (ref_loss * m["batch"].size()).backward()
        plain_loss = loss(plain(gx), gy)
        plain_loss.backward()
        rp, pp = dict(ref.named_parameters()), dict(plain.named_parameters())
        fsdp_err = max((g.full_tensor() - rp[k].grad.full_tensor()).abs().max().item()
                       for k, g in grads.items())  # fmt: skip
        plain_err = max((g.full_tensor() - pp[k].grad).abs().max().item()
                        for k, g in grads.items())  # fmt: skip
        layout = all(
            sharded[k].placements == p.placements
            and torch.allclose(sharded[k].to_local(), p.to_local(), atol=1e-6)
            for k, p in rp.items()
        )
        out.append((abs(value.item() - plain_loss.item()), abs(ref_loss.item() - value.item()),
                    fsdp_err, plain_err, layout))  # fmt: skip
        with torch.no_grad():
            for k in rp:
                rp[k] -= 0.1 * rp[k].grad
                rp[k].grad = None
                pp[k] -= 0.1 * pp[k].grad
                pp[k].grad = None
            sharded = {k: p - 0.1 * grads[k] for k, p in sharded.items()}
    return out


@pytest.mark.skipif(not HAS_2_13, reason="FSDP2's dp_mesh_dims: torch 2.13")
def test_full_spmd_vs_fsdp2(world4):
    for rank in world4.run(full_spmd_vs_fsdp2, 2):
        for loss_err, fsdp_loss_err, fsdp_err, plain_err, layout in rank:
            assert loss_err < 1e-6 and fsdp_loss_err < 1e-6, rank
            assert fsdp_err < 1e-6 and plain_err < 1e-6 and layout, rank


def plan_labels():
    """What the printed plan says about each layout: per-parameter meshes (the dense MoE above),
    replicated parameters and FSDP x TP (1-d parameters replicated over dp), HSDP."""
    dense, experts = mesh(4, names=("world",)), mesh(2, 2, names=("ep", "edp"))
    moe = make_moe()
    own = lambda path, t: (experts, (Shard(0), Shard(1))) if path in ("w1", "w2") else None
    moe_plan = fs.plan(moe).with_meshes(fs.shard(fs.extract(moe)[0], dense, own))
    m, tp = parallelized()
    small = lambda path, t: Replicate() if t.dim() == 1 else None
    tp_plan = fs.plan(tp, fs.policy.by_type(type(tp.blocks[0])))
    tp_plan = tp_plan.with_meshes(fs.shard(fs.extract(tp)[0], m["dp"], small))
    net = make()
    hsdp = fs.shard(fs.extract(net)[0], mesh(2, 2), (Replicate(), Shard(0)))
    return moe_plan.groups[0].meshes, tp_plan.groups[1].meshes, fs.plan(net).with_meshes(hsdp)


def test_plan_shows_meshes(world4):
    moe, block, hsdp = world4.run(plan_labels)[0]
    dense = ("inp.weight", "inp.bias", "router.weight", "head.weight", "head.bias")
    assert moe == (  # the module's own parameters come first
        ("gathered over ep(2), edp(2)", ("w1", "w2")),
        ("gathered over world(4)", dense),
    ), moe
    tp = "tensor parallel over tp(2)"
    assert dict(block) == {
        "all-reduced over dp(2)": ("blocks.0.norm.weight", "blocks.0.norm.bias"),
        f"gathered over dp(2), {tp}": ("blocks.0.w1.weight", "blocks.0.w2.weight"),
        f"all-reduced over dp(2), {tp}": ("blocks.0.w1.bias", "blocks.0.w2.bias"),
    }, block
    assert "gathered over shard(2), all-reduced over replicate(2): inp.weight" in str(hsdp), hsdp
