"""A paused rank is not a dead rank: a rank stopped by a signal (a debugger, a job scheduler's
suspend), one inside a C call that holds the GIL, or one asleep, between two steps and for longer
than a heartbeat's silence used to be allowed, leaves a run whose results equal an uninterrupted
run's; its peer warns once, naming it and its process's state, and keeps waiting."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard._communication import _liveness, _peers

from _mesh import mesh

_PAUSE = 7  # seconds: longer than the 5 s of silence after which a rank used to be declared dead
_QUIET = 2.0  # seconds of silence before the waiting rank warns (10 s by default)


def _pause(how: str) -> None:
    if how == "stopped":  # SIGSTOP, and SIGCONT from another process _PAUSE seconds later
        subprocess.Popen(["sh", "-c", f"sleep {_PAUSE}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "holds the GIL":  # a C call that never releases the GIL (ctypes.PyDLL keeps it)
        ctypes.PyDLL(None).sleep(_PAUSE)
    elif how == "asleep":
        time.sleep(_PAUSE)


def trains_with_a_pause(how: str, host: str) -> tuple[list[float], list[str]]:
    """Four AdamW steps of a scheduled 3-block model; rank 1 pauses (``how``) before step 2.
    Returns the losses and the warnings about silent peers."""
    # elsewhere: as if each rank ran on a host of its own (its peers cannot read its state)
    _peers.HOST = socket.gethostname() if host == "here" else f"elsewhere-{dist.get_rank()}"
    _liveness.start()  # publishes the host
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 1))
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    model.to("meta")
    sharded = fs.shard(params, mesh(2))
    opt = fs.optim.adamw(1e-2)
    state = opt.init(sharded)
    step = fs.value_and_grad(lambda p, x: apply(p, x).square().mean())
    torch.manual_seed(1 + dist.get_rank())
    batches = [torch.randn(4, 8) for _ in range(4)]
    losses = []
    with (
        mock.patch.object(_peers, "_QUIET", _QUIET),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        for i, x in enumerate(batches):
            if i == 2 and dist.get_rank() == 1:
                _pause(how)
            loss, grads = step(sharded, x)
            sharded, state = fs.optim.step(opt, sharded, grads, state)
            losses.append(loss.item())
    silent = [str(w.message) for w in caught if "has not responded" in str(w.message)]
    return losses, silent


@pytest.mark.parametrize(
    ("how", "host"),
    [
        ("stopped", "here"),
        ("stopped", "elsewhere"),
        ("holds the GIL", "here"),
        ("asleep", "here"),
    ],
)
def test_a_paused_rank_is_waited_for_and_named_once(world2, how, host):
    uninterrupted = world2.run(trains_with_a_pause, "", "here")
    paused = world2.run(trains_with_a_pause, how, host)
    for r in range(2):
        assert paused[r][0] == uninterrupted[r][0], (r, paused[r][0], uninterrupted[r][0])
    assert uninterrupted[0][1] == [] and paused[1][1] == []
    warned = paused[0][1]
    if how == "asleep":  # the GIL is free: rank 1's heartbeat goes on
        assert warned == [], warned
        return
    assert len(warned) == 1, warned  # once, not at every poll
    assert warned[0].startswith("funcshard: rank 1 has not responded for 2 s; its process "), warned
    assert "Rank 0 keeps waiting" in warned[0], warned
    if host == "elsewhere":
        assert "runs on host elsewhere-1, which this rank cannot inspect" in warned[0], warned
    elif how == "stopped":
        assert "is stopped (state T: a debugger or a suspend?)" in warned[0], warned
    else:  # asleep inside the C call, holding the GIL
        assert "is sleeping (state S" in warned[0] or "is running (state R" in warned[0], warned
