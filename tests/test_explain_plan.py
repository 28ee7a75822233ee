"""fs.explain against hand computations from the model, the plan and the mesh: bytes per group,
the collectives each plan runs (kind, group, count, bytes), what reshard-after-forward and
recompute change, the main job's ``--explain``, and that explaining communicates nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import funcshard as fs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_lm

WIDTH, BLOCKS, ROWS = 32, 3, 8
HW = fs.Hardware({torch.float32: 1e10}, 1e10, 1e-6, 1e9, 1e-5, name="test")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d: int = WIDTH, n: int = BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(n)))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.blocks(x))


def _explained(world: int, **plan_options) -> tuple[fs.Explanation, dict, fs.Plan]:
    """Net on the meta device, sharded over a fake world of ``world`` ranks, explained."""
    from funcshard._pricing._fake_world import fake_world

    dtypes = {k: plan_options.pop(k) for k in ("param_dtype", "reduce_dtype") if k in plan_options}
    with fake_world(world) as mesh:
        with torch.device("meta"):
            model = Net()
        params, _ = fs.extract(model)
        sharded = fs.shard(params, mesh)
        plan = fs.plan(model, fs.policy.by_type(Block), **plan_options)
        apply = fs.schedule(model, plan, **dtypes)
        x = torch.empty(ROWS, WIDTH, device="meta")
        e = fs.explain(apply, sharded, x, optimizer=fs.optim.adamw(1e-3), hardware=HW)
        shapes = {k: (v.shape, v.to_local().shape) for k, v in sharded.items()}
    return e, shapes, plan


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


def test_group_bytes_are_the_shards_and_the_full_parameters():
    """Per group: shard bytes are the local shards' (uneven shards included), gathered bytes the
    full parameters in the compute dtype, reduce bytes in the reduce dtype, and the optimizer
    state AdamW's two moments per shard and its step count per parameter."""
    e, shapes, plan = _explained(4, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for g, cost in zip(plan.groups, e.groups, strict=True):
        assert cost.name == g.name
        local = sum(_numel(shapes[p][1]) for p in g.params)
        full = sum(_numel(shapes[p][0]) for p in g.params)
        assert cost.shard_bytes == 4 * local
        assert cost.gathered_bytes == 2 * full
        assert cost.reduce_bytes == 4 * full
        assert cost.optimizer_bytes == 2 * 4 * local + 4 * len(g.params)  # + a step per leaf
    assert e.at_peak["parameters"] == sum(4 * _numel(s[1]) for s in shapes.values())


def test_collectives_are_what_the_plan_runs():
    """One all-gather per group in forward, one more in backward per group resharded after
    forward, one reduce-scatter per group; bytes from the parameters' sizes."""
    e, shapes, plan = _explained(4)
    by = {(c.kind, c.group, c.phase): c for c in e.collectives}
    for g in plan.groups:
        full = sum(4 * _numel(shapes[p][0]) for p in g.params)
        gather = by[("all_gather", g.name, "forward")]
        assert gather.count == 1 and gather.out_bytes >= full
        assert gather.out_bytes == 4 * gather.in_bytes  # 4 ranks: padded chunks
        assert gather.wire_bytes == gather.out_bytes * 3 // 4
        again = ("all_gather", g.name, "backward")
        assert (again in by) == g.reshard_after_forward
        reduce = by[("reduce_scatter", g.name, "backward")]
        assert reduce.count == 1 and reduce.in_bytes == gather.out_bytes
    kinds = {c.kind for c in e.collectives if c.phase != "optimizer"}
    assert kinds == {"all_gather", "reduce_scatter"}


def test_keeping_groups_unsharded_skips_the_backward_gathers_and_costs_memory():
    resharded, _, _ = _explained(4)
    kept, _, _ = _explained(4, reshard_after_forward=False)
    assert not any(c.kind == "all_gather" and c.phase == "backward" for c in kept.collectives)
    gathered = sum(g.gathered_bytes for g in kept.groups)
    at_forward_end = max(
        m.by_category["gathered parameters"] for m in kept.timeline if m.phase == "forward"
    )
    assert at_forward_end >= gathered  # every group unsharded at once

    def forward_peak(e):  # backward holds two groups at once either way (prefetch 1)
        return max(m.bytes for m in e.timeline if m.phase == "forward")

    assert forward_peak(kept) > forward_peak(resharded)
    assert kept.communication_s < resharded.communication_s


def test_recompute_keeps_only_the_inputs_of_recomputed_groups():
    """A recomputing block keeps its input ([ROWS, WIDTH] float32) for backward, and runs its
    first matmul again in backward (the recompute stops once what backward needs is rebuilt:
    the last matmul's output is not needed)."""
    plain, _, _ = _explained(2)
    again, _, _ = _explained(2, recompute=True)
    for p, r in zip(plain.groups, again.groups, strict=True):
        if not r.recompute:
            continue
        assert r.activation_bytes <= ROWS * WIDTH * 4 < p.activation_bytes
        up = 2 * ROWS * WIDTH * 4 * WIDTH
        assert p.forward_flops == 2 * up  # up and down
        assert r.backward_flops == p.backward_flops + up
    first, second = plain.groups[1:3]  # the first block's input needs no gradient
    assert second.backward_flops == 2 * second.forward_flops
    assert first.backward_flops == 2 * first.forward_flops - 2 * ROWS * WIDTH * 4 * WIDTH


def test_table_json_and_picture(tmp_path):
    e, _, _ = _explained(2)
    text = str(e)
    assert "peak" in text and "all_gather" in text and "blocks.0" in text
    d = json.loads(e.to_json())
    assert d["peak_bytes"] == e.peak_bytes and len(d["collectives"]) == len(e.collectives)
    assert d["plan"]["order"] == list(e.plan.order)
    pytest.importorskip("matplotlib")
    e.plot(str(tmp_path / "step.png"))
    assert (tmp_path / "step.png").read_bytes()[:4] == b"\x89PNG"


def test_peak_is_the_largest_moment_and_time_adds_up():
    e, _, _ = _explained(4)
    assert e.peak_bytes == max(m.bytes for m in e.timeline) == e.peak_at.bytes
    assert sum(e.at_peak.values()) == e.peak_bytes
    assert e.predicted_step_s == pytest.approx(e.compute_s + e.exposed_communication_s)
    assert e.compute_s <= e.predicted_step_s <= e.compute_s + e.communication_s + 1e-12


def test_explain_refuses_what_is_not_a_scheduled_apply():
    model = Net()
    params, _ = fs.extract(model)
    with pytest.raises(TypeError, match=r"what fs\.schedule returned"):
        fs.explain(lambda p, x: fs.functional_call(model, p, x), params, torch.ones(2, WIDTH))
    apply = fs.schedule(model, fs.plan(model))
    with pytest.raises(TypeError, match=r"'blocks\.0\.up\.weight' must be a DTensor"):
        fs.explain(apply, params, torch.ones(2, WIDTH))


def _explain_alone(_: int) -> tuple[int, int]:
    """A real step with AdamW on both ranks, then rank 0 explains a step (with the optimizer)
    while rank 1 does not, then both take another real step: nothing may wait for rank 1, and
    the fake step must leave no trace in what the ranks check with each other (its optimizer
    update, the real update not yet checked)."""
    import torch.distributed as dist

    from _mesh import mesh

    m = mesh(2)
    torch.manual_seed(0)
    model = Net()
    params, _ = fs.extract(model)
    sharded = fs.shard(params, m)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(Block)))
    opt = fs.optim.adamw(1e-3)
    state = opt.init(sharded)
    x = torch.ones(ROWS, WIDTH)

    def step(sharded, state):
        loss, grads = fs.value_and_grad(lambda p: apply(p, x).sum())(sharded)
        return (*fs.optim.step(opt, sharded, grads, state), loss)

    sharded, state, _ = step(sharded, state)
    peak = -1
    if dist.get_rank() == 0:
        peak = fs.explain(apply, sharded, x, optimizer=opt, hardware=HW).peak_bytes
    dist.barrier()
    sharded, state, loss = step(sharded, state)  # the real steps still agree
    return peak, int(loss.isfinite())


