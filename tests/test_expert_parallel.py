"""True expert parallelism (torchtitan's MoE): each ep rank holds whole experts and computes only
the tokens routed to them (all-to-all dispatch), the experts sharded over efsdp on top, the
dense weights over every rank. Against the unsharded MoE on the global batch and against FSDP2
on the same layout (torchtitan's ``set_gradient_divide_factor``), with the plan that shows it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

import funcshard as fs

from _mesh import mesh
from _moe import ExpertParallel, Experts, make_moe
from _tp import Counter, batch, loss


def ep_layout():
    """``(meshes, model, sharded)``: experts on the (efsdp, ep) mesh, ep by ExpertParallel and
    efsdp by fs.shard; the dense weights on the 1-D mesh of every rank (the data-parallel
    mesh: every rank holds a different batch)."""
    m, dense = mesh(2, 2, names=("efsdp", "ep")), mesh(4, names=("dp",))
    model = make_moe()
    parallelize_module(model.experts, m["ep"], ExpertParallel())

    def experts_apart(path, t):
        return (m["efsdp"], Shard(0)) if path.startswith("experts.") else None

    return (m, dense), model, fs.shard(fs.extract(model)[0], dense, experts_apart)


def fsdp2_reference(m, dense):
    """The same layout under FSDP2, as torchtitan builds it: ``fully_shard`` of the EP experts
    on efsdp, their gradients divided by the dp world size (summed on the wire: gloo has no
    PREMUL_SUM), the rest on every rank."""
    ref = make_moe()
    parallelize_module(ref.experts, m["ep"], ExpertParallel())
    fully_shard(ref.experts, mesh=m["efsdp"])
    ref.experts.set_gradient_divide_factor(float(dense.size()))
    ref.experts.set_force_sum_reduction_for_comms(True)
    fully_shard(ref, mesh=dense)
    return ref


def ep_vs_references(steps: int):
    """fs.schedule (experts a group of their own, as FSDP2's unit) + fs.optim.adamw vs the
    unsharded MoE on the global batch + torch.optim.AdamW, and vs FSDP2 + EP: loss, every
    gradient's full tensor, parameters after each step, collectives per mesh dim."""
    (m, dense), model, sharded = ep_layout()
    plan = fs.plan(model, fs.policy.by_type(Experts))
    apply = fs.schedule(model, plan)
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(sharded)
    plain, fsdp = make_moe(), fsdp2_reference(m, dense)
    opts = [torch.optim.AdamW(r.parameters(), lr=1e-2, weight_decay=0.1) for r in (plain, fsdp)]
    out = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank(), dp=4)
        with Counter(dense, m) as ours:
            value, grads = fs.value_and_grad(lambda p, x, y: loss(apply(p, x), y))(sharded, x, y)
        with Counter(dense, m) as theirs:
            fsdp_loss = loss(fsdp(x), y)
            fsdp_loss.backward()
        plain_loss = loss(plain(batch(step, dp=4)[0]), batch(step, dp=4)[1])
        plain_loss.backward()
        pp, fp = dict(plain.named_parameters()), dict(fsdp.named_parameters())
        grad_err = [max((g.full_tensor() - ref[k]).abs().max().item() for k, g in grads.items())
                    for ref in ({k: p.grad for k, p in pp.items()},
                                {k: p.grad.full_tensor() for k, p in fp.items()})]  # fmt: skip
        sharded, state = fs.optim.step(opt, sharded, grads, state)
        for o in opts:
            o.step()
            o.zero_grad()
        param_err = [max((p.full_tensor() - ref[k]).abs().max().item()
                         for k, p in sharded.items())
                     for ref in (pp, {k: p.full_tensor() for k, p in fp.items()})]  # fmt: skip
        mean = value.detach().clone()
        dist.all_reduce(mean)
        losses = (mean.item() / 4 - plain_loss.item(), value.item() - fsdp_loss.item())
        out.append((*map(abs, losses), *grad_err, *param_err, ours.counts, theirs.counts))
    return out


def test_expert_parallel_vs_unsharded_and_fsdp2(world4):
    for rank in world4.run(ep_vs_references, 2):
        for *errors, ours, theirs in rank:
            assert max(errors) < 1e-6, (errors, rank)
            assert ours == theirs, (ours, theirs)
            # dense weights over every rank, experts over efsdp (gathered again in backward),
            # tokens over ep: counts, tokens and outputs forward, two back
            assert ours == {
                ("all_gather", "dp"): 1,
                ("all_gather", "efsdp"): 2,
                ("reduce_scatter", "dp"): 1,
                ("reduce_scatter", "efsdp"): 1,
                ("all_to_all", "ep"): 5,
            }, ours


def ep_plan():
    """The plan of the EP layout, one group holding dense weights and experts: printed, as
    JSON and back."""
    _, model, sharded = ep_layout()
    plan = fs.plan(model).with_meshes(sharded)
    loaded = fs.Plan.from_json(plan.to_json())
    return (
        str(plan),
        plan.groups[0].meshes,
        loaded == plan
        and loaded.groups == plan.groups
        and [g.meshes for g in loaded.groups] == [g.meshes for g in plan.groups],
    )


def test_plan_shows_each_parameters_mesh(world4):
    text, meshes, round_trip = world4.run(ep_plan)[0]
    dense = ("inp.weight", "inp.bias", "router.weight", "head.weight", "head.bias")
    experts = "gathered over efsdp(2), expert parallel over ep(2) (mean over 4)"
    assert meshes == (
        ("gathered over dp(4)", dense),
        (experts, ("experts.w1", "experts.w2")),
    ), meshes
    assert f"{experts}: experts.w1, experts.w2" in text, text
    assert round_trip
