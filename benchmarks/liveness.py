"""The heartbeat and the per-rank record (``funcshard/_communication/_liveness.py``): their
cost per step.

Run: ``python -m benchmarks.liveness`` (2 gloo ranks on this machine). A scheduled model of 16
``Linear(64, 64)`` groups (many small groups: the record is updated per plan step and per
collective), one ``fs.value_and_grad`` + ``fs.optim.step`` per step. Steps with the watcher
thread running and the record kept alternate, in blocks (in rotating order), with steps where
the thread is stopped (``record only``), and steps where both are off (the record's updates
patched out too); medians of the host time per step, after a barrier. Also the cost of one
record update alone, and the process's CPU time while its main thread sleeps, with and without
the watcher.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs
from funcshard._communication import _liveness


def _off(mode: str):
    """Patches for ``mode``: the watcher not started again (and the record not kept)."""
    nothing = lambda *a, **k: None
    names = {"on": (), "record only": ("start",), "off": ("start", "doing", "step", "collective")}
    return [mock.patch.object(_liveness, name, nothing) for name in names[mode]]


def _steps(step, n: int) -> list[float]:
    times = []
    for _ in range(n):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def measure(rounds: int = 30, per_round: int = 10) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(16)])
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    model.to("meta")
    sharded = fs.shard(params, init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = fs.optim.sgd(0.01)
    state = [opt.init(sharded)]
    x = torch.randn(8, 64)
    grad = fs.value_and_grad(lambda p: apply(p, x).square().mean())

    def step():
        _, g = grad(sharded)
        _, state[0] = fs.optim.step(opt, sharded, g, state[0])

    modes = ("on", "record only", "off")
    times: dict[str, list[float]] = {m: [] for m in modes}
    _steps(step, 10)  # warm-up
    for r in range(rounds):
        for mode in modes[r % 3 :] + modes[: r % 3]:  # the order rotates: no drift favours one
            patches = _off(mode)
            if mode != "on":
                _liveness.stop()
            for p in patches:
                p.start()
            times[mode] += _steps(step, per_round)
            for p in patches:
                p.stop()
            _liveness.doing("benchmark")  # restarts the watcher
    out = {f"step, liveness {m} (us)": statistics.median(times[m]) * 1e6 for m in modes}
    out["ratio on / off"] = out["step, liveness on (us)"] / out["step, liveness off (us)"]
    calls = {name: 0 for name in ("doing", "step", "collective")}
    real = {name: getattr(_liveness, name) for name in calls}

    def counted(name):
        def fn(*a, **k):
            calls[name] += 1
            return real[name](*a, **k)

        return fn

    with contextlib.ExitStack() as stack:
        for name in calls:
            stack.enter_context(mock.patch.object(_liveness, name, counted(name)))
        step()
    out.update({f"{name}() calls per step": float(c) for name, c in calls.items()})
    for mode in ("off", "on"):  # CPU time of this process while its main thread sleeps
        if mode == "off":
            _liveness.stop()
        else:
            _liveness.doing("benchmark")
        cpu = time.process_time()
        time.sleep(10)
        out[f"process CPU while idle, watcher {mode} (us/s)"] = (time.process_time() - cpu) / 10e-6
    n = 100_000
    start = time.perf_counter()
    for _ in range(n):
        _liveness.collective("all_gather", None, "x")
    out["one record update (ns)"] = (time.perf_counter() - start) / n * 1e9
    start = time.perf_counter()
    for _ in range(n):
        _liveness.doing("benchmark")
    out["one doing() (ns)"] = (time.perf_counter() - start) / n * 1e9
    return out


if __name__ == "__main__":
    for rank, result in enumerate(fs.testing.run(measure, world=2, timeout=1200)):
        print(f"rank {rank}: " + ", ".join(f"{k}: {v:.3g}" for k, v in result.items()))
