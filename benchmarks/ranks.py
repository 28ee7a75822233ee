"""The parts that run on real ranks, under torchrun (``run.py`` launches this):

    torchrun --standalone --nproc-per-node 2 -m benchmarks.ranks --parts step,memory [--quick]

Rank 0 writes ``<out>/<part>-<W>ranks.json`` per part: the machine, the settings and the result.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from . import comms, explain_accuracy, harness, memory, overhead, recompute, step_time, timeline
from . import compile as compiled

PARTS = {
    "step": step_time.run,
    "memory": memory.run,
    "comms": comms.run,
    "overhead": overhead.run,
    "timeline": timeline.run,
    "compile": compiled.run,
    "recompute": recompute.run,
    "explain": explain_accuracy.run,
}


def _init(device_type: str):
    world = int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        # NCCL for the tensors, gloo for the harness's object collectives and barriers
        dist.init_process_group("cuda:nccl,cpu:gloo")
        return init_device_mesh("cuda", (world,)), torch.device("cuda", local)
    return init_device_mesh("cpu", (world,)), torch.device("cpu")


def main() -> None:
    warnings.filterwarnings("ignore", message=".*(returned a view tensor|Full backward hook).*")
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", required=True, help=f"comma-separated, from {sorted(PARTS)}")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=harness.RESULTS)
    args = ap.parse_args()

    mesh, device = _init(args.device)
    ctx = harness.Context(mesh, device, args.quick, args.rounds, args.warmup)
    for part in args.parts.split(","):
        start, before = time.perf_counter(), harness.machine(device)
        result = PARTS[part](ctx)
        if ctx.rank == 0:
            info = {
                "part": part,
                "world": ctx.world,
                "quick": args.quick,
                "rounds": args.rounds,
                "warmup": args.warmup,
                "machine": before,
                "load_average_after": harness.machine(device)["load_average"],
                "seconds": time.perf_counter() - start,
                "result": result,
            }
            path = harness.write(f"{part}-{ctx.world}ranks", info, args.out)
            print(f"[bench] {part} on {ctx.world} ranks: {info['seconds']:.0f} s -> {path}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
