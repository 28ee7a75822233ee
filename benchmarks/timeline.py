"""Part ``timeline``: one real training step of each framework under ``torch.profiler``, cut into
lanes per rank; ``report`` draws them side by side (``timeline_rank<r>.png``).

Lanes (CPU / gloo):

- **compute**: the calling thread's top-level ``aten::`` operations outside communication code;
- **comm. on the calling thread**: issuing collectives, copies in and out of their buffers, and
  waiting for them (``funcshard::all_gather / wait / reduce_scatter / ...``, ``FSDP::all_gather /
  all_gather_copy_out / post_backward_reduce / ...``, ``c10d::*``);
- **all-gather**, **reduce-scatter**: gloo's worker threads doing the transfer
  (``gloo:all_gather``; gloo reduce-scatters with ``gloo:all_reduce``).

A transfer drawn under a compute bar is overlapped; one drawn under a comm. bar of the calling
thread is waited for. On CUDA the lanes are the GPU's kernels instead (NCCL's all-gather and
reduce-scatter kernels, every other kernel as compute).
"""

from __future__ import annotations

import gc
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from . import harness
from .memory import COMM_RANGES
from .variants import VARIANTS, Options
from .workloads import describe, transformer

LANES = ("compute", "comm. on the calling thread", "all-gather", "reduce-scatter")
_STEP = "bench::step"
_WORKER = {"gloo:all_gather": "all-gather", "gloo:all_reduce": "reduce-scatter"}
_WORKER["gloo:reduce_scatter"] = "reduce-scatter"
_NCCL = (
    (re.compile("AllGather", re.I), "all-gather"),
    (re.compile("ReduceScatter", re.I), "reduce-scatter"),
)

Intervals = list[tuple[float, float]]


def merge(intervals: Intervals, gap: float = 0.0) -> Intervals:
    """Sorted intervals, those overlapping or closer than ``gap`` joined."""
    out: Intervals = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(a: Intervals, b: Intervals) -> float:
    """Total length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _cpu_lanes(prof) -> tuple[dict[str, Intervals], float]:
    roots = prof.profiler.kineto_results.experimental_event_tree()
    stack = list(roots)
    step = None
    while stack and step is None:
        e = stack.pop()
        step = e if e.name == _STEP else None
        stack.extend(e.children)
    t0, main = step.start_time_ns, step.start_tid
    lanes: dict[str, Intervals] = {lane: [] for lane in LANES}
    span = lambda e: ((e.start_time_ns - t0) / 1e6, (e.end_time_ns - t0) / 1e6)
    stack = list(roots)
    while stack:
        e = stack.pop()
        if e.start_tid != main:
            if e.name in _WORKER and e.start_time_ns >= t0:
                lanes[_WORKER[e.name]].append(span(e))
                continue
        elif COMM_RANGES.match(e.name) and e.start_time_ns >= t0:
            lanes[LANES[1]].append(span(e))
            continue
        elif e.name.startswith("aten::") and e.start_time_ns >= t0:
            lanes[LANES[0]].append(span(e))
            continue
        stack.extend(e.children)
    return {k: merge(v) for k, v in lanes.items()}, (step.end_time_ns - t0) / 1e6


def _compact(intervals: Intervals) -> Intervals:
    """Merged, with gaps under 20 us closed and times in whole microseconds: the same picture
    in a fraction of the JSON."""
    return [(round(a, 3), round(b, 3)) for a, b in merge(intervals, gap=0.02)]


def _cuda_lanes(prof) -> tuple[dict[str, Intervals], float]:
    """GPU kernels by lane (NCCL kernels by name), relative to the first kernel."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return {lane: [] for lane in LANES}, 0.0
    t0 = min(e.time_range.start for e in kernels)
    lanes: dict[str, Intervals] = {lane: [] for lane in LANES}
    for e in kernels:
        lane = next((name for pattern, name in _NCCL if pattern.search(e.name)), LANES[0])
        lanes[lane].append(((e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3))
    end = max(e.time_range.end for e in kernels)
    return {k: merge(v) for k, v in lanes.items()}, (end - t0) / 1e3


def trace(trainer, batch, device: torch.device) -> dict[str, Any]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    harness.sync(device)
    dist.barrier()
    with profile(activities=activities) as prof:
        with record_function(_STEP):
            trainer.step(batch)
        harness.sync(device)
    lanes, duration = (_cuda_lanes if device.type == "cuda" else _cpu_lanes)(prof)
    comm = merge(lanes["all-gather"] + lanes["reduce-scatter"])
    busy = sum(b - a for a, b in comm)
    return {
        "lanes": {k: _compact(v) for k, v in lanes.items()},
        "duration_ms": duration,
        "comm_ms": busy,
        "comm_overlapped": overlap(comm, lanes["compute"]) / busy if busy else 0.0,
    }


def run(ctx: harness.Context) -> dict[str, Any]:
    workload = transformer(ctx.quick).to(ctx.device)
    out: dict[str, Any] = {"workload": describe(workload), "frameworks": {}}
    for label, name in (("funcshard", "funcshard"), ("FSDP2", "fsdp2")):
        trainer = VARIANTS[name](workload, ctx.mesh, Options())
        for i in range(2):
            trainer.step(workload.batch(i, ctx.rank))
        mine = trace(trainer, workload.batch(2, ctx.rank), ctx.device)
        everyone: list[Any] = [None] * ctx.world
        dist.all_gather_object(everyone, mine)
        out["frameworks"][label] = everyone
        del trainer
        gc.collect()
    return out
