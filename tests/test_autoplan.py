"""fs.autoplan: the plan explain predicts fastest within a memory budget; checked against
explain's own numbers for the alternatives, and against the unsharded model on 2 ranks."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs

from _mesh import mesh

# fixed rates: results do not depend on this machine's speed; a slow link makes prefetch and
# reshard matter
RATES = fs.Hardware(
    {torch.float32: 1e11},
    memory_bytes_per_s=1e10,
    op_overhead_s=2e-6,
    link_bytes_per_s=2e8,
    latency_s=2e-5,
)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def _model(device="meta", blocks=6, d=64):
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(nn.Linear(16, d), *[Block(d) for _ in range(blocks)])


@pytest.fixture(scope="module")
def fake_mesh():
    from benchmarks.fake import fake_world

    with fake_world(2) as m:
        yield m


def _explain(model, mesh_, plan, x):
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh_)
    return fs.explain(fs.schedule(model, plan), sharded, x, optimizer=_opt(), hardware=RATES)


def _opt():
    return fs.optim.adamw(1e-3)


def _autoplan(model, mesh_, x, budget, **kw):
    return fs.autoplan(
        model, mesh_, x, memory_budget=budget, optimizer=_opt(), hardware=RATES, **kw
    )


def test_loose_budget_returns_the_fastest_fitting_plan(fake_mesh):
    model, x = _model(), torch.randn(256, 16)
    got = _autoplan(model, fake_mesh, x, 2**30, explain=True)
    assert isinstance(got, fs.Autoplanned) and isinstance(got.plan, fs.Plan)
    assert got.plan == _autoplan(model, fake_mesh, x, 2**30)  # the plain form: the same plan
    again = _explain(model, fake_mesh, got.plan, x)  # explained independently
    assert again.peak_bytes == got.explanation.peak_bytes <= 2**30
    fitting = [t.predicted_step_s for t in got.tried if t.fits]
    assert again.predicted_step_s == pytest.approx(min(fitting))
    # hand-written alternatives are no faster
    for kw in ({}, {"reshard_after_forward": False}, {"prefetch": 0}):
        hand = fs.plan(model, fs.policy.by_type(Block), **kw)
        assert _explain(model, fake_mesh, hand, x).predicted_step_s >= again.predicted_step_s
    assert "budget" in str(got) and len(str(got).splitlines()) == 3 + len(got.tried)


def test_tight_budget_recomputes(fake_mesh):
    model, x = _model(), torch.randn(2048, 16)
    by_block = fs.policy.by_type(Block)
    plain = [  # no recompute, every prefetch and reshard setting
        _explain(model, fake_mesh, fs.plan(model, by_block, **kw), x).peak_bytes
        for kw in (
            {"prefetch": f, "backward_prefetch": f, "reshard_after_forward": r}
            for f in (0, 1, 2)
            for r in (True, False)
        )
    ]
    low = _explain(
        model,
        fake_mesh,
        fs.plan(model, by_block, prefetch=0, backward_prefetch=0, recompute=True),
        x,
    ).peak_bytes
    assert low < min(plain)
    budget = (low + min(plain)) // 2  # only recompute fits
    got = _autoplan(model, fake_mesh, x, budget, explain=True)
    assert any(g.recompute for g in got.plan.groups)
    assert _explain(model, fake_mesh, got.plan, x).peak_bytes <= budget
    assert all(not t.fits for t in got.tried if not any(g.recompute for g in t.plan.groups))


def test_budget_between_reshard_settings_reshards(fake_mesh):
    model, x = _model(blocks=4, d=128), torch.randn(64, 16)
    by_block = fs.policy.by_type(Block)
    kept = _explain(model, fake_mesh, fs.plan(model, by_block, reshard_after_forward=False), x)
    freed = _explain(model, fake_mesh, fs.plan(model, by_block), x)
    assert freed.peak_bytes < kept.peak_bytes and kept.predicted_step_s < freed.predicted_step_s
    budget = (freed.peak_bytes + kept.peak_bytes) // 2
    loose = _autoplan(model, fake_mesh, x, 2**30)
    assert not any(g.reshard_after_forward for g in loose.groups)  # faster when it fits
    got = _autoplan(model, fake_mesh, x, budget, explain=True)
    chosen = _explain(model, fake_mesh, got.plan, x)
    assert chosen.peak_bytes <= budget
    assert chosen.predicted_step_s <= freed.predicted_step_s
    assert any(g.reshard_after_forward or g.recompute for g in got.plan.groups)


def test_unfittable_budget_names_the_smallest_that_fits(fake_mesh):
    model, x = _model(), torch.randn(256, 16)
    with pytest.raises(ValueError, match="no plan fits memory_budget=1000 bytes") as info:
        _autoplan(model, fake_mesh, x, 1000)
    smallest = int(re.search(r"memory_budget >= (\d+)", str(info.value)).group(1))
    plan = _autoplan(model, fake_mesh, x, smallest)  # the budget it names is enough
    assert _explain(model, fake_mesh, plan, x).peak_bytes <= smallest
    with pytest.raises(ValueError, match="positive int"):
        _autoplan(model, fake_mesh, x, 0)


def autoplanned_step(budget):
    rank = dist.get_rank()
    model = _model("cpu", blocks=4, d=32)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(2))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 32, generator=g)
    plan = fs.autoplan(
        model, mesh(2), x, memory_budget=budget, optimizer=_opt(), loss=lambda out, x: out.sum()
    )
    apply = fs.schedule(model, plan)
    loss, grads = fs.value_and_grad(lambda s: F.mse_loss(apply(s, x), y))(sharded)
    ref_loss, ref_grads = fs.testing.reference_value_and_grad(
        lambda s, x, y: F.mse_loss(fs.functional_call(model, s, (x,)), y), sharded, x, y
    )
    fs.testing.assert_close(loss, ref_loss)
    fs.testing.assert_close(grads, ref_grads)
    return plan.to_json()


def test_the_plan_runs_like_the_unsharded_model(world2):
    plans = world2.run(autoplanned_step, 2**30)
    assert plans[0] == plans[1]  # one plan on every rank
