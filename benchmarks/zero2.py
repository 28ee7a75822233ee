"""ZeRO-2 against ZeRO-1 for replicated (DDP) parameters: time, bytes on the wire, gradient memory.

Run: ``python -m benchmarks.zero2`` (2 gloo ranks on this machine). A stack of ``Linear(width,
width)`` blocks replicated on every rank (DDP), one ``fs.schedule`` group per block, AdamW with
its state sharded (``fs.optim.shard_state``); per step ``fs.value_and_grad`` and
``fs.optim.step``. ZeRO-1: the gradients all-reduced whole; ZeRO-2: ``grad_placements=
fs.optim.state_placements``, reduce-scattered into the state's layout. Per rank: the median step
time (the two interleaved step by step), the bytes each rank sends per step by the ring
algorithms (a reduce-scatter or all-gather (W-1)/W of its buffer, an all-reduce twice that), and
the bytes of the gradients ``value_and_grad`` returns.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

import funcshard as fs
from funcshard import optim

KINDS = {"all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce",
         "allreduce_": "all_reduce"}  # fmt: skip


class _Sent(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes each rank sends, by the ring algorithms, over groups of ``world`` ranks."""

    def __init__(self, world: int):
        super().__init__()
        self.world, self.bytes = world, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = KINDS.get(func.overloadpacket.__name__)
        if kind is not None and func.namespace in ("_c10d_functional", "c10d"):
            t = args[1] if func.namespace == "c10d" and kind != "all_reduce" else args[0]
            t = t[0] if isinstance(t, list) else t
            n = t.numel() * t.element_size() * (self.world if kind == "all_gather" else 1)
            self.bytes += n * (self.world - 1) / self.world * (2 if kind == "all_reduce" else 1)
        return func(*args, **(kwargs or {}))


def measure(width: int = 512, blocks: int = 4, steps: int = 30) -> dict[str, float]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(blocks)))
    full, _ = fs.extract(model)
    model.to("meta")
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(dist.get_rank()))

    def loss(p):
        return apply(p, x).pow(2).mean()

    opt = optim.shard_state(optim.adamw(1e-3))
    runs = {}
    for name, placements in (("ZeRO-1", None), ("ZeRO-2", optim.state_placements)):
        params = fs.shard(full, mesh, Replicate())
        runs[name] = [fs.value_and_grad(loss, grad_placements=placements), params,
                      opt.init(params), []]  # fmt: skip
    out = {}
    for step in range(steps + 3):
        for name, run in runs.items():
            vg, params, state, times = run
            dist.barrier()
            start = time.perf_counter()
            with _Sent(world) as sent:
                _, grads = vg(params)
                run[1], run[2] = optim.step(opt, params, grads, state)
            if step >= 3:  # warm-up
                times.append(time.perf_counter() - start)
            out[f"{name} MB sent"] = sent.bytes / 2**20
            out[f"{name} gradient MB"] = (
                sum(g.to_local().numel() * g.element_size() for g in grads.values()) / 2**20
            )
    for name, run in runs.items():
        out[f"{name} ms"] = statistics.median(run[3]) * 1e3
    diff = max((runs["ZeRO-1"][1][k].to_local() - runs["ZeRO-2"][1][k].to_local()).abs().max()
               .item() for k in full)  # fmt: skip
    out["max |ZeRO-1 - ZeRO-2| after all steps"] = diff
    return out


if __name__ == "__main__":
    for rank, result in enumerate(fs.testing.run(measure, world=2, timeout=900)):
        print(f"rank {rank}: " + ", ".join(f"{k}: {v:.3g}" for k, v in result.items()))
