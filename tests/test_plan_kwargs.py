"""Planning from keyword-only examples (``fs.plan(module, example_kwargs=...)``, no
``example_args``), by a dry run on meta and by one real forward over the shards, and
``fs.testing.check_plan`` with keyword arguments only; and each planning error's suggested fix,
run as the message writes it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from test_record_real import POLICY, _setup, _x
from torch import nn

import funcshard as fs

from _hf import batch, block_types, build
from _mesh import mesh


class Reversed(nn.Module):
    """Uses ``second`` before ``first`` (not the module order), from a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, *, scale: float = 1.0):
        return self.first(torch.tanh(self.second(x))) * scale


def test_keyword_only_examples_on_meta():
    net = Reversed().to("meta")
    policy = fs.policy.by_type(nn.Linear)
    x = torch.randn(2, 4)
    plan = fs.plan(net, policy, example_kwargs={"x": x, "scale": 2.0})
    assert plan.order == ("second", "first")  # recorded: not the module order
    assert plan == fs.plan(net, policy, example_args=(x,))
    assert fs.testing.check_plan(net, plan, x=x, scale=2.0).ok
    check = fs.testing.check_plan(net, fs.plan(net, policy), x=x)  # the module order
    assert not check.ok and "fs.plan(..., example_args=(...), example_kwargs={...})" in str(check)
    assert fs.testing.check_plan(net, fs.plan(net, policy, example_kwargs={"x": x}), x=x).ok


