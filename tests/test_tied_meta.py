"""Tied weights after ``module.to("meta")``, and a module's tensors left on meta: plans and
check_plan work, every path computes as the unsharded model, and a tensor left on meta is an
error naming it, never a silent product with uninitialised memory."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

import funcshard as fs
from funcshard._trees import _meta
from funcshard._trees._deferred import Deferred

from _checks import raises
from _mesh import mesh
from _models import Block, lm_loss, make, reference_step, tokens


class Tied(nn.Module):
    """A user's 15-line model: an embedding, a hidden layer, a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.emb(x))))


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(seed))


# ---- plans and check_plan on meta ---------------------------------------------------------------


@pytest.mark.parametrize("model", ["tied", "tinylm"])
def test_plan_and_check_plan_of_a_tied_model_on_meta(model):
    """The order recorded on meta equals the order recorded on the intact module (and the
    order the forward visibly follows); check_plan agrees."""
    torch.manual_seed(0)
    if model == "tied":
        module, policy, x = Tied(), fs.policy.by_type(nn.Linear), _ids()
        expected = ("", "mid", "")
    else:
        module, policy, x = make(layers=2), fs.policy.by_type(Block), tokens(0)
        expected = ("", "blocks.0", "blocks.1", "")
    intact = fs.plan(module, policy, example_args=(x,))
    fs.extract(module)
    module.to("meta")
    on_meta = fs.plan(module, policy, example_args=(x,))
    assert on_meta == intact and on_meta.order == expected
    assert fs.testing.check_plan(module, on_meta, x).ok


