"""Part ``memory``: peak memory per rank of one training step, by category, from the
allocator's events -- the same accounting for both frameworks.

[Note: memory categories]
Training steps (after two warm-up steps) run under ``torch.profiler`` with
``profile_memory=True`` and ``with_stack=True``. Every allocation in it is classified when it is
made, every free is matched to its allocation by address, and the live bytes of each category
are followed event by event:

- **parameters**, **optimizer state**: resident before the step; the bytes of the storages of
  the local shards and of the optimizer's state tensors (padding included).
- **gradients**: allocations whose address is the storage of a sharded gradient when backward
  returns, and that are still alive then.
- **unsharded parameters + comm. buffers**: made by the calling thread inside communication
  code: a collective op (``c10d::*``, ``_c10d_functional::*``) or a Python frame of the
  framework's gathering and reducing code (``funcshard/_communication/_flat.py``,
  ``funcshard/_communication/_collectives.py``,
  the scheduler's ``arm`` / ``issue`` / ``wait`` of a group; FSDP2's ``_fsdp_collectives.py``,
  which allocates and copies out its all-gathers and reduce-scatters). Python frames, not
  profiler ranges: with ``with_stack`` the tree does not nest frames under ``record_function``
  ranges.
- **activations + temporaries**: everything else the calling thread allocates: activations,
  full-size gradients before their reduce-scatter, the optimizer's temporaries.
- **gloo threads**: allocations made on other threads (gloo's worker threads allocate a
  full-size scratch buffer for each collective in flight; NCCL has none).
- **freed pre-existing**: frees of memory allocated before the step (negative; ~0).

The *peak* is the moment the sum of all categories is highest; **own peak** leaves out the
other threads' category (what ``peak_bytes(this_thread=True)`` measures). The table shows each
category at that moment, so the categories add up to the peak. Peaks vary from step to step
with the timing of asynchronous collectives (FSDP2's by up to 30% on gloo), so three steps are
accounted and the one with the median all-threads peak is reported, with the range.
"""

from __future__ import annotations

import dataclasses
import gc
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from . import harness
from .variants import VARIANTS, Options, Trainer
from .workloads import describe, mlp, transformer

CATEGORIES = (
    "parameters",
    "optimizer state",
    "gradients",
    "unsharded parameters + comm. buffers",
    "activations + temporaries",
    "gloo threads",
    "freed pre-existing",
)
_THREADS, _PRE = CATEGORIES[5], CATEGORIES[6]
COMM_RANGES = re.compile(
    r"^(funcshard::(all_gather|wait|reduce_scatter|wait_reduce_scatter|all_reduce|free) "
    r"|FSDP::(all_gather|post_backward_reduce|post_backward_rs_wait)"
    r"|c10d::|_c10d_functional::|gloo:|nccl:)"
)
COMM_CODE = re.compile(
    r"funcshard/_(flat|collectives)\.py\(|funcshard/_schedule\.py\(\d+\): (arm|issue|wait)$"
    r"|fsdp/_fully_shard/_fsdp_collectives\.py\("
)
_FB, _OPT = "bench::forward_backward", "bench::optimizer"


@dataclasses.dataclass(frozen=True)
class Event:
    """One allocator event: ``size`` > 0 allocates, < 0 frees; ``comm``: made inside
    communication code (see [Note: memory categories])."""

    time: int
    ptr: int
    size: int
    thread: int
    comm: bool = False


def account(
    events: Iterable[Event],
    *,
    main: int,
    gradients: set[int],
    backward_end: int,
    resident: dict[str, int],
) -> dict[str, Any]:
    """The categories at the all-threads peak and at the own (``main`` thread) peak.

    ``gradients``: storage addresses of the sharded gradients when backward returned (at time
    ``backward_end``); ``resident``: bytes of ``parameters`` and ``optimizer state``.
    """
    events = sorted(events, key=lambda e: e.time)
    alive_at_end = _alive_at(events, backward_end)
    live = dict.fromkeys(CATEGORIES, 0)
    live.update(resident)
    owner: dict[int, tuple[str, int]] = {}  # ptr -> (category, size)
    best = {"all": (sum(live.values()), dict(live)), "own": (_own(live), dict(live))}
    for i, e in enumerate(events):
        if e.size > 0:
            cat = _category(e, main, gradients, i in alive_at_end)
            owner[e.ptr] = (cat, e.size)
            live[cat] += e.size
        elif e.ptr in owner:
            cat, size = owner.pop(e.ptr)
            live[cat] -= size
        else:
            live[_PRE] += e.size
        for key, total in (("all", sum(live.values())), ("own", _own(live))):
            if total > best[key][0]:
                best[key] = (total, dict(live))
    return {
        "peak_all": best["all"][0],
        "peak_own": best["own"][0],
        "at_peak_all": best["all"][1],
        "at_peak_own": {k: v for k, v in best["own"][1].items() if k != _THREADS},
    }


