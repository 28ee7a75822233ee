"""The ranks agree on the step, not only on the tree: an optimizer whose learning rate or chain
differs on one rank, a rank that skips an optimizer step (or its ``value_and_grad`` call), a
rank whose optimizer state is at another step, a plan grouped differently on one rank, and (in
debug mode) a model initialised differently on one rank are each an error on every rank,
naming the difference, at the next check at the latest and without a hang; the ranks stay in
step after it. Ranks that step the same way train as the unsharded model does (no false
positive), and different batch sizes under ``grad_reduce="mean"`` warn once."""

from __future__ import annotations

import os
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs
from funcshard._communication import _counts

from _mesh import mesh

optim = fs.optim


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int, rank: int, size: int = 3):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(size, 4, generator=g), torch.randn(size, 2, generator=g)


def _in_step() -> bool:
    """The ranks' next calls pair up: an unshard gives back the full tensor."""
    full = torch.arange(6.0)
    return torch.equal(fs.unshard(fs.shard({"w": full}, mesh(dist.get_world_size())))["w"], full)


def _optimizer(case: str, rank: int):
    """``case``'s optimizer on ``rank``; the last rank is the odd one."""
    rank = int(rank == dist.get_world_size() - 1)
    if case == "lr":
        return optim.adamw(1e-2 if rank == 0 else 2e-2)
    if case == "clip":  # clipping in rank 0's chain only
        return optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2)) if rank == 0 else (
            optim.adamw(1e-2))  # fmt: skip
    if case == "schedule":
        warmup = 2 if rank == 0 else 3
        return optim.adamw(optim.warmup_cosine_decay_schedule(0.0, 1e-2, warmup, 10))
    if case == "same":
        clip = optim.clip_by_global_norm(0.5)
        return optim.apply_if_finite(optim.chain(clip, optim.adamw(1e-2)), 2)
    return optim.adamw(1e-2)