def scheduled_tied_on_meta():
    """A plan recorded on the meta module, followed by fs.schedule: loss and gradients of the
    unsharded model on each rank's batch, averaged (the tied weight's gradient sums both uses)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make(layers=2)
    reference = copy.deepcopy(model)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(world))
    model.to("meta")
    plan = fs.plan(model, fs.policy.by_type(Block), example_args=(tokens(rank),))
    apply = fs.schedule(model, plan)
    batch = tokens(rank)
    bufs = {k: v.clone() for k, v in buffers.items()}
    loss, grads = fs.value_and_grad(lambda p: lm_loss(apply(p, batch, buffers=bufs), batch))(
        sharded
    )
    ref_loss, ref_grads, _ = reference_step(reference, [tokens(r) for r in range(world)])
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss)
    fs.testing.assert_close(grads, {k: ref_grads[k] for k in grads})
    return plan.order


def test_scheduled_tied_model_on_meta_matches_unsharded(world2):
    assert world2.run(scheduled_tied_on_meta) == [("", "blocks.0", "blocks.1", "")] * 2


# ---- a tensor left on meta is refused where it is used ------------------------------------------


def test_untied_alias_left_on_meta_is_refused():
    """copy.deepcopy(m).to("meta") without fs.extract unties the head: it stays on meta. torch
    would compute CPU x meta into uninitialised memory; funcshard names it and the fix."""
    model = Tied()
    params, _ = fs.extract(model)
    base = copy.deepcopy(model).to("meta")
    with pytest.raises(RuntimeError, match=r"'head\.weight', which is on the meta device") as e:
        fs.functional_call(base, params, (_ids(),))
    assert "fs.extract" in str(e.value) and "before module.to('meta')" in str(e.value)
    fs.extract(base := copy.deepcopy(model))  # the fix: the tie is recorded before the move
    base.to("meta")
    torch.testing.assert_close(fs.functional_call(base, params, (_ids(),)), model(_ids()))


def test_only_tensors_used_are_refused_and_dry_runs_pass():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.register_buffer("unused", torch.ones(4))
            self.register_buffer("scale", torch.full((4,), 2.0))

        def forward(self, x):
            return self.b(self.a(x)) * self.scale

    net = Net()
    params, buffers = fs.extract(net)
    x = torch.randn(3, 4)
    expected = net(x)
    net.to("meta")
    # every used tensor given: the unused buffer left on meta is no error
    got = fs.functional_call(net, (params, {"scale": buffers["scale"]}), (x,))
    torch.testing.assert_close(got, expected)
    for left in ("b.weight", "scale"):
        given = {k: v for k, v in {**params, **buffers}.items() if k != left}
        with pytest.raises(RuntimeError, match=rf"Net uses '{left}', which is on the meta"):
            fs.functional_call(net, given, (x,))
    # a dry run (inputs on meta) computes shapes only: allowed
    out = fs.functional_call(net, {}, (x.to("meta"),))
    assert out.is_meta and out.shape == (3, 4)


def test_meta_check_looks_at_the_module_once_per_set_of_names():
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    params, buffers = fs.extract(net)
    x = torch.randn(3, 4)
    with mock.patch.object(_meta, "_unfilled", wraps=_meta._unfilled) as scans:
        for _ in range(3):
            fs.functional_call(net, (params, buffers), (x,))
        assert scans.call_count == 1
        fs.functional_call(net, params, (x,))  # another set of names: looked at once more
        fs.functional_call(net, params, (x,))
        assert scans.call_count == 2
    net.to("meta")  # the same names: the tensors themselves are looked at on every call
    with pytest.raises(RuntimeError, match=r"'1\.num_batches_tracked', which is on the meta"):
        fs.functional_call(net, params, (x,))


def test_meta_check_does_not_gather_a_parameter_to_look_at_it():
    """A nested functional_call that leaves a slot to the module, while an outer call holds a
    Deferred parameter there: the check reads its device without resolving (gathering) it."""

    class Counting:
        def __init__(self, value):
            self.value, self.calls = value, 0

        def resolve(self, fqns):
            self.calls += 1
            return [self.value]

        def release(self):
            pass

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def forward(self, x):
            return fs.functional_call(self.inner, {"bias": torch.zeros(2)}, (x,))

    outer, weight, x = Outer(), torch.randn(2, 2), torch.randn(3, 2)
    resolver = Counting(weight)
    deferred = Deferred("inner.weight", (2, 2), torch.float32, "cpu", resolver)
    got = fs.functional_call(outer, {"inner.weight": deferred}, (x,))
    torch.testing.assert_close(got, x @ weight.T)
    assert resolver.calls == 1  # F.linear's use only


def scheduled_without_buffers():
    """fs.schedule on a meta module, buffers not passed: the same error on every rank, before
    any compute with them."""
    model = make(layers=1)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    plan = fs.plan(model, fs.policy.by_type(Block))
    model.to("meta")
    apply = fs.schedule(model, plan)
    needles = ("'bn.num_batches_tracked'", "Pass it")
    return raises(lambda: apply(sharded, tokens(0)), RuntimeError, *needles)


def test_schedule_refuses_a_buffer_left_on_meta(world2):
    assert world2.run(scheduled_without_buffers) == [None, None]


# ---- the vmap ensemble recipe of docs/torch_func.md, on tied members -----------------------------


def ensemble(extract_first: bool):
    members = [Tied() for _ in range(3)]
    stacked, _ = torch.func.stack_module_state(members)  # tied: "head.weight" is not in it
    sharded = fs.shard(stacked, mesh(dist.get_world_size()), Shard(1))
    base = copy.deepcopy(members[0])
    if extract_first:
        fs.extract(base)  # records the tie before to("meta") breaks it
    base.to("meta")
    x = _ids()

    def f(p, x):
        return fs.functional_call(base, fs.unshard(p), (x,))

    run = lambda: torch.func.vmap(f, in_dims=(0, None))(sharded, x)
    if not extract_first:
        return raises(run, RuntimeError, "'head.weight'", "fs.extract")
    torch.testing.assert_close(run(), torch.stack([m(x) for m in members]))
    per_member = torch.func.vmap(torch.func.grad(lambda p, x: f(p, x).sum()), in_dims=(0, None))
    grads = per_member(sharded, x)
    for m in members:
        m(x).sum().backward()
    for k in stacked:
        expected = torch.stack([dict(m.named_parameters())[k].grad for m in members])
        torch.testing.assert_close(grads[k].full_tensor(), expected)
    return None


@pytest.mark.parametrize("extract_first", [False, True])
def test_vmap_ensemble_of_tied_members(world2, extract_first):
    assert world2.run(ensemble, extract_first) == [None, None]
