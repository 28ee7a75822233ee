"""``fs.cuda_graph``'s own host work per call, without a GPU.

A replayed step costs the host what the wrapper does around the replay: flatten the arguments,
find the graph (each leaf's key; the donated trees are the last call's objects), copy the batch
in, copy the loss out. Here the replay does nothing (a stand-in backend), the trees are those of
a 72-matrix model with its AdamW state (289 leaves) over a fake process group of 8 ranks, and the
median of 300 calls is printed: on a GPU this is the floor of a graphed step's host time.

    python -m benchmarks.graph_call
"""

from __future__ import annotations

import statistics
import time

import torch

import funcshard as fs
from funcshard._execution._cuda_graph import CudaGraphed

from .fake import fake_world


class _Noop:
    """Backend whose capture runs the step once and whose replay does nothing."""

    def warm(self, fn):
        return fn()

    def capture(self, fn):
        return fn(), lambda: None


def main(calls: int = 300) -> float:
    with fake_world(8) as mesh:
        shapes = {f"blocks.{i}.w{j}": torch.randn(16, 8) for i in range(8) for j in range(9)}
        params = fs.shard(shapes, mesh)
        opt = fs.optim.adamw(1e-3, capturable=True)
        state = opt.init(params)
        step = CudaGraphed(lambda p, s, b: (b.sum(), p, s), 1, 2, backend=_Noop())
        times = []
        for _ in range(calls):
            batch = torch.randint(0, 9, (4, 16))
            t0 = time.perf_counter()
            _, params, state = step(params, state, batch)
            times.append(time.perf_counter() - t0)
        leaves = len(torch.utils._pytree.tree_leaves((params, state)))
    us = statistics.median(times[10:]) * 1e6
    print(f"[graph_call] {leaves} leaves: {us:.0f} us per call (median of {calls - 10})")
    return us


if __name__ == "__main__":
    main()
