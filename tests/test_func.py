"""unshard / reduce composed with torch.func, each against the same computation unsharded."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vjp, vmap

import funcshard as fs

from _comm import Collectives
from _mesh import mesh
from _models import lm_loss, make, reference_step, shard_of, tokens


def _err(sharded_tree, full_tree):
    """Max |local shard - this rank's slice of the full reference| over a DTensor tree."""
    errs = [
        (d.to_local() - shard_of(full_tree[k], d)).abs().max().item()
        for k, d in sharded_tree.items()
        if d.to_local().numel()
    ]
    return max(errs, default=0.0)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _setup(model):
    world = dist.get_world_size()
    params, buffers = fs.extract(model)
    return fs.shard(params, mesh(world)), buffers


def func_grad_matches_reference():
    """torch.func.grad through to_local / unshard / from_local == the unsharded gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make(batchnorm=False)
    sharded, buffers = _setup(model)
    batch = tokens(rank)

    def loss(p):
        return lm_loss(fs.functional_call(model, (fs.unshard(p), buffers), (batch,)), batch)

    grads = fs.from_local(grad(loss)(fs.to_local(sharded)))
    _, ref, _ = reference_step(make(batchnorm=False), [tokens(r) for r in range(world)])
    same_types = all(g.placements == sharded[k].placements for k, g in grads.items())
    _, eager = fs.value_and_grad(loss)(sharded)
    return _err(grads, ref), _err(grads, {k: v.full_tensor() for k, v in eager.items()}), same_types


def test_func_grad(world2):
    for err, vs_eager, same in world2.run(func_grad_matches_reference):
        assert err < 1e-5 and vs_eager < 1e-6 and same


def func_grad_with_batchnorm():
    """BatchNorm running stats are updated in place under torch.func.grad, as unsharded.

    functorch refuses in-place updates of *captured* tensors, so buffers are an argument.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make()
    sharded, buffers = _setup(model)
    buffers = {k: v.clone() for k, v in buffers.items()}
    batch = tokens(rank)

    def loss(p, bufs):
        return lm_loss(fs.functional_call(model, (fs.unshard(p), bufs), (batch,)), batch)

    grads = fs.from_local(grad(loss)(fs.to_local(sharded), buffers))
    _, ref, ref_buffers = reference_step(make(), [tokens(r) for r in range(world)])
    buf_err = max(
        (buffers[k].float() - ref_buffers[rank][k].float()).abs().max().item() for k in buffers
    )
    return _err(grads, ref), buf_err


def test_func_grad_with_batchnorm(world2):
    for err, buf_err in world2.run(func_grad_with_batchnorm):
        assert err < 1e-5 and buf_err < 1e-6


def vjp_sum():
    """vjp with grad_reduce='sum' is the exact adjoint: sum over ranks of J_r^T c_r."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp()
    sharded, _ = _setup(model)
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    cots = [
        torch.randn(4, 2, generator=torch.Generator().manual_seed(50 + r)) for r in range(world)
    ]
    out, pullback = vjp(
        lambda p: functional_call(model, fs.unshard(p, grad_reduce="sum"), xs[rank]),
        fs.to_local(sharded),
    )
    (g,) = pullback(cots[rank])
    full = dict(mlp().named_parameters())
    ref = None
    for x, c in zip(xs, cots, strict=True):
        _, pb = vjp(lambda p, x=x: functional_call(mlp(), p, x), full)
        (r,) = pb(c)
        ref = r if ref is None else {k: ref[k] + r[k] for k in r}
    return _err(fs.from_local(g), ref), (
        out - functional_call(mlp(), full, xs[rank])
    ).abs().max().item()


def test_vjp(world2):
    for err, out_err in world2.run(vjp_sum):
        assert err < 1e-5 and out_err < 1e-6


def jvp_params():
    """A sharded tangent gives the directional derivative along the full tangent."""
    rank = dist.get_rank()
    model = mlp()
    sharded, _ = _setup(model)
    full = dict(mlp().named_parameters())
    tangent = {
        k: torch.randn(v.shape, generator=torch.Generator().manual_seed(i))
        for i, (k, v) in enumerate(full.items())
    }
    local_t = {
        k: fs.LocalShard(shard_of(t, sharded[k]), fs.ShardSpec.of(sharded[k]))
        for k, t in tangent.items()
    }
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    _, out_t = jvp(
        lambda p: functional_call(model, fs.unshard(p), x), (fs.to_local(sharded),), (local_t,)
    )
    _, ref_t = jvp(lambda p: functional_call(mlp(), p, x), (full,), (tangent,))
    return (out_t - ref_t).abs().max().item()


def test_jvp(world2):
    assert max(world2.run(jvp_params)) < 1e-5


def jacobians():
    """jacrev w.r.t. sharded params (same input everywhere, mean) and jacfwd w.r.t. the input."""
    world = dist.get_world_size()
    model = mlp()
    sharded, _ = _setup(model)
    ref_model = mlp()
    full = dict(ref_model.named_parameters())
    x = torch.randn(3, generator=torch.Generator().manual_seed(7))
    # d(output)/d(local shard): LocalShards whose tensors have the output dims in front
    jac = jacrev(lambda p: functional_call(model, fs.unshard(p), x))(fs.to_local(sharded))
    ref = jacrev(lambda p: functional_call(ref_model, p, x))(full)
    rev = max(
        (jac[k].tensor - _rows(ref[k], sharded[k], world)).abs().max().item()
        for k in jac
        if jac[k].tensor.numel()
    )
    local = fs.to_local(sharded)
    fwd = jacfwd(lambda x: functional_call(model, fs.unshard(local), x))(x)
    ref_fwd = jacfwd(lambda x: functional_call(ref_model, full, x))(x)
    return rev, (fwd - ref_fwd).abs().max().item()


def _rows(jac, dtensor, world):
    """The Jacobian [out, *param] restricted to this rank's shard of the param dims."""
    return torch.stack([shard_of(row, dtensor) for row in jac])


