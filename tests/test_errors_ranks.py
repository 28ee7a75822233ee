"""One rank's error is every rank's: a mistake on one rank only raises on every rank in the same
call, before any collective, so that a program that catches it stays in step (checked against
the unsharded values right after); and a rank that dies before a call's check is named within
seconds, not after the process group's timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard.testing import _pool

from _mesh import mesh


def _caught(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def one_rank_fails():
    m = mesh(2)
    rank = dist.get_rank()
    full = {"w": torch.arange(12.0).reshape(4, 3), "b": torch.arange(4.0)}
    sharded = fs.shard(full, m)
    found = {}
    # unshard: a plain tensor where a shard belongs, on rank 1 only
    mine = dict(sharded, b=torch.ones(4)) if rank == 1 else sharded
    found["unshard"] = _caught(lambda: fs.unshard(mine))
    found["unshard after"] = torch.equal(fs.unshard(sharded)["w"], full["w"])
    # reduce: a gradient of the wrong shape on rank 0 only
    grads = {k: torch.ones(v.shape if rank else (5,) * v.dim()) for k, v in full.items()}
    found["reduce"] = _caught(lambda: fs.reduce(grads, sharded))
    ones = fs.reduce({k: torch.ones(v.shape) for k, v in full.items()}, sharded)
    found["reduce after"] = torch.equal(ones["w"].full_tensor(), torch.ones(4, 3))
    # a scheduled apply: a parameter missing on rank 1 only
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    x = torch.randn(5, 3)
    reference = model(x)
    model.to("meta")
    p = fs.shard(params, m)
    partial = {k: v for k, v in p.items() if k != "1.bias"} if rank == 1 else p
    found["schedule"] = _caught(lambda: apply(partial, x))
    found["schedule after"] = torch.allclose(apply(p, x), reference, atol=1e-6)
    return rank, found


def test_one_ranks_error_is_raised_on_every_rank_and_they_stay_in_step(world2):
    for rank, found in world2.run(one_rank_fails):
        assert found["unshard after"] and found["reduce after"] and found["schedule after"]
        kinds = {k: found[k][0] for k in ("unshard", "reduce", "schedule")}
        assert kinds == {"unshard": "TypeError", "reduce": "ValueError", "schedule": "ValueError"}
        if rank == 0:  # the others' message names the rank that failed and its message
            assert "unshard: rank 1 raised TypeError" in found["unshard"][1]
            assert "schedule: rank 1 raised ValueError" in found["schedule"][1]
            assert "'1.bias'" in found["schedule"][1]
        else:
            assert "reduce: rank 0 raised ValueError" in found["reduce"][1]
            assert "full_grads at 'b' has shape [5]" in found["reduce"][1]


def dies_before_the_check():
    m = mesh(2)
    fs.unshard(fs.shard({"first": torch.ones(4)}, m))  # every rank has taken part once
    if dist.get_rank() == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        fs.unshard(fs.shard({"new": torch.ones(6)}, m))
    except RuntimeError as e:
        raise RuntimeError(f"{e} [after {time.monotonic() - start:.1f} s]") from None


def test_a_rank_dying_before_the_check_is_named_within_seconds(world2):
    # the pool stops the survivors 10 s after a rank died (instead of 1 s), far below the
    # process group's timeout (60 s): rank 0 must report before that
    with mock.patch.object(_pool, "_GRACE", 10.0), pytest.raises(fs.testing.RankError) as info:
        world2.run(dies_before_the_check)
    assert "exited with code 3" in info.value.errors[1]
    assert "rank 1 is gone" in info.value.errors[0], info.value.errors
    assert "has exited" in info.value.errors[0] or "zombie" in info.value.errors[0]


class Dropping(nn.Module):
    """Three blocks; ``drop`` computes the last two and drops their output (a data-dependent
    branch). Inside ``torch.func`` nothing of funcshard runs in backward, so the dropping rank's
    backward lacks their reduce-scatters: the collectives differ (see docs/failures.md)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 6), nn.Linear(6, 4)])
        self.out = nn.Linear(4, 1)

    def forward(self, x, drop: bool):
        h = self.blocks[0](x)
        later = self.blocks[2](self.blocks[1](h).relu())
        return self.out(h if drop else later)


def diverging_forwards(debug: str):
    torch.manual_seed(0)
    model = Dropping()
    params, _ = fs.extract(model)
    plan = fs.plan(model, fs.policy.by_type(nn.Linear))
    apply = fs.schedule(model, plan)
    model.to("meta")
    sharded = fs.to_local(fs.shard(params, mesh(2)))
    drop = dist.get_rank() == 0
    step = lambda: torch.func.grad(lambda p, x: apply(p, x, drop).sum())(sharded, torch.ones(2, 4))
    if debug == "argument":
        with fs.checking_collectives():
            found = _caught(step)
    else:
        with mock.patch.dict(os.environ, {"FUNCSHARD_DEBUG": "1"}):
            found = _caught(step)
    # still in step: the next calls pair up, with the values of the unsharded model
    after = fs.unshard(fs.shard({"w": torch.arange(6.0)}, mesh(2)))["w"]
    return found, torch.equal(after, torch.arange(6.0))


@pytest.mark.parametrize("debug", ["argument", "environment"])
def test_debug_mode_turns_diverging_collectives_into_an_error_on_every_rank(world2, debug):
    for found, in_step in world2.run(diverging_forwards, debug):
        assert found is not None and found[0] == "RuntimeError", found
        message = found[1]  # the group, and what each rank was about to do
        assert "the ranks of process group [0, 1] are about to issue different" in message
        assert "rank 0: reduce_scatter of 20 float32 for 'blocks.0'" in message, message
        assert "rank 1: reduce_scatter of 28 float32 for 'blocks.2'" in message, message
        assert in_step


_STORE = """
import datetime, sys, time, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60),
                  wait_for_workers=False)
print(s.port, flush=True)
time.sleep(600)
"""

_RANK = """
import datetime, os, sys, time, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import funcshard as fs
rank, port, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
mesh = init_device_mesh("cpu", (2,))
fs.unshard(fs.shard({"a": torch.ones(4)}, mesh))
open(f"{ready}{rank}", "w").close()
while not os.path.exists(f"{ready}gone"):  # the store's process is killed meanwhile
    time.sleep(0.05)
start = time.monotonic()
try:
    fs.unshard(fs.shard({"b": torch.ones(6)}, mesh))
except RuntimeError as e:
    print(f"ERROR {e} [after {time.monotonic() - start:.1f} s]", flush=True)
"""


def test_a_dead_store_host_is_said_so_not_a_timeout(tmp_path):
    store = subprocess.Popen([sys.executable, "-c", _STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = store.stdout.readline().strip()
        ready = str(tmp_path / "ready")
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK, str(r), port, ready],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for r in range(2)
        ]
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{ready}{r}") for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks)
            time.sleep(0.1)
    finally:
        store.kill()
        store.wait()
    open(f"{ready}gone", "w").close()
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    for r, out in enumerate(outs):
        assert f"rank {r} cannot reach the process group's store" in out, out
        assert "within" not in out and "timeout" not in out.lower(), out