def test_explain_on_real_shards_needs_no_other_rank(world2):
    (peak, ok0), (absent, ok1) = world2.run(_explain_alone, 0)
    assert peak > 0 and absent == -1 and ok0 == ok1 == 1


def test_main_job_explains_and_exits(world2):
    """``--explain``: the plan's prediction, and no training; its shards are the run's."""
    from test_train_lm import TINY

    results = world2.run(train_lm.main, [*TINY, "--explain"])
    for r in results:
        e = r.explanation
        assert r.losses == [] and e is not None
        shards = [getattr(v, "to_local", lambda v=v: v)() for v in r.params.values()]
        assert sum(g.shard_bytes for g in e.groups) == sum(
            t.numel() * t.element_size() for t in shards
        )
        assert {c.kind for c in e.collectives} >= {"all_gather", "reduce_scatter"}


def test_reshard_to_a_smaller_mesh_is_priced():
    """``reshard_after_forward=2`` on 8 ranks: backward re-gathers within sub-groups of 2
    ranks (each rank sends half the group), and between forward and backward each rank keeps
    half of each block's full parameters instead of none."""
    full, _, _ = _explained(8)
    half, _, plan = _explained(8, reshard_after_forward=2)
    blocks = [g for g in plan.groups if g.name]
    assert all(g.reshard_after_forward == 2 for g in blocks)
    by = {(c.kind, c.group, c.phase): c for c in half.collectives}
    for g in blocks:
        forward, backward = (
            by[("all_gather", g.name, "forward")],
            by[("all_gather", g.name, "backward")],
        )
        assert forward.mesh_dim.endswith("(8 ranks)") and backward.mesh_dim.endswith("(2 ranks)")
        assert (
            backward.out_bytes == forward.out_bytes and backward.in_bytes == forward.out_bytes // 2
        )
        assert backward.wire_bytes == forward.out_bytes // 2
    kept = next(m for m in half.timeline if m.phase == "backward")
    freed = next(m for m in full.timeline if m.phase == "backward")
    slices = sum(by[("all_gather", g.name, "forward")].out_bytes // 2 for g in blocks)
    assert (
        kept.by_category["gathered parameters"] - freed.by_category["gathered parameters"] >= slices
    )


def _explain_hsdp(_: int) -> list[tuple]:
    from torch.distributed.tensor import Replicate, Shard

    from _mesh import mesh

    m = mesh(2, 2)  # (replicate, shard)
    model = Net()
    params, _ = fs.extract(model)
    sharded = fs.shard(params, m, placements=(Replicate(), Shard(0)))
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(Block)))
    e = fs.explain(apply, sharded, torch.randn(ROWS, WIDTH), hardware=HW)
    full = {g.name: g.reduce_bytes for g in e.groups}
    return [
        (c.kind, c.group, c.mesh_dim, c.phase, c.in_bytes, full[c.group]) for c in e.collectives
    ]


def test_hsdp_reduces_the_shard_over_the_replicas(world4):
    """HSDP: gathers and reduce-scatters over the shard dim, then an all-reduce of the reduced
    shard (half the full gradient, padded) over the replicate dim, in backward only."""
    rows = world4.run(_explain_hsdp, 0)[0]
    reduces = [r for r in rows if r[0] == "all_reduce"]
    assert {r[1] for r in reduces} == {g for _, g, *_ in rows}
    for kind, _, dim, phase, in_bytes, full in rows:
        assert dim == ("replicate (2 ranks)" if kind == "all_reduce" else "shard (2 ranks)")
        if kind == "all_reduce":
            assert phase == "backward" and full // 2 <= in_bytes <= full // 2 + 64
