"""Part ``optim-host``: the host's cost of an AdamW step on many small shards (one rank).

The CPU stand-in for the GPU's "AdamW alone on the shards" (``benchmarks/gpu.py``): with tiny
tensors the kernel costs almost nothing, so a step is the host's work, as on a GPU that waits
for Python. ``torch.optim.AdamW`` steps the local shards as its parameters (the floor: what an
optimizer must do); ``fs.optim.step`` of ``fs.optim.adamw`` steps the sharded tree (DTensors),
with gradients as ``fs.value_and_grad`` returns them (placed like their parameters). Both with
the same kernel (``fused=True`` by default, ``--foreach`` for the foreach kernel). With
``--device-counts`` fs.optim keeps its step counts as tensors beside the parameters
(``capturable=True``), the path ``fused=True`` takes on a GPU; torch.optim runs as before (it has
no capturable CPU kernel). With ``--clip`` both clip the gradients by their global norm first,
the common recipe: ``fs.optim.chain(fs.optim.clip_by_global_norm(m), adamw)`` against
``torch.nn.utils.clip_grad_norm_(foreach=True)`` and the same AdamW (``m`` above the norm, so
that both scale by exactly 1 and their parameters stay comparable bit for bit; the norm, its
all-reduce and the scaling run all the same). The step thread's CPU time per step, medians
over alternating rounds; nothing is asserted.

    OMP_NUM_THREADS=1 python -m benchmarks.optim_host [--leaves 16,128,512] [--foreach]
        [--device-counts] [--clip]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs
from funcshard._trees._dtensor import placed_like

from . import harness

LR, WD, WIDTH = 1e-3, 0.1, 32
MAX_NORM = 1e6  # above any gradient's norm here: clipping scales by exactly 1


def steps(
    n: int, mesh, kernel: dict, device_counts: bool = False, clip: bool = False
) -> tuple[dict[str, Callable[[int], object]], Callable]:
    """Step functions of both optimizers on ``n`` parameters of ``WIDTH x WIDTH``, and a check
    that their parameters are equal."""
    g = torch.Generator().manual_seed(0)
    full = {f"layers.{i}.weight": torch.randn(WIDTH, WIDTH, generator=g) for i in range(n)}
    sharded = fs.shard(full, mesh)
    grads = {k: placed_like(torch.randn(v.to_local().shape, generator=g), v)
             for k, v in sharded.items()}  # fmt: skip
    leaves = [torch.nn.Parameter(v.to_local().detach().clone()) for v in sharded.values()]
    for p, gr in zip(leaves, grads.values(), strict=True):
        p.grad = gr.to_local().clone()
    topt = torch.optim.AdamW(leaves, lr=LR, weight_decay=WD, **kernel)
    opt = fs.optim.adamw(LR, weight_decay=WD, capturable=device_counts, **kernel)
    if clip:
        opt = fs.optim.chain(fs.optim.clip_by_global_norm(MAX_NORM), opt)
    box = {"p": sharded, "s": opt.init(sharded)}

    def fs_step(i: int) -> None:
        box["p"], box["s"] = fs.optim.step(opt, box["p"], dict(grads), box["s"])

    def same() -> bool:
        """Both optimizers took as many steps: the same kernel gives the same parameters."""
        ours = [v.to_local() for v in box["p"].values()]
        return all(torch.equal(a, b) for a, b in zip(ours, leaves, strict=True))

    def torch_step(i: int) -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_(leaves, MAX_NORM, foreach=True)
        topt.step()

    fns = {"torch.optim.AdamW": torch_step, "fs.optim.adamw": fs_step}
    return fns, same


def measure(n: int, mesh, kernel: dict, rounds: int, **variant: bool) -> dict[str, float]:
    host: dict[str, list[float]] = {}
    fns, same = steps(n, mesh, kernel, **variant)
    per = 20  # steps per round: a round is long enough for the thread clock

    def batch(fn):
        return lambda i: [fn(i) for _ in range(per)]

    harness.alternate({k: batch(f) for k, f in fns.items()}, rounds=rounds, warmup=2,
                      device=torch.device("cpu"), host=host)  # fmt: skip
    out = {k: 1e3 * statistics.median(v) / per for k, v in host.items()}
    out["ratio"] = out["fs.optim.adamw"] / out["torch.optim.AdamW"]
    out["same_parameters"] = same()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leaves", default="16,128,512", help="parameter counts, comma-separated")
    ap.add_argument("--foreach", action="store_true", help="the foreach kernel, not the fused")
    ap.add_argument(
        "--device-counts", action="store_true", help="fs.optim with capturable=True (a GPU path)"
    )
    ap.add_argument("--clip", action="store_true", help="clip by the global norm first")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=harness.RESULTS, help="results folder")
    args = ap.parse_args(argv)
    kernel = {"foreach": True} if args.foreach else {"fused": True}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        t0 = time.perf_counter()
        variant = {"device_counts": args.device_counts, "clip": args.clip}
        rows = {n: measure(n, mesh, kernel, args.rounds, **variant)
                for n in map(int, args.leaves.split(","))}  # fmt: skip
    finally:
        dist.destroy_process_group()
    name = ("fused" if not args.foreach else "foreach") + ("-device-counts" * args.device_counts)
    name += "-clip" * args.clip
    print(f"AdamW ({name}) host ms per step, one rank, {WIDTH}x{WIDTH} parameters")
    print(f"{'leaves':>8} {'torch.optim':>12} {'fs.optim':>10} {'ratio':>7}  same parameters")
    for n, r in rows.items():
        print(f"{n:8d} {r['torch.optim.AdamW']:12.3f} {r['fs.optim.adamw']:10.3f} "
              f"{r['ratio']:7.2f}  {r['same_parameters']}")  # fmt: skip
    info = {"part": "optim-host", "kernel": name, "machine": harness.machine(torch.device("cpu")),
            "seconds": time.perf_counter() - t0, "result": rows}  # fmt: skip
    harness.write(f"optim-host-{name}", info, args.out)
    return rows


if __name__ == "__main__":
    main()
