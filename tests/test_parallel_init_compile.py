"""FSDP x TP's 2-D layout with fs.materialize (a module built and parallelized on meta) and under
torch.compile (a whole scheduled training step, one graph): against the module built normally
and sharded by fs.shard, against eager, and against the unsharded model on the global batch."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.tensor.parallel import parallelize_module

import funcshard as fs

from _tp import Net, batch, dp_rank, loss, make, parallelized, tp_plan


def materialized_vs_shard():
    """Built on meta and parallelized there, then fs.materialize(model, mesh['dp']): the same
    placements and local shards as fs.shard of the module built normally (same seed) and
    parallelized; a training step on them equals the unsharded model on the global batch."""
    m, built = parallelized()
    want = fs.shard(fs.extract(built)[0], m["dp"])
    with torch.device("meta"):
        model = Net(2)
    parallelize_module(model, m["tp"], tp_plan(model))
    torch.manual_seed(0)  # as make() does before building
    got, buffers = fs.materialize(model, m["dp"])
    same = [(k, got[k].placements == v.placements and torch.equal(got[k].to_local(), v.to_local()))
            for k, v in want.items()]  # fmt: skip
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(type(model.blocks[0]))))
    x, y = batch(0, dp_rank(m))
    value, grads = fs.value_and_grad(lambda p: loss(apply(p, x), y))(got)
    ref = make()
    gx, gy = batch(0)
    ref_loss = loss(ref(gx), gy)
    ref_loss.backward()
    rp = dict(ref.named_parameters())
    grad_err = max((g.full_tensor() - rp[k].grad).abs().max().item() for k, g in grads.items())
    mean = value.detach().clone()
    torch.distributed.all_reduce(mean)
    loss_err = abs(mean.item() / m.size() - ref_loss.item())
    return list(got) == list(want), same, buffers, grad_err, loss_err


def test_materialize_2d(world4):
    for in_order, same, buffers, grad_err, loss_err in world4.run(materialized_vs_shard):
        assert in_order and all(ok for _, ok in same), same
        assert buffers == {} and grad_err < 1e-6 and loss_err < 1e-6


def compiled_2d_step(steps: int):
    """A whole step -- value_and_grad over fs.schedule's apply + fs.optim.step (AdamW) -- on
    the 2-D layout, compiled with fullgraph (aot_eager): equal to the same step run eagerly,
    compiled once, and its loss the unsharded model's on the global batch."""
    torch._dynamo.reset()
    m, model = parallelized()
    sharded = fs.shard(fs.extract(model)[0], m["dp"])
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(type(model.blocks[0]))))
    vg = fs.value_and_grad(lambda p, x, y: loss(apply(p, x), y))
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)

    def step(params, state, x, y):
        value, grads = vg(params, x, y)
        params, state = fs.optim.step(opt, params, grads, state)
        return value, params, state

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_p = {k: v.detach().clone() for k, v in sharded.items()}
    comp_p = {k: v.detach().clone() for k, v in sharded.items()}
    eager_s, comp_s = opt.init(eager_p), opt.init(comp_p)
    ref = make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    errors = []
    for i in range(steps):
        x, y = batch(i, dp_rank(m))
        e_loss, eager_p, eager_s = step(eager_p, eager_s, x, y)
        c_loss, comp_p, comp_s = compiled(comp_p, comp_s, x, y)
        gx, gy = batch(i)
        ref_loss = loss(ref(gx), gy)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = c_loss.detach().clone()
        torch.distributed.all_reduce(mean)
        rp = dict(ref.named_parameters())
        errors.append((
            abs(c_loss.item() - e_loss.item()),
            max((comp_p[k].to_local() - eager_p[k].to_local()).abs().max().item() for k in comp_p),
            abs(mean.item() / m.size() - ref_loss.item()),
            max((p.full_tensor() - rp[k]).abs().max().item() for k, p in comp_p.items()),
        ))  # fmt: skip
    return counter.frame_count, errors


def test_compiled_2d_step(world4):
    for frames, errors in world4.run(compiled_2d_step, 2):
        assert frames == 1
        for err in errors:
            assert max(err) < 1e-5, errors
