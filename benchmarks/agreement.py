"""The per-call agreement of the ranks (``funcshard/_consensus.py``): its cost per call.

Run: ``python -m benchmarks.agreement`` (2 gloo ranks on this machine). Prints, per rank, the
median time of ``_consensus.agree`` for a structure seen before (the status exchange through
the store: what every ``unshard`` / ``reduce`` / scheduled ``apply`` pays once per call), and
of a whole ``fs.unshard`` of a small tree (one all-gather) with and without it, and in debug
mode (``fs.checking_collectives``: one more exchange per collective). Then the agreement on the
step (``funcshard/_updates.py``): the record an optimizer update leaves, alone, and a whole
training step (a scheduled ``value_and_grad`` and ``fs.optim.step``) with ``adamw`` (whose
records ride the next call's status) and with ``chain(clip_by_global_norm, adamw)`` (which
checks them before its all-reduce: one more exchange per step), each with the records on and
patched out, the variants interleaved round by round.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs
from funcshard import _consensus, _updates


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(n: int = 300) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = fs.shard({f"w{i}": torch.ones(64, 64) for i in range(8)}, mesh)
    fs.unshard(sharded)
    entries = [("w", fs.ShardSpec.of(sharded["w0"]), torch.float32, False)]
    out = {"agree (status exchange)": _median_us(lambda: _consensus.agree("x", entries), n)}
    out["unshard 8 x [64, 64]"] = _median_us(lambda: fs.unshard(sharded), n)
    with mock.patch.object(_consensus, "agree", lambda *a, **k: None):
        out["unshard, agreement off"] = _median_us(lambda: fs.unshard(sharded), n)
    with fs.checking_collectives():  # debug mode: one more exchange per collective
        out["unshard, debug mode"] = _median_us(lambda: fs.unshard(sharded), n)
    return out


def measure_steps(rounds: int = 15, n: int = 20) -> dict[str, float]:
    """Medians (µs) of a record alone and of whole steps, records on and off, interleaved."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(8)))
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    model.to("meta")
    sharded = fs.shard(params, mesh)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    vg = fs.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x), y))
    adamw = fs.optim.adamw(1e-4)
    clipped = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), adamw)
    opts = {"adamw": adamw, "clip + adamw": clipped}
    states = {k: o.init(sharded) for k, o in opts.items()}
    record = lambda: _updates._record(
        f"{_updates.describe(opts['clip + adamw'].update.funcshard_update)} at step "
        f"{_updates._steps(states['adamw'])}"
    )
    out = {"a record (describe, cached; step counts)": _median_us(record, 300)}
    _updates.taken()  # drop the records made here
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, opt in opts.items():
            for on in (True, False):
                patch = mock.patch.object(_updates, "_shared", lambda g: False)
                with contextlib.nullcontext() if on else patch:
                    def step(opt=opt, name=name):
                        nonlocal sharded
                        _, g = vg(sharded, x, y)
                        sharded, states[name] = fs.optim.step(opt, sharded, g, states[name])
                    key = f"step, {name}, records {'on' if on else 'off'}"
                    times.setdefault(key, []).append(_median_us(step, n))
    out.update({k: statistics.median(v) for k, v in times.items()})
    return out


if __name__ == "__main__":
    for rank, result in enumerate(fs.testing.run(measure, world=2, timeout=600)):
        print(f"rank {rank}: " + ", ".join(f"{k}: {v:.0f} us" for k, v in result.items()))
    for rank, result in enumerate(fs.testing.run(measure_steps, world=2, timeout=1200)):
        print(f"rank {rank}: " + ", ".join(f"{k}: {v:.0f} us" for k, v in result.items()))
