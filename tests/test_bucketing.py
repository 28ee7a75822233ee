"""merge_groups: consecutive small groups merged under a byte budget; the same values and
gradients with fewer collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs

from _comm import Collectives
from _mesh import mesh
from _models import Block, TinyLM


def _chain(n=8, width=4):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)])


def _linear_plan(model, **kw):
    return fs.plan(model, fs.policy.by_type(nn.Linear), **kw)


LINEAR_BYTES = (4 * 4 + 4) * 4  # one Linear(4, 4) in fp32


def test_merges_consecutive_groups_within_the_budget():
    model = _chain(8)
    plan = _linear_plan(model)
    merged = fs.merge_groups(plan, model, 3 * LINEAR_BYTES)
    assert [g.name for g in merged.groups] == ["0.0..2.0", "3.0..5.0", "6.0..7.0"]
    assert merged.order == ("0.0..2.0", "3.0..5.0", "6.0..7.0")
    assert merged.backward_order == tuple(reversed(merged.order))
    assert merged.groups[0].params == (
        "0.0.weight",
        "0.0.bias",
        "1.0.weight",
        "1.0.bias",
        "2.0.weight",
        "2.0.bias",
    )
    # every parameter once, nothing lost; prefetch settings kept
    assert sorted(merged.group_of()) == sorted(plan.group_of())
    assert (merged.prefetch, merged.backward_prefetch) == (plan.prefetch, plan.backward_prefetch)
    sizes = {k: p.numel() * 4 for k, p in model.named_parameters()}
    for g in merged.groups:
        assert sum(sizes[p] for p in g.params) <= 3 * LINEAR_BYTES
    assert str(merged).startswith("Plan: 3 groups")
    assert fs.Plan.from_json(merged.to_json()) == merged


def test_budget_extremes():
    model = _chain(8)
    plan = _linear_plan(model)
    assert fs.merge_groups(plan, model, LINEAR_BYTES) == plan  # nothing fits two
    assert fs.merge_groups(plan, model, 1) == plan  # groups over budget stay alone
    one = fs.merge_groups(plan, model, 10**9)
    assert [g.name for g in one.groups] == ["0.0..7.0"] and one.order == ("0.0..7.0",)
    assert fs.merge_groups(one, model, 10**9) == one  # idempotent


def test_sizes_as_bytes_tensors_or_param_dtype():
    model = _chain(4)
    plan = _linear_plan(model)
    params, _ = fs.extract(model)
    by_module = fs.merge_groups(plan, model, 2 * LINEAR_BYTES)
    assert fs.merge_groups(plan, params, 2 * LINEAR_BYTES) == by_module
    assert fs.merge_groups(plan, {k: p.numel() * 4 for k, p in params.items()}, 40 * 4) == (
        by_module
    )
    # in bf16 twice as many parameters fit the same budget
    halved = fs.merge_groups(plan, model, 2 * LINEAR_BYTES, param_dtype=torch.bfloat16)
    assert [g.name for g in halved.groups] == ["0.0..3.0"]
    model.to("meta")  # sizes come from shapes: a meta module works
    assert fs.merge_groups(plan, model, 2 * LINEAR_BYTES) == by_module


def test_groups_that_run_twice_or_differ_in_reshard_stay_apart():
    torch.manual_seed(0)
    lm = TinyLM(layers=4, batchnorm=False)
    plan = fs.plan(lm, fs.policy.by_type(Block))
    assert plan.order.count("") == 2  # the root: embedding first, tied head last
    merged = fs.merge_groups(plan, lm, 10**9)
    assert merged.order == ("", "blocks.0..blocks.3", "")
    assert merged.groups[0] == plan.groups[0]

    model = _chain(4)
    groups = tuple(
        fs.Group(g.name, g.params, reshard_after_forward=i < 2)
        for i, g in enumerate(_linear_plan(model).groups)
    )
    mixed = _linear_plan(model).replace(groups=groups)
    merged = fs.merge_groups(mixed, model, 10**9)
    assert [(g.name, g.reshard_after_forward) for g in merged.groups] == [
        ("0.0..1.0", True),
        ("2.0..3.0", False),
    ]


def test_custom_backward_order_is_renamed():
    model = _chain(4)
    plan = _linear_plan(model, backward_order=["3.0", "2.0", "0.0", "1.0"])
    merged = fs.merge_groups(plan, model, 2 * LINEAR_BYTES)
    assert merged.order == ("0.0..1.0", "2.0..3.0")
    assert merged.backward_order == ("2.0..3.0", "0.0..1.0")


def test_errors():
    model = _chain(2)
    plan = _linear_plan(model)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes must be a positive int"):
            fs.merge_groups(plan, model, bad)
    with pytest.raises(ValueError, match=r"no size for parameters \['1.0.weight'"):
        fs.merge_groups(plan, {"0.0.weight": 64, "0.0.bias": 16}, 1000)
    with pytest.raises(TypeError, match="sizes must be the module"):
        fs.merge_groups(plan, [1, 2], 1000)
    clash = plan.replace(groups=(*plan.groups, fs.Group("0.0..1.0", ())))
    with pytest.raises(ValueError, match="already a group's name"):
        fs.merge_groups(clash, model, 1000)


def merged_step(budget, prefetch, reshard):
    """A merged plan against the unmerged one and the unsharded reference."""
    rank = dist.get_rank()
    model = _chain(8, width=6)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    kw = dict(prefetch=prefetch, backward_prefetch=prefetch, reshard_after_forward=reshard)
    plan = _linear_plan(model, **kw)
    merged = fs.merge_groups(plan, model, budget)
    model.to("meta")
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    results = {}
    for name, p in (("plan", plan), ("merged", merged)):
        apply = fs.schedule(model, p)
        with Collectives() as comm:
            loss, grads = fs.value_and_grad(lambda s, apply=apply: F.mse_loss(apply(s, x), y))(
                sharded
            )
        results[name] = (loss, grads, comm.count("all_gather"), comm.count("reduce_scatter"))
    ref_loss, ref_grads = fs.testing.reference_value_and_grad(
        lambda s, x, y: F.mse_loss(fs.functional_call(model, s, (x,)), y), sharded, x, y
    )
    loss, grads, gathers, scatters = results["merged"]
    fs.testing.assert_close(loss, results["plan"][0], rtol=0, atol=0)
    fs.testing.assert_close(grads, results["plan"][1], rtol=0, atol=0)
    fs.testing.assert_close(grads, ref_grads)
    fs.testing.assert_close(loss, ref_loss)
    return {
        "groups": (len(plan.groups), len(merged.groups)),
        "gathers": (results["plan"][2], gathers),
        "scatters": (results["plan"][3], scatters),
    }


@pytest.mark.parametrize(("prefetch", "reshard"), [(1, True), (0, False), (2, True)])
def test_merged_plan_same_values_fewer_collectives(world2, prefetch, reshard):
    budget = 3 * (6 * 6 + 6) * 4  # three Linear(6, 6) per group
    for r in world2.run(merged_step, budget, prefetch, reshard):
        assert r["groups"] == (8, 3)
        per_group = 2 if reshard else 1  # all-gathers per group per step
        assert r["gathers"] == (8 * per_group, 3 * per_group)
        assert r["scatters"] == (8, 3)
