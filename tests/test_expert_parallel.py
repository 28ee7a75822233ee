"""True expert parallelism (torchtitan's MoE): each ep rank holds whole experts and computes only
the tokens routed to them (all-to-all dispatch), the experts sharded over efsdp on top, the
dense weights over every rank. Against the unsharded MoE on the global batch and against FSDP2
on the same layout (torchtitan's ``set_gradient_divide_factor``), with the plan that shows it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

import funcshard as fs

from _mesh import mesh
from _moe import ExpertParallel, Experts, make_moe
from _tp import Counter, batch, loss


def ep_layout(ep: int = 2):
    """``(meshes, model, sharded)``: experts on the (efsdp, ep) mesh, ep by ExpertParallel and
    efsdp by fs.shard; the dense weights on the 1-D mesh of every rank (the data-parallel
    mesh: every rank holds a different batch)."""
    m = mesh(4 // ep, ep, names=("efsdp", "ep"))
    dense = mesh(4, names=("dp",))
    model = make_moe()
    parallelize_module(model.experts, m["ep"], ExpertParallel())

    def experts_apart(path, t):
        return (m["efsdp"], Shard(0)) if path.startswith("experts.") else None

    return (m, dense), model, fs.shard(fs.extract(model)[0], dense, experts_apart)


def fsdp2_reference(m, dense):
    """The same layout under FSDP2, as torchtitan builds it: ``fully_shard`` of the EP experts
    on efsdp, their gradients divided by the dp world size, the rest on every rank. Summed on
    the wire (gloo has no PREMUL_SUM) where efsdp has ranks to reduce over: with one rank,
    FSDP2 (torch 2.13) would divide twice (``reduce_output.copy_(input / factor)``, then by its
    post-divide factor)."""
    ref = make_moe()
    parallelize_module(ref.experts, m["ep"], ExpertParallel())
    fully_shard(ref.experts, mesh=m["efsdp"])
    ref.experts.set_gradient_divide_factor(float(dense.size()))
    ref.experts.set_force_sum_reduction_for_comms(m["efsdp"].size() > 1)
    fully_shard(ref, mesh=dense)
    return ref


def ep_vs_references(steps: int, ep: int):
    """fs.schedule (experts a group of their own, as FSDP2's unit) + fs.optim.adamw vs the
    unsharded MoE on the global batch + torch.optim.AdamW, and vs FSDP2 + EP: loss, every
    gradient's full tensor, parameters after each step, collectives per mesh dim."""
    (m, dense), model, sharded = ep_layout(ep)
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


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_vs_unsharded_and_fsdp2(world4, ep):
    """ep 2: experts over (efsdp, ep) = (2, 2); ep 4: one expert per rank, efsdp of 1 rank
    (nothing to gather: the mean's division by ep alone)."""
    for rank in world4.run(ep_vs_references, 2, ep):
        for *errors, ours, theirs in rank:
            assert max(errors) < 1e-6, (errors, rank)
            assert ours == theirs, (ours, theirs)
            if ep == 2:  # (with ep 4, ep and dp are both the world's process group)
                # dense weights over every rank, experts over efsdp (gathered again in
                # backward), tokens over ep: counts, tokens and outputs forward, two back
                assert ours == {
                    ("all_gather", "dp"): 1,
                    ("reduce_scatter", "dp"): 1,
                    ("all_gather", "efsdp"): 2,
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


def unshard_and_reduce_vs_unsharded():
    """The other ways in: fs.functional_call over fs.unshard (the module sees stand-ins that
    pass for DTensors: isinstance, to_local, placements), and fs.reduce of the gradients the
    module computed on the unsharded DTensors; both against the unsharded MoE."""
    _, model, sharded = ep_layout()
    x, y = batch(0, dist.get_rank(), dp=4)

    def loss_fn(p):
        return loss(fs.functional_call(model, fs.unshard(p), (x,)), y)

    _, grads = fs.value_and_grad(loss_fn)(sharded)
    full = fs.unshard(sharded)
    computed = torch.autograd.grad(
        loss(fs.functional_call(model, full, (x,)), y), list(full.values())
    )
    reduced = fs.reduce(dict(zip(full, computed, strict=True)), sharded)
    plain = make_moe()
    loss(plain(batch(0, dp=4)[0]), batch(0, dp=4)[1]).backward()
    pp = dict(plain.named_parameters())
    errors = [max((g.full_tensor() - pp[k].grad).abs().max().item() for k, g in tree.items())
              for tree in (grads, reduced)]  # fmt: skip
    probe = fs.functional_call(_Probe(model.experts), {"experts.w1": full["experts.w1"]})
    return errors, probe, full["experts.w1"].to_local().sum().item()


class _Probe(torch.nn.Module):
    """Reads the experts' weight as model code does, inside a funcshard call."""

    def __init__(self, experts) -> None:
        super().__init__()
        self.experts = experts

    def forward(self):
        from torch.distributed.tensor import DTensor

        w = self.experts.w1
        return (
            isinstance(w, DTensor) and type(w) is not DTensor,  # a stand-in passing for one
            tuple(w.placements),
            w.device_mesh.mesh_dim_names,
            hasattr(w, "not_a_dtensor_attribute"),
            w.to_local().sum().item(),
        )


def test_unshard_and_reduce(world4):
    for errors, probe, local_sum in world4.run(unshard_and_reduce_vs_unsharded):
        assert max(errors) < 1e-6, errors
        assert probe[:4] == (True, (Shard(0),), ("ep",), False), probe
        assert abs(probe[4] - local_sum) < 1e-6


def bad_ep_inputs():
    from torch.distributed.tensor import distribute_tensor

    from _checks import raises

    dense = mesh(4, names=("dp",))
    pp = mesh(2, 1, 2, names=("pp", "efsdp1", "ep2"))  # a pipeline dim: a layout of 2 ranks
    experts = distribute_tensor(torch.ones(4, 2), pp["ep2"], [Shard(0)])
    wide = mesh(1, 4, names=("one", "ep4"))  # an ep dim of 4 ranks ...
    spread = distribute_tensor(torch.ones(4, 2), wide["ep4"], [Shard(0)])
    half = mesh(2, 2, names=("a", "b"))["a"]  # ... half inside a data-parallel mesh of 2
    plan = fs.plan(make_moe())
    return [
        raises(  # a per-parameter mesh whose 2-D layout does not cover the ranks
            lambda: fs.shard({"experts": experts}, dense, lambda p, t: (pp["efsdp1"], Shard(0))),
            ValueError,
            "'experts'",
            "model parallel on DeviceMesh",
            "sharded over DeviceMesh",
            "together 2 ranks, which do not cover the 4 ranks",
            "mesh['efsdp'] of an (efsdp, ep) mesh",
        ),
        raises(
            lambda: fs.shard({"experts": spread}, half, lambda p, t: (wide["one"], Shard(0))),
            ValueError,
            "'experts'",
            "model parallel on 'ep4'",
            "partly inside the data-parallel mesh",
            "Build both from one mesh",
        ),
        raises(  # "weighted" scales each rank's gradient once: experts sum several ranks'
            lambda: fs.unshard(ep_layout()[2], grad_reduce="weighted", count=1.0),
            ValueError,
            "grad_reduce='weighted' is not supported for expert-parallel parameters",
            "'experts.w1'",
            "'sum' with the loss divided by the global count",
        ),
        raises(
            lambda: plan.with_meshes({"w1": None}),
            ValueError,
            "Plan.with_meshes",
            "'inp.weight'",
            "missing from sharded",
        ),
    ]


def test_bad_ep_inputs(world4):
    for rank in world4.run(bad_ep_inputs):
        assert rank == [None] * len(rank), rank
