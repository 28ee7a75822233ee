"""funcshard vs FSDP2 ``fully_shard`` on the same model and data: same loss, same shards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.debug import CommDebugMode

import funcshard as fs

from _comm import counts
from _mesh import mesh
from _models import Block, lm_loss, make, tokens


def fsdp2_vs_funcshard(mesh_shape, steps, param_dtype, batchnorm=True):
    rank = dist.get_rank()
    m = mesh(*mesh_shape)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    ref = make(batchnorm=batchnorm)
    for block in ref.blocks:
        fully_shard(block, mesh=m, mp_policy=mp)
    fully_shard(ref, mesh=m, mp_policy=mp)

    model = make(batchnorm=batchnorm)
    params, buffers = fs.extract(model)
    buffers = {k: v.clone() for k, v in buffers.items()}
    sharded = fs.shard(params, m)

    def loss_fn(p, batch):
        full = fs.unshard(p, param_dtype=param_dtype, reduce_dtype=torch.float32)
        return lm_loss(fs.functional_call(model, (full, buffers), (batch,)).float(), batch)

    out = []
    for step in range(steps):
        batch = tokens(rank, step=step)
        ref_loss = lm_loss(ref(batch).float(), batch)
        ref_loss.backward()
        loss, grads = fs.value_and_grad(loss_fn)(sharded, batch)
        ref_params = dict(ref.named_parameters())
        grad_err = max(
            (grads[k].to_local() - ref_params[k].grad.to_local()).abs().max().item()
            for k in grads
            if grads[k].to_local().numel()
        )
        same_placement = all(grads[k].placements == ref_params[k].grad.placements for k in grads)
        out.append((abs(loss.item() - ref_loss.item()), grad_err, same_placement))
        with torch.no_grad():  # same SGD step on both sides
            for k, p in ref_params.items():
                p -= 0.1 * p.grad
                p.grad = None
                sharded[k] -= 0.1 * grads[k]
    return out


@pytest.mark.parametrize("mesh_shape", [(2,)])
def test_fsdp2_parity_fp32(world2, mesh_shape):
    for rank in world2.run(fsdp2_vs_funcshard, mesh_shape, 3, None):
        for loss_err, grad_err, same in rank:
            assert loss_err < 1e-5 and grad_err < 1e-5 and same, rank


def test_fsdp2_parity_hsdp_4_ranks(world4):
    for rank in world4.run(fsdp2_vs_funcshard, (2, 2), 2, None):
        for loss_err, grad_err, same in rank:
            assert loss_err < 1e-5 and grad_err < 1e-5 and same, rank


def test_fsdp2_parity_bf16(world2):
    # BatchNorm with bf16 parameters and fp32 running stats fails in FSDP2 too: leave it out
    for rank in world2.run(fsdp2_vs_funcshard, (2,), 2, torch.bfloat16, False):
        for loss_err, grad_err, same in rank:
            assert loss_err < 1e-3 and grad_err < 1e-3 and same, rank


def scheduled_vs_fsdp2(mesh_shape, prefetch, reshard):
    """fs.schedule vs fully_shard (per block + root) with the same resharding: the same loss
    and sharded gradients, and no more collectives of any kind than FSDP2."""
    rank = dist.get_rank()
    m = mesh(*mesh_shape)
    ref = make()
    for block in ref.blocks:
        fully_shard(block, mesh=m, reshard_after_forward=reshard)
    fully_shard(ref, mesh=m, reshard_after_forward=reshard)
    model = make()
    params, buffers = fs.extract(model)
    buffers = {k: v.clone() for k, v in buffers.items()}
    sharded = fs.shard(params, m)
    plan = fs.plan(
        model,
        fs.policy.by_type(Block),
        prefetch=prefetch,
        backward_prefetch=prefetch,
        reshard_after_forward=reshard,
    )
    model.to("meta")
    apply = fs.schedule(model, plan)
    batch = tokens(rank)
    with CommDebugMode() as comm:
        ref_loss = lm_loss(ref(batch), batch)
        ref_loss.backward()
    theirs = counts(comm)
    with CommDebugMode() as comm:
        loss, grads = fs.value_and_grad(lambda p: lm_loss(apply(p, batch, buffers=buffers), batch))(
            sharded
        )
    ours = counts(comm)
    ref_params = dict(ref.named_parameters())
    grad_err = max(
        (grads[k].to_local() - ref_params[k].grad.to_local()).abs().max().item()
        for k in grads
        if grads[k].to_local().numel()
    )
    return abs(loss.item() - ref_loss.item()), grad_err, ours, theirs


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("reshard", [True, False])
def test_schedule_matches_fsdp2(world2, prefetch, reshard):
    for loss_err, grad_err, ours, theirs in world2.run(scheduled_vs_fsdp2, (2,), prefetch, reshard):
        assert loss_err < 1e-5 and grad_err < 1e-5
        assert all(ours[k] <= theirs.get(k, 0) for k in ours), (ours, theirs)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_schedule_matches_fsdp2_4_ranks(world4, mesh_shape):
    for loss_err, grad_err, ours, theirs in world4.run(scheduled_vs_fsdp2, mesh_shape, 1, True):
        assert loss_err < 1e-5 and grad_err < 1e-5
        assert all(ours[k] <= theirs.get(k, 0) for k in ours), (ours, theirs)
