"""Bad input gets a clear error on every rank -- never a hang, a killed rank or garbage: ranks
that disagree, shards that do not belong to the process group, jacfwd through collectives,
modules already under fully_shard."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard

import funcshard as fs
from funcshard._communication import _consensus

from _checks import raises
from _mesh import mesh

# ---- ranks that disagree -----------------------------------------------------------------------


def _tree(rank, case):
    """A tree that agrees across ranks except as ``case`` says (on rank 0)."""
    odd = rank == 0
    w = torch.ones(6, 4, requires_grad=True)
    tree = {f"{case}.w": w, f"{case}.b": torch.ones(3, requires_grad=True)}
    opts = {}
    if case == "extra" and odd:
        tree[f"{case}.x"] = torch.ones(2, requires_grad=True)
    elif case == "shape" and odd:
        tree[f"{case}.w"] = torch.ones(6, 5, requires_grad=True)
    elif case == "dtype":
        tree[f"{case}.w"] = w.detach().to(torch.bfloat16 if odd else torch.float16)
    elif case == "frozen" and odd:
        tree[f"{case}.b"] = torch.ones(3)
    elif case == "param_dtype":
        opts["param_dtype"] = torch.bfloat16 if odd else None
    placements = lambda _, t: Shard(1) if case == "placements" and odd and t.dim() == 2 else None
    sharded = fs.shard(tree, mesh(dist.get_world_size()), placements)
    return sharded, opts


def disagreeing(case: str, path: str):
    rank = dist.get_rank()
    sharded, opts = _tree(rank, case)
    loss = lambda p: sum(v.float().sum() for v in fs.unshard(p, **opts).values())
    found = [raises(lambda: fs.value_and_grad(loss)(sharded), ValueError, "ranks disagree", path)]
    # reduce: the `like` trees disagree
    fulls = {k: torch.ones(v.shape) for k, v in sharded.items()}
    found.append(raises(lambda: fs.reduce(fulls, sharded), ValueError, "ranks disagree", path))
    # the ranks are still in step: an agreeing tree works right after
    ok = fs.shard({"after.w": torch.arange(6.0)}, mesh(dist.get_world_size()))
    found.append(fs.unshard(ok)["after.w"].tolist() == list(range(6)) or "garbage after error")
    return found


@pytest.mark.parametrize(
    ("case", "path"),
    [
        ("extra", "'extra.x' (rank 0: torch.float32 [2] (S(0)) on mesh [0, 1], requires grad; "),
        ("shape", "'shape.w' (rank 0: torch.float32 [6, 5]"),
        ("dtype", "rank 0: torch.bfloat16 [6, 4]"),
        ("placements", "rank 0: torch.float32 [6, 4] (S(1))"),
        ("frozen", "'frozen.b' (rank 0: torch.float32 [3] (S(0)) on mesh [0, 1], no grad"),
        ("param_dtype", "'<param_dtype>' (rank 0: torch.bfloat16; rank 1: None)"),
    ],
)
def test_ranks_that_disagree_get_the_same_error(world2, case, path):
    for found in world2.run(disagreeing, case, path):
        if case in ("param_dtype", "frozen"):  # not part of a reduce: both ranks agree there
            found[1] = None
        assert found == [None, None, True], found


def disagreeing_plans():
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    plan = fs.plan(model, fs.policy.by_type(nn.Linear), prefetch=rank)
    apply = fs.schedule(model, plan)
    x = torch.ones(2, 4)
    return raises(
        lambda: apply(sharded, x),
        ValueError,
        "ranks disagree",
        "'<plan prefetch>' (rank 0: '0, backward 1'",
    )


def test_ranks_with_different_plans_get_an_error(world2):
    assert world2.run(disagreeing_plans) == [None, None]


def steady_state_is_cheap():
    """One status exchange per call (see [Note: one status per call]); the structure is
    described and hashed once."""
    calls, described = [], []
    real, describe = _consensus._exchange, _consensus._describe
    _consensus._exchange = lambda *a: calls.append(a[0]) or real(*a)
    _consensus._describe = lambda *a: described.append(1) or describe(*a)
    try:
        sharded = fs.shard({"steady.w": torch.ones(8, 2)}, mesh(dist.get_world_size()))
        for _ in range(5):
            fs.value_and_grad(lambda p: fs.unshard(p)["steady.w"].sum())(sharded)
    finally:
        _consensus._exchange, _consensus._describe = real, describe
    return calls, len(described)


def test_agreement_is_one_exchange_per_call(world2):
    assert world2.run(steady_state_is_cheap) == [(["status"] * 5, 1)] * 2


# ---- shards that do not belong to the process group ---------------------------------------------


def foreign_shards():
    world = dist.get_world_size()
    found = []
    permuted = DeviceMesh("cpu", list(reversed(range(world))))
    local = torch.ones(2, 3)
    t = DTensor.from_local(local, permuted, [Shard(0)], run_check=False)
    found.append(raises(lambda: fs.unshard({"p": t}), ValueError, "'p'", "permuted"))
    found.append(raises(lambda: fs.shard({"p": torch.ones(4)}, permuted), ValueError, "permuted"))
    partial = DTensor.from_local(local, mesh(world), [Partial()], run_check=False)
    found.append(raises(lambda: fs.unshard({"q": partial}), ValueError, "'q'", "Partial"))
    apply = fs.schedule(nn.Linear(3, 2), fs.plan(nn.Linear(3, 2)))
    bad = {"weight": DTensor.from_local(torch.ones(1, 3), mesh(world), [Partial()])}
    bad["bias"] = DTensor.from_local(torch.ones(1), mesh(world), [Shard(0)], run_check=False)
    found.append(raises(lambda: apply(bad, torch.ones(3)), ValueError, "'weight'", "Partial"))
    if world == 4:
        sub = mesh(2, 2)["shard"]  # 2 of the 4 ranks
        s = DTensor.from_local(local, sub, [Shard(0)], run_check=False)
        found.append(raises(lambda: fs.unshard({"s": s}), ValueError, "'s'", "has 2 ranks"))
    return found


def test_foreign_meshes_and_partial_placements_are_refused(world2, world4):
    for found in world2.run(foreign_shards) + world4.run(foreign_shards):
        assert set(found) == {None}, found


# ---- jacfwd through collectives ---------------------------------------------------------------


def jacfwd_sharded(rows: int):
    torch.manual_seed(0)
    model = nn.Linear(3, rows)  # rows=3: uneven shards on 2 ranks
    params, _ = fs.extract(model)
    local = fs.to_local(fs.shard(params, mesh(dist.get_world_size())))
    x = torch.ones(3)
    f = lambda p: fs.functional_call(model, fs.unshard(p), (x,))
    found = [raises(lambda: torch.func.jacfwd(f)(local), ValueError, "jacfwd", "jacrev")]
    found.append(
        raises(lambda: torch.func.hessian(lambda p: f(p).sum())(local), ValueError, "jacfwd")
    )
    # jacfwd w.r.t. the input stays fine
    g = lambda x: fs.functional_call(model, fs.unshard(local), (x,))
    found.append(torch.func.jacfwd(g)(x).shape == (rows, 3) or "jacfwd w.r.t. inputs broke")
    return found


@pytest.mark.parametrize("rows", [4, 3])
def test_jacfwd_wrt_sharded_parameters_is_refused(world2, rows):
    for found in world2.run(jacfwd_sharded, rows):
        assert found == [None, None, True], found


# ---- modules already under fully_shard ----------------------------------------------------------


def fully_sharded_module():
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    apply = fs.schedule(model, fs.plan(model))
    fully_shard(model[1])
    x = torch.ones(2, 4)
    return [
        raises(lambda: apply(sharded, x), ValueError, "'1'", "fully_shard", "without"),
        raises(lambda: fs.functional_call(model, fs.unshard(sharded), (x,)), ValueError, "'1'"),
        raises(lambda: fs.plan(model), ValueError, "'1'", "fully_shard"),
    ]


def test_module_under_fully_shard_is_refused(world2):
    for found in world2.run(fully_sharded_module):
        assert found == [None, None, None], found
