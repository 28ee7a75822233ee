"""The counts of ``grad_reduce`` (``funcshard/_communication/_counts.py``): what they add per call.

Run: ``python -m benchmarks.counts`` (2 gloo ranks on this machine). Per rank, medians of ``n``
calls after a barrier of one training step's ``fs.value_and_grad`` through ``fs.unshard`` of 8 x
[64, 64] (one all-gather, one reduce-scatter) on a batch of two tensors: ``"mean"`` (its empty-
batch check: the walk over the batch arguments and the count in the status), the same with the
counts patched out (the code before them), and ``"weighted"`` with ``count=``. And, in one
process, the pieces alone: the walk over an HF-style batch, the checks of 2 and 1024 ranks'
counts, and a bucket's weight.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs
from funcshard._communication import _counts


def _median_us(fn, n: int, barrier: bool = True) -> float:
    times = []
    for _ in range(n):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _off():
    """The counts patched out: no walk, no count in the status, no check."""
    return (
        mock.patch.object(_counts, "own", lambda *a, **k: None),
        mock.patch.object(_counts, "batch", lambda *a, **k: contextlib.nullcontext()),
        mock.patch.object(_counts, "check", lambda *a, **k: None),
    )


def measure(n: int = 300) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = fs.shard({f"w{i}": torch.ones(64, 64) for i in range(8)}, mesh)
    x, y = torch.randn(16, 64), torch.randn(16, 64)

    def loss(p, x, y, grad_reduce="mean", count=None):
        full = fs.unshard(p, grad_reduce=grad_reduce, count=count)
        return sum(((x @ w - y) ** 2).mean() for w in full.values())

    step = fs.value_and_grad(loss)
    variants = {
        "mean": (lambda: step(sharded, x, y), None),
        "counts off": (lambda: step(sharded, x, y), _off),
        "weighted": (lambda: step(sharded, x, y, "weighted", len(x)), None),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(n):  # interleaved call by call: the machine's load moves
        for name, (fn, patches) in variants.items():
            with contextlib.ExitStack() as stack:
                for p in patches() if patches else ():
                    stack.enter_context(p)
                dist.barrier()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    result = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    batch = ((), {"input_ids": torch.ones(8, 128, dtype=torch.long), "labels": torch.ones(8, 128),
                  "attention_mask": torch.ones(8, 128)})  # fmt: skip
    result["walk over an HF-style batch"] = _median_us(lambda: _counts.empty(batch), n, False)
    for w in (2, 1024):
        counts = [float(r % 7 + 1) for r in range(w)]
        result[f"check, {w} ranks"] = _median_us(
            lambda c=counts: _counts.check("x", "weighted", c), n, False
        )
    counts = [3.0] * dist.get_world_size()
    result["weight of a bucket"] = _median_us(lambda: _counts.weight(counts, mesh), n, False)
    return result


if __name__ == "__main__":
    for rank, result in enumerate(fs.testing.run(measure, world=2, timeout=900)):
        print(f"rank {rank}: " + ", ".join(f"{k}: {v:.1f} us" for k, v in result.items()))
