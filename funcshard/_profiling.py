"""Peak memory of a call, from the allocator's own events (torch.profiler, profile_memory).

Used by the tests and the benchmarks, for funcshard and FSDP2 alike: ``MemTracker`` cannot
follow ``functional_call`` with non-leaf parameters (see ``shared/notes``).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn, *, this_thread: bool = False) -> tuple[int, object]:
    """(highest running total of CPU allocations minus frees during ``fn()``, its result).

    ``this_thread``: count only allocations made by the calling thread (not, e.g., the
    temporaries gloo's worker threads allocate for collectives in flight).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    main = _thread_of(prof) if this_thread else None
    total = peak = 0
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU and main in (None, e.start_thread_id()):
            total += e.nbytes()
            peak = max(peak, total)
    return peak, result


def _thread_of(prof) -> int:
    """The profiler's id of the thread that ran the profiled code (its first op)."""
    ops = [e for e in prof.profiler.kineto_results.events() if e.name() != "[memory]"]
    return min(ops, key=lambda e: e.start_ns()).start_thread_id()
