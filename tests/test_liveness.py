"""Deaths and hangs are named: a rank that dies is named by its peers within seconds (on another
host too: by its heartbeat), before or after its first collective; a rank that waits for its
peers longer than ``FUNCSHARD_WAIT_TIMEOUT`` raises an error listing what every rank is doing (its
last funcshard call, plan step, collective) and its stack; and the watcher threads never abort a
process at exit."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard._communication import _liveness, _peers
from funcshard.testing import _pool

from _mesh import mesh

_WAIT = "2"  # FUNCSHARD_WAIT_TIMEOUT in the hang cases: seconds


def _elsewhere():
    """Make this rank look as if it ran on a host of its own (no pid checks by its peers)."""
    _peers.HOST = f"elsewhere-{dist.get_rank()}"
    _liveness.start()


# ---- deaths ---------------------------------------------------------------------------------


def dies_before_the_first_exchange():
    _elsewhere()
    sharded = fs.shard({"w": torch.ones(4)}, mesh(2))  # a funcshard call: the heartbeat runs
    if dist.get_rank() == 1:
        os._exit(3)
    with mock.patch.dict(os.environ, {"FUNCSHARD_WAIT_TIMEOUT": "6"}):
        fs.unshard(sharded)


def test_a_rank_on_another_host_that_dies_silently_is_named_at_the_limit_with_its_silence(world2):
    # a silent heartbeat alone is no proof of death (a paused rank is silent too): rank 0 names
    # rank 1 at its wait's limit (6 s here), far below the process group's timeout (240 s),
    # with how long it has been silent; the pool stops the survivors 30 s after a rank died
    with mock.patch.object(_pool, "_GRACE", 30.0), pytest.raises(fs.testing.RankError) as info:
        world2.run(dies_before_the_first_exchange)
    message = info.value.errors[0]
    assert "ranks [1] did not get there" in message, message
    assert "rank 1: no answer within 4 s, no heartbeat for " in message, message
    assert "runs on host elsewhere-1, which this rank cannot inspect" in message, message


class Dying(nn.Module):
    """Three blocks; rank 1 dies in block 1's forward (``where="forward"``) or backward."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.where: str | None = None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x).tanh()
            if i == 1 and self.where and dist.get_rank() == 1:
                x = _Die.apply(x, self.where)
        return x


class _Die(torch.autograd.Function):
    @staticmethod
    def forward(x, where):
        if where == "forward":
            os._exit(3)
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.where = inputs[1]

    @staticmethod
    def backward(ctx, g):
        os._exit(3)


def dies_in_a_collective(where: str, host: str):
    if host == "elsewhere":
        _elsewhere()
    torch.manual_seed(0)
    model = Dying()
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    model.to("meta")
    sharded = fs.shard(params, mesh(2))
    loss = lambda p: apply(p, torch.ones(2, 4)).sum()
    fs.value_and_grad(loss)(sharded)  # every rank has taken part in collectives
    model.where = where
    fs.value_and_grad(loss)(sharded)


def dies_while_saving(directory: str):
    _elsewhere()
    sharded = fs.shard({"w": torch.ones(4)}, mesh(2))
    fs.checkpoint.save(f"{directory}/first", sharded)  # every rank has saved once
    if dist.get_rank() == 1:  # dies in the middle of its write
        from funcshard.checkpoint import _integrity

        _integrity.Writer.write_data = lambda *args, **kwargs: os._exit(3)
    fs.checkpoint.save(f"{directory}/second", sharded)


def test_a_rank_that_dies_while_saving_is_named(world2, tmp_path):
    with mock.patch.object(_pool, "_GRACE", 10.0), pytest.raises(fs.testing.RankError) as info:
        world2.run(dies_while_saving, str(tmp_path))
    message = info.value.errors[0]
    assert "fs.checkpoint.save failed on rank 0 because rank 1 is gone (" in message, message


