"""Mistakes that used to fail deep inside torch with a cryptic message (or silently) now raise
before compute, on every rank, naming the parameter, module or field and the fix; and the
documented outcomes (zero gradients for parameters the value does not use) hold, checked
against plain autograd on the unsharded model."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs

from _checks import raises
from _mesh import mesh
from _models import meta_mlp


def _model():
    return meta_mlp(16, 8, 1)


def named_errors():
    m = mesh(2)
    model, params = _model()
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(dist.get_rank()))

    def loss(p, x):
        return fs.functional_call(model, fs.unshard(p), (x,)).sum()

    vg = fs.value_and_grad(loss)
    sharded = fs.shard(params, m)
    found = {}
    wrong = fs.shard({**params, "0.weight": torch.randn(8, 17)}, m)
    found["shape"] = raises(
        lambda: vg(wrong, x), ValueError, "'0.weight' has shape [8, 17]", "(Linear) has [8, 16]"
    )
    mixed = fs.shard({**params, "2.weight": params["2.weight"].double()}, m)
    found["float64"] = raises(lambda: vg(mixed, x), ValueError, "'2.weight' is float64")
    found["nested"] = raises(
        lambda: fs.value_and_grad(lambda p, x: vg(p, x)[0])(sharded, x), TypeError, "inside"
    )
    found["argnums"] = raises(
        lambda: fs.value_and_grad(loss, argnums=2)(sharded, x), ValueError, "argnums [2] out"
    )

    def bf16(p, x):
        return fs.functional_call(model, fs.unshard(p, param_dtype=torch.bfloat16), (x,)).sum()

    found["bf16 input"] = raises(
        lambda: fs.value_and_grad(bf16)(sharded, x), RuntimeError, "input 0", "is float32: cast"
    )
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bparams, buffers = fs.extract(bn)
    bn.to("meta")
    bsharded = fs.shard(bparams, m)
    y = torch.randn(3, 4)

    def bn_loss(p, buffers=None):
        return fs.functional_call(bn, (fs.unshard(p), buffers or {}), (y,)).sum()

    found["buffers"] = raises(
        lambda: fs.value_and_grad(bn_loss)(bsharded), RuntimeError, "'1.", "on the meta device"
    )
    half = {k: v.bfloat16() for k, v in buffers.items() if v.is_floating_point()}
    found["bn bf16"] = raises(
        lambda: fs.value_and_grad(bn_loss)(bsharded, {**buffers, **half}),
        ValueError,
        "'1' (BatchNorm1d) is training with its running statistics in bfloat16",
    )

    # a value without autograd history: raised, naming the likely cause
    def no_grad_loss(p, x):
        with torch.no_grad():
            return fs.functional_call(model, fs.unshard(p), (x,)).sum()

    found["no history"] = raises(
        lambda: fs.value_and_grad(no_grad_loss)(sharded, x), ValueError, "torch.no_grad()"
    )
    found["detached"] = raises(
        lambda: fs.value_and_grad(lambda p, x: (fs.unshard(p), x.sum())[1])(sharded, x),
        ValueError,
        "without autograd history",
    )

    # a value that uses some of the parameters: zeros for the others (docs/value_and_grad.md)
    def bias_only(p, x):
        return (fs.unshard(p)["0.bias"] * x[:, :8]).mean()

    value, grads = fs.value_and_grad(bias_only)(sharded, x)
    ref_value, ref = fs.testing.reference_value_and_grad(
        lambda p, x: (p["0.bias"] * x[:, :8]).mean() + 0 * p["ids"].sum(),
        {**params, "ids": torch.arange(3)},
        x,
    )
    zeros = all(torch.equal(grads[k].full_tensor(), ref[k]) for k in grads if k != "0.bias")
    close = torch.allclose(grads["0.bias"].full_tensor(), ref["0.bias"])
    found["zero grads"] = (zeros and close and torch.equal(value, ref_value)) or "not zeros"
    found["reference int"] = ref["ids"] is None and torch.equal(ref["0.weight"], torch.zeros(8, 16))
    found["after"] = torch.equal(
        vg(sharded, x)[0],
        fs.testing.reference_value_and_grad(
            lambda p, x: fs.functional_call(model, p, (x,)).sum(), params, x
        )[0],
    )
    return found


def test_mistakes_are_named_on_every_rank(world2):
    for found in world2.run(named_errors):
        assert found == {
            **dict.fromkeys(["shape", "float64", "nested", "argnums", "bf16 input"]),
            **dict.fromkeys(["buffers", "bn bf16", "no history", "detached"]),
            "zero grads": True,
            "reference int": True,
            "after": True,
        }


def test_plan_from_json_names_a_missing_field():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    text = fs.plan(model, fs.policy.by_type(nn.Linear)).to_json()
    broken = text.replace('"backward_prefetch"', '"backward_prefetch_"')
    with pytest.raises(ValueError, match=r"the plan lacks the field\(s\) \['backward_prefetch'\]"):
        fs.Plan.from_json(broken)
    assert fs.Plan.from_json(text) == fs.plan(model, fs.policy.by_type(nn.Linear))


def empty_batch_on_one_rank():
    model, params = _model()
    sharded = fs.shard(params, mesh(2))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(0 if dist.get_rank() == 1 else 6, 16, generator=g)  # rank 1: no samples

    def mean_loss(p, x):  # the usual per-rank mean, grad_reduce="mean"
        return fs.functional_call(model, fs.unshard(p), (x,)).pow(2).mean()

    def summed_loss(p, x):  # a documented fix: sum / global count, grad_reduce="sum"
        count = torch.tensor(float(len(x)))
        dist.all_reduce(count)
        out = fs.functional_call(model, fs.unshard(p, grad_reduce="sum"), (x,))
        return out.pow(2).sum() / count

    def weighted_loss(p, x):  # the other: each rank's mean weighted by its count
        out = fs.functional_call(model, fs.unshard(p, grad_reduce="weighted", count=len(x)), (x,))
        return out.pow(2).mean()

    found = raises(lambda: fs.value_and_grad(mean_loss)(sharded, x), ValueError, "rank(s) [1]")
    _, summed = fs.value_and_grad(summed_loss)(sharded, x)
    value, weighted = fs.value_and_grad(weighted_loss)(sharded, x)
    _, ref = fs.testing.reference_value_and_grad(
        lambda p, x: fs.functional_call(model, p, (x,)).pow(2).mean(), params, x
    )
    right = max(float((summed[k].full_tensor() - ref[k]).abs().max()) for k in ref)
    also = max(float((weighted[k].full_tensor() - ref[k]).abs().max()) for k in ref)
    return found, bool(value.isnan()), right, also


def test_an_empty_batch_on_one_rank_as_documented(world2):
    (found0, nan0, right, also), (found1, nan1, _, _) = world2.run(empty_batch_on_one_rank)
    assert found0 is None and found1 is None  # "mean": an error on every rank
    assert not nan0 and nan1  # the NaN is only in the empty rank's loss value
    assert right < 1e-6  # sum / global count with grad_reduce="sum": the global mean's
    assert also < 1e-6  # grad_reduce="weighted": the same


def no_grad_forward_on_some_ranks():
    """A loss whose forward runs under ``torch.no_grad()``: on one rank only, an error on every
    rank at the forward's first call (it computes gradients on one rank and not the other),
    before any collective; on every rank, each rank's own error; then, in step, the right
    gradients (the unsharded model's)."""
    model, params = _model()
    sharded = fs.shard(params, mesh(2))
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))

    def loss(p, x, without):
        with torch.no_grad() if without else contextlib.nullcontext():
            return apply(p, x).pow(2).mean()

    found = {
        "one rank": raises(
            lambda: fs.value_and_grad(loss)(sharded, x, dist.get_rank() == 1),
            ValueError,
            "ranks disagree at '<computes gradients>' (rank 0: True; rank 1: False)",
        ),
        "every rank": raises(
            lambda: fs.value_and_grad(loss)(sharded, x, True), ValueError, "torch.no_grad()"
        ),
    }
    _, grads = fs.value_and_grad(loss)(sharded, x, False)
    _, ref = fs.testing.reference_value_and_grad(
        lambda p, x: fs.functional_call(model, p, (x,)).pow(2).mean(), params, x
    )
    found["after"] = all(torch.allclose(grads[k].full_tensor(), ref[k]) for k in ref)
    return found


