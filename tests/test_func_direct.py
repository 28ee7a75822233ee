"""DTensor trees straight into torch.func: every transform x {unshard, reduce, schedule} x two
models (one with uneven shards), equal to the conversion form (fs.to_local / fs.from_local) and
to the unsharded model. All ranks use the same input, so the rank-mean convention reduces to
the unsharded computation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vjp, vmap

import funcshard as fs
from funcshard._trees._dtensor import unwrap

from _mesh import mesh

LR = 0.3


def _model(rows: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, rows), nn.Tanh(), nn.Linear(rows, 2))


def _paths(model):
    meta = _model(model[0].out_features).to("meta")
    plan = fs.plan(meta, fs.policy.by_type(nn.Linear))
    apply = fs.schedule(meta, plan)
    return {
        "unshard": lambda p, x: fs.functional_call(model, fs.unshard(p), (x,)),
        "reduce": lambda p, x: fs.functional_call(
            model, fs.unshard(fs.reduce(fs.unshard(p), like=p)), (x,)
        ),
        "schedule": lambda p, x: apply(p, x),
    }


def _sq(f, x):
    return lambda p: f(p, x).square().sum()


def _maml(f, x):
    def outer(p):
        g = grad(_sq(f, x[:2]))(p)
        return _sq(f, x[2:])(fs.tree_map(lambda a, b: a - LR * b, p, g))

    return grad(outer)


TRANSFORMS = {
    "grad": lambda f, p, x, t: grad(_sq(f, x))(p),
    "vjp": lambda f, p, x, t: vjp(lambda p: f(p, x), p)[1](torch.ones(len(x), 2))[0],
    "jvp": lambda f, p, x, t: jvp(lambda p: f(p, x), (p,), (t,))[1],
    "hvp": lambda f, p, x, t: jvp(grad(_sq(f, x)), (p,), (t,))[1],
    "jacrev_params": lambda f, p, x, t: jacrev(lambda p: f(p, x[0]))(p),
    "jacrev_inputs": lambda f, p, x, t: jacrev(lambda x: f(p, x))(x),
    "jacfwd_inputs": lambda f, p, x, t: jacfwd(lambda x: f(p, x))(x),
    "per_sample": lambda f, p, x, t: vmap(
        grad(lambda p, xi: f(p, xi[None]).square().sum()), in_dims=(None, 0)
    )(p, x),
    "grad_of_grad": lambda f, p, x, t: _maml(f, x)(p),
    "closed_over": lambda f, p, x, t: grad(lambda x: f(p, x).square().sum())(x),
}


def _local(tree):
    """Results as this rank's tensors: DTensor -> local shard, LocalShard -> its tensor."""
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, fs.LocalShard):
        return tree.tensor
    return tree.to_local() if isinstance(tree, DTensor) else tree


def _full(tree):
    if isinstance(tree, dict):
        return {k: _full(v) for k, v in tree.items()}
    return tree.full_tensor() if isinstance(tree, DTensor) else tree


def _kinds(tree) -> set[str]:
    leaves = tree.values() if isinstance(tree, dict) else [tree]
    return {type(v).__name__ for v in leaves}


def matrix(rows: int, path: str):
    """For each transform: (direct == conversion, direct == unsharded, leaf kinds)."""
    model = _model(rows)
    params, _ = fs.extract(model)
    full = {k: v.detach() for k, v in params.items()}
    m = mesh(dist.get_world_size())
    sharded = fs.shard(params, m)
    g = torch.Generator().manual_seed(7)
    tangent_full = {k: torch.randn(v.shape, generator=g) for k, v in full.items()}
    tangent = fs.shard(tangent_full, m)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))  # the same on every rank
    f = _paths(model)[path]
    ref_f = lambda p, x: functional_call(model, p, (x,))
    out = {}
    for name, transform in TRANSFORMS.items():
        direct = transform(f, sharded, x, tangent)
        converted = transform(f, fs.to_local(sharded), x, fs.to_local(tangent))
        reference = transform(ref_f, full, x, tangent_full)
        same = _close(_local(direct), _local(converted), 1e-6)
        exact = _close(_full(direct), reference, 1e-5)
        out[name] = (same, exact, sorted(_kinds(direct)))
    return out


def _close(a, b, tol) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol)


PARAM_RESULTS = {"grad", "vjp", "hvp", "jacrev_params", "per_sample", "grad_of_grad"}


@pytest.mark.parametrize("path", ["unshard", "reduce", "schedule"])
@pytest.mark.parametrize("rows", [4, 5])  # 5 rows: uneven shards on 2 ranks
def test_every_transform_takes_dtensor_trees(world2, rows, path):
    for result in world2.run(matrix, rows, path):
        for name, (same, exact, kinds) in result.items():
            assert same, f"{name}: direct differs from the conversion form"
            assert exact, f"{name}: differs from the unsharded model"
            if name in PARAM_RESULTS:
                assert kinds == ["DTensor"], (name, kinds)


