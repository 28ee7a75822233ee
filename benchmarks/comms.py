"""Part ``comms``: collectives and bytes per training step against the ZeRO-3 lower bound.

[Note: the lower bound]
A ZeRO-3 step must all-gather every parameter before its forward, again before its backward
(when it was resharded after forward), and reduce-scatter every gradient once. With ring (or
any bandwidth-optimal) collectives a rank sends ``(W - 1) / W`` of a collective's full buffer,
so the bytes a rank must send per step are at least

    (W - 1) / W * (gathers * P_gather + P_reduce)

with ``P_gather`` the parameters' bytes in the gathered dtype (``param_dtype``), ``P_reduce``
their bytes in the reduce dtype, and ``gathers`` 2 with reshard after forward, 1 without.
Measured bytes are counted the same way from every collective issued, with its buffer as issued
(padding included): the all-gather's output, the reduce-scatter's input, 2x an all-reduce's
buffer. Both frameworks keep the root group unsharded through the step (FSDP2's default), so
its parameters are gathered once: slightly under the bound is expected.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import harness
from .variants import VARIANTS, Options
from .workloads import describe, transformer

_KINDS = (
    ("all_gather", "all_gather"),
    ("allgather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
)
_KINDS += (("all_reduce", "all_reduce"), ("allreduce", "all_reduce"), ("broadcast", "broadcast"))


def kind_of(op_name: str) -> str | None:
    """``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``broadcast`` for a c10d or
    functional collective op's name, else ``None``."""
    for needle, kind in _KINDS:
        if needle in op_name:
            return kind
    return None


def buffer_bytes(args: Any, result: Any) -> int:
    """The full buffer of a collective: the largest of its top-level arguments or its result
    (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor)."""
    sizes = [
        sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))
        for x in (*args, result)
    ]
    return max(sizes, default=0)


def sent_bytes(kind: str, nbytes: int, world: int) -> float:
    """What one rank sends for a bandwidth-optimal collective on a ``nbytes`` buffer."""
    share = (world - 1) / world
    return (2 if kind == "all_reduce" else 1) * share * nbytes


def lower_bound(numels: list[int], gather_size: int, reduce_size: int, world: int, gathers: int):
    """Bytes per rank per step of [Note: the lower bound]; ``numels``: parameter sizes."""
    total = sum(numels)
    return (world - 1) / world * (gathers * total * gather_size + total * reduce_size)


class Collectives(TorchDispatchMode):
    """Counts collectives by kind and the bytes they move (c10d and functional ops)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.count: dict[str, int] = {}
        self.sent = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = kind_of(func.overloadpacket.__name__)
            if kind is not None:
                self.count[kind] = self.count.get(kind, 0) + 1
                self.sent += sent_bytes(kind, buffer_bytes(args, result), self.world)
        return result


def measure(ctx: harness.Context, workload, options: Options) -> dict[str, Any]:
    params = list(workload.build().parameters())
    gather = (options.param_dtype or torch.float32).itemsize
    reduce = (options.reduce_dtype or torch.float32).itemsize
    gathers = 2 if options.reshard_after_forward else 1
    bound = lower_bound([p.numel() for p in params], gather, reduce, ctx.world, gathers)
    out: dict[str, Any] = {"bound_mib": bound / 2**20}
    for name in ("fsdp2", "funcshard"):
        trainer = VARIANTS[name](workload, ctx.mesh, options)
        trainer.step(workload.batch(0, ctx.rank))
        dist.barrier()
        with Collectives(ctx.world) as comm:
            trainer.forward_backward(workload.batch(1, ctx.rank))
        trainer.optimizer_step()
        out[name] = {
            "collectives": comm.count,
            "mib": comm.sent / 2**20,
            "x_bound": comm.sent / bound if bound else None,  # one rank: nothing to send
        }
        del trainer
        gc.collect()
    return out


def run(ctx: harness.Context) -> dict[str, Any]:
    workload = transformer(ctx.quick).to(ctx.device)
    rows = []
    configs = ((None, True), (None, False), (torch.bfloat16, True))
    for dtype, reshard in configs[:1] if ctx.quick else configs:
        options = Options(param_dtype=dtype, reshard_after_forward=reshard)
        row = measure(ctx, workload, options)
        row.update(param_dtype=harness.dtype_name(dtype), reshard_after_forward=reshard)
        rows.append(row)
    return {"workload": describe(workload), "rows": rows}
