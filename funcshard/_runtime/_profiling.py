"""Profiler ranges that cost nothing when no profiler runs; the peak memory of a call, from the
allocator's own events (torch.profiler, profile_memory).

``peak_bytes`` is used by the tests and the benchmarks, for funcshard and FSDP2 alike:
``MemTracker`` cannot follow ``functional_call`` with non-leaf parameters (torch 2.13).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from ._compat import compiling

_NULL = contextlib.nullcontext()
_profiler_enabled = torch._C._autograd._profiler_enabled


def span(op: str, label: str) -> contextlib.AbstractContextManager:
    """``record_function(f"funcshard::{op} ({label})")`` while a profiler is active, else a shared
    no-op context.

    [Note: profiler ranges only under a profiler]
    The scheduler opens about ten named ranges per group per step (gather, wait, forward,
    free, backward, reduce-scatter, ...). ``record_function`` enters and leaves a C++ range even
    when nothing records it, and the label is formatted first: on a model of 64 small groups
    (``benchmarks/overhead.py``, fake process group) that was several percent of the step's CPU
    time. Whether a profiler is active is one C++ query (the same flag ``record_function``'s
    consumers read), so ranges are opened only then, under the same names; a profiler started
    in the middle of a call sees the ranges opened after it starts. While ``torch.compile``
    traces, the range is recorded as before (it runs once, and the graph keeps what it keeps).
    """
    if _profiler_enabled() or compiling():
        return record_function(f"funcshard::{op} ({label})")
    return _NULL


_MARK = "funcshard::peak_bytes"


def peak_bytes(fn, *, this_thread: bool = False) -> tuple[int, object]:
    """(highest running total of CPU allocations minus frees during ``fn()``, its result).

    ``this_thread``: count only memory allocated by the calling thread (not, e.g., the
    temporaries gloo's worker threads allocate for collectives in flight), wherever it is freed.

    [Note: own allocations, freed by any thread]
    A tensor the calling thread allocates may be freed on a communication thread (the last
    reference to a collective's input dies with its c10d work object). Counting frees by thread
    would then depend on timing; matching each free to its allocation by address does not.
    Frees of memory allocated before the call count when the calling thread makes them.
    """
    activities = [ProfilerActivity.CPU]
    with (
        profile(activities=activities, profile_memory=True, acc_events=True) as prof,
        record_function(_MARK),
    ):
        result = fn()  # _MARK names the calling thread in the trace
    events = sorted(_allocations(prof), key=lambda e: e.start_time_ns)
    main = next(e.start_tid for e in _walk(prof) if e.name == _MARK) if this_thread else None
    owned: dict[int, int] = {}
    total = peak = 0
    for e in events:
        ptr, size = e.typed[1].ptr, e.typed[1].alloc_size
        if size > 0 and main in (None, e.start_tid):
            owned[ptr] = size
        elif size > 0:
            continue
        elif ptr in owned:
            size = -owned.pop(ptr)
        elif main not in (None, e.start_tid):
            continue
        total += size
        peak = max(peak, total)
    return peak, result


def _walk(prof) -> Iterator:
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.children)


def _allocations(prof) -> Iterator:
    for e in _walk(prof):
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
            yield e