def placements_of_results():
    """Documented forms: gradients placed like the parameters; Jacobians and per-sample
    results with the new dims in front and Shard dims shifted."""
    model = _model(4)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    f = _paths(model)["unshard"]
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    jac = jacrev(lambda p: f(p, x[0]))(sharded)["0.weight"]
    per = vmap(grad(lambda p, xi: f(p, xi[None]).sum()), in_dims=(None, 0))(sharded, x)["0.weight"]
    g = grad(_sq(f, x))(sharded)["0.weight"]
    return [
        (tuple(g.shape), g.placements),
        (tuple(jac.shape), jac.placements),
        (tuple(per.shape), per.placements),
    ]


def test_result_forms(world2):
    for r in world2.run(placements_of_results):
        assert r == [((4, 3), (Shard(0),)), ((2, 4, 3), (Shard(1),)), ((4, 4, 3), (Shard(1),))]


def ensembles(path: str):
    """vmap over a stacked ensemble (member dim unsharded, Shard(1)): one gather for all
    members; per-member gradients are stacked DTensors equal to a loop over members."""
    members = [_model(5) for _ in range(3)]
    for i, mb in enumerate(members):
        with torch.no_grad():
            for p in mb.parameters():
                p.mul_(1 + i)
    stacked, _ = torch.func.stack_module_state(members)
    sharded = fs.shard(stacked, mesh(dist.get_world_size()), Shard(1))
    base = _model(5).to("meta")
    f = (
        _paths(base)[path]
        if path != "unshard"
        else lambda p, x: functional_call(base, fs.unshard(p), (x,))
    )
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    out = vmap(f, in_dims=(0, None))(sharded, x)
    grads = vmap(grad(lambda p, x: f(p, x).square().sum()), in_dims=(0, None))(sharded, x)
    expected_out = torch.stack([m(x) for m in members])
    for m in members:
        m(x).square().sum().backward()
    ok = torch.allclose(out, expected_out, atol=1e-6)
    for k, gk in grads.items():
        expected = torch.stack([dict(m.named_parameters())[k].grad for m in members])
        ok &= gk.placements == (Shard(1),) and torch.allclose(gk.full_tensor(), expected, atol=1e-5)
    return ok


@pytest.mark.parametrize("path", ["unshard", "schedule"])
def test_vmap_over_stacked_dtensor_ensembles(world2, path):
    assert world2.run(ensembles, path) == [True, True]


def no_extra_communication():
    """The direct form issues exactly the collectives of the conversion form."""
    from _comm import Collectives

    model = _model(5)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    f = _paths(model)["unshard"]
    x = torch.randn(4, 3)
    recs = []
    for tree in (sharded, fs.to_local(sharded)):
        rec = Collectives()
        with rec:
            grad(_sq(f, x))(tree)
        recs.append(rec.sent)
    return recs[0] == recs[1] and len(recs[0]) > 0


def test_no_extra_communication(world2):
    assert world2.run(no_extra_communication) == [True, True]


def wrapped_leaf_is_read_under_the_wrappers():
    sharded = fs.shard({"w": torch.ones(4, 2)}, mesh(dist.get_world_size()))
    seen = []
    grad(lambda p: (seen.append(type(unwrap(p["w"])).__name__), fs.unshard(p)["w"].sum())[1])(
        sharded
    )
    return seen


def test_functorch_wraps_dtensors(world2):
    """The premise of the design: inside a transform the leaf is a functorch wrapper around the
    DTensor (if torch changes this, the ToLocal/FromLocal pair needs another look)."""
    assert world2.run(wrapped_leaf_is_read_under_the_wrappers) == [["DTensor"]] * 2


def built_like_from_local():
    """See [Note: DTensors built from their spec]: the DTensor funcshard builds from a spec is
    the one DTensor.from_local builds (uneven shards, Shard(1), a 0-d Replicate)."""
    from funcshard._trees._dtensor import _as_dtensor
    from funcshard._trees._spec import ShardSpec

    m = mesh(dist.get_world_size())
    tree = fs.shard({"a": torch.randn(5, 3), "b": torch.randn(3, 5), "c": torch.tensor(2.0)}, m,
                    lambda path, t: Shard(1) if path == "b" else None)  # fmt: skip
    same = []
    for d in tree.values():
        spec = ShardSpec.of(d)
        ours = _as_dtensor(d.to_local(), spec)
        ref = DTensor.from_local(d.to_local(), m, spec.placements, shape=d.shape, stride=d.stride())
        same.append(
            ours.placements == ref.placements
            and ours.shape == ref.shape
            and ours.stride() == ref.stride()
            and ours.dtype == ref.dtype
            and torch.equal(ours.full_tensor(), ref.full_tensor())
        )
    return same


def test_dtensors_built_from_spec_equal_from_local(world2):
    assert world2.run(built_like_from_local) == [[True] * 3] * 2