def _own(live: dict[str, int]) -> int:
    return sum(v for k, v in live.items() if k != _THREADS)


def _alive_at(events: list[Event], t: int) -> set[int]:
    """Indices of the allocations made before ``t`` and not freed by then."""
    open_: dict[int, int] = {}
    for i, e in enumerate(events):
        if e.time > t:
            break
        if e.size > 0:
            open_[e.ptr] = i
        else:
            open_.pop(e.ptr, None)
    return set(open_.values())


def _category(e: Event, main: int, gradients: set[int], alive_at_end: bool) -> str:
    if e.thread != main:
        return _THREADS
    if e.ptr in gradients and alive_at_end:
        return "gradients"
    return CATEGORIES[3] if e.comm else CATEGORIES[4]


def profile_step(trainer: Trainer, batch, device: torch.device) -> dict[str, Any]:
    """One step of ``trainer`` under the profiler, accounted by category."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    grads: set[int] = set()
    with profile(activities=activities, profile_memory=True, with_stack=True) as prof:
        with record_function(_FB):
            trainer.forward_backward(batch)
        grads = {_storage(g).data_ptr() for g in trainer.gradients()}
        with record_function(_OPT):
            trainer.optimizer_step()
    events, marks = _events(prof, device.type)
    resident = {
        "parameters": _bytes(trainer.parameters()),
        "optimizer state": _bytes(trainer.optimizer_state()),
    }
    result = account(
        events, main=marks[_FB][2], gradients=grads, backward_end=marks[_FB][1], resident=resident
    )
    return result


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen = {}
    for t in tensors:
        s = _storage(t)
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _events(prof, device_type: str) -> tuple[list[Event], dict[str, tuple[int, int, int]]]:
    """Allocator events on ``device_type``, and ``{mark: (start, end, thread)}``."""
    out, marks = [], {}
    stack = [(e, False) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        e, comm = stack.pop()
        name = _name(e)
        if name in (_FB, _OPT):
            marks[name] = (e.start_time_ns, e.end_time_ns, e.start_tid)
        comm = comm or bool(COMM_RANGES.match(name) or COMM_CODE.search(name))
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == device_type:
            a = e.typed[1]
            out.append(Event(e.start_time_ns, a.ptr, a.alloc_size, e.start_tid, comm))
        stack.extend((c, comm) for c in e.children)
    return out, marks


def _name(e) -> str:
    """An event's name; "" where the profiler recorded bytes that are not UTF-8 (seen for a
    Python frame after torch.compile had run in the process)."""
    try:
        return e.name
    except UnicodeDecodeError:
        return ""


def variants(quick: bool) -> dict[str, tuple[Any, Options]]:
    """FSDP2, funcshard as planned by default, and funcshard without backward prefetch."""
    return {
        "FSDP2": (VARIANTS["fsdp2"], Options()),
        "funcshard": (VARIANTS["funcshard"], Options()),
        "funcshard, backward_prefetch=0": (VARIANTS["funcshard"], Options(backward_prefetch=0)),
    }


def median_step(trainer: Trainer, workload, ctx: harness.Context, steps: int) -> dict[str, Any]:
    """Account ``steps`` steps (after two warm-up steps, the first of which creates
    torch.optim's state); return the one with the median all-threads peak, with the range."""
    for i in range(2):
        trainer.step(workload.batch(i, ctx.rank))
    runs = [
        profile_step(trainer, workload.batch(2 + i, ctx.rank), ctx.device) for i in range(steps)
    ]
    runs.sort(key=lambda r: r["peak_all"])
    chosen = dict(runs[len(runs) // 2])
    chosen["peak_all_range"] = [runs[0]["peak_all"], runs[-1]["peak_all"]]
    chosen["resident"] = (
        chosen["at_peak_all"]["parameters"] + chosen["at_peak_all"]["optimizer state"]
    )
    return chosen


def run(ctx: harness.Context) -> dict[str, Any]:
    cases = [(transformer(ctx.quick), None), (transformer(ctx.quick), torch.bfloat16)]
    cases = cases[:1] if ctx.quick else [*cases, (mlp(), None)]
    steps = 1 if ctx.quick else 3
    tables = []
    for workload, dtype in cases:
        workload = workload.to(ctx.device)
        rows = {}
        for label, (fn, options) in variants(ctx.quick).items():
            trainer = fn(workload, ctx.mesh, dataclasses.replace(options, param_dtype=dtype))
            rows[label] = median_step(trainer, workload, ctx, steps)
            del trainer
            gc.collect()
        tables.append(
            {
                "workload": describe(workload),
                "param_dtype": harness.dtype_name(dtype),
                "steps": steps,
                "rows": rows,
            }
        )
    return {"tables": tables, "categories": list(CATEGORIES)}