def training(case: str, steps: int = 3):
    """``steps`` scheduled steps of ``case``; returns the first error (step, type, message),
    whether the ranks are in step afterwards, and the parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1  # the rank that differs
    model = _model()
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    model.to("meta")
    sharded = fs.shard(params, mesh(world))
    opt = _optimizer(case, rank)
    state = opt.init(sharded)
    if case == "state" and odd:  # a state restored from another step's checkpoint
        state = state._replace(count=state.count + 1)
    vg = fs.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x), y))
    found = None
    for step in range(steps):
        try:
            skip = case == "skip grad" and odd and step == 1
            if not skip:  # a NaN batch: this rank skips its value_and_grad, not its step
                _, grads = vg(sharded, *_batch(step, rank))
            if case == "skip step" and odd and step == 1:
                continue  # a non-finite loss seen on this rank only: its step is skipped
            sharded, state = optim.step(opt, sharded, grads, state)
        except Exception as e:
            found = (step, type(e).__name__, str(e))
            break
    full = {k: v.full_tensor() for k, v in sharded.items()}
    return found, _in_step(), full


@pytest.mark.parametrize(
    ("case", "step", "says"),
    [
        ("lr", 1, ["the ranks run different optimizers", "rank 0:", "0.01", "rank 1:", "0.02"]),
        ("schedule", 1, ["different optimizers", "warmup_steps=2", "warmup_steps=3"]),
        ("clip", 1, ["different optimizers", "clip_by_global_norm", "rank 1: ",
                     "rank 0: fs.optim (global_norm's all-reduce); rank 1: schedule"]),
        ("skip step", 2, ["different numbers of optimizer updates", "rank 0: 1; rank 1: 0",
                          "skipped an optimizer step"]),
        ("skip grad", 2, ["different numbers of optimizer updates", "rank 0: 1; rank 1: 2"]),
        ("state", 1, ["rank 0 at optimizer step 0", "rank 1 at optimizer step 1",
                      "skipped an optimizer step"]),
    ],
)  # fmt: skip
def test_ranks_that_step_differently_raise_on_every_rank(world2, case, step, says):
    results = world2.run(training, case, timeout=90)  # a hang fails here
    for rank, (found, in_step, _) in enumerate(results):
        assert found is not None, f"rank {rank} raised nothing"
        assert found[1] == "ValueError", found
        for text in says:
            assert text in found[2], (rank, found[2])
        assert in_step
    assert max(f[0] for f, _, _ in results) == step  # caught at that step's first check
    assert results[0][0][2].split(": ", 1)[1] == results[1][0][2].split(": ", 1)[1]


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("lr", ["ranks 0-2: adamw(lr=0.01, weight_decay", "rank 3: adamw(lr=0.02"]),
        ("skip step", ["(ranks 0-2: 1; rank 3: 0;", "the last ones: ranks 0-2: adamw(lr=0.01"]),
    ],
)
def test_on_4_ranks_the_rank_that_steps_differently_is_named_on_every_rank(world4, case, says):
    results = world4.run(training, case, timeout=90)
    messages = {found[2].split(": ", 1)[1] for found, _, _ in results}
    assert len(messages) == 1, messages  # the same message on every rank
    for found, in_step, _ in results:
        assert found[1] == "ValueError" and in_step
        for text in says:
            assert text in found[2], found[2]


def test_ranks_that_step_the_same_way_train_as_the_unsharded_model(world2):
    results = world2.run(training, "same", 4)
    assert all(found is None and in_step for found, in_step, _ in results), results
    model = _model()
    params, _ = fs.extract(model)
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    torch_opt = torch.optim.AdamW(params.values(), lr=1e-2)
    for step in range(4):
        x, y = (torch.cat(t) for t in zip(*(_batch(step, r) for r in range(2)), strict=True))
        loss = F.mse_loss(torch.func.functional_call(model, params, (x,)), y)
        torch_opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 0.5)
        torch_opt.step()
    for _, _, full in results:
        for k, v in params.items():
            torch.testing.assert_close(full[k], v.detach(), atol=1e-6, rtol=1e-5)


def planned(by_rank: str):
    """A plan grouped differently on rank 1."""
    model = _model()
    params, _ = fs.extract(model)
    policy = fs.policy.by_type(nn.Linear)
    plan = fs.plan(model, policy if dist.get_rank() == 0 or by_rank == "same" else None)
    apply = fs.schedule(model, plan)
    model.to("meta")
    sharded = fs.shard(params, mesh(2))
    try:
        apply(sharded, torch.ones(2, 4))
        found = None
    except ValueError as e:
        found = str(e)
    return found, _in_step()


def test_a_plan_grouped_differently_on_one_rank_is_an_error_naming_the_group(world2):
    for found, in_step in world2.run(planned, "differs"):
        assert found is not None and in_step
        assert "schedule: ranks disagree at '<plan group 0>'" in found, found
        assert "rank 1: absent" in found
    assert world2.run(planned, "same") == [(None, True)] * 2


def seeded(debug: bool):
    """A model initialised with another seed on rank 1."""
    torch.manual_seed(dist.get_rank() if debug else 0)
    params, _ = fs.extract(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    env = {"FUNCSHARD_DEBUG": "1" if debug else "0"}
    with mock.patch.dict(os.environ, env):
        try:
            fs.shard(params, mesh(2))
            found = None
        except ValueError as e:
            found = str(e)
    return found, _in_step()


def test_debug_mode_names_a_model_initialised_differently_on_one_rank(world2):
    for found, in_step in world2.run(seeded, True):
        assert found is not None and in_step
        assert "shard (FUNCSHARD_DEBUG" in found and "'<values of 0.bias>'" in found, found
        assert "same seed" in found
    assert world2.run(seeded, False) == [(None, True)] * 2  # same values, debug mode on or off


def uneven_mean():
    rank = dist.get_rank()
    _counts._WARNED.clear()  # this process's first time
    model = _model()
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(2))
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    vg = fs.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x), y))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vg(sharded, *_batch(0, rank, 3 + 2 * rank))  # 3 and 5 samples
        vg(sharded, *_batch(1, rank, 3 + 2 * rank))
        vg(sharded, *_batch(2, rank, 4))  # equal
    return [str(w.message) for w in caught if "grad_reduce='mean'" in str(w.message)]


def test_different_batch_sizes_under_mean_warn_once(world2):
    for warned in world2.run(uneven_mean):
        assert len(warned) == 1, warned
        assert "rank 0: 3; rank 1: 5" in warned[0] and "'weighted'" in warned[0], warned[0]