def out_of_order():
    """The schedule's warning for a plan whose order is not the forward's (and its error, at the
    next call), then its fix: the plan recorded from inputs like the call's, as keywords."""
    torch.manual_seed(0)
    net = Reversed()
    params, _ = fs.extract(net)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    net.to("meta")
    policy = fs.policy.by_type(nn.Linear)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"example_kwargs=\{...\}\)\), or pass order="):
        fs.schedule(net, fs.plan(net, policy))(sharded, x=x)
    fixed = fs.schedule(net, fs.plan(net, policy, example_kwargs={"x": x}))
    with pytest.raises(RuntimeError, match="forward used group 'first'"):  # the next call
        fixed(sharded, x=x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed(sharded, x=x)
    return True


def test_out_of_order_warnings_fix_works_as_written(world2):
    assert world2.run(out_of_order) == [True, True]


def keyword_only_real():
    """A forward that reads values (cannot run on meta), keyword-only examples: the dry run's
    error, its two suggested fixes run as written, check_plan, and a step with the plan."""
    model, reference, sharded, buffers = _setup()
    x = _x(1)
    with pytest.raises(RuntimeError, match="sharded=<the shards>, buffers=<the buffers>") as e:
        fs.plan(model, POLICY, example_kwargs={"x": x})
    assert "plan(..., order=[...])" in str(e.value)
    # the first fix: record from one real forward
    plan = fs.plan(model, POLICY, example_kwargs={"x": x}, sharded=sharded, buffers=buffers)
    assert plan.order == ("", "a", "b", "")
    assert fs.testing.check_plan(model, plan, x=x, sharded=sharded, buffers=buffers).ok
    # the second: give the order
    assert fs.plan(model, POLICY, order=["", "a", "b", ""]).order == plan.order
    apply = fs.schedule(model, plan)
    loss = lambda p: apply(p, buffers=buffers, x=x).square().mean()
    _, grads = fs.value_and_grad(loss)(sharded)
    full = {k: v.full_tensor() for k, v in sharded.items()}
    _, ref = fs.testing.reference_value_and_grad(
        lambda p, x: fs.functional_call(reference, p, (), {"x": x}).square().mean(), full, x
    )
    return max((g.full_tensor() - ref[k]).abs().max().item() for k, g in grads.items())


def test_keyword_only_examples_recorded_from_a_real_forward(world2):
    assert max(world2.run(keyword_only_real)) < 1e-6


def hf_keyword_only(name: str):
    """A Hugging Face model planned from its batch as keywords (how it is called), no
    ``example_args``: on meta without a mask, and from a real forward with one (its mask code
    cannot run on meta: the error's fix, as written); check_plan with the same keywords."""
    model = build(name)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    model.to("meta")
    policy = fs.policy.by_type(*block_types(model))
    b = batch(name, dist.get_rank())  # input_ids, attention_mask (padded), labels
    unmasked = {k: v for k, v in b.items() if k != "attention_mask"}
    on_meta = fs.plan(model, policy, example_kwargs=unmasked)
    with pytest.raises(RuntimeError, match="sharded=<the shards>, buffers=<the buffers>"):
        fs.plan(model, policy, example_kwargs=b)
    real = fs.plan(model, policy, example_kwargs=b, sharded=sharded, buffers=buffers)
    assert fs.testing.check_plan(model, on_meta, **unmasked).ok
    assert fs.testing.check_plan(model, real, sharded=sharded, buffers=buffers, **b).ok
    return on_meta.order, real.order


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models_planned_from_keywords(world2, name):
    prefix = "transformer.h" if name == "gpt2" else "model.layers"
    for on_meta, real in world2.run(hf_keyword_only, name):
        assert on_meta == real == ("", f"{prefix}.0", f"{prefix}.1", "")


# --- each planning error's suggested fix, as written -------------------------------------------


def fixes():
    """Each error of fs.plan / Plan.with_recompute, then the fix its message suggests."""
    model, _, sharded, buffers = _setup()
    x = _x(1)
    # "pass the inputs as example_args= / example_kwargs=, and no order="
    with pytest.raises(ValueError, match="pass the inputs as example_args= / example_kwargs="):
        fs.plan(model, POLICY, sharded=sharded, buffers=buffers)
    fs.plan(model, POLICY, example_kwargs={"x": x}, sharded=sharded, buffers=buffers)
    fs.plan(model, POLICY, example_args=(x,), sharded=sharded, buffers=buffers)
    with pytest.raises(ValueError, match="and no order="):
        fs.plan(model, POLICY, example_kwargs={"x": x}, sharded=sharded, order=["", "a"])
    # "pass the dict from fs.shard(fs.extract(module)[0], mesh) for this module"
    missing = {k: v for k, v in sharded.items() if k != "a.weight"}
    with pytest.raises(ValueError, match=r"fs.shard\(fs.extract\(module\)\[0\], mesh\)"):
        fs.plan(model, POLICY, example_kwargs={"x": x}, sharded=missing, buffers=buffers)
    fresh, _, _, _ = _setup()
    fresh = type(fresh)()  # the same module, with weights of its own
    fixed = fs.shard(fs.extract(fresh)[0], mesh(dist.get_world_size()))
    fs.plan(fresh, POLICY, example_kwargs={"x": x}, sharded=fixed, buffers=buffers)
    # "record with example inputs that take the same path on every rank (e.g. the same batch
    # everywhere), or give the order with order="
    own = _x(1 if dist.get_rank() == 0 else -1)
    with pytest.raises(ValueError, match="the same batch everywhere"):
        fs.plan(model, POLICY, example_kwargs={"x": own}, sharded=sharded, buffers=buffers)
    same = fs.plan(model, POLICY, example_kwargs={"x": x}, sharded=sharded, buffers=buffers)
    assert fs.plan(model, POLICY, order=list(same.order)).order == same.order
    # Plan.with_recompute: "pass False for none"; "groups are [...]"
    with pytest.raises(ValueError, match="pass False for none"):
        same.with_recompute(0)
    assert not any(g.recompute for g in same.with_recompute(False).groups)
    with pytest.raises(ValueError, match=r"groups are \['', 'a', 'b'\]"):
        same.with_recompute(["c"])
    assert same.with_recompute(["a"]).groups[1].recompute
    return True


def test_each_planning_errors_fix_works_as_written(world2):
    assert world2.run(fixes) == [True, True]
