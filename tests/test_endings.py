"""How a rank ended is what its peers say: a rank that raised is quoted (its error's first line
and the user's line it came from), a rank that exited after fewer funcshard calls is named as
such and fails too, and a store whose host was killed is named as the cause. Real processes
(each rank a Python process, a launcher's store or rank 0's), real exits and exit codes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

_SCRIPT = """
import datetime, os, signal, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
import funcshard as fs

case, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
timeout = datetime.timedelta(seconds=60)
host = case == "store host killed" and rank == 0  # else the launcher (the test) hosts it
store = dist.TCPStore("127.0.0.1", port, 2, host, timeout=timeout, wait_for_workers=False)
print(store.port, flush=True)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
mesh = init_device_mesh("cpu", (2,))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fail = False

    def forward(self, x):
        if self.fail and rank == 1 and case == "raises":
            raise ValueError("a bad batch")
        if self.fail and rank == 0 and case == "store host killed":
            os.kill(os.getpid(), signal.SIGKILL)
        return x + self.fc(x).tanh()


torch.manual_seed(0)
model = nn.Sequential(Block(), Block(), Block())
params, _ = fs.extract(model)
apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(Block)))
sharded = fs.shard(params, mesh)
opt = fs.optim.sgd(0.1)
state = opt.init(sharded)
step = fs.value_and_grad(lambda p, x: apply(p, x).square().mean())
for i in range(5):
    if case == "skips a batch" and rank == 1 and i == 2:
        continue  # a NaN batch, decided on this rank alone
    model[1].fail = case in ("raises", "store host killed") and i == 3
    loss, grads = step(sharded, torch.ones(4, 8))
    sharded, state = fs.optim.step(opt, sharded, grads, state)
print("finished", flush=True)
dist.destroy_process_group()
"""


def _run(tmp_path: Path, case: str) -> list[tuple[int, str, str]]:
    """Both ranks of ``_SCRIPT``'s ``case``: (exit code, stdout, stderr) per rank."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    launcher = None
    if case != "store host killed":
        launcher = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start = lambda r, port: subprocess.Popen(
        [sys.executable, str(script), case, str(r), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = start(0, launcher.port if launcher else 0)
    ranks = [first, start(1, int(first.stdout.readline()))]
    outs = [p.communicate(timeout=240) for p in ranks]
    return [(p.returncode, out, err) for p, (out, err) in zip(ranks, outs, strict=True)]


def test_a_rank_that_raises_is_quoted_by_its_peers(tmp_path):
    (code0, _, err0), (code1, _, err1) = _run(tmp_path, "raises")
    assert code1 == 1 and "ValueError: a bad batch" in err1, err1
    assert code0 == 1, err0
    assert "because rank 1 failed first: ValueError: a bad batch (raised at " in err0, err0
    assert f"{tmp_path / 'train.py'}:" in err0 and ", in forward)" in err0, err0
    assert "is gone" not in err0, err0


def test_a_rank_that_skips_a_batch_is_named_and_fails_too(tmp_path):
    (code0, _, err0), (code1, out1, err1) = _run(tmp_path, "skips a batch")
    waiting = re.search(
        r"rank 1 exited \(with no uncaught error\) after (\d+) funcshard calls, while this rank "
        r"is at call (\d+): the ranks made different numbers of funcshard calls",
        err0,
    )
    assert code0 == 1 and waiting, err0
    left, at = int(waiting[1]), int(waiting[2])
    assert at == left + 1, err0
    # the rank that left early ran to its end, then fails with the counts
    assert "finished" in out1 and code1 == 1, (code1, err1)
    assert (
        f"funcshard: rank 1 exited after {left} funcshard calls, but rank 0 failed at call "
        f"{at}: the ranks made different numbers of funcshard calls"
    ) in err1, err1


def test_ranks_that_make_the_same_calls_exit_cleanly(tmp_path):
    for code, out, err in _run(tmp_path, "healthy"):
        assert code == 0 and "finished" in out, (code, err)
        assert "funcshard" not in err, err


@pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL of the store's host")
def test_a_killed_store_host_is_named(tmp_path):
    (code0, _, _), (code1, _, err1) = _run(tmp_path, "store host killed")
    assert code0 == -9
    assert code1 == 1, err1
    assert "failed on rank 1" in err1, err1
    assert "rank 0 is gone (its process" in err1 or "store cannot be reached" in err1, err1
