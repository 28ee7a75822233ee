"""FSDP x tensor parallel (the torchtitan recipe): funcshard's 2-D layout against the unsharded
model on the global batch and against FSDP2 + TP on the same mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _tp import Counter, batch, dp_rank, loss, make, parallelized
from torch.distributed.fsdp import fully_shard

import funcshard as fs


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
        out.append((abs(_global_loss(value, m) - ref_loss.item()), grad_err, same))
        with torch.no_grad():
            for p in rp.values():
                p -= 0.1 * p.grad
                p.grad = None
            sharded = {k: p - 0.1 * grads[k] for k, p in sharded.items()}
    return out


def test_unshard_vs_unsharded(world4):
    for rank in world4.run(unshard_vs_unsharded, 2):
        for loss_err, grad_err, same in rank:
            assert loss_err < 1e-6 and grad_err < 1e-6 and same, rank


def schedule_vs_fsdp2(steps: int):
    """fs.schedule (a group per block) + fs.optim.adamw vs fully_shard per block + root over the
    same TP module + torch.optim.AdamW: loss, every gradient's full tensor, parameters after
    each step, and the collectives per mesh dim."""
    m, model = parallelized()
    _, ref = parallelized()
    for b in ref.blocks:
        fully_shard(b, mesh=m["dp"])
    fully_shard(ref, mesh=m["dp"])
    sharded = fs.shard(fs.extract(model)[0], m["dp"])
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(type(model.blocks[0]))))
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(sharded)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(steps):
        x, y = batch(step, dp_rank(m))
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


def test_schedule_and_adamw_vs_fsdp2_tp(world4):
    for rank in world4.run(schedule_vs_fsdp2, 3):
        for loss_err, grad_err, param_err, ours, theirs in rank:
            assert loss_err < 1e-6 and grad_err < 1e-6 and param_err < 1e-6, rank
            assert ours == theirs, (ours, theirs)
            assert {dim for _, dim in ours} == {"dp", "tp"}
            # gathers and reduce-scatters over dp only; TP's all-reduces over tp only
            assert all(dim == ("tp" if kind == "all_reduce" else "dp") for kind, dim in ours)