@pytest.mark.parametrize(("where", "host"), [("forward", "elsewhere"), ("backward", "here")])
def test_a_rank_that_dies_during_a_collective_is_named(world2, where, host):
    with mock.patch.object(_pool, "_GRACE", 10.0), pytest.raises(fs.testing.RankError) as info:
        world2.run(dies_in_a_collective, where, host)
    message = info.value.errors[0]
    assert "rank 1 is gone (" in message, message
    if host == "elsewhere":
        assert "no heartbeat for" in message, message
    else:
        assert "has exited" in message or "is a zombie" in message, message
    assert "This rank was doing: last funcshard call: schedule" in message, message


# ---- hangs ----------------------------------------------------------------------------------


class Failing(nn.Module):
    """Three blocks; block 1's forward raises on rank 1 while ``fail`` is set."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.fail = False

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x).tanh()
            if i == 1 and self.fail and dist.get_rank() == 1:
                raise ValueError("a bad batch")
        return x


def _training(model: nn.Module):
    torch.manual_seed(0)
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    model.to("meta")
    sharded = fs.shard(params, mesh(2))
    step = fs.value_and_grad(lambda p, x: apply(p, x).sum())
    return sharded, step


def raises_in_a_block_and_goes_on(debug: str):
    model = Failing()
    sharded, step = _training(model)
    step(sharded, torch.ones(2, 4))
    with mock.patch.dict(os.environ, {"FUNCSHARD_WAIT_TIMEOUT": _WAIT, "FUNCSHARD_DEBUG": debug}):
        model.fail = True
        with contextlib.suppress(ValueError):  # rank 1 goes on with its next batch
            step(sharded, torch.ones(2, 4))
        model.fail = False
        step(sharded, torch.ones(2, 4))


def test_a_rank_that_catches_an_error_in_a_blocks_forward_is_named(world2):
    with pytest.raises(fs.testing.RankError) as info:
        world2.run(raises_in_a_block_and_goes_on, "0")
    message = info.value.errors[1]  # rank 1 waits at its next call's check; rank 0 in a gather
    assert "ranks [0] did not get there" in message, message
    assert "rank 0 (" in message and "last funcshard call: schedule" in message, message
    assert "plan step: " in message, message
    assert "last collective funcshard issued: all_gather for 'blocks." in message, message
    assert "(c10d sequence number " in message  # a private torch API: fails here if it goes
    listing = message.split("What each rank is doing:", 1)[1]
    assert listing.count("in raises_in_a_block_and_goes_on") == 2  # both ranks' stacks


def test_the_same_in_debug_mode_is_an_error_on_both_ranks(world2):
    with pytest.raises(fs.testing.RankError) as info:
        world2.run(raises_in_a_block_and_goes_on, "1")
    errors = info.value.errors
    assert "rank 0 is one collective behind or ahead" in errors[1], errors
    assert "rank 0: all_gather of" in errors[0], errors
    assert "rank 1: at the per-call check of a funcshard call" in errors[0], errors


def clips_on_rank_0_only():
    sharded, step = _training(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    sgd = fs.optim.sgd(0.1)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), sgd) if dist.get_rank() == 0 else sgd
    state = opt.init(sharded)
    with mock.patch.dict(os.environ, {"FUNCSHARD_WAIT_TIMEOUT": _WAIT}):
        for _ in range(2):
            _, grads = step(sharded, torch.ones(2, 4))
            sharded, state = fs.optim.step(opt, sharded, grads, state)


def test_clipping_in_one_ranks_chain_only_is_named(world2):
    # the clip's collective checks the optimizers first: an error on both ranks, not a hang
    with pytest.raises(fs.testing.RankError) as info:
        world2.run(clips_on_rank_0_only)
    for message in info.value.errors.values():
        assert "the ranks run different optimizers" in message, message
        assert "clip_by_global_norm" in message, message
        assert "rank 0: fs.optim (global_norm's all-reduce); rank 1: schedule" in message, message


def norms_on_rank_0_only():
    """Rank 0 takes the gradients' global norm (an all-reduce) that rank 1 never takes: no
    optimizer update left a record to check first, so rank 0 waits in the collective itself."""
    sharded, step = _training(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    with mock.patch.dict(os.environ, {"FUNCSHARD_WAIT_TIMEOUT": _WAIT}):
        for _ in range(2):
            _, grads = step(sharded, torch.ones(2, 4))
            if dist.get_rank() == 0:
                fs.optim.global_norm(grads)


def test_the_rank_stuck_in_the_collective_lists_every_rank_at_its_timeout():
    # a process group timeout of 10 s: rank 0's all_reduce of the norm times out, after rank 1
    # raised at its wait limit (2 s); the pool lets rank 0 report instead of stopping it
    with (
        fs.testing.Pool(2, timeout=10) as pool,
        mock.patch.object(_pool, "_GRACE", 60.0),
        pytest.raises(fs.testing.RankError) as info,
    ):
        pool.run(norms_on_rank_0_only, timeout=120)
    message = info.value.errors[0]
    assert "the all_reduce of fs.optim.global_norm failed on rank 0" in message, message
    assert "no rank is known to be dead" in message, message
    listing = message.split("What each rank is doing:", 1)[1]
    assert "rank 1 (" in listing and "in norms_on_rank_0_only" in listing, listing
    assert "ranks [0] did not get there" in info.value.errors[1]


def saves_on_some_ranks(fewer: bool, directory: str):
    sharded, step = _training(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    rank = dist.get_rank()
    with mock.patch.dict(os.environ, {"FUNCSHARD_WAIT_TIMEOUT": _WAIT}):
        for i in range(3 - (fewer and rank == 1)):
            step(sharded, torch.ones(2, 4))
            if not fewer and rank == 0:
                fs.checkpoint.save(f"{directory}/step{i}", sharded)
        if fewer:  # one batch fewer on rank 1, then a save
            fs.checkpoint.save(f"{directory}/last", sharded)


@pytest.mark.parametrize("fewer", [False, True], ids=["save on rank 0 only", "one batch fewer"])
def test_a_save_that_not_every_rank_makes_is_named(world2, fewer, tmp_path):
    with pytest.raises(fs.testing.RankError) as info:
        world2.run(saves_on_some_ranks, fewer, str(tmp_path))
    waiting, saving = (0, 1) if fewer else (1, 0)
    message = info.value.errors[waiting]
    assert f"ranks [{saving}] did not get there" in message, message
    assert f"rank {saving} (" in message, message
    assert "last funcshard call: fs.checkpoint.save" in message, message
    assert "in save" in message  # the saving rank's stack


def test_the_wait_limit_must_be_a_positive_number():
    class Store:
        timeout = None

    with (
        mock.patch.dict(os.environ, {"FUNCSHARD_WAIT_TIMEOUT": "soon"}),
        pytest.raises(ValueError, match="FUNCSHARD_WAIT_TIMEOUT='soon'"),
    ):
        _peers.limit(Store())


# ---- exit -----------------------------------------------------------------------------------

_FORGETS = """
import datetime, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import funcshard as fs
rank, port = int(sys.argv[1]), int(sys.argv[2])
timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout, wait_for_workers=False)
print(store.port, flush=True)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
mesh = init_device_mesh("cpu", (2,))
fs.unshard(fs.shard({"a": torch.ones(4)}, mesh))  # the watcher runs from here on
dist.barrier()
print("done", flush=True)
# no dist.destroy_process_group()
"""


def _rank(rank: int, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _FORGETS, str(rank), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_run_that_forgets_destroy_process_group_exits_cleanly():
    first = _rank(0, 0)  # hosts the store, on a port the OS picks
    ranks = [first, _rank(1, int(first.stdout.readline()))]
    outs = [p.communicate(timeout=180) for p in ranks]
    for p, (out, err) in zip(ranks, outs, strict=True):
        assert p.returncode == 0 and "done" in out, (p.returncode, out, err)
        assert "terminate called" not in err, err