def test_a_loss_without_gradients_is_an_error_on_every_rank(world2):
    expected = {"one rank": None, "every rank": None, "after": True}
    assert world2.run(no_grad_forward_on_some_ranks) == [expected, expected]


class KeepsAView(nn.Module):
    """Keeps ``a.weight.t()`` past group ``a``'s last planned use, and uses it after ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        w = self.a.weight.t()
        return (self.b(x @ w) @ w).sum()


def view_past_free():
    torch.manual_seed(0)
    model = KeepsAView()
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    x = torch.ones(2, 4)
    reference = model(x)
    model.to("meta")
    sharded = fs.shard(params, mesh(2))
    found = raises(
        lambda: fs.value_and_grad(lambda p: apply(p, x))(sharded),
        RuntimeError,
        "freed group(s) {'a': ['a.weight', 'a.bias']}",
        "reshard_after_forward=False",
    )
    kept = fs.schedule(
        model, fs.plan(model, fs.policy.by_type(nn.Linear), reshard_after_forward=False)
    )
    value = fs.value_and_grad(lambda p: kept(p, x))(sharded)[0]  # the fix, and still in step
    return found, torch.allclose(value, reference.detach())


def test_a_view_kept_past_its_groups_free_names_the_group(world2):
    assert world2.run(view_past_free) == [(None, True)] * 2
