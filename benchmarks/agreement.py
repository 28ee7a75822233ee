"""The per-call agreement of the ranks (``funcshard/_communication/_consensus.py``): its cost
per call.

Run: ``python -m benchmarks.agreement`` (2 gloo ranks on this machine). Prints, per rank, the
median time of ``_consensus.agree`` for a structure seen before (the status exchange through
the store: what every ``unshard`` / ``reduce`` / scheduled ``apply`` pays once per call), and
of a whole ``fs.unshard`` of a small tree (one all-gather) with and without it, and in debug
mode (``fs.checking_collectives``: one more exchange per collective). Then the agreement on the
step (``funcshard/_communication/_updates.py``): the record an optimizer update leaves, alone,
and a whole
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
from funcshard._communication import _consensus, _updates


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
    record = "chain(clip_by_global_norm(max_norm=1.0), adamw(lr=0.001, ...)) at step 7"
    with_record = lambda: (_updates._record(record), _consensus.agree("x", entries))
    out["agree, carrying an optimizer record"] = _median_us(with_record, n)
    out["unshard 8 x [64, 64]"] = _median_us(lambda: fs.unshard(sharded), n)
    world = dist.get_world_size()
    with mock.patch.object(_consensus, "agree", lambda *a, **k: [None] * world):
        out["unshard, agreement off"] = _median_us(lambda: fs.unshard(sharded), n)
    with fs.checking_collectives():  # debug mode: one more exchange per collective
        out["unshard, debug mode"] = _median_us(lambda: fs.unshard(sharded), n)
    return out


def measure_steps(samples: int = 150) -> dict[str, float]:
    """A record alone, and per step: the store exchanges, their time and the step's time,
    records on and patched out (medians; the four variants alternate step by step)."""
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
        f"{_updates.describe(clipped.update.funcshard_update)} at step "
        f"{_updates._steps(states['clip + adamw'])}"
    )
    out = {"a record (describe, cached; step counts)": _median_us(record, 300)}
    _updates.taken()  # drop the records made here
    exchange, spent = _consensus._exchange, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return exchange(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    found: dict[str, list[tuple[float, float, int]]] = {}
    with mock.patch.object(_consensus, "_exchange", timed):
        for _ in range(samples):
            for name, opt in opts.items():
                for on in (True, False):
                    off = mock.patch.object(_updates, "_shared", lambda g: False)
                    with contextlib.nullcontext() if on else off:
                        dist.barrier()
                        spent.clear()
                        start = time.perf_counter()
                        _, g = vg(sharded, x, y)
                        sharded, states[name] = fs.optim.step(opt, sharded, g, states[name])
                        took = time.perf_counter() - start
                    key = f"{name}, records {'on' if on else 'off'}"
                    found.setdefault(key, []).append((took, sum(spent), len(spent)))
    for key, rows in found.items():
        out[f"step, {key}"] = statistics.median(r[0] for r in rows) * 1e6
        out[f"exchanges per step, {key}"] = statistics.median(r[2] for r in rows)
        out[f"exchange time per step, {key}"] = statistics.median(r[1] for r in rows) * 1e6
    return out


if __name__ == "__main__":
    for rank, result in enumerate(fs.testing.run(measure, world=2, timeout=600)):
        print(f"rank {rank}: " + ", ".join(f"{k}: {v:.0f} us" for k, v in result.items()))
    for rank, result in enumerate(fs.testing.run(measure_steps, world=2, timeout=1200)):
        print(f"rank {rank}: " + ", ".join(f"{k}: {v:.0f} us" for k, v in result.items()))
