"""The per-call agreement of the ranks (``funcshard/_consensus.py``): its cost per call.

Run: ``python -m benchmarks.agreement`` (2 gloo ranks on this machine). Prints, per rank, the
median time of ``_consensus.agree`` for a structure seen before (the status exchange through
the store: what every ``unshard`` / ``reduce`` / scheduled ``apply`` pays once per call), and
of a whole ``fs.unshard`` of a small tree (one all-gather) with and without it, and in debug
mode (``fs.checking_collectives``: one more exchange per collective).
"""

from __future__ import annotations

import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs
from funcshard import _consensus


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


if __name__ == "__main__":
    for rank, result in enumerate(fs.testing.run(measure, world=2, timeout=600)):
        print(f"rank {rank}: " + ", ".join(f"{k}: {v:.0f} us" for k, v in result.items()))
