"""What every part shares: alternating timing with medians and paired ratios, the machine's
description, JSON results, and the CPU stand-in for a GPU's kernel launches.

[Note: fair timing]
Variants run in the same processes, one step each in turn (the order rotating every round),
after warm-up steps, with a barrier before each step: machine noise (other jobs on a shared
machine, frequency changes) then hits every variant alike. A step's time is the slowest rank's
(the others wait for it at the next collective anyway). The reported time is the median over
rounds; the reported ratio is the median of the per-round ratios ``variant / baseline``, which
cancels slow drifts that a ratio of medians would keep.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESULTS = Path(__file__).parent / "results"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(
    steps: dict[str, Callable[[int], Any]],
    *,
    rounds: int,
    warmup: int,
    device: torch.device,
    host: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Run each step function (``fn(i)`` for round ``i``) once per round, in rotating order;
    return the slowest rank's seconds per measured round. Collective: every rank calls it.
    ``host``: filled with this rank's thread CPU seconds per measured round, taken before the
    device synchronisation (the host's own work, not its wait for the device)."""
    names = list(steps)
    mine: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            sync(device)
            if dist.is_initialized():
                dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            steps[name](i)
            c1 = time.thread_time()
            sync(device)
            if i >= warmup:
                mine[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
    if host is not None:
        host.update(cpu)
    if not dist.is_initialized() or dist.get_backend() == "fake":  # one process: its own times
        return mine
    everyone: list[dict[str, list[float]]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    return {n: [max(r[n][j] for r in everyone) for j in range(rounds)] for n in names}


def summary(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    """Median ms per variant, and the median per-round ratio to ``baseline``."""
    base = times[baseline]
    out = {}
    for name, ts in times.items():
        out[name] = {
            "ms": 1e3 * statistics.median(ts),
            "ratio": statistics.median(t / b for t, b in zip(ts, base, strict=True)),
            "rounds": len(ts),
        }
    return out


def machine(device: torch.device) -> dict[str, Any]:
    """Where the numbers come from (recorded with every result)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def label(info: dict[str, Any]) -> str:
    """A short machine label for tables: ``2-core AMD EPYC, CPU (gloo)``."""
    if info.get("gpu"):
        return f"{info['gpu']} (NCCL)"
    return f"{info['cores']}-core {info['cpu']}, CPU (gloo)"


def write(name: str, result: dict[str, Any], out: Path = RESULTS) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def dtype_name(dtype: torch.dtype | None) -> str:
    return "fp32" if dtype in (None, torch.float32) else str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Context:
    """What a part running on the ranks gets: the mesh, the device and the sizes to use."""

    mesh: Any  # DeviceMesh
    device: torch.device
    quick: bool
    rounds: int
    warmup: int

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world(self) -> int:
        return dist.get_world_size()


# allocations and metadata: no kernel on a GPU (their returns alias nothing, so the schema test
# below does not catch them)
_NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "set_",
    "_unsafe_view", "_has_compatible_shallow_copy_type", "result_type",
})  # fmt: skip


def launches_on_cpu(aten_events) -> int:
    """The ATen calls among a CPU profile's ``aten_events`` that would each launch a kernel (or a
    copy) on a GPU, the stand-in for a GPU profile's launches: calls that neither allocate only
    nor return a view or alias of an input (``view``, ``as_strided``, ``detach``, ``t``,
    ``split``...), and none of whose nested calls launches (a composite's work is its parts':
    ``linear`` is its ``mm``, a cast its ``copy_``). A foreach or fused operation counts once,
    as its single launch does for small lists."""
    return sum(map(_counts, aten_events))


def _counts(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _multi_tensor(parent.name):
            return False  # a part of a foreach or fused operation: CPU loops, a GPU does not
        parent = parent.cpu_parent
    if _multi_tensor(event.name):
        return True
    return _launches(event.name) and not any(map(_works, event.cpu_children))


def _multi_tensor(event_name: str) -> bool:
    return event_name.startswith(("aten::_foreach_", "aten::_fused_"))


def _works(event) -> bool:
    """Whether ``event`` or a call nested in it would launch on a GPU."""
    return _launches(event.name) or any(map(_works, event.cpu_children))


@functools.cache
def _launches(event_name: str) -> bool:
    """Whether the ATen operation ``aten::name`` itself does work on a GPU (see above)."""
    if not event_name.startswith("aten::"):
        return False
    name = event_name.removeprefix("aten::")
    if name in _NO_KERNEL:
        return False
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return True
    for overload in packet.overloads():
        returns = getattr(packet, overload)._schema.returns
        if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return False  # a view of its input: no data moves
    return True