def test_jacrev_jacfwd(world2):
    for rev, fwd in world2.run(jacobians):
        assert rev < 1e-5 and fwd < 1e-5


def per_sample_clipped():
    """DP-SGD: per-sample grads on unsharded params (vmap), clip, then fs.reduce -> shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp()
    sharded, _ = _setup(model)
    clip = 0.5

    def sample_loss(p, x, y):
        return F.mse_loss(functional_call(model, p, x[None]), y[None])

    def clipped_mean(p, xs, ys):
        g = vmap(grad(sample_loss), in_dims=(None, 0, 0))(p, xs, ys)
        norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
        scale = (clip / (norms + 1e-6)).clamp(max=1.0)
        return {k: (v * scale.view(-1, *[1] * (v.dim() - 1))).mean(0) for k, v in g.items()}

    data = [
        (
            torch.randn(5, 3, generator=torch.Generator().manual_seed(r)),
            torch.randn(5, 2, generator=torch.Generator().manual_seed(100 + r)),
        )
        for r in range(world)
    ]
    with torch.no_grad():
        full = fs.unshard(sharded)
    mine = fs.reduce(clipped_mean(full, *data[rank]), like=sharded)
    ref_p = dict(mlp().named_parameters())
    ref = clipped_mean(
        {k: v.detach() for k, v in ref_p.items()},
        torch.cat([d[0] for d in data]),
        torch.cat([d[1] for d in data]),
    )
    return _err(mine, ref)


def test_per_sample_gradients(world2):
    assert max(world2.run(per_sample_clipped)) < 1e-5


def vmap_grad_is_a_loop():
    """vmap(grad(f)) with unshard inside f equals a Python loop of grad(f)."""
    model = mlp()
    sharded, _ = _setup(model)
    local = fs.to_local(sharded)
    xs = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(dist.get_rank()))

    def f(p, x):
        return functional_call(model, fs.unshard(p), x).pow(2).sum()

    batched = vmap(grad(f), in_dims=(None, 0))(local, xs)
    looped = [grad(f)(local, x) for x in xs]
    return max(
        (batched[k].tensor[i] - looped[i][k].tensor).abs().max().item()
        for k in batched
        for i in range(len(xs))
    )


def test_vmap_of_grad_equals_loop(world2):
    assert max(world2.run(vmap_grad_is_a_loop)) < 1e-6


def _member_dim(path, t):
    return Shard(1) if t.dim() >= 2 else Replicate()


def ensemble():
    """vmap over stacked shards (stack_module_state): one all-gather for the whole ensemble."""
    world = dist.get_world_size()
    models = [mlp(seed) for seed in range(3)]
    stacked, _ = torch.func.stack_module_state(models)
    sharded = fs.shard(stacked, mesh(world), _member_dim)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(dist.get_rank()))

    def f(p, x):
        return functional_call(base, fs.unshard(p), x)

    with Collectives() as comm:
        out = vmap(f, in_dims=(0, None))(fs.to_local(sharded), x)
    gathers = len(comm.sent)
    ref = torch.stack([m(x) for m in models])
    grads = fs.from_local(
        vmap(grad(lambda p, x: f(p, x).sum()), in_dims=(0, None))(fs.to_local(sharded), x)
    )
    # each rank's loss uses its own x: the gradient is the rank-mean of per-rank gradients
    mean = {k: 0 for k in stacked}
    for r in range(world):
        xr = torch.randn(4, 3, generator=torch.Generator().manual_seed(r))
        for m in models:
            m.zero_grad()
            m(xr).sum().backward()
        for k in stacked:
            mean[k] = mean[k] + torch.stack([dict(m.named_parameters())[k].grad for m in models])
    mean = {k: v / world for k, v in mean.items()}
    return (
        (out - ref).abs().max().item(),
        gathers,
        _err(grads, mean),
        all(g.placements == sharded[k].placements for k, g in grads.items()),
    )


def test_vmap_over_stacked_shards(world2):
    for out_err, gathers, grad_err, placed in world2.run(ensemble):
        assert out_err < 1e-6 and gathers == 1 and grad_err < 1e-5 and placed


def maml():
    """grad of grad: one inner SGD step on sharded params, outer loss, outer gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp()
    sharded, _ = _setup(model)
    data = [
        (
            torch.randn(6, 3, generator=torch.Generator().manual_seed(r)),
            torch.randn(6, 2, generator=torch.Generator().manual_seed(10 + r)),
        )
        for r in range(world)
    ]
    lr = 0.3

    def loss(full, x, y):
        return F.mse_loss(functional_call(model, full, x), y)

    def inner(p, x, y):
        return loss(fs.unshard(p), x, y)

    def outer(p):
        x, y = data[rank]
        adapted = fs.tree_map(lambda a, g: a - lr * g, p, grad(inner)(p, x[:3], y[:3]))
        return inner(adapted, x[3:], y[3:])

    mine = fs.from_local(grad(outer)(fs.to_local(sharded)))

    def ref_outer(full):
        inner_mean = lambda q: sum(loss(q, x[:3], y[:3]) for x, y in data) / world
        adapted = {k: full[k] - lr * g for k, g in grad(inner_mean)(full).items()}
        return sum(loss(adapted, x[3:], y[3:]) for x, y in data) / world

    ref = grad(ref_outer)({k: v.detach() for k, v in mlp().named_parameters()})
    return _err(mine, ref)


def test_grad_of_grad_maml(world2):
    assert max(world2.run(maml)) < 1e-5
